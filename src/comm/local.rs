//! Sums and copies between this process's GPUs ([`CrossGpu`], so that the CUDA backend never
//! names NCCL): grouped NCCL collectives for `nccl` stores, peer copies otherwise.

use super::nccl;
use crate::backend::cuda::{
    copy_device, copy_many, CrossGpu, DeviceCopy, Fanout, GpuBuf, GpuPtr, PartialSum,
};
use crate::{Error, Result};

/// The links between this process's GPUs for one call.
pub(crate) struct GpuLinks {
    /// NCCL collectives (else peer copies).
    pub use_nccl: bool,
}

impl CrossGpu for GpuLinks {
    /// One grouped NCCL reduce per key onto a scratch buffer on the home, or one peer copy per
    /// other GPU into its own scratch buffer (the update kernel sums them as inputs).
    fn sum_to_homes(&self, sums: Vec<PartialSum<'_>>, keep: &mut Vec<GpuBuf>) -> Result<()> {
        let mut collectives = Vec::new();
        // KVSTORE_NCCL_FORCE=1: NCCL even for values all on the home (a one-rank reduce).
        let force = self.use_nccl && nccl::force_single();
        for s in sums {
            if s.parts.is_empty() && !force {
                continue;
            }
            let with_key = |e: Error| e.with_key(s.key);
            let (home, dtype, n) = (s.home, s.dtype, s.n);
            let recv = GpuBuf::scratch(home, dtype, n).map_err(with_key)?;
            let recv_addr = recv.ptr();
            keep.push(recv);
            if !self.use_nccl {
                s.inputs.push(recv_addr);
                for (i, p) in s.parts.iter().enumerate() {
                    let dst = if i == 0 {
                        recv_addr
                    } else {
                        let b = GpuBuf::scratch(home, dtype, n).map_err(with_key)?;
                        let a = b.ptr();
                        keep.push(b);
                        s.inputs.push(a);
                        a
                    };
                    let to = GpuPtr {
                        ordinal: home,
                        addr: dst,
                    };
                    copy_device(to, *p, n * dtype.size()).map_err(with_key)?;
                }
                continue;
            }
            // The home rank sends its first value (taken out of the direct inputs), or zeros.
            let home_send = match s.inputs.is_empty() {
                false => s.inputs.remove(0),
                true => {
                    let z = GpuBuf::zeros(home, dtype, n).map_err(with_key)?;
                    let a = z.ptr();
                    keep.push(z);
                    a
                }
            };
            let mut devices: Vec<usize> = s.parts.iter().map(|p| p.ordinal).collect();
            devices.push(home);
            devices.sort_unstable();
            let root = devices.binary_search(&home).expect("home is in the set");
            let sends = devices
                .iter()
                .map(|&d| match s.parts.iter().find(|p| p.ordinal == d) {
                    Some(p) => p.addr,
                    None => home_send,
                })
                .collect();
            collectives.push(nccl::Job {
                key: s.key.clone(),
                dtype,
                n,
                devices,
                kind: nccl::Kind::Reduce {
                    sends,
                    recv: recv_addr,
                    root,
                },
            });
            s.inputs.push(recv_addr);
        }
        nccl::run("push (reduce)", &collectives)
    }

    /// One grouped NCCL broadcast per key from the home to the other GPUs, or peer copies.
    fn fan_out(&self, fanouts: &[Fanout<'_>]) -> Result<()> {
        let mut collectives = Vec::new();
        // In key order: each key's copy to its home's first out, then (without NCCL) its copies
        // to the other GPUs' first outs, so an out listed under several keys ends with the
        // last one's value (`copy_many` keeps the order where copies touch the same buffer).
        let mut copies: Vec<DeviceCopy> = Vec::new();
        // KVSTORE_NCCL_FORCE=1: the home's own first out comes through a one-rank broadcast.
        let force = self.use_nccl && nccl::force_single();
        for f in fanouts {
            let home = f.src.ordinal;
            let bytes = f.n * f.dtype.size();
            let home_first = f.firsts.iter().find(|p| p.ordinal == home);
            let remote: Vec<GpuPtr> = f
                .firsts
                .iter()
                .filter(|p| p.ordinal != home)
                .copied()
                .collect();
            if let (Some(&first), false) = (home_first, force) {
                copies.push(DeviceCopy {
                    dst: first,
                    src: f.src,
                    bytes,
                    dtype: f.dtype,
                });
            }
            if remote.is_empty() && !force {
                continue;
            }
            if !self.use_nccl {
                copies.extend(remote.into_iter().map(|dst| DeviceCopy {
                    dst,
                    src: f.src,
                    bytes,
                    dtype: f.dtype,
                }));
                continue;
            }
            let mut devices: Vec<usize> = remote.iter().map(|r| r.ordinal).collect();
            devices.push(home);
            devices.sort_unstable();
            let root = devices.binary_search(&home).expect("home is in the set");
            let recvs = devices
                .iter()
                .map(|&d| match remote.iter().find(|r| r.ordinal == d) {
                    Some(r) => r.addr,
                    // The root receives into its first out when forced, else in place.
                    None if force => home_first.map_or(f.src.addr, |p| p.addr),
                    None => f.src.addr,
                })
                .collect();
            collectives.push(nccl::Job {
                key: f.key.clone(),
                dtype: f.dtype,
                n: f.n,
                devices,
                kind: nccl::Kind::Broadcast {
                    send: f.src.addr,
                    recvs,
                    root,
                },
            });
        }
        // The copies go first, then the broadcasts.
        copy_many(&copies)?;
        nccl::run("pull (broadcast)", &collectives)
    }
}
