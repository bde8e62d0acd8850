//! Push and pull for keys whose home is a GPU.
//!
//! Push: values are grouped by device. Values on the home GPU, and values on the host (each
//! copied to the home), are passed straight to the fused update kernel as its k inputs (sum and
//! update in one pass, the sum in f32). Several values on another GPU are first summed there by
//! the `assign` kernel. Across GPUs, `nccl` stores use one NCCL reduce per key (all keys of a
//! call in one group); `device` stores, or any store without NCCL, use peer copies into scratch
//! buffers on the home. Then ONE launch per (home GPU, rule, dtype) updates every key of the
//! call. Updater state (f32) lives on the home GPU.
//!
//! Rounding: a sum made on another GPU (the `assign` pre-sum, or NCCL's reduce, which adds in
//! the dtype itself) is rounded to the key's dtype before the home adds it, so f16 and bf16
//! keys pushed from several GPUs can differ from the CPU home in the last bits; as with NCCL
//! reductions in DDP or Horovod. Values on the home GPU and on the host are summed in f32.
//!
//! Pull: one NCCL broadcast (or peer copy) from the home to each distinct GPU that has outs,
//! device copies for further outs on the same GPU, and one device-to-host copy for host outs and
//! for outs of another dtype (converted on the host).
//!
//! Everything is enqueued on the GPUs' streams; nothing here waits, except the host copies.

use std::collections::BTreeMap;
use std::sync::RwLockReadGuard;

use cudarc::driver::{CudaSlice, DevicePtr};

use super::kernels::{self, RuleKind};
use super::{
    cross_gpu_order, cuda_err, gpu, launch_fused, launch_user, stream_wait, GpuBuf, Record,
    UserLaunch,
};
use crate::comm::nccl;
use crate::host::{convert_into, with_host, HostData};
use crate::ndarray::Storage;
use crate::updater::Hyper;
use crate::{DType, Device, Element, Error, Key, NDArray, PtxUpdater, Result, Updater};

/// A key's value and updater state on its home GPU.
#[derive(Debug)]
pub(crate) struct GpuCell {
    /// The stored value.
    pub buf: GpuBuf,
    state: Option<GpuState>,
}

/// Updater state on the home GPU.
#[derive(Debug)]
struct GpuState {
    generation: u64,
    step: u64,
    bufs: Vec<CudaSlice<f32>>,
}

impl GpuCell {
    /// A cell holding `buf`, with no updater state yet.
    pub fn new(buf: GpuBuf) -> GpuCell {
        GpuCell { buf, state: None }
    }

    /// The step count of updater `generation`: `None` when the key has no state for it.
    pub fn step(&self, generation: u64) -> Option<u64> {
        self.state
            .as_ref()
            .filter(|s| s.generation == generation)
            .map(|s| s.step)
    }

    /// The step count and state buffers of updater `generation`, copied to the host (for
    /// checkpoints); `None` when the key has no state for it.
    pub fn state_to_host(&self, generation: u64) -> Result<Option<(u64, Vec<HostData>)>> {
        let Some(state) = self.state.as_ref().filter(|s| s.generation == generation) else {
            return Ok(None);
        };
        let stream = self.buf.stream();
        super::host_wait(gpu(self.buf.ordinal())?)?;
        let bufs = state
            .bufs
            .iter()
            .map(|b| {
                let v =
                    super::clone_dtoh(stream, b).map_err(cuda_err("copy state to host", None))?;
                Ok(HostData::F32(v))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some((state.step, bufs)))
    }

    /// Replaces the updater state with host buffers (`float32`, one per state name) for
    /// updater `generation`, or clears it.
    pub fn set_state_from_host(
        &mut self,
        generation: u64,
        state: Option<(u64, Vec<HostData>)>,
    ) -> Result<()> {
        let Some((step, bufs)) = state else {
            self.state = None;
            return Ok(());
        };
        // The kernels index the state with the value's length: never hand them a shorter one.
        if let Some(b) = bufs.iter().find(|b| b.len() != self.buf.len()) {
            return Err(Error::Internal {
                op: "copy state to GPU",
                message: format!(
                    "a state buffer of {} elements for a value of {}",
                    b.len(),
                    self.buf.len()
                ),
            });
        }
        let stream = self.buf.stream();
        let bufs = bufs
            .iter()
            .map(|b| {
                let v: Vec<f32> = b.to_vec();
                super::clone_htod(stream, &v).map_err(cuda_err("copy state to GPU", None))
            })
            .collect::<Result<Vec<_>>>()?;
        self.state = Some(GpuState {
            generation,
            step,
            bufs,
        });
        Ok(())
    }
}

/// One key of a push on a GPU home.
pub(crate) struct PushJob<'a> {
    pub key: &'a Key,
    pub cell: &'a mut GpuCell,
    pub values: &'a [&'a NDArray],
    /// The learning rate and weight decay of this key in this push (built-in rules).
    pub hyper: Hyper,
}

/// One key of a pull from a GPU home.
pub(crate) struct PullJob<'a> {
    pub key: &'a Key,
    pub cell: &'a GpuCell,
    pub outs: &'a [&'a NDArray],
}

/// Read locks on arrays, each taken once.
struct Reads<'a> {
    guards: Vec<(usize, RwLockReadGuard<'a, Storage>)>,
}

impl<'a> Reads<'a> {
    fn lock<'b>(arrays: impl Iterator<Item = &'b &'a NDArray>) -> Reads<'a>
    where
        'a: 'b,
    {
        let mut uniq: Vec<&'a NDArray> = arrays.copied().collect();
        uniq.sort_by_key(|a| a.storage_id());
        uniq.dedup_by_key(|a| a.storage_id());
        Reads {
            guards: uniq.iter().map(|a| (a.storage_id(), a.read())).collect(),
        }
    }

    fn get(&self, a: &NDArray) -> &Storage {
        let i = self
            .guards
            .binary_search_by_key(&a.storage_id(), |(id, _)| *id)
            .expect("every array was locked");
        &self.guards[i].1
    }
}

/// A raw device address and the GPU it is on.
#[derive(Clone, Copy)]
struct Ptr {
    ordinal: usize,
    addr: u64,
}

/// Enqueues a validated push of built-in or PTX updaters on GPU homes (f32, f16 and bf16
/// keys; for a PTX updater, keys of its dtype).
/// `use_nccl`: cross-GPU sums go through NCCL (else through peer copies).
pub(crate) fn push(
    updater: &Updater,
    generation: u64,
    use_nccl: bool,
    jobs: Vec<PushJob<'_>>,
) -> Result<()> {
    check_kernels(updater, &jobs)?;
    let reads = Reads::lock(jobs.iter().flat_map(|j| j.values.iter()));
    // Scratch buffers: alive until every launch and copy using them is enqueued; they are
    // freed on their own GPU's stream, so after those.
    let mut keep: Vec<GpuBuf> = Vec::new();
    // Per key: the k inputs on the home GPU.
    let mut inputs: Vec<Vec<u64>> = Vec::with_capacity(jobs.len());
    // Pre-sums on non-home GPUs: (ordinal, dtype) -> assign records.
    let mut presums: BTreeMap<(usize, DTypeKey), Vec<Record>> = BTreeMap::new();
    // Per key: partial sums on other GPUs (one address per GPU), to move to the home.
    let mut partials: Vec<Vec<Ptr>> = Vec::with_capacity(jobs.len());

    for job in &jobs {
        let home = job.cell.buf.ordinal();
        let dtype = job.cell.buf.dtype();
        let n = job.cell.buf.len();
        // The kernel sums its k inputs in f32 in this order. Host values are not summed on
        // the host (f16 and bf16 sums must round once, as on the CPU home): they go up side by
        // side in one buffer, one copy, each padded to 16 bytes so the kernel's vector loads
        // apply, and each is an input.
        let hosts: Vec<&HostData> = job
            .values
            .iter()
            .filter_map(|v| match reads.get(v) {
                Storage::Host(h) => Some(h),
                Storage::Gpu(_) => None,
            })
            .collect();
        let mut host_inputs = Vec::new();
        if let Some(first) = hosts.first() {
            let stride = n.next_multiple_of(16 / dtype.size());
            let side_by_side = with_host!(*first, _f: T => {
                let mut all = Vec::with_capacity(stride * hosts.len());
                for (i, h) in hosts.iter().enumerate() {
                    all.extend_from_slice(T::slice(h).expect("value dtypes were checked"));
                    all.resize((i + 1) * stride, T::from_f64(0.0));
                }
                T::wrap(all)
            });
            let up = GpuBuf::upload(home, &side_by_side).map_err(with_key(job.key))?;
            let base = up.ptr();
            host_inputs = (0..hosts.len())
                .map(|i| base + (i * stride * dtype.size()) as u64)
                .collect();
            keep.push(up);
        }
        let mut host_inputs = host_inputs.into_iter();
        let mut on_home = Vec::new();
        let mut others: BTreeMap<usize, Vec<u64>> = BTreeMap::new();
        for v in job.values {
            match reads.get(v) {
                Storage::Host(_) => on_home.push(host_inputs.next().expect("one per host value")),
                Storage::Gpu(b) if b.ordinal() == home => on_home.push(b.ptr()),
                Storage::Gpu(b) => others.entry(b.ordinal()).or_default().push(b.ptr()),
            }
        }
        let mut parts = Vec::new();
        for (d, ptrs) in others {
            if ptrs.len() == 1 {
                parts.push(Ptr {
                    ordinal: d,
                    addr: ptrs[0],
                });
                continue;
            }
            let scratch = GpuBuf::scratch(d, dtype, n).map_err(with_key(job.key))?;
            parts.push(Ptr {
                ordinal: d,
                addr: scratch.ptr(),
            });
            presums
                .entry((d, DTypeKey(dtype)))
                .or_default()
                .push(Record {
                    stored: scratch.ptr(),
                    inputs: ptrs,
                    n: n as u64,
                    ..Record::default()
                });
            keep.push(scratch);
        }
        inputs.push(on_home);
        partials.push(parts);
    }

    for ((d, dt), records) in &presums {
        launch_fused(gpu(*d)?, RuleKind::Assign, dt.0, &[], records)?;
    }

    move_partials(use_nccl, &jobs, &mut inputs, &partials, &mut keep)?;
    match updater {
        Updater::Ptx(p) => update_ptx(p, generation, jobs, &inputs, &mut keep)?,
        _ => update(updater, generation, jobs, &inputs)?,
    }
    drop(keep);
    drop(reads);
    Ok(())
}

/// Loads every kernel the push needs before anything changes, so a missing or broken module
/// fails the whole call with every key unchanged.
fn check_kernels(updater: &Updater, jobs: &[PushJob<'_>]) -> Result<()> {
    for job in jobs {
        let home = gpu(job.cell.buf.ordinal())?;
        let dtype = job.cell.buf.dtype();
        match updater {
            Updater::Ptx(p) => {
                home.user_function(p).map_err(with_key(job.key))?;
            }
            _ => {
                let rule = updater.rule::<f32>(1).expect("closures take the host path");
                home.function(kernels::scalars(&rule).0, dtype)?;
            }
        }
        home.function(RuleKind::Assign, dtype)?;
        for v in job.values {
            if let Device::Gpu(d) = v.device() {
                gpu(d)?.function(RuleKind::Assign, dtype)?;
            }
        }
    }
    Ok(())
}

/// `DType` ordered, for map keys.
#[derive(Clone, Copy, PartialEq, Eq)]
struct DTypeKey(DType);

impl PartialOrd for DTypeKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for DTypeKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.0 as u8).cmp(&(other.0 as u8))
    }
}

fn with_key(key: &Key) -> impl FnOnce(Error) -> Error + '_ {
    move |e| e.with_key(key)
}

/// Brings every key's partial sums from other GPUs to its home: one grouped NCCL reduce, or
/// peer copies into scratch buffers. Adds the resulting home addresses to `inputs`.
fn move_partials(
    use_nccl: bool,
    jobs: &[PushJob<'_>],
    inputs: &mut [Vec<u64>],
    partials: &[Vec<Ptr>],
    keep: &mut Vec<GpuBuf>,
) -> Result<()> {
    let mut collectives = Vec::new();
    // KVSTORE_NCCL_FORCE=1: NCCL even for values all on the home (a one-rank reduce).
    let force = use_nccl && nccl::force_single();
    for ((job, ins), parts) in jobs.iter().zip(inputs.iter_mut()).zip(partials) {
        if parts.is_empty() && !force {
            continue;
        }
        let home = job.cell.buf.ordinal();
        let dtype = job.cell.buf.dtype();
        let n = job.cell.buf.len();
        let recv = GpuBuf::scratch(home, dtype, n).map_err(with_key(job.key))?;
        let recv_addr = recv.ptr();
        keep.push(recv);
        if use_nccl {
            // The home rank sends its first value (taken out of the direct inputs), or zeros.
            let home_send = match ins.is_empty() {
                false => ins.remove(0),
                true => {
                    let z = GpuBuf::zeros(home, dtype, n).map_err(with_key(job.key))?;
                    let a = z.ptr();
                    keep.push(z);
                    a
                }
            };
            let mut devices: Vec<usize> = parts.iter().map(|p| p.ordinal).collect();
            devices.push(home);
            devices.sort_unstable();
            let root = devices.binary_search(&home).expect("home is in the set");
            let sends = devices
                .iter()
                .map(|&d| match parts.iter().find(|p| p.ordinal == d) {
                    Some(p) => p.addr,
                    None => home_send,
                })
                .collect();
            collectives.push(nccl::Job {
                key: job.key.clone(),
                dtype,
                n,
                devices,
                kind: nccl::Kind::Reduce {
                    sends,
                    recv: recv_addr,
                    root,
                },
            });
            ins.push(recv_addr);
        } else {
            // One scratch buffer per other GPU (the kernel sums them as inputs).
            ins.push(recv_addr);
            for (i, p) in parts.iter().enumerate() {
                let dst = if i == 0 {
                    recv_addr
                } else {
                    let b = GpuBuf::scratch(home, dtype, n).map_err(with_key(job.key))?;
                    let a = b.ptr();
                    keep.push(b);
                    ins.push(a);
                    a
                };
                peer_copy(
                    Ptr {
                        ordinal: home,
                        addr: dst,
                    },
                    *p,
                    n * dtype.size(),
                )
                .map_err(with_key(job.key))?;
            }
        }
    }
    nccl::run("push (reduce)", &collectives)
}

/// Copies `bytes` from `src` to `dst` on `dst`'s stream, ordered against `src`'s stream both
/// ways (the copy waits for src's producers; later work on src's GPU waits for the copy).
fn peer_copy(dst: Ptr, src: Ptr, bytes: usize) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    let d = gpu(dst.ordinal)?;
    let s = gpu(src.ordinal)?;
    if dst.ordinal != src.ordinal {
        // Direct copies where the GPUs allow it (else the driver stages through the host).
        d.enable_peer(s);
        s.enable_peer(d);
    }
    let _order = cross_gpu_order();
    stream_wait(d.stream(), s.stream())?;
    d.context()
        .bind_to_thread()
        .map_err(cuda_err("copy between GPUs", None))?;
    let r = if dst.ordinal == src.ordinal {
        // SAFETY: both addresses name live buffers of at least `bytes` on this GPU, kept alive
        // by the caller until after the copy is enqueued, and freed on this stream later.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                dst.addr,
                src.addr,
                bytes,
                d.stream().cu_stream(),
            )
        }
    } else {
        // SAFETY: as above, with `src` on another GPU whose context is given; the source
        // stream waits for this copy below before anything can reuse or free the source.
        unsafe {
            cudarc::driver::result::memcpy_peer_async(
                d.context().cu_ctx(),
                dst.addr,
                s.context().cu_ctx(),
                src.addr,
                bytes,
                d.stream().cu_stream(),
            )
        }
    };
    r.map_err(cuda_err("copy between GPUs", None))?;
    stream_wait(s.stream(), d.stream())
}

/// One fused launch being built: the rule, its scalars, and the tensors.
type Launch = (RuleKind, Vec<f32>, Vec<Record>);

/// Launches are grouped by home GPU, dtype and the bits of their f32 scalars.
type LaunchKey = (usize, DTypeKey, Vec<u32>);

/// The fused update: one launch per (home GPU, dtype, scalars) for every key of the call. Keys
/// share their scalars unless per-key multipliers make their learning rate or weight decay
/// differ (Adam's learning rate is per tensor, in the record, and never splits a launch).
fn update(
    updater: &Updater,
    generation: u64,
    mut jobs: Vec<PushJob<'_>>,
    inputs: &[Vec<u64>],
) -> Result<()> {
    make_states(&mut jobs, generation, updater.state_names().len())?;
    let mut launches: BTreeMap<LaunchKey, Launch> = BTreeMap::new();
    for (job, ins) in jobs.into_iter().zip(inputs) {
        let home = job.cell.buf.ordinal();
        let dtype = job.cell.buf.dtype();
        let n = job.cell.buf.len();
        let state = job.cell.state.as_mut().expect("states are made first");
        state.step += 1;
        let rule = updater
            .rule_with::<f32>(state.step, job.hyper)
            .expect("custom updaters take the host path");
        let (kind, scalars, lr_t) = kernels::scalars(&rule);
        let st = gpu(home)?.stream();
        let addr = |s: &CudaSlice<f32>| s.device_ptr(st).0;
        let record = Record {
            stored: job.cell.buf.ptr(),
            inputs: ins.clone(),
            m: state.bufs.first().map_or(0, addr),
            v: state.bufs.get(1).map_or(0, addr),
            n: n as u64,
            lr_t: lr_t.unwrap_or(0.0),
        };
        let bits = scalars.iter().map(|s| s.to_bits()).collect();
        launches
            .entry((home, DTypeKey(dtype), bits))
            .or_insert_with(|| (kind, scalars, Vec::new()))
            .2
            .push(record);
    }
    for ((home, dt, _), (kind, scalars, records)) in &launches {
        launch_fused(gpu(*home)?, *kind, dt.0, scalars, records)?;
    }
    Ok(())
}

/// The PTX updater's step: the k inputs of each key are summed into scratch (one `assign`
/// launch per home GPU and dtype; a key with one input passes it as is), then the user's
/// kernel runs once per key.
fn update_ptx(
    p: &PtxUpdater,
    generation: u64,
    mut jobs: Vec<PushJob<'_>>,
    inputs: &[Vec<u64>],
    keep: &mut Vec<GpuBuf>,
) -> Result<()> {
    make_states(&mut jobs, generation, p.state_buffers())?;
    let mut sums: BTreeMap<(usize, DTypeKey), Vec<Record>> = BTreeMap::new();
    let mut merged = Vec::with_capacity(jobs.len());
    for (job, ins) in jobs.iter().zip(inputs) {
        if let [one] = ins.as_slice() {
            merged.push(*one);
            continue;
        }
        let (home, dtype, n) = (
            job.cell.buf.ordinal(),
            job.cell.buf.dtype(),
            job.cell.buf.len(),
        );
        let scratch = GpuBuf::scratch(home, dtype, n).map_err(with_key(job.key))?;
        merged.push(scratch.ptr());
        sums.entry((home, DTypeKey(dtype)))
            .or_default()
            .push(Record {
                stored: scratch.ptr(),
                inputs: ins.clone(),
                n: n as u64,
                ..Record::default()
            });
        keep.push(scratch);
    }
    for ((d, dt), records) in &sums {
        launch_fused(gpu(*d)?, RuleKind::Assign, dt.0, &[], records)?;
    }
    for (job, merged) in jobs.into_iter().zip(merged) {
        let home = job.cell.buf.ordinal();
        let n = job.cell.buf.len();
        let state = job.cell.state.as_mut().expect("states are made first");
        state.step += 1;
        let st = gpu(home)?.stream();
        let addr = |s: &CudaSlice<f32>| s.device_ptr(st).0;
        let launch = UserLaunch {
            stored: job.cell.buf.ptr(),
            merged,
            m: state.bufs.first().map_or(0, addr),
            v: state.bufs.get(1).map_or(0, addr),
            n: n as u64,
            step: state.step,
        };
        launch_user(gpu(home)?, p, &launch).map_err(with_key(job.key))?;
    }
    Ok(())
}

/// Gives every job's cell an updater state for `generation` with `names` f32 buffers (zeros
/// where it has none, or one of another updater). All are made before any step count moves,
/// so a failed allocation leaves every key's state as it was.
fn make_states(jobs: &mut [PushJob<'_>], generation: u64, names: usize) -> Result<()> {
    for job in jobs.iter_mut() {
        let (home, n) = (job.cell.buf.ordinal(), job.cell.buf.len());
        // (A state with too few buffers would hand the kernel a null m or v.)
        let current = matches!(&job.cell.state,
            Some(s) if s.generation == generation && s.bufs.len() == names);
        if current {
            continue;
        }
        let st = gpu(home)?.stream();
        let bufs = (0..names)
            .map(|_| super::alloc_zeros::<f32>(st, n))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(cuda_err("push", Some(job.key)))?;
        job.cell.state = Some(GpuState {
            generation,
            step: 0,
            bufs,
        });
    }
    Ok(())
}

/// Enqueues a validated pull from GPU homes into every job's outs.
pub(crate) fn pull(use_nccl: bool, jobs: &[PullJob<'_>]) -> Result<()> {
    let mut outs: Vec<&NDArray> = jobs.iter().flat_map(|j| j.outs.iter().copied()).collect();
    outs.sort_by_key(|a| a.storage_id());
    outs.dedup_by_key(|a| a.storage_id());
    let mut guards: Vec<_> = outs.iter().map(|a| (a.storage_id(), a.write())).collect();
    let mut collectives = Vec::new();
    // Per key: further outs on a GPU, copied from the first out there once it is written.
    let mut copies: Vec<(Ptr, Ptr, usize)> = Vec::new();
    // Per key: the first out on the home GPU, copied straight from the stored value.
    let mut home_copies: Vec<(Ptr, Ptr, usize)> = Vec::new();
    for job in jobs {
        let home = job.cell.buf.ordinal();
        let dtype = job.cell.buf.dtype();
        let n = job.cell.buf.len();
        let src = Ptr {
            ordinal: home,
            addr: job.cell.buf.ptr(),
        };
        let mut ids: Vec<usize> = job.outs.iter().map(|a| a.storage_id()).collect();
        ids.sort_unstable();
        ids.dedup();
        let mut host_copy: Option<HostData> = None;
        let mut firsts: BTreeMap<usize, u64> = BTreeMap::new();
        for id in ids {
            let i = guards
                .binary_search_by_key(&id, |(g, _)| *g)
                .expect("every out was locked");
            match &mut *guards[i].1 {
                Storage::Gpu(b) if b.dtype() == dtype => {
                    let dst = Ptr {
                        ordinal: b.ordinal(),
                        addr: b.ptr(),
                    };
                    match firsts.get(&dst.ordinal) {
                        Some(&first) => copies.push((
                            dst,
                            Ptr {
                                ordinal: dst.ordinal,
                                addr: first,
                            },
                            n * dtype.size(),
                        )),
                        None => {
                            firsts.insert(dst.ordinal, dst.addr);
                        }
                    }
                }
                other => {
                    if host_copy.is_none() {
                        host_copy = Some(job.cell.buf.download().map_err(with_key(job.key))?);
                    }
                    let h = host_copy.as_ref().expect("just set");
                    match other {
                        Storage::Host(out) => {
                            with_host!(h, s: T => convert_into(s.as_slice(), out))
                        }
                        Storage::Gpu(b) => b.upload_into(h).map_err(with_key(job.key))?,
                    }
                }
            }
        }
        // The first out on each GPU gets the value from the home.
        let remote: Vec<(usize, u64)> = firsts
            .iter()
            .filter(|(&d, _)| d != home)
            .map(|(&d, &a)| (d, a))
            .collect();
        // KVSTORE_NCCL_FORCE=1: the home's own first out comes through a one-rank broadcast.
        let force = use_nccl && nccl::force_single();
        if let (Some(&a), false) = (firsts.get(&home), force) {
            home_copies.push((
                Ptr {
                    ordinal: home,
                    addr: a,
                },
                src,
                n * dtype.size(),
            ));
        }
        if remote.is_empty() && !force {
            continue;
        }
        if use_nccl {
            let mut devices: Vec<usize> = remote.iter().map(|&(d, _)| d).collect();
            devices.push(home);
            devices.sort_unstable();
            let root = devices.binary_search(&home).expect("home is in the set");
            let recvs = devices
                .iter()
                .map(|&d| match remote.iter().find(|r| r.0 == d) {
                    Some(r) => r.1,
                    // The root receives into its first out when forced, else in place.
                    None if force => firsts.get(&home).copied().unwrap_or(src.addr),
                    None => src.addr,
                })
                .collect();
            collectives.push(nccl::Job {
                key: job.key.clone(),
                dtype,
                n,
                devices,
                kind: nccl::Kind::Broadcast {
                    send: src.addr,
                    recvs,
                    root,
                },
            });
        } else {
            for (d, a) in remote {
                peer_copy(
                    Ptr {
                        ordinal: d,
                        addr: a,
                    },
                    src,
                    n * dtype.size(),
                )
                .map_err(with_key(job.key))?;
            }
        }
    }
    // Same-GPU copies from the home go first; the rest read the first out on their GPU, which
    // the broadcast (enqueued before them on that GPU's stream) has written.
    for (dst, src, bytes) in home_copies {
        peer_copy(dst, src, bytes)?;
    }
    nccl::run("pull (broadcast)", &collectives)?;
    for (dst, src, bytes) in copies {
        peer_copy(dst, src, bytes)?;
    }
    drop(guards);
    Ok(())
}

/// Element type checks for the fast path: every dtype but f64 has a PTX kernel.
pub(crate) fn has_kernel(dtype: DType) -> bool {
    dtype != DType::F64
}
