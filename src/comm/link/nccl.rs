//! The NCCL link: GPU ranks started without MPI (`torchrun --no-python`, srun wrappers), joined
//! by [`RankComm::from_env`], which use NCCL for everything: the fingerprint check, the control
//! messages and the data. Words travel as 16-bit pieces in `float32`, which holds them exactly.
//! Every NCCL call is bounded by `KVSTORE_TIMEOUT` ([`RankComm`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{in_place_over_nccl, ArrayOp, Link, Op, Round, Seat, Ticket};
use crate::backend::cuda::GpuBuf;
use crate::comm::fingerprint::{check_across, Fingerprint};
use crate::comm::launch::LaunchEnv;
use crate::comm::nccl::RankComm;
use crate::config::Config;
use crate::host::HostData;
use crate::{DType, Device, Error, NDArray, Result, Shape};

/// Whether this process was started by a launcher without MPI: `WORLD_SIZE` is set and no MPI
/// launcher's variables are.
pub(crate) fn launched_without_mpi() -> bool {
    const MPI_VARS: [&str; 4] = [
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
        "PMIX_RANK",
        "MPI_LOCALNRANKS",
    ];
    std::env::var_os("WORLD_SIZE").is_some()
        && MPI_VARS.iter().all(|v| std::env::var_os(v).is_none())
}

/// GPU ranks joined by NCCL alone.
pub(crate) struct NcclLink {
    rc: Arc<RankComm>,
    seat: Seat,
    /// The last call begun, and the first failure (the link refuses calls after a desync).
    calls: Mutex<(u64, Option<String>)>,
    stores: AtomicU64,
}

impl NcclLink {
    /// Joins the NCCL communicator of every rank the launcher's environment describes.
    pub(crate) fn from_env(config: &Config) -> Result<NcclLink> {
        let launch = LaunchEnv::from_process()?;
        let rc = RankComm::from_env()?;
        let seat = Seat {
            rank: rc.rank(),
            size: rc.size(),
            local_rank: launch.local_rank,
            hosts: launch.hosts(),
            check: config.dist_check,
            timeout: rc.timeout(),
        };
        Ok(NcclLink {
            rc: Arc::new(rc),
            seat,
            calls: Mutex::new((0, None)),
            stores: AtomicU64::new(0),
        })
    }
}

impl Link for NcclLink {
    fn seat(&self) -> Seat {
        self.seat
    }

    fn next_store_id(&self) -> u64 {
        self.stores.fetch_add(1, Ordering::Relaxed)
    }

    fn in_place_home(&self) -> Option<Device> {
        Some(Device::Gpu(self.rc.ordinal()))
    }

    fn shut(&self, why: String) {
        let mut st = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        st.1.get_or_insert(why);
    }

    fn begin(&self, fp: &Fingerprint) -> Result<Box<dyn Round + '_>> {
        let mut st = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(first) = &st.1 {
            return Err(Error::DistFailed {
                op: fp.op(),
                first: first.clone(),
            });
        }
        st.0 += 1;
        let seq = st.0;
        let mut round = NcclRound {
            rc: &self.rc,
            op: fp.op(),
            seq,
            serial: st,
            landed: Vec::new(),
        };
        if self.seat.check {
            let size = self.seat.size;
            if let Err(e) = check_across(fp, seq, size, |w| round.all_gather_words(w)) {
                if matches!(e, Error::Desync { .. }) {
                    round.serial.1 = Some(e.to_string());
                }
                return Err(e);
            }
        }
        Ok(Box::new(round))
    }
}

/// One call over NCCL; holds the link's lock, so calls never interleave.
struct NcclRound<'a> {
    rc: &'a RankComm,
    /// The store call's op ("push", "pull", ...), for the errors of its agreements.
    op: &'static str,
    seq: u64,
    /// The link's state, locked: calls never interleave, and a failure shuts the link.
    serial: MutexGuard<'a, (u64, Option<String>)>,
    /// The (send, received) host buffers of each all-to-all started, until landed.
    landed: Vec<Option<(HostData, HostData)>>,
}

impl NcclRound<'_> {
    /// An all-to-all of host buffers (compressed pushes and row-sparse keys) over NCCL, through
    /// this rank's GPU; done when this returns. [`Round::land`] hands the buffers over.
    fn all_to_all(
        &mut self,
        send: HostData,
        sends: Vec<usize>,
        recv: HostData,
        receives: Vec<usize>,
    ) -> Result<Ticket> {
        let (sent, received) = (sends.iter().sum::<usize>(), receives.iter().sum::<usize>());
        let fits =
            match sent <= send.len() && received == recv.len() && send.dtype() == recv.dtype() {
                true => Ok(()),
                false => Err(Error::internal(&format!(
                    "an all-to-all of {sent} and {received} elements on buffers of {} and {}",
                    send.len(),
                    recv.len()
                ))),
            };
        let ordinal = self.rc.ordinal();
        // A GPU keeps no empty arrays: an empty side is one unused element.
        let on_gpu = |h: &HostData| match h.len() {
            0 => NDArray::full_on([1], 0.0, h.dtype(), Device::Gpu(ordinal)),
            n => Ok(NDArray::from_gpu(
                GpuBuf::upload(ordinal, h)?,
                Shape::new(&[n])?,
            )),
        };
        // The ranks agree that each staged its buffers, and read its result back: a rank that
        // failed either step must not leave the others waiting in NCCL, or going on without it.
        let staged = fits.and_then(|()| Ok((on_gpu(&send)?, on_gpu(&recv)?)));
        let together = self.agree_on("staging its all-to-all on its GPU", staged.is_ok());
        let (send_gpu, recv_gpu) = staged?;
        together?;
        self.rc
            .all_to_all_v(&send_gpu, &sends, &recv_gpu, &receives)?;
        let got = match received {
            0 => Ok(recv),
            _ => recv_gpu.into_host(),
        };
        let together = self.agree_on("reading its all-to-all back from its GPU", got.is_ok());
        let got = got?;
        together?;
        self.landed.push(Some((send, got)));
        Ok(Ticket(self.landed.len() - 1))
    }

    /// `got`, shutting the link on an error: a rank that failed its part of a word exchange is
    /// out of step, and must fail its later calls rather than meet others' collectives.
    fn shut_on_error<T>(&mut self, got: Result<T>) -> Result<T> {
        if let Err(e) = &got {
            self.serial.1.get_or_insert_with(|| e.to_string());
        }
        got
    }

    /// Whether every rank succeeded at `what`, given this rank's `ok` (see `Round::agree`).
    fn agree_on(&mut self, what: &str, ok: bool) -> Result<()> {
        let op = self.op;
        let round: &mut dyn Round = self;
        round.agree(op, ok, what)
    }
}

impl Round for NcclRound<'_> {
    fn shut_link(&mut self, why: String) {
        self.serial.1.get_or_insert(why);
    }

    fn seq(&self) -> u64 {
        self.seq
    }

    fn start(&mut self, op: Op, send: HostData, recv: HostData) -> Result<Ticket> {
        // Only the all-to-all of equal blocks (the padded form of `Blocks`) moves host data
        // here; the other collectives of GPU ranks run on the GPU arrays themselves.
        let Op::AllToAll = op else {
            return Err(Error::internal(&format!(
                "a host-memory {op:?} on a NCCL-only link"
            )));
        };
        let size = self.rc.size();
        let each = vec![send.len() / size.max(1); size];
        self.all_to_all(send, each.clone(), recv, each)
    }

    fn start_all_to_all_v(
        &mut self,
        send: HostData,
        lens: &[usize],
        recv: HostData,
    ) -> Result<Ticket> {
        let (rank, size) = (self.rc.rank(), self.rc.size());
        if lens.len() != size * size {
            return Err(Error::internal(
                "all-to-all lengths not one per pair of ranks",
            ));
        }
        let sends = lens[rank * size..(rank + 1) * size].to_vec();
        let receives = (0..size).map(|s| lens[s * size + rank]).collect();
        self.all_to_all(send, sends, recv, receives)
    }

    fn land(&mut self, ticket: Ticket) -> Result<(HostData, HostData)> {
        (self.landed.get_mut(ticket.0))
            .and_then(Option::take)
            .ok_or_else(|| Error::internal("a ticket landed twice, or never started"))
    }

    fn in_place(&mut self, ops: &[ArrayOp<'_>]) -> Result<()> {
        in_place_over_nccl(self.rc, ops, &mut || Ok(()))
    }

    fn all_gather_words(&mut self, mine: &[u64]) -> Result<Vec<u64>> {
        let pieces: Vec<f32> = mine.iter().flat_map(|&w| split(w)).collect();
        let got = all_gather_f32(self.rc, &pieces);
        self.shut_on_error(got).map(|g| join_words(&g))
    }

    fn broadcast_words(&mut self, words: Vec<u64>, root: usize) -> Result<Vec<u64>> {
        let n = words.len();
        let pieces: Vec<f32> = words.iter().flat_map(|&w| split(w)).collect();
        let got = (|| {
            let buf = NDArray::from_vec_on(pieces, [n * 4], Device::Gpu(self.rc.ordinal()))?;
            self.rc.broadcast(&buf, root)?;
            buf.to_vec::<f32>()
        })();
        self.shut_on_error(got).map(|g| join_words(&g))
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
