//! The push of keys homed on a GPU, the mirror of [`cpu::push`](crate::backend::cpu::push).
//!
//! Values on the home GPU, and values on the host (each copied to the home), are passed
//! straight to the fused update kernel as its k inputs (sum and update in one pass, the sum in
//! f32). Several values on another GPU are first summed there by the `assign` kernel; the
//! [`CrossGpu`] links that `comm` hands in bring those partial sums to the home (one NCCL
//! reduce per key, or peer copies). Then ONE launch per (home GPU, rule, dtype) updates every
//! key of the call. Updater state (f32) lives on the home GPU ([`state`](super::state)).
//!
//! Rounding: a sum made on another GPU (the `assign` pre-sum, or NCCL's reduce, which adds in
//! the dtype itself) is rounded to the key's dtype before the home adds it, so f16 and bf16
//! keys pushed from several GPUs can differ from the CPU home in the last bits; as with NCCL
//! reductions in DDP or Horovod. Values on the home GPU and on the host are summed in f32.
//!
//! Everything is enqueued on the GPUs' streams; nothing here waits.

use std::collections::BTreeMap;
use std::sync::RwLockReadGuard;

use cudarc::driver::{CudaSlice, DevicePtr};

use super::kernels::{self, RuleKind};
use super::state::{make_states, GpuCell};
use super::{
    gpu, host_data_bytes, launch_fused, launch_user, with_key, CrossGpu, GpuBuf, GpuPtr,
    PartialSum, Record, UserLaunch,
};
use crate::ndarray::Storage;
use crate::updater::Hyper;
use crate::{DType, Device, Key, NDArray, PtxUpdater, Result, Updater};

/// One key of a push on a GPU home.
pub(crate) struct PushJob<'a> {
    pub key: &'a Key,
    pub cell: &'a mut GpuCell,
    pub values: &'a [&'a NDArray],
    /// The learning rate and weight decay of this key in this push (built-in rules).
    pub hyper: Hyper,
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

/// Enqueues a validated push of built-in or PTX updaters on GPU homes (f32, f16 and bf16
/// keys; for a PTX updater, keys of its dtype).
/// `links` brings partial sums made on other GPUs to the homes (NCCL or peer copies: `comm`
/// decides).
pub(crate) fn push(
    updater: &Updater,
    generation: u64,
    between: &dyn CrossGpu,
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
    let mut partials: Vec<Vec<GpuPtr>> = Vec::with_capacity(jobs.len());

    // The kernel sums its k inputs in f32 in this order. Host values are not summed on the
    // host (f16 and bf16 sums must round once, as on the CPU home): they go up side by side,
    // each padded to 16 bytes so the kernel's vector loads apply, and each is an input. Every
    // key's host values for one home GPU go up in ONE buffer and one copy (not one per key).
    let mut uploads: BTreeMap<usize, Vec<u8>> = BTreeMap::new();
    // Per key: where its host values start in its home's upload, and the bytes between them.
    let mut host_at: Vec<(usize, usize)> = Vec::with_capacity(jobs.len());
    for job in &jobs {
        let stride = (job.cell.buf.len() * job.cell.buf.dtype().size()).next_multiple_of(16);
        if !job
            .values
            .iter()
            .any(|v| matches!(reads.get(v), Storage::Host(_)))
        {
            host_at.push((0, stride));
            continue;
        }
        // (A home whose keys are all empty still gets a buffer: every input is a live address.)
        let up = uploads.entry(job.cell.buf.ordinal()).or_default();
        host_at.push((up.len(), stride));
        for v in job.values {
            if let Storage::Host(h) = reads.get(v) {
                let bytes = host_data_bytes(h);
                up.extend_from_slice(bytes);
                up.resize(up.len() + stride - bytes.len(), 0);
            }
        }
    }
    let mut bases: BTreeMap<usize, u64> = BTreeMap::new();
    for (&home, bytes) in &uploads {
        // f32 only as a unit of bytes (a multiple of 16): the segments hold the keys' dtypes.
        let up = GpuBuf::scratch(home, DType::F32, bytes.len() / 4)?;
        gpu(home)?.upload_bytes(up.ptr(), bytes)?;
        bases.insert(home, up.ptr());
        keep.push(up);
    }

    for (job, &(at, stride)) in jobs.iter().zip(&host_at) {
        let home = job.cell.buf.ordinal();
        let dtype = job.cell.buf.dtype();
        let n = job.cell.buf.len();
        let hosts = job
            .values
            .iter()
            .filter(|v| matches!(reads.get(v), Storage::Host(_)))
            .count();
        let host_inputs: Vec<u64> = match bases.get(&home) {
            Some(&base) => (0..hosts)
                .map(|i| base + (at + i * stride) as u64)
                .collect(),
            None => Vec::new(),
        };
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
                parts.push(GpuPtr {
                    ordinal: d,
                    addr: ptrs[0],
                });
                continue;
            }
            let scratch = GpuBuf::scratch(d, dtype, n).map_err(with_key(job.key))?;
            parts.push(GpuPtr {
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

    let sums = jobs
        .iter()
        .zip(inputs.iter_mut())
        .zip(&partials)
        .map(|((job, ins), parts)| PartialSum {
            key: job.key,
            home: job.cell.buf.ordinal(),
            dtype: job.cell.buf.dtype(),
            n: job.cell.buf.len(),
            inputs: ins,
            parts,
        })
        .collect();
    between.sum_to_homes(sums, &mut keep)?;
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
                home.function(kernels::scalars(&rule).0, dtype)
                    .map_err(with_key(job.key))?;
            }
        }
        home.function(RuleKind::Assign, dtype)
            .map_err(with_key(job.key))?;
        for v in job.values {
            if let Device::Gpu(d) = v.device() {
                gpu(d)?
                    .function(RuleKind::Assign, dtype)
                    .map_err(with_key(job.key))?;
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
    make_states(
        jobs.iter_mut().map(|j| (j.key, &mut *j.cell)),
        generation,
        updater.state_names().len(),
    )?;
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
    make_states(
        jobs.iter_mut().map(|j| (j.key, &mut *j.cell)),
        generation,
        p.state_buffers(),
    )?;
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
