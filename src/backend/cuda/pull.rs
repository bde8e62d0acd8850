//! The pull of keys homed on a GPU, the mirror of [`cpu::pull`](crate::backend::cpu::pull).
//!
//! The [`CrossGpu`] links that `comm` hands in bring the home's value to the first out on each
//! GPU (one NCCL broadcast, or peer copies); further outs on a GPU are device copies of that
//! first out. Host outs, and outs of another dtype (converted on the host), share one
//! device-to-host copy per key.
//!
//! Everything is enqueued on the GPUs' streams; nothing here waits, except the host copies.

use std::collections::BTreeMap;

use super::state::GpuCell;
use super::{copy_device, with_key, CrossGpu, Fanout, GpuPtr};
use crate::host::{convert_into, with_host, HostData};
use crate::ndarray::Storage;
use crate::{Key, NDArray, Result};

/// One key of a pull from a GPU home.
pub(crate) struct PullJob<'a> {
    pub key: &'a Key,
    pub cell: &'a GpuCell,
    pub outs: &'a [&'a NDArray],
}

/// Enqueues a validated pull from GPU homes into every job's outs.
pub(crate) fn pull(links: &dyn CrossGpu, jobs: &[PullJob<'_>]) -> Result<()> {
    let mut outs: Vec<&NDArray> = jobs.iter().flat_map(|j| j.outs.iter().copied()).collect();
    outs.sort_by_key(|a| a.storage_id());
    outs.dedup_by_key(|a| a.storage_id());
    let mut guards: Vec<_> = outs.iter().map(|a| (a.storage_id(), a.write())).collect();
    // Per key: the first out on each GPU, which the links fill from the home.
    let mut fanouts: Vec<Fanout<'_>> = Vec::new();
    // Per key: further outs on a GPU, copied from the first out there once it is written.
    let mut copies: Vec<(GpuPtr, GpuPtr, usize)> = Vec::new();
    for job in jobs {
        let home = job.cell.buf.ordinal();
        let dtype = job.cell.buf.dtype();
        let n = job.cell.buf.len();
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
                    let dst = GpuPtr {
                        ordinal: b.ordinal(),
                        addr: b.ptr(),
                    };
                    match firsts.get(&dst.ordinal) {
                        Some(&first) => copies.push((
                            dst,
                            GpuPtr {
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
        fanouts.push(Fanout {
            key: job.key,
            dtype,
            n,
            src: GpuPtr {
                ordinal: home,
                addr: job.cell.buf.ptr(),
            },
            firsts: firsts
                .into_iter()
                .map(|(ordinal, addr)| GpuPtr { ordinal, addr })
                .collect(),
        });
    }
    links.fan_out(&fanouts)?;
    // These read the first out on their GPU, which the fan-out (enqueued before them on that
    // GPU's stream) has written.
    for (dst, src, bytes) in copies {
        copy_device(dst, src, bytes)?;
    }
    drop(guards);
    Ok(())
}
