//! The push of keys homed on a GPU, the mirror of [`cpu::push`](crate::backend::cpu::push).
//!
//! Values on the home GPU and on the host (copied up) are the fused update kernel's k inputs
//! (sum in f32 and update in one pass). Several values on another GPU are first summed there
//! by the `assign` kernel, and `comm`'s [`CrossGpu`] links bring those partial sums home (NCCL
//! reduce or peer copies). Then ONE launch per (home GPU, rule, dtype) updates every key.
//! Updater state (f32) lives on the home GPU ([`state`](super::state)).
//!
//! Rounding: a sum made on another GPU (the pre-sum, or NCCL's reduce in the dtype itself) is
//! rounded to the key's dtype before the home adds it, so f16 and bf16 keys pushed from several
//! GPUs can differ from the CPU home in the last bits, as NCCL reductions in DDP do.
//!
//! Everything is enqueued on the GPUs' streams; nothing here waits.

use std::collections::BTreeMap;
use std::sync::RwLockReadGuard;

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

/// Enqueues a validated push of a built-in or PTX updater on GPU homes (dtypes with kernels).
pub(crate) fn push(
    updater: &Updater,
    generation: u64,
    between: &dyn CrossGpu,
    jobs: Vec<PushJob<'_>>,
) -> Result<()> {
    check_kernels(updater, &jobs)?;
    let reads = Reads::lock(jobs.iter().flat_map(|j| j.values.iter()));
    // Scratch buffers, alive until every use is enqueued (freed on their GPU's stream, after).
    let mut keep: Vec<GpuBuf> = Vec::new();
    let host_inputs = upload_host_values(&jobs, &reads, &mut keep)?;
    // Per key: the k inputs on the home GPU.
    let mut inputs: Vec<Vec<u64>> = Vec::with_capacity(jobs.len());
    // Several values on one non-home GPU are summed there first.
    let mut presums = Presums::default();
    // Per key: partial sums on other GPUs (one address per GPU), to move to the home.
    let mut partials: Vec<Vec<GpuPtr>> = Vec::with_capacity(jobs.len());
    for (job, host) in jobs.iter().zip(host_inputs) {
        let value = &job.cell.buf;
        let (home, dtype, n) = (value.ordinal(), value.dtype(), value.len());
        let mut host = host.into_iter();
        let mut on_home = Vec::new();
        let mut others: BTreeMap<usize, Vec<u64>> = BTreeMap::new();
        for v in job.values {
            match reads.get(v) {
                Storage::Host(_) => on_home.push(host.next().expect("one per host value")),
                Storage::Gpu(b) if b.ordinal() == home => on_home.push(b.ptr()),
                Storage::Gpu(b) => others.entry(b.ordinal()).or_default().push(b.ptr()),
            }
        }
        let mut parts = Vec::new();
        for (d, ptrs) in others {
            let addr = match ptrs[..] {
                [one] => one,
                _ => presums.add(job.key, (d, dtype, n), ptrs, &mut keep)?,
            };
            parts.push(GpuPtr::new(d, addr));
        }
        inputs.push(on_home);
        partials.push(parts);
    }
    presums.launch()?;
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

/// Sends the keys' host values home, each an input of its own (f16 and bf16 sums round once,
/// as on the CPU), padded to 16 bytes, in ONE buffer (kept in `keep`) per GPU; returns, per
/// key, their addresses.
fn upload_host_values(
    jobs: &[PushJob<'_>],
    reads: &Reads<'_>,
    keep: &mut Vec<GpuBuf>,
) -> Result<Vec<Vec<u64>>> {
    let mut uploads: BTreeMap<usize, Vec<u8>> = BTreeMap::new();
    // Per key: its home, and where each of its host values starts in the home's upload.
    let mut offsets: Vec<(usize, Vec<usize>)> = Vec::with_capacity(jobs.len());
    for job in jobs {
        let home = job.cell.buf.ordinal();
        let stride = job.cell.buf.bytes().next_multiple_of(16);
        let mut at = Vec::new();
        for v in job.values {
            if let Storage::Host(h) = reads.get(v) {
                // Empty keys still get a buffer: every input is a live address.
                let up = uploads.entry(home).or_default();
                at.push(up.len());
                let bytes = host_data_bytes(h);
                up.extend_from_slice(bytes);
                up.resize(up.len() + stride - bytes.len(), 0);
            }
        }
        offsets.push((home, at));
    }
    let mut bases: BTreeMap<usize, u64> = BTreeMap::new();
    for (&home, bytes) in &uploads {
        // f32 only as a unit of bytes (a multiple of 16): the segments hold the keys' dtypes.
        let up = GpuBuf::scratch(home, DType::F32, bytes.len() / 4)?;
        gpu(home)?.upload_bytes(up.ptr(), bytes)?;
        bases.insert(home, up.ptr());
        keep.push(up);
    }
    let addrs =
        |(home, at): (usize, Vec<usize>)| at.iter().map(|&a| bases[&home] + a as u64).collect();
    Ok(offsets.into_iter().map(addrs).collect())
}

/// Sums made into scratch by one `assign` launch per (GPU, dtype tag: `DType` is not ordered).
#[derive(Default)]
struct Presums(BTreeMap<(usize, u8), (DType, Vec<Record>)>);

impl Presums {
    /// The address of scratch on GPU `d` (kept in `keep`) that will hold the sum of `inputs`.
    fn add(
        &mut self,
        key: &Key,
        (d, dtype, n): (usize, DType, usize),
        inputs: Vec<u64>,
        keep: &mut Vec<GpuBuf>,
    ) -> Result<u64> {
        let scratch = GpuBuf::scratch(d, dtype, n).map_err(with_key(key))?;
        let stored = scratch.ptr();
        let (_, records) = (self.0.entry((d, dtype as u8))).or_insert((dtype, Vec::new()));
        records.push(Record {
            stored,
            inputs,
            n: n as u64,
            ..Record::default()
        });
        keep.push(scratch);
        Ok(stored)
    }

    /// Enqueues the sums.
    fn launch(&self) -> Result<()> {
        for (&(d, _), (dtype, records)) in &self.0 {
            launch_fused(gpu(d)?, RuleKind::Assign, *dtype, &[], records)?;
        }
        Ok(())
    }
}

/// Loads every kernel the push needs first, so a broken module fails it with nothing changed.
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

/// One fused launch being built: the rule, the dtype, its scalars, and the tensors.
type Launch = (RuleKind, DType, Vec<f32>, Vec<Record>);

/// Launches are grouped by home GPU, dtype tag and the bits of their f32 scalars.
type LaunchKey = (usize, u8, Vec<u32>);

/// The fused update: one launch per (home GPU, dtype, scalars); per-key multipliers split
/// launches, except Adam's learning rate (per tensor, in the record).
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
        let state = job.cell.state.as_mut().expect("states are made first");
        let (step, m, v) = state.advance();
        let rule = updater
            .rule_with::<f32>(step, job.hyper)
            .expect("custom updaters take the host path");
        let (kind, scalars, lr_t) = kernels::scalars(&rule);
        let record = Record {
            stored: job.cell.buf.ptr(),
            inputs: ins.clone(),
            m,
            v,
            n: job.cell.buf.len() as u64,
            lr_t: lr_t.unwrap_or(0.0),
        };
        let bits = scalars.iter().map(|s| s.to_bits()).collect();
        launches
            .entry((home, dtype as u8, bits))
            .or_insert_with(|| (kind, dtype, scalars, Vec::new()))
            .3
            .push(record);
    }
    for (&(home, ..), (kind, dtype, scalars, records)) in &launches {
        launch_fused(gpu(home)?, *kind, *dtype, scalars, records)?;
    }
    Ok(())
}

/// The PTX updater's step: each key's inputs summed into scratch, then the user's kernel.
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
    let mut sums = Presums::default();
    let mut merged = Vec::with_capacity(jobs.len());
    for (job, ins) in jobs.iter().zip(inputs) {
        let b = &job.cell.buf;
        merged.push(match ins[..] {
            [one] => one,
            _ => sums.add(
                job.key,
                (b.ordinal(), b.dtype(), b.len()),
                ins.clone(),
                keep,
            )?,
        });
    }
    sums.launch()?;
    for (job, merged) in jobs.into_iter().zip(merged) {
        let state = job.cell.state.as_mut().expect("states are made first");
        let (step, m, v) = state.advance();
        let launch = UserLaunch {
            stored: job.cell.buf.ptr(),
            merged,
            m,
            v,
            n: job.cell.buf.len() as u64,
            step,
        };
        launch_user(gpu(job.cell.buf.ordinal())?, p, &launch).map_err(with_key(job.key))?;
    }
    Ok(())
}
