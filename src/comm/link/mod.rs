//! The link between the ranks of a store: one trait, [`Link`], chosen once when the store is
//! created, with one file per implementation.
//!
//! - [`solo`]: the single-process kinds. One rank; values pass through unchanged.
//! - `mpi` (feature `mpi`): ranks started by `mpirun` (a GPU rank's NCCL id travels over MPI).
//! - [`nccl`]: GPU ranks started without MPI (`torchrun --no-python`, srun), over NCCL alone.
//! - `loopback` (tests only): N ranks as N threads of one process, without `mpirun`.
//!
//! A store call begins a numbered [`Round`], in which the ranks compare the call's
//! [`Fingerprint`] before any data moves, then start and land collectives
//! ([`Round::start`], [`Round::land`]) that [`crate::comm::dist`] plans. `cfg(feature)`
//! appears here, where a link is built, and nowhere else.

#[cfg(test)]
pub(crate) mod loopback;
#[cfg(feature = "mpi")]
mod mpi;
pub(crate) mod nccl;
pub(crate) mod solo;

use std::time::Duration;

use super::fingerprint::{ranks, Fingerprint};

use super::nccl::{InPlace, RankComm, Watch};
use crate::config::Config;
use crate::host::HostData;
use crate::{Device, Error, NDArray, Result};

/// A collective on host buffers, as a [`Round`] starts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Op {
    /// The element-wise sum of every rank's send buffer, into the root's receive buffer.
    Reduce { root: usize },
    /// The root's buffer, into every rank's (the send buffer is the one buffer).
    Broadcast { root: usize },
    /// The element-wise sum of every rank's send buffer; rank `r` receives block `r` of it.
    ReduceScatter,
    /// Every rank's send buffer, in rank order, into every rank's receive buffer.
    AllGather,
    /// Block `r` of the root's send buffer into rank `r`'s receive buffer (the other ranks'
    /// send buffers are empty).
    Scatter { root: usize },
    /// Block `r` of every rank's send buffer (`size` equal blocks) into rank `r`'s receive
    /// buffer, in rank order: an all-to-all.
    AllToAll,
}

impl Op {
    /// The elements the receive buffer of `op` holds on `rank` of `size`, for a send buffer of
    /// `len` elements (a scatter's receive buffer is always given: its length is its own).
    pub(crate) fn recv_len(self, len: usize, rank: usize, size: usize) -> usize {
        match self {
            Op::Reduce { root } if root == rank => len,
            Op::Reduce { .. } | Op::Broadcast { .. } | Op::Scatter { .. } => 0,
            Op::ReduceScatter => len / size.max(1),
            Op::AllGather => len * size,
            Op::AllToAll => len,
        }
    }
}

/// A collective on arrays where the ranks keep their values, as [`Round::in_place`] runs it.
pub(crate) enum ArrayOp<'a> {
    /// The element-wise sum of every rank's `buf`, into rank `root`'s.
    Reduce { buf: &'a NDArray, root: usize },
    /// Rank `root`'s `buf`, into every rank's.
    Broadcast { buf: &'a NDArray, root: usize },
    /// The element-wise sum of every rank's `send`; rank `r` receives block `r` into `recv`.
    ReduceScatter {
        send: &'a NDArray,
        recv: &'a NDArray,
    },
    /// Every rank's `send`, in rank order, into every rank's `recv`.
    AllGather {
        send: &'a NDArray,
        recv: &'a NDArray,
    },
}

/// Where a rank sits in its job, and the link's settings the ranks must agree on.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Seat {
    /// This process's rank.
    pub(crate) rank: usize,
    /// The number of ranks.
    pub(crate) size: usize,
    /// This process's rank among the ranks on its machine.
    pub(crate) local_rank: usize,
    /// The number of machines the ranks run on (1: one box, where links are memory).
    pub(crate) hosts: usize,
    /// Whether calls compare their fingerprints (`KVSTORE_DIST_CHECK`, on by default).
    pub(crate) check: bool,
    /// The bound on every wait (`KVSTORE_TIMEOUT`).
    pub(crate) timeout: Duration,
}

/// How the survivors of a lost rank went on without it ([`Link::rejoin`]).
pub(crate) struct Rejoined {
    /// The ranks lost, numbered as before.
    pub(crate) lost: Vec<usize>,
    /// How long finding who is left and building their link took.
    pub(crate) took: Duration,
    /// Whether the call that failed had passed its commit point on every survivor
    /// ([`Round::commit`]): its change to the store took effect everywhere.
    pub(crate) committed: bool,
}

/// A collective started by [`Round::start`], to give to [`Round::land`].
pub(crate) struct Ticket(pub usize);

/// The connection of a store to the other ranks of its job.
pub(crate) trait Link: Send + Sync {
    /// Where this rank sits in its job, and the link's settings.
    fn seat(&self) -> Seat;
    /// A number for a new store on this link, the same on every rank for stores created in the
    /// same order, so a call of one store never matches another store's.
    fn next_store_id(&self) -> u64;
    /// Where this rank keeps its values when the link moves them in place there
    /// ([`Round::in_place`]): GPU ranks' GPUs. `None`: values cross in host buffers.
    fn in_place_home(&self) -> Option<Device> {
        None
    }
    /// Shuts the link after `why`: every later call fails with [`Error::DistFailed`].
    fn shut(&self, why: String);
    /// After a call failed with `after`: where a rank was lost and this link can go on without
    /// it (MPI with fault tolerance), the survivors' link, which every survivor must ask for (it is a
    /// collective among them; [`Link::seat`] then says the new rank and size). `None`: no rank
    /// was lost, or this link cannot go on without one (this default).
    fn rejoin(&self, _after: &Error) -> Option<Result<Rejoined>> {
        None
    }
    /// Whether [`Link::rejoin`] can go on after a lost rank (this default: no).
    fn survives_loss(&self) -> bool {
        false
    }
    /// Each rank's machine, in rank order, as a number shared by the ranks on it (this
    /// default: one machine).
    fn machines(&self) -> Vec<usize> {
        vec![0; self.seat().size]
    }
    /// Begins a store call: numbers it and, unless the check is off, compares `fp` across the
    /// ranks ([`Error::Desync`], or [`Error::RankRejected`] when a rank rejected its input).
    fn begin(&self, fp: &Fingerprint) -> Result<Box<dyn Round + '_>>;
}

/// One store call in progress on a [`Link`]; calls of one link never interleave.
pub(crate) trait Round {
    /// This call's number (1 for the first).
    fn seq(&self) -> u64;
    /// Starts `op` with this rank's `send` buffer, receiving into `recv` (of
    /// [`Op::recv_len`] elements, the dtype of `send`).
    fn start(&mut self, op: Op, send: HostData, recv: HostData) -> Result<Ticket>;
    /// Whether [`Round::start_borrowed`] would send a buffer of `op` in place now, rather than
    /// copy it (this default: never), so a caller can copy it into a buffer it reuses instead.
    fn sends_borrowed(&mut self, _op: Op) -> bool {
        false
    }
    /// [`Round::start`] from a send buffer the caller keeps: sent in place where the link can,
    /// else copied (this default). [`Round::land`] then gives back an empty send buffer.
    fn start_borrowed(&mut self, op: Op, send: &HostData, recv: HostData) -> Result<Ticket> {
        self.start(op, send.clone(), recv)
    }
    /// Starts an all-to-all of blocks of their own lengths: rank `s` sends rank `r`
    /// `lens[s * size + r]` elements (the same `size × size` lengths on every rank). `send`
    /// holds this rank's blocks for ranks 0, 1, ..., `recv` receives this rank's blocks from
    /// ranks 0, 1, ..., unpadded ([`crate::comm::dist::Blocks`] lays them out).
    fn start_all_to_all_v(
        &mut self,
        send: HostData,
        lens: &[usize],
        recv: HostData,
    ) -> Result<Ticket>;
    /// Waits (bounded) for a started collective: its (send, result) buffers. A broadcast's
    /// result is its one buffer.
    fn land(&mut self, ticket: Ticket) -> Result<(HostData, HostData)>;
    /// Moves the started collectives on without waiting (MPI progresses a non-blocking
    /// collective only inside its calls): for a caller that computes while they travel. Here
    /// (this default) nothing: the link moves them on its own.
    fn progress(&mut self) -> Result<()> {
        Ok(())
    }
    /// Every rank's `mine` (every rank gives as many words), in rank order.
    fn all_gather_words(&mut self, mine: &[u64]) -> Result<Vec<u64>>;
    /// Rank `root`'s `words`, on every rank (every rank passes as many); by default, through
    /// an all-gather.
    fn broadcast_words(&mut self, words: Vec<u64>, root: usize) -> Result<Vec<u64>> {
        let n = words.len();
        let all = self.all_gather_words(&words)?;
        all.get(root * n..(root + 1) * n)
            .map(<[u64]>::to_vec)
            .ok_or_else(|| Error::internal("no such root"))
    }
    /// Runs `ops`, in order, on arrays where [`Link::in_place_home`] says the ranks keep their
    /// values, and waits (bounded) for all of them. An error on links without (this default).
    fn in_place(&mut self, _ops: &[ArrayOp<'_>]) -> Result<()> {
        Err(Error::internal(
            "a link of host buffers asked to move arrays in place",
        ))
    }
    /// The point where a call that changes the store commits, on a link that can go on after a
    /// lost rank: `Ok` where every survivor may apply the change, an error where none may (a
    /// rank was lost first). Every rank must reach it. Elsewhere (this default) `Ok` at once.
    fn commit(&mut self) -> Result<()> {
        Ok(())
    }
    /// The end of a call that goes on after its commit point or never commits, on a link that
    /// can go on after a lost rank ([`crate::comm::points`]): `Ok` where every rank passed `ok`
    /// and none was lost, an error on every rank otherwise. Every rank that began the call must
    /// reach it, with `ok` false where its own part failed ([`Round::ended`] passes it).
    /// Elsewhere (this default) `Ok` at once.
    fn end(&mut self, _ok: bool) -> Result<()> {
        Ok(())
    }
    /// [`Link::shut`] from a round in progress (which holds the link's call lock).
    fn shut_link(&mut self, why: String);
    /// Waits until every rank is here.
    fn barrier(&mut self) -> Result<()> {
        self.all_gather_words(&[1]).map(drop)
    }
}

impl dyn Round + '_ {
    /// Ends the call at its end point ([`Round::end`]) with what its body `got`: `got` where
    /// every rank's body succeeded, else an error on every rank (this rank's own where it has
    /// one).
    pub(crate) fn ended<T>(&mut self, got: Result<T>) -> Result<T> {
        let end = self.end(got.is_ok());
        let got = got?;
        end.map(|()| got)
    }

    /// Gives back `got`, and on an error shuts this rank's link ([`Round::shut_link`]): a rank
    /// that failed its part of a call after the check may have left the others waiting in a
    /// collective it never joined, so its later calls must fail at once
    /// ([`Error::DistFailed`]) rather than meet that collective with one of their own
    /// (collectives match by their order alone: over NCCL, and with the check off).
    pub(crate) fn out_of_step_on_error<T>(&mut self, got: Result<T>) -> Result<T> {
        if let Err(e) = &got {
            let why = format!(
                "this rank failed its part of call #{} midway, so it is out of step with the \
                 others: {e}",
                self.seq()
            );
            self.shut_link(why);
        }
        got
    }

    /// `got` where every rank's part `what` of call `op` succeeded; else
    /// [`Error::RankFailed`] on every rank, naming the ranks that failed, with this rank's own
    /// error where it has one (never that error alone: every rank must go on from the same
    /// error).
    pub(crate) fn agreed<T>(&mut self, op: &'static str, got: Result<T>, what: &str) -> Result<T> {
        match (self.agree(op, got.is_ok(), what), got) {
            (Ok(()), got) => got,
            (Err(Error::RankFailed { op, seq, detail }), Err(own)) => Err(Error::RankFailed {
                op,
                seq,
                detail: format!("{detail}; this rank's: {own}"),
            }),
            (Err(e), _) => Err(e),
        }
    }

    /// Whether every rank succeeded at its part `what` of call `op`, given this rank's `ok`:
    /// else [`Error::RankFailed`] naming the ranks that did not. Return this rank's own error
    /// first.
    pub(crate) fn agree(&mut self, op: &'static str, ok: bool, what: &str) -> Result<()> {
        let flags = self.all_gather_words(&[u64::from(ok)])?;
        let failed: Vec<usize> = (flags.iter().enumerate())
            .filter(|(_, &ok)| ok != 1)
            .map(|(r, _)| r)
            .collect();
        if failed.is_empty() {
            return Ok(());
        }
        Err(Error::RankFailed {
            op,
            seq: self.seq(),
            detail: format!("{} failed {what} (its own error says why)", ranks(&failed)),
        })
    }
}

/// Joins the link of a distributed store. `on_gpu`: the ranks keep their values on GPUs
/// (`dist_device_sync` on a machine with GPUs) and move them over NCCL. Ranks started without
/// MPI (`WORLD_SIZE` set, no MPI launcher's variables) use NCCL alone.
pub(crate) fn connect(on_gpu: bool, config: &Config) -> Result<Box<dyn Link>> {
    if on_gpu && nccl::launched_without_mpi() {
        return Ok(Box::new(nccl::NcclLink::from_env(config)?));
    }
    connect_mpi(on_gpu)
}

#[cfg(feature = "mpi")]
fn connect_mpi(on_gpu: bool) -> Result<Box<dyn Link>> {
    Ok(Box::new(mpi::MpiLink::join(on_gpu)?))
}

#[cfg(not(feature = "mpi"))]
fn connect_mpi(on_gpu: bool) -> Result<Box<dyn Link>> {
    let gpu_note = match on_gpu {
        true => {
            ", or start GPU ranks without MPI as torchrun does (RANK, WORLD_SIZE, \
                 LOCAL_RANK, MASTER_ADDR, MASTER_PORT)"
        }
        false => "",
    };
    Err(Error::KindUnavailable {
        kind: "dist".to_owned(),
        reason: format!(
            "this build of kvstore has no MPI transport: build it with `--features mpi` (it \
             needs an MPI library, such as Open MPI, and libclang) and start the program with \
             `mpirun -np N`{gpu_note}"
        ),
    })
}

/// [`Round::in_place`] over NCCL between the ranks' GPUs: each run of reduces and broadcasts in
/// NCCL groups (one wait each), the others one call each.
fn in_place_over_nccl(rc: &RankComm, ops: &[ArrayOp<'_>], watch: Watch<'_>) -> Result<()> {
    let mut group = Vec::new();
    for op in ops {
        match *op {
            ArrayOp::Reduce { buf, root } => group.push(InPlace::Reduce { buf, root }),
            ArrayOp::Broadcast { buf, root } => group.push(InPlace::Broadcast { buf, root }),
            ArrayOp::ReduceScatter { send, recv } => {
                rc.group_watched(&std::mem::take(&mut group), &mut *watch)?;
                rc.reduce_scatter_watched(send, recv, &mut *watch)?;
            }
            ArrayOp::AllGather { send, recv } => {
                rc.group_watched(&std::mem::take(&mut group), &mut *watch)?;
                rc.all_gather_watched(send, recv, &mut *watch)?;
            }
        }
    }
    rc.group_watched(&group, watch)
}
