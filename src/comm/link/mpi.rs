//! The MPI link (`mpirun`): CPU ranks move host buffers over the MPI transport; GPU ranks
//! join an NCCL communicator whose id travels over MPI, and keep MPI for the checks.

use std::convert::identity;
use std::sync::Arc;

use super::{in_place_over_nccl, ArrayOp, Link, Op, Rejoined, Round, Seat, Ticket};
use crate::backend::probe;
use crate::comm::fingerprint::Fingerprint;
use crate::comm::mpi::{Call, Done, Group, Layout, Pending, Wire, World};
use crate::comm::nccl::loader::UniqueId;
use crate::comm::nccl::RankComm;
use crate::host::HostData;
use crate::{Device, Element, Error, Result};

/// The MPI world, and NCCL between the ranks' GPUs when they keep their values there.
pub(crate) struct MpiLink {
    /// The world's newest generation this link has joined.
    world: std::sync::RwLock<&'static World>,
    /// GPU ranks' NCCL communicator among the world's ranks (a new one after a lost rank).
    gpu: std::sync::RwLock<Option<Arc<RankComm>>>,
}

impl MpiLink {
    /// Joins the MPI world and, for GPU ranks, an NCCL communicator of every rank.
    pub(super) fn join(on_gpu: bool) -> Result<MpiLink> {
        let world = World::get()?;
        let gpu = match on_gpu {
            true => {
                let ordinal = world.local_rank() % probe::gpu_count().max(1);
                Some(Arc::new(join_nccl_over_mpi(world, ordinal)?))
            }
            false => None,
        };
        Ok(MpiLink {
            world: std::sync::RwLock::new(world),
            gpu: std::sync::RwLock::new(gpu),
        })
    }

    /// The world this link is on.
    fn world(&self) -> &'static World {
        *self.world.read().unwrap_or_else(|p| p.into_inner())
    }

    /// GPU ranks' communicator.
    fn gpu(&self) -> Option<Arc<RankComm>> {
        self.gpu.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Link for MpiLink {
    fn seat(&self) -> Seat {
        let w = self.world();
        Seat {
            rank: w.rank(),
            size: w.size(),
            local_rank: w.local_rank(),
            hosts: w.host_count(),
            check: w.check_enabled(),
            timeout: w.timeout(),
        }
    }

    fn next_store_id(&self) -> u64 {
        self.world().next_store_id()
    }

    fn in_place_home(&self) -> Option<Device> {
        self.gpu().map(|rc| Device::Gpu(rc.ordinal()))
    }

    fn shut(&self, why: String) {
        self.world().poison_with(why);
    }

    fn survives_loss(&self) -> bool {
        self.world().is_elastic()
    }

    fn machines(&self) -> Vec<usize> {
        self.world().machine_of().to_vec()
    }

    fn rejoin(&self, after: &Error) -> Option<Result<Rejoined>> {
        let world = self.world();
        let gpu = self.gpu();
        // GPU ranks may have seen the loss in NCCL (an error, or a wait past the timeout), not
        // in MPI: then MPI is asked. Other errors (an updater's, a rejected input) are no loss.
        let in_nccl = matches!(
            after,
            Error::Nccl { .. } | Error::Timeout { .. } | Error::Cuda { .. }
        );
        let lost = world.lost_a_rank() || (gpu.is_some() && in_nccl && world.find_loss());
        if !world.is_elastic() || !lost {
            return None;
        }
        let start = std::time::Instant::now();
        let committed = world.settle_commit();
        let shrunk = match world.shrink() {
            Ok(shrunk) => shrunk,
            Err(e) => return Some(Err(e)),
        };
        *self.world.write().unwrap_or_else(|p| p.into_inner()) = shrunk.world;
        if let Some(old) = gpu {
            // The old communicator counts the lost rank, whose part of any collective never
            // comes (and a finalize would wait for it): abort it, and join one of the survivors,
            // its id sent over the survivors' MPI world, on the GPU that holds this rank's
            // values (whatever its new local rank).
            old.abort();
            match join_nccl_over_mpi(shrunk.world, old.ordinal()) {
                Ok(rc) => *self.gpu.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(rc)),
                Err(e) => return Some(Err(e)),
            }
        }
        Some(Ok(Rejoined {
            lost: shrunk.lost,
            took: start.elapsed(),
            committed,
        }))
    }

    fn begin(&self, fp: &Fingerprint) -> Result<Box<dyn Round + '_>> {
        let world = self.world();
        let call = world.begin(fp)?;
        let agreed = world.check_enabled();
        Ok(Box::new(MpiRound {
            call,
            gpu: self.gpu(),
            flights: smallvec::SmallVec::new(),
            agreed,
        }))
    }
}

/// One call on the MPI world, with its collectives in flight.
///
/// A reduce runs blocking ([`blocking_wins`]) when every rank has just agreed to start it (the
/// fingerprint check, or a word exchange, [`Round::all_gather_words`]), with no collective
/// landed since and no rank's timeout in this call heard of: a store's step between an
/// agreement and its collectives fails on every rank or on none. Every other collective, and
/// every one with `KVSTORE_DIST_CHECK=0`, is polled within the timeout.
struct MpiRound {
    call: Call,
    /// NCCL between the ranks' GPUs, for GPU ranks.
    gpu: Option<Arc<RankComm>>,
    /// Inline for a call of a few transfers.
    flights: smallvec::SmallVec<[Option<Flight>; 2]>,
    /// Whether every rank has agreed to the collectives started next.
    agreed: bool,
}

/// A started collective of one dtype, tested and landed by the call that started it.
trait Airborne {
    /// One `MPI_Test`: whether it completed (MPI moves non-blocking collectives on inside it).
    fn test(&mut self, call: &mut Call) -> Result<bool>;
    /// Waits for it (bounded): its (send, result) buffers.
    fn land(self: Box<Self>, call: &mut Call) -> Result<(HostData, HostData)>;
}

impl<T: Wire + Element> Airborne for Pending<T> {
    fn test(&mut self, call: &mut Call) -> Result<bool> {
        call.test(self)
    }

    fn land(self: Box<Self>, call: &mut Call) -> Result<(HostData, HostData)> {
        call.wait(*self).map(wrap)
    }
}

/// A collective in two stages, the second started when the first lands: its (send, result)
/// buffers once both have.
type Staged = Box<dyn FnOnce(&mut Call) -> Result<(HostData, HostData)>>;

/// A started collective of any dtype, or the buffers of one that ran blocking when borrowed.
enum Flight {
    Started(Box<dyn Airborne>),
    Staged(Staged),
    Landed(HostData, HostData),
}

/// A started collective as a [`Flight`]: it lands when its call waits for it.
fn started<T: Wire + Element>(p: Pending<T>) -> Flight {
    Flight::Started(Box::new(p))
}

/// `$e` on the buffers `$s` and `$r` of one dtype, through `$out` (two dtypes: an error).
macro_rules! typed {
    ($send:expr, $recv:expr, $out:expr, |$s:ident, $r:ident| $e:expr) => {
        match ($send, $recv) {
            (HostData::F32($s), HostData::F32($r)) => $e.map($out),
            (HostData::F64($s), HostData::F64($r)) => $e.map($out),
            (HostData::F16($s), HostData::F16($r)) => $e.map($out),
            (HostData::BF16($s), HostData::BF16($r)) => $e.map($out),
            _ => Err(Error::internal("a receive buffer of another dtype")),
        }
    };
}

impl MpiRound {
    /// Whether `op` runs blocking: every rank agreed to start it, blocking wins for it, and no
    /// rank gave this call up meanwhile (a rank that timed out still let the agreement complete
    /// on the others). Asked last, so a call with no blocking start (a pull) never probes.
    fn may_block(&mut self, op: Op) -> bool {
        // Under fault tolerance nothing runs blocking: a blocking collective across machines
        // returned success with wrong sums when a rank died in it (Open MPI 5.0.11, measured:
        // the design notes' ULFM findings); a polled one fails as it should.
        self.agreed
            && blocking_wins(op)
            && !self.call.world().is_elastic()
            && !self.call.peer_timed_out()
    }

    /// Keeps `flight` until it lands; returns its ticket.
    fn fly(&mut self, flight: Flight) -> Ticket {
        self.flights.push(Some(flight));
        Ticket(self.flights.len() - 1)
    }
}

impl Round for MpiRound {
    fn shut_link(&mut self, why: String) {
        self.call.world().poison_with(why);
    }

    fn commit(&mut self) -> Result<()> {
        // Nothing blocking follows unagreed: the agreement ends every rank's wait alike.
        self.agreed = false;
        self.call.commit_point(true)
    }

    fn end(&mut self, ok: bool) -> Result<()> {
        self.agreed = false;
        self.call.end_point(ok)
    }

    fn seq(&self) -> u64 {
        self.call.seq()
    }

    fn start(&mut self, op: Op, send: HostData, recv: HostData) -> Result<Ticket> {
        let blocking = self.may_block(op);
        self.call.set_blocking(blocking);
        // Several machines of several ranks: a sliced key crosses between them in two stages.
        let staged = self.call.world().layout().is_some();
        let call = &mut self.call;
        let flight = match op {
            Op::Reduce { root } => typed!(send, recv, started, |s, r| call.reduce_sum(s, r, root)),
            Op::Broadcast { root } => typed!(send, recv, started, |s, _r| call.broadcast(s, root)),
            Op::ReduceScatter if staged => {
                typed!(send, recv, identity, |s, r| reduce_scatter_in_stages(
                    call, s, r
                ))
            }
            Op::ReduceScatter => typed!(send, recv, started, |s, r| call.reduce_scatter(s, r)),
            Op::AllGather if staged => {
                typed!(send, recv, identity, |s, r| all_gather_in_stages(
                    call, s, r
                ))
            }
            Op::AllGather => typed!(send, recv, started, |s, r| call.all_gather(s, r)),
            Op::Scatter { root } => typed!(send, recv, started, |s, r| call.scatter(s, r, root)),
            Op::AllToAll => typed!(send, recv, started, |s, r| call.all_to_all(s, r)),
        };
        // Off again whatever happened: the round's word exchanges never run blocking.
        self.call.set_blocking(false);
        Ok(self.fly(flight?))
    }

    fn sends_borrowed(&mut self, op: Op) -> bool {
        matches!(op, Op::Reduce { .. }) && self.may_block(op)
    }

    fn start_borrowed(&mut self, op: Op, send: &HostData, recv: HostData) -> Result<Ticket> {
        // Only a blocking collective is done with the borrowed buffer when it returns.
        let (Op::Reduce { root }, true) = (op, self.may_block(op)) else {
            return self.start(op, send.clone(), recv);
        };
        self.call.set_blocking(true);
        let call = &mut self.call;
        let landed = typed!(send, recv, wrap, |s, r| call
            .reduce_sum_borrowed(s, r, root));
        self.call.set_blocking(false);
        let (send, recv) = landed?;
        Ok(self.fly(Flight::Landed(send, recv)))
    }

    fn start_all_to_all_v(
        &mut self,
        send: HostData,
        lens: &[usize],
        recv: HostData,
    ) -> Result<Ticket> {
        let call = &mut self.call;
        let flight = typed!(send, recv, started, |s, r| call.all_to_all_v(s, lens, r));
        Ok(self.fly(flight?))
    }

    fn land(&mut self, ticket: Ticket) -> Result<(HostData, HostData)> {
        let flight = (self.flights.get_mut(ticket.0).and_then(Option::take))
            .ok_or_else(|| Error::internal("a collective landed twice"))?;
        // The store works on what landed, which may fail on this rank only: the next
        // collectives need a new agreement.
        self.agreed = false;
        match flight {
            Flight::Started(p) => p.land(&mut self.call),
            Flight::Staged(land) => land(&mut self.call),
            Flight::Landed(send, recv) => Ok((send, recv)),
        }
    }

    fn progress(&mut self) -> Result<()> {
        for flight in self.flights.iter_mut().flatten() {
            if let Flight::Started(p) = flight {
                p.test(&mut self.call)?;
            }
        }
        Ok(())
    }

    fn in_place(&mut self, ops: &[ArrayOp<'_>]) -> Result<()> {
        // A rank may fail its part alone: the next reduce is no longer agreed to.
        self.agreed = false;
        match &self.gpu {
            // MPI may learn of a lost rank that NCCL waits for.
            Some(rc) => in_place_over_nccl(rc, ops, &mut || self.call.loss_known()),
            None => Err(Error::internal("host ranks asked to move arrays in place")),
        }
    }

    fn all_gather_words(&mut self, mine: &[u64]) -> Result<Vec<u64>> {
        let words = self.call.all_gather_u64(mine)?;
        self.agreed = true;
        Ok(words)
    }

    fn broadcast_words(&mut self, words: Vec<u64>, root: usize) -> Result<Vec<u64>> {
        let p = self.call.broadcast(words, root)?;
        self.agreed = false;
        Ok(self.call.wait(p)?.recv)
    }

    fn barrier(&mut self) -> Result<()> {
        self.call.barrier()?;
        self.agreed = true;
        Ok(())
    }
}

/// Whether Open MPI's blocking algorithm for `op` (`tuned`) beats its polled non-blocking one
/// (`libnbc`), measured side by side (`examples/bench_dist_store`, BENCHMARKS.md "Blocking or
/// not"): a reduce is 2–3× faster blocking from 4 KiB to 1 MiB at 2–4 ranks; a broadcast and
/// an all-gather are as fast or faster non-blocking (an all-gather of 16 MiB at 3 ranks 3×
/// faster); a reduce-scatter of 16 MiB is mixed. On three ranks or more a blocking reduce (the
/// store's own, in rank order) completes in one `MPI_Waitall` (BENCHMARKS.md, "Sums in rank
/// order").
fn blocking_wins(op: Op) -> bool {
    matches!(op, Op::Reduce { .. })
}

/// The world's machines, for a two-stage collective whose whole buffer of `len` elements holds
/// one block of `n` per rank (else an internal error: nothing is started).
fn staged_layout(call: &Call, len: usize, n: usize) -> Result<&'static Layout> {
    let layout = (call.world().layout()).ok_or_else(|| Error::internal("no machines to stage"))?;
    match n.checked_mul(layout.order().len()) == Some(len) {
        true => Ok(layout),
        false => Err(Error::internal(
            "a two-stage buffer is not a block per rank",
        )),
    }
}

/// A sliced key's reduce-scatter in two stages ([`crate::comm::mpi::hierarchy`]): among the
/// ranks of this machine, then, when that lands, among the ranks of this local rank across
/// machines. `send` is given back as it was.
fn reduce_scatter_in_stages<T: Wire + Element>(
    call: &mut Call,
    send: Vec<T>,
    recv: Vec<T>,
) -> Result<Flight> {
    let n = recv.len();
    let layout = staged_layout(call, send.len(), n)?;
    let mut staged = call.scratch::<T>(send.len());
    layout.stage_order(&send, n, &mut staged);
    let chunk = call.scratch::<T>(n * layout.hosts);
    let first = call.reduce_scatter_in(Group::Machine, staged, chunk)?;
    // One timeout bounds both stages.
    let start = first.started_at();
    Ok(Flight::Staged(Box::new(move |call: &mut Call| {
        let Done {
            send: staged,
            recv: chunk,
        } = call.wait(first)?;
        call.keep_scratch(staged);
        let second = (call.reduce_scatter_in(Group::Across, chunk, recv)?).counting_from(start);
        let Done { send: chunk, recv } = call.wait(second)?;
        call.keep_scratch(chunk);
        Ok(wrap(Done { send, recv }))
    })))
}

/// A sliced key's all-gather in two stages: among the ranks of this local rank across
/// machines, then, when that lands, among the ranks of this machine; `recv` gets every rank's
/// block in rank order.
fn all_gather_in_stages<T: Wire + Element>(
    call: &mut Call,
    send: Vec<T>,
    recv: Vec<T>,
) -> Result<Flight> {
    let n = send.len();
    let layout = staged_layout(call, recv.len(), n)?;
    let size = layout.order().len();
    let chunk = call.scratch::<T>(n * layout.hosts);
    let first = call.all_gather_in(Group::Across, send, chunk)?;
    let start = first.started_at();
    Ok(Flight::Staged(Box::new(move |call: &mut Call| {
        let Done { send, recv: chunk } = call.wait(first)?;
        let staged = call.scratch::<T>(n * size);
        let second = (call.all_gather_in(Group::Machine, chunk, staged)?).counting_from(start);
        let Done {
            send: chunk,
            recv: staged,
        } = call.wait(second)?;
        let mut recv = recv;
        layout.rank_order(&staged, n, &mut recv);
        call.keep_scratch(chunk);
        call.keep_scratch(staged);
        Ok(wrap(Done { send, recv }))
    })))
}

/// The (send, result) buffers of a finished collective (a broadcast's one buffer is `recv`).
fn wrap<T: Element>(done: Done<T>) -> (HostData, HostData) {
    (T::wrap(done.send), T::wrap(done.recv))
}

/// Joins the NCCL communicator of every rank of `world`, on GPU `ordinal`.
fn join_nccl_over_mpi(world: &'static World, ordinal: usize) -> Result<RankComm> {
    let mut call = world.begin(&Fingerprint::new("join NCCL ranks"))?;
    let mut words = vec![0u64; 16];
    let mut made = Ok(());
    if world.rank() == 0 {
        match RankComm::unique_id() {
            Ok(id) => words = pack(&id),
            Err(e) => made = Err(e),
        }
    }
    let p = call.broadcast(words, 0)?;
    let words = call.wait(p)?.recv;
    // The world's lock is not held across NCCL's own bootstrap, which waits for every rank
    // (bounded by KVSTORE_TIMEOUT).
    drop(call);
    made?;
    if words.iter().all(|&w| w == 0) {
        let why = "rank 0 could not create an NCCL id (its own error says why)";
        return Err(Error::dist_env("NCCL", why));
    }
    RankComm::join(unpack(&words), world.rank(), world.size(), ordinal)
}

/// The 128 bytes of an NCCL id as 16 little-endian words, for MPI.
fn pack(id: &UniqueId) -> Vec<u64> {
    bytemuck::cast::<_, [u64; 16]>(id.0)
        .map(u64::from_le)
        .to_vec()
}

/// The NCCL id from the 16 words of [`pack`] (missing words read as zeros).
fn unpack(words: &[u64]) -> UniqueId {
    let mut all = [0u64; 16];
    all.iter_mut().zip(words).for_each(|(a, w)| *a = w.to_le());
    UniqueId(bytemuck::cast(all))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_nccl_id_survives_its_trip_as_words() {
        let mut id = UniqueId([0; 128]);
        for (i, b) in id.0.iter_mut().enumerate() {
            *b = (i as i32 * 37 - 100) as _;
        }
        let back = unpack(&pack(&id));
        assert_eq!(back.0, id.0);
    }
}
