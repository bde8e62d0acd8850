//! The pull of keys homed on a GPU, the mirror of [`cpu::pull`](crate::backend::cpu::pull).
//!
//! `comm`'s [`CrossGpu`] links bring the home's value to the first out on each GPU (NCCL
//! broadcast or peer copies); further outs on a GPU are device copies of that first out
//! ([`copy_many`]). Host outs and outs of another dtype (converted on the host; a GPU one is
//! uploaded) share one host copy of the value, the small keys' fetched together
//! ([`download_many`]).
//!
//! Everything is enqueued on the GPUs' streams; only the host copies wait (once per home GPU
//! for the small keys).

use std::collections::BTreeMap;
use std::sync::RwLockWriteGuard;

use super::state::GpuCell;
use super::{copy_many, download_many, with_key, CrossGpu, DeviceCopy, Fanout, GpuBuf, GpuPtr};
use crate::host::{convert_into, with_host, HostData};
use crate::ndarray::Storage;
use crate::{Key, NDArray, Result};

/// One key of a pull from a GPU home.
pub(crate) struct PullJob<'a> {
    pub key: &'a Key,
    pub cell: &'a GpuCell,
    pub outs: &'a [&'a NDArray],
}

/// Write locks on the outs of a pull, each taken once, sorted by storage id.
type Locked<'a> = Vec<(usize, RwLockWriteGuard<'a, Storage>)>;

/// Enqueues a validated pull from GPU homes into every job's outs.
pub(crate) fn pull(between: &dyn CrossGpu, jobs: &[PullJob<'_>]) -> Result<()> {
    let mut outs: Vec<&NDArray> = jobs.iter().flat_map(|j| j.outs.iter().copied()).collect();
    outs.sort_by_key(|a| a.storage_id());
    outs.dedup_by_key(|a| a.storage_id());
    let mut guards: Locked<'_> = outs.iter().map(|a| (a.storage_id(), a.write())).collect();
    // Keys with an out on the host or of another dtype: one host copy of the value each.
    let needs_host: Vec<bool> = jobs
        .iter()
        .map(|job| {
            let dtype = job.cell.buf.dtype();
            job.outs.iter().any(|a| {
                let out = &*guards[locked(&guards, a.storage_id())].1;
                !matches!(out, Storage::Gpu(b) if b.dtype() == dtype)
            })
        })
        .collect();
    let to_host: Vec<&GpuBuf> = jobs
        .iter()
        .zip(&needs_host)
        .filter(|(_, &need)| need)
        .map(|(job, _)| &job.cell.buf)
        .collect();
    let mut host_copies = download_many(&to_host)?.into_iter();
    // Per key: the first out on each GPU, which the links fill from the home.
    let mut fanouts: Vec<Fanout<'_>> = Vec::new();
    // Per key: further outs on a GPU, copied from the first out there once it is written.
    let mut copies: Vec<DeviceCopy> = Vec::new();
    for (job, need) in jobs.iter().zip(needs_host) {
        let host_copy: Option<HostData> = if need { host_copies.next() } else { None };
        fanouts.push(fill_outs(
            job,
            &mut guards,
            host_copy.as_ref(),
            &mut copies,
        )?);
    }
    between.fan_out(&fanouts)?;
    // These read the first out on their GPU, written by the fan-out enqueued before them.
    copy_many(&copies)?;
    drop(guards);
    Ok(())
}

/// Where the out of storage id `id` is in `guards`.
fn locked(guards: &Locked<'_>, id: usize) -> usize {
    guards
        .binary_search_by_key(&id, |(g, _)| *g)
        .expect("every out was locked")
}

/// Fills `job`'s outs that need no link; returns the first out on each GPU, for the links.
fn fill_outs<'j>(
    job: &PullJob<'j>,
    guards: &mut Locked<'_>,
    host_copy: Option<&HostData>,
    copies: &mut Vec<DeviceCopy>,
) -> Result<Fanout<'j>> {
    let value = &job.cell.buf;
    let (home, dtype, n) = (value.ordinal(), value.dtype(), value.len());
    let mut ids: Vec<usize> = job.outs.iter().map(|a| a.storage_id()).collect();
    ids.sort_unstable();
    ids.dedup();
    let mut firsts: BTreeMap<usize, u64> = BTreeMap::new();
    for id in ids {
        let i = locked(guards, id);
        match &mut *guards[i].1 {
            Storage::Gpu(b) if b.dtype() == dtype => {
                let dst = b.at();
                match firsts.get(&dst.ordinal) {
                    // On the home GPU from the value (no pull writes it, unlike an out another
                    // key may fill); elsewhere from the first out there.
                    Some(&first) => {
                        let from = if dst.ordinal == home {
                            job.cell.buf.ptr()
                        } else {
                            first
                        };
                        let src = GpuPtr::new(dst.ordinal, from);
                        let bytes = n * dtype.size();
                        copies.push(DeviceCopy {
                            dst,
                            src,
                            bytes,
                            dtype,
                        });
                    }
                    None => {
                        firsts.insert(dst.ordinal, dst.addr);
                    }
                }
            }
            Storage::Host(out) => {
                let h = host_copy.expect("fetched for this key");
                with_host!(h, s: T => convert_into(s.as_slice(), out))
            }
            Storage::Gpu(b) => {
                let h = host_copy.expect("fetched for this key");
                b.upload_into(h).map_err(with_key(job.key))?
            }
        }
    }
    let firsts = firsts.into_iter().map(|(d, addr)| GpuPtr::new(d, addr));
    Ok(Fanout {
        key: job.key,
        dtype,
        n,
        src: job.cell.buf.at(),
        firsts: firsts.collect(),
    })
}
