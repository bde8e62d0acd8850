//! One call of a distributed store across its ranks, over whichever link joins them: MPI
//! (`mpirun`), or NCCL alone for GPU ranks started without MPI (`torchrun --no-python`, srun).
//!
//! Over NCCL the call does what the MPI transport's [`Call`] does: it numbers the call, compares
//! the call's fingerprint across ranks before any data moves (an all-gather of a 32-byte record,
//! sent as sixteen 16-bit pieces in `float32`, which holds them exactly), and on a mismatch
//! exchanges the ranks' descriptions to name the first difference. Every NCCL call is bounded by
//! `KVSTORE_TIMEOUT` ([`RankComm`]), which aborts the communicator on a timeout.

use std::sync::{Mutex, MutexGuard};

use super::super::mpi::fingerprint::{mismatch_error, ranks, Record};
use super::super::mpi::{Call, Fingerprint};
use super::super::nccl::RankComm;
use crate::{DType, Device, Error, NDArray, Result};

/// How the ranks of a NCCL-only link number their calls: the last call begun, and the first
/// failure (the link refuses calls after a desync).
#[derive(Default)]
pub(crate) struct NcclCalls {
    state: Mutex<(u64, Option<String>)>,
}

/// One call in progress.
pub(crate) enum Round<'a> {
    /// Over the MPI transport.
    Mpi(Call),
    /// Over NCCL between GPU ranks; holds the link's lock, so calls never interleave.
    Nccl {
        rc: &'a RankComm,
        seq: u64,
        _serial: MutexGuard<'a, (u64, Option<String>)>,
    },
}

impl NcclCalls {
    /// Begins a call over `rc`: numbers it and, when `check` is on, compares `fp` across ranks.
    pub fn begin<'a>(
        &'a self,
        rc: &'a RankComm,
        fp: &Fingerprint,
        check: bool,
    ) -> Result<Round<'a>> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(first) = &st.1 {
            return Err(Error::DistFailed {
                op: fp.op(),
                first: first.clone(),
            });
        }
        st.0 += 1;
        let seq = st.0;
        if check {
            if let Err(e) = check_fingerprint(rc, fp, seq) {
                if matches!(e, Error::Desync { .. }) {
                    st.1 = Some(e.to_string());
                }
                return Err(e);
            }
        }
        Ok(Round::Nccl {
            rc,
            seq,
            _serial: st,
        })
    }
}

impl Round<'_> {
    /// This call's number (1 for the first).
    pub fn seq(&self) -> u64 {
        match self {
            Round::Mpi(call) => call.seq(),
            Round::Nccl { seq, .. } => *seq,
        }
    }

    /// The MPI call, for the collectives of host-memory ranks.
    pub fn mpi(&mut self) -> Result<&mut Call> {
        match self {
            Round::Mpi(call) => Ok(call),
            Round::Nccl { .. } => Err(Error::Mpi {
                op: "dist",
                message: "internal error: a host-memory collective on a NCCL-only link; please \
                          report it"
                    .to_owned(),
            }),
        }
    }

    /// Every rank's `ok`, in rank order.
    pub fn flags(&mut self, ok: bool) -> Result<Vec<bool>> {
        match self {
            Round::Mpi(call) => {
                let size = call.world().size();
                let p = call.all_gather(vec![u64::from(ok)], vec![0u64; size])?;
                Ok(call.wait(p)?.recv.into_iter().map(|v| v == 1).collect())
            }
            Round::Nccl { rc, .. } => {
                let got = all_gather_f32(rc, &[if ok { 1.0 } else { 0.0 }])?;
                Ok(got.into_iter().map(|v| v == 1.0).collect())
            }
        }
    }

    /// Whether every rank succeeded at its part `what` of call `op`, given this rank's `ok`:
    /// `Ok` when all did, else [`Error::RankFailed`] naming the ranks that did not (each of
    /// them has its own error). Return this rank's own error first.
    pub fn agree(&mut self, op: &'static str, ok: bool, what: &str) -> Result<()> {
        let seq = self.seq();
        let failed: Vec<usize> = (self.flags(ok)?.iter().enumerate())
            .filter(|(_, &ok)| !ok)
            .map(|(r, _)| r)
            .collect();
        if failed.is_empty() {
            return Ok(());
        }
        Err(Error::RankFailed {
            op,
            seq,
            detail: format!("{} failed {what} (its own error says why)", ranks(&failed)),
        })
    }

    /// Rank `root`'s `words`, on every rank (every rank passes as many).
    pub fn broadcast_words(&mut self, words: Vec<u64>, root: usize) -> Result<Vec<u64>> {
        match self {
            Round::Mpi(call) => {
                let p = call.broadcast(words, root)?;
                Ok(call.wait(p)?.recv)
            }
            Round::Nccl { rc, .. } => {
                let n = words.len();
                let pieces: Vec<f32> = words.iter().flat_map(|&w| split(w)).collect();
                let buf = NDArray::from_vec_on(pieces, [n * 4], Device::Gpu(rc.ordinal()))?;
                rc.broadcast(&buf, root)?;
                Ok(join_words(&buf.to_vec::<f32>()?))
            }
        }
    }

    /// Waits until every rank is here.
    pub fn barrier(&mut self) -> Result<()> {
        match self {
            Round::Mpi(call) => call.barrier(),
            Round::Nccl { .. } => self.flags(true).map(drop),
        }
    }
}

/// A word as four 16-bit pieces, each exact in `float32`.
fn split(w: u64) -> [f32; 4] {
    [0, 16, 32, 48].map(|s| ((w >> s) & 0xffff) as f32)
}

/// Words from the pieces of [`split`].
fn join_words(pieces: &[f32]) -> Vec<u64> {
    pieces
        .chunks(4)
        .map(|c| {
            c.iter()
                .enumerate()
                .fold(0u64, |w, (i, &p)| w | ((p as u64) << (16 * i)))
        })
        .collect()
}

/// An all-gather of a few `float32`s over NCCL: every rank's `mine`, in rank order.
fn all_gather_f32(rc: &RankComm, mine: &[f32]) -> Result<Vec<f32>> {
    let gpu = Device::Gpu(rc.ordinal());
    let send = NDArray::from_vec_on(mine.to_vec(), [mine.len()], gpu)?;
    let recv = NDArray::full_on([mine.len() * rc.size()], 0.0, DType::F32, gpu)?;
    rc.all_gather(&send, &recv)?;
    recv.to_vec::<f32>()
}

/// Compares `fp` across the ranks of `rc` for call `seq`; see [`crate::comm::mpi`]'s check,
/// which this mirrors.
fn check_fingerprint(rc: &RankComm, fp: &Fingerprint, seq: u64) -> Result<()> {
    let mine: Record = fp.record(seq);
    let pieces: Vec<f32> = mine.iter().flat_map(|&w| split(w)).collect();
    let all = join_words(&all_gather_f32(rc, &pieces)?);
    if all.chunks(mine.len()).all(|r| r == mine) {
        return Ok(());
    }
    // Every rank saw the same records: exchange the descriptions, as bytes in float32.
    let text = fp.describe(seq).into_bytes();
    let lens = all_gather_f32(rc, &[text.len() as f32])?;
    let max = lens.iter().fold(0.0f32, |m, &l| m.max(l)) as usize;
    let mut padded: Vec<f32> = text.iter().map(|&b| f32::from(b)).collect();
    padded.resize(max, 0.0);
    let gathered = all_gather_f32(rc, &padded)?;
    let texts: Vec<String> = (0..rc.size())
        .map(|r| {
            let bytes: Vec<u8> = gathered[r * max..(r + 1) * max]
                .iter()
                .take(lens[r] as usize)
                .map(|&b| b as u8)
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        })
        .collect();
    Err(mismatch_error(fp.op(), seq, &texts))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_survive_their_trip_as_float32_pieces() {
        let words = [0u64, 1, u64::MAX, 0xcbf2_9ce4_8422_2325, 1 << 63];
        let pieces: Vec<f32> = words.iter().flat_map(|&w| split(w)).collect();
        assert_eq!(join_words(&pieces), words);
    }
}
