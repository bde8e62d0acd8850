//! The loopback link: N ranks as N threads of one process, so the rules of the distributed
//! stores run in `cargo test` in milliseconds, without `mpirun`.
//!
//! The k-th exchange of every rank is matched with the k-th of every other, as MPI matches
//! collectives by their order. A rank deposits its buffer when it starts a collective and takes
//! its result when it lands it, once every rank has deposited; a wait past the hub's timeout is
//! [`Error::Timeout`] naming the ranks that never came. Sums are taken in `float64` in rank
//! order and rounded once.
//!
//! **Lost ranks** ([`Loopback::elastic`]), as MPI with fault tolerance (ULFM) has them: a rank
//! that dies ([`Loopback::die_after`] its n-th exchange) fails every wait
//! for its deposits at once, and the first survivor to see it revokes the world: every later
//! exchange fails too, except the fault-tolerant agreements ([`Round::commit`]), which end alike
//! on every survivor. [`Link::rejoin`] then moves the survivors to a new world of their own
//! (a strict majority only), numbered in their old order.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{ArrayOp, Link, Op, Rejoined, Round, Seat, Ticket};
use crate::comm::dist::copy_into;
use crate::comm::fingerprint::{check_across, Fingerprint};
use crate::comm::points::{Agreed, Point, Points, Vote};
use crate::host::{with_host, HostData};
use crate::ndarray::Storage;
use crate::{DType, Device, Error, Key, Result};

/// What a rank puts into an exchange.
#[derive(Clone)]
enum Payload {
    Data(HostData),
    Words(Vec<u64>),
}

/// One exchange: every rank's deposit, and how many ranks have taken their result.
struct Exchange {
    deposits: Vec<Option<Payload>>,
    taken: usize,
    /// The lowest rank that died in this exchange after its deposit.
    died_after: Option<usize>,
}

/// One fault-tolerant agreement: every rank's flag, and the outcome once decided.
struct Agreement {
    flags: Vec<Option<Vote>>,
    decided: Option<Agreed>,
}

/// What the ranks of one loopback world share, under one lock.
#[derive(Default)]
struct Shared {
    exchanges: HashMap<u64, Exchange>,
    agreements: HashMap<u64, Agreement>,
    /// The ranks that died.
    dead: Vec<usize>,
    /// Whether a survivor saw a rank lost: every later exchange fails.
    revoked: bool,
    /// The survivors' world, once one of them rejoined: it, and their ranks here.
    successor: Option<(Arc<Hub>, Vec<usize>)>,
}

/// What the ranks of one loopback world share.
struct Hub {
    size: usize,
    timeout: Duration,
    shared: Mutex<Shared>,
    arrived: Condvar,
}

impl Hub {
    fn new(size: usize, timeout: Duration) -> Arc<Hub> {
        Arc::new(Hub {
            size,
            timeout,
            shared: Mutex::default(),
            arrived: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The call numbering of one rank, shared by its stores (as MPI's world is by a process's).
struct RankState {
    seq: u64,
    stores: u64,
    exchanges: u64,
    /// The agreements this rank has joined in this world.
    agreements: u64,
    /// The agreements of the call begun last (its commit and end points).
    points: Points,
    /// The exchange of this world at which this rank dies (tests of a lost rank), and whether
    /// it makes its deposit first.
    die_at: Option<(u64, bool)>,
    /// Whether this rank died.
    gone: bool,
    /// The exchange of the next world at which this rank dies (tests of a loss during the
    /// recovery from another).
    die_next: Option<u64>,
    /// The first desync: the link refuses calls after it, as a poisoned MPI world does.
    failed: Option<String>,
    /// Elements this rank has received from data collectives (what a transfer moved to it).
    received: usize,
}

/// One rank of a loopback world; clones are the same rank (they share its call numbering).
#[derive(Clone)]
pub(crate) struct Loopback {
    /// The world this rank is in now, and its rank there (read by [`Link::seat`] during a
    /// call, which holds `state`).
    place: Arc<std::sync::RwLock<(Arc<Hub>, usize)>>,
    state: Arc<Mutex<RankState>>,
    /// Whether the link goes on after a lost rank ([`Loopback::elastic`]).
    elastic: bool,
    check: bool,
    /// A collective this rank never joins (tests of a rank that stops): it fails to start it.
    stall_at: Option<Op>,
    /// Whether the ranks keep their values in arrays that move in place ([`Round::in_place`]).
    in_place: bool,
    /// The machines the ranks say they run on.
    hosts: usize,
}

impl Loopback {
    /// The `size` ranks of a new loopback world, every wait bounded by `timeout`.
    pub(crate) fn world(size: usize, timeout: Duration) -> Vec<Loopback> {
        let hub = Hub::new(size, timeout);
        (0..size)
            .map(|rank| Loopback {
                place: Arc::new(std::sync::RwLock::new((hub.clone(), rank))),
                state: Arc::new(Mutex::new(RankState {
                    seq: 0,
                    stores: 0,
                    exchanges: 0,
                    agreements: 0,
                    points: Points::default(),
                    die_at: None,
                    gone: false,
                    die_next: None,
                    failed: None,
                    received: 0,
                })),
                elastic: false,
                check: true,
                stall_at: None,
                in_place: false,
                hosts: 1,
            })
            .collect()
    }

    /// This rank, going on after a lost rank as MPI with fault tolerance does (see the module
    /// documentation).
    pub(crate) fn elastic(mut self) -> Loopback {
        self.elastic = true;
        self
    }

    /// Makes this rank die in its `n`-th exchange from now (in this world): that call fails,
    /// and it makes no more. `sent`: it dies after making its deposit, so that the exchange
    /// completes on some survivors only ([`LoopRound::collect`]); else before, so that the
    /// exchange fails on every rank.
    pub(crate) fn die_after(&self, n: u64, sent: bool) {
        let mut st = self.lock();
        st.die_at = Some((st.exchanges + n, sent));
    }

    /// Makes this rank die at its `n`-th exchange of the next world the survivors make (while
    /// they recover from another loss), before its part goes out.
    pub(crate) fn die_in_next_world(&self, n: u64) {
        self.lock().die_next = Some(n);
    }

    /// Whether this rank died.
    pub(crate) fn is_gone(&self) -> bool {
        self.lock().gone
    }

    fn lock(&self) -> MutexGuard<'_, RankState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The world this rank is in now, and its rank there.
    fn place(&self) -> (Arc<Hub>, usize) {
        self.place.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// This rank, never joining its first collective `op` (its call fails; the others time out).
    pub(crate) fn stalling_at(mut self, op: Op) -> Loopback {
        self.stall_at = Some(op);
        self
    }

    /// The elements this rank has received from data collectives so far.
    pub(crate) fn received(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .received
    }

    /// This rank keeping its values in arrays that move in place, as GPU ranks do.
    pub(crate) fn moving_in_place(mut self) -> Loopback {
        self.in_place = true;
        self
    }

    /// This rank, saying the ranks run on `hosts` machines.
    pub(crate) fn on_hosts(mut self, hosts: usize) -> Loopback {
        self.hosts = hosts;
        self
    }

    /// This rank with the per-call fingerprint check off (`KVSTORE_DIST_CHECK=0`).
    pub(crate) fn unchecked(mut self) -> Loopback {
        self.check = false;
        self
    }
}

impl Link for Loopback {
    fn seat(&self) -> Seat {
        let (hub, rank) = self.place();
        Seat {
            rank,
            size: hub.size,
            local_rank: rank,
            hosts: self.hosts,
            check: self.check,
            timeout: hub.timeout,
        }
    }

    fn survives_loss(&self) -> bool {
        self.elastic
    }

    fn rejoin(&self, _after: &Error) -> Option<Result<Rejoined>> {
        let start = Instant::now();
        let mut st = self.lock();
        let (hub, my_rank) = self.place();
        let lost_any = {
            let sh = hub.lock();
            !sh.dead.is_empty() || sh.successor.is_some()
        };
        if !self.elastic || !lost_any || st.gone {
            return None;
        }
        // The point of the call begun last that this rank failed before.
        if let Some(point) = st.points.next() {
            let agreed = agree(&mut st, (&hub, my_rank), Vote::Recovering);
            st.points.passed(point, agreed.unwrap_or(Agreed::Lost));
        }
        let committed = st.points.committed();
        let (next, members) = {
            let mut sh = hub.lock();
            sh.revoked = true;
            let dead = sh.dead.clone();
            sh.successor
                .get_or_insert_with(|| {
                    let alive: Vec<usize> = (0..hub.size).filter(|r| !dead.contains(r)).collect();
                    (Hub::new(alive.len(), hub.timeout), alive)
                })
                .clone()
        };
        hub.arrived.notify_all();
        let lost: Vec<usize> = (0..hub.size).filter(|r| !members.contains(r)).collect();
        if 2 * members.len() <= hub.size {
            let why = format!(
                "no majority: {} of the {} ranks are left on this side (lost: {lost:?}), not a \
                 strict majority, so this side stops",
                members.len(),
                hub.size
            );
            st.failed = Some(why.clone());
            return Some(Err(Error::DistFailed {
                op: "recover from a lost rank",
                first: why,
            }));
        }
        let Some(rank) = members.iter().position(|&r| r == my_rank) else {
            return Some(Err(Error::internal(
                "a survivor missing from its new world",
            )));
        };
        // A new world: calls and exchanges are numbered afresh, as a new MPI world's are.
        *self.place.write().unwrap_or_else(|p| p.into_inner()) = (next, rank);
        (st.seq, st.exchanges, st.agreements) = (0, 0, 0);
        if let Some(n) = st.die_next.take() {
            st.die_at = Some((n, false));
        }
        st.points = Points::default();
        st.failed = None;
        Some(Ok(Rejoined {
            lost,
            took: start.elapsed(),
            committed,
        }))
    }

    fn next_store_id(&self) -> u64 {
        let mut st = self.lock();
        st.stores += 1;
        st.stores - 1
    }

    fn in_place_home(&self) -> Option<Device> {
        self.in_place.then_some(Device::Cpu(0))
    }

    fn shut(&self, why: String) {
        self.lock().failed.get_or_insert(why);
    }

    fn begin(&self, fp: &Fingerprint) -> Result<Box<dyn Round + '_>> {
        let mut st = self.lock();
        if let Some(first) = &st.failed {
            return Err(Error::DistFailed {
                op: fp.op(),
                first: first.clone(),
            });
        }
        st.seq += 1;
        st.points = Points::of_call(fp);
        let (hub, rank) = self.place();
        let mut round = LoopRound {
            link: self,
            hub,
            rank,
            seq: st.seq,
            st,
            op: fp.op(),
            keys: fp.keys(),
            summary: fp.summary(),
            flights: Vec::new(),
        };
        if self.check {
            let (seq, size) = (round.seq, round.hub.size);
            if let Err(e) = check_across(fp, seq, size, |w| round.all_gather_words(w)) {
                if matches!(e, Error::Desync { .. }) {
                    round.st.failed = Some(e.to_string());
                }
                return Err(e);
            }
        }
        Ok(Box::new(round))
    }
}

/// One call of a loopback rank; holds the rank's lock, so its calls never interleave.
struct LoopRound<'a> {
    link: &'a Loopback,
    /// The world of this call, and this rank's rank there.
    hub: Arc<Hub>,
    rank: usize,
    st: MutexGuard<'a, RankState>,
    seq: u64,
    op: &'static str,
    keys: Vec<Key>,
    summary: String,
    /// Started collectives.
    flights: Vec<Option<Flight>>,
}

/// A started collective: its exchange, op, send and receive buffers, and the block lengths of
/// an all-to-all of unequal blocks (empty for every other collective).
struct Flight {
    id: u64,
    op: Op,
    send: HostData,
    recv: HostData,
    lens: Vec<usize>,
}

/// Marks rank `rank` of `hub` (whose state is `st`) dead: every wait for it fails from now on.
fn die(st: &mut RankState, (hub, rank): (&Hub, usize)) {
    st.gone = true;
    st.failed
        .get_or_insert_with(|| "this loopback rank died (a test of a lost rank)".to_owned());
    hub.lock().dead.push(rank);
    hub.arrived.notify_all();
    // Dead in every world the survivors made since, as a process is to MPI.
    let mut next = hub.lock().successor.clone();
    let mut rank = rank;
    while let Some((h, members)) = next {
        let Some(r) = members.iter().position(|&m| m == rank) else {
            break;
        };
        rank = r;
        h.lock().dead.push(r);
        h.arrived.notify_all();
        next = h.lock().successor.clone();
    }
}

/// The fault-tolerant agreement of `st`'s rank (its next in its world): what every rank's vote
/// makes, the same outcome on every survivor; a rank that died without joining makes it
/// [`Agreed::Lost`], as MPI's agreement fails then. Bounded by the world's timeout.
fn agree(st: &mut RankState, (hub, rank): (&Hub, usize), vote: Vote) -> Result<Agreed> {
    st.agreements += 1;
    let id = st.agreements;
    let deadline = Instant::now() + hub.timeout;
    let mut sh = hub.lock();
    let size = hub.size;
    let a = sh.agreements.entry(id).or_insert_with(|| Agreement {
        flags: vec![None; size],
        decided: None,
    });
    a.flags[rank] = Some(vote);
    hub.arrived.notify_all();
    loop {
        let dead = sh.dead.clone();
        let a = sh
            .agreements
            .get_mut(&id)
            .ok_or_else(|| Error::internal("an agreement vanished"))?;
        if a.decided.is_none() {
            let here = |r: usize| a.flags[r].is_some() || dead.contains(&r);
            if (0..size).all(here) {
                // A dead rank's missing vote fails the agreement, as a loss does MPI's.
                let anded = (a.flags.iter()).try_fold(0b11, |acc, f| f.map(|v| acc & v.flag()));
                a.decided = Some(Agreed::from_flag(anded));
            }
        }
        if let Some(d) = a.decided {
            return Ok(d);
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::internal("a loopback agreement timed out"));
        }
        sh = hub
            .arrived
            .wait_timeout(sh, deadline - now)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

impl LoopRound<'_> {
    /// Passes `point` of this call, if it is the call's next, voting `ok` (or, where a rank was
    /// lost, as one recovering), as MPI's world does (`Call::pass` there).
    fn pass(&mut self, point: Point, ok: bool) -> Result<()> {
        if !self.link.elastic || self.st.points.next() != Some(point) {
            return Ok(());
        }
        let dead = self.hub.lock().dead.clone();
        let vote = match ok {
            true => Vote::Yes,
            false if !dead.is_empty() => Vote::Recovering,
            false => Vote::FailedHere,
        };
        let agreed = agree(&mut self.st, (&self.hub.clone(), self.rank), vote)?;
        self.st.points.passed(point, agreed);
        match agreed {
            Agreed::All => Ok(()),
            Agreed::FailedElsewhere => Err(Error::Mpi {
                op: self.op,
                message: "another rank failed its part of this call".to_owned(),
            }),
            Agreed::Lost => {
                let dead = self.hub.lock().dead.clone();
                Err(self.lost(&dead))
            }
        }
    }

    /// The error of a call that finds a rank lost, as MPI with fault tolerance gives it.
    fn lost(&self, dead: &[usize]) -> Error {
        match dead.first() {
            Some(&rank) => Error::RankExited {
                op: self.op,
                seq: self.seq,
                rank,
                host: None,
                detail: "was lost during this call (a loopback rank that died)".to_owned(),
            },
            None => Error::Mpi {
                op: self.op,
                message: "a rank was lost, and another rank revoked the world".to_owned(),
            },
        }
    }

    /// Deposits `mine` into this rank's next exchange; returns the exchange's number. A rank
    /// that dies here ([`Loopback::die_after`]), or finds the world revoked, fails; one that
    /// dies after sending deposits first (see [`LoopRound::collect`] for what the others get).
    fn deposit(&mut self, mine: Payload) -> Result<u64> {
        self.st.exchanges += 1;
        let id = self.st.exchanges;
        let (rank, hub) = (self.rank, self.hub.clone());
        if self.st.die_at == Some((id, false)) {
            die(&mut self.st, (&hub, rank));
        }
        let dies = self.st.die_at == Some((id, true));
        if dies {
            // Dead before its deposit is seen: whoever finds the deposit finds the death.
            die(&mut self.st, (&hub, rank));
        } else if self.st.gone {
            return Err(Error::internal("this loopback rank died"));
        }
        let mut sh = hub.lock();
        if sh.revoked && !dies {
            let dead = sh.dead.clone();
            return Err(self.lost(&dead));
        }
        if !sh.revoked {
            let ex = sh.exchanges.entry(id).or_insert_with(|| Exchange {
                deposits: vec![None; hub.size],
                taken: 0,
                died_after: None,
            });
            ex.deposits[rank] = Some(mine);
            if dies {
                ex.died_after = Some(ex.died_after.map_or(rank, |d| d.min(rank)));
            }
            hub.arrived.notify_all();
        }
        drop(sh);
        if dies {
            return Err(Error::internal("this loopback rank died"));
        }
        Ok(id)
    }

    /// Every rank's deposit into exchange `id`, once all are there (bounded by the timeout). A
    /// wait for a rank that died fails at once, and revokes the world. An exchange a rank died
    /// in after its deposit completes on the ranks numbered below it and fails on those above,
    /// as a collective that loses a rank midway can complete on some survivors only.
    fn collect(&mut self, id: u64, what: &str) -> Result<Vec<Payload>> {
        let hub = self.hub.clone();
        let deadline = Instant::now() + hub.timeout;
        let mut sh = hub.lock();
        loop {
            let dead = sh.dead.clone();
            let revoked = sh.revoked;
            let ex = sh
                .exchanges
                .get_mut(&id)
                .ok_or_else(|| Error::internal("an exchange vanished"))?;
            let after_a_death = ex.died_after.is_some_and(|d| d < self.rank);
            if ex.deposits.iter().all(Option::is_some) && after_a_death {
                sh.revoked = true;
                hub.arrived.notify_all();
                return Err(self.lost(&dead));
            }
            if ex.deposits.iter().all(Option::is_some) {
                let got = ex.deposits.iter().flatten().cloned().collect();
                ex.taken += 1;
                if ex.taken == hub.size {
                    sh.exchanges.remove(&id);
                }
                return Ok(got);
            }
            let waits_for_dead =
                (ex.deposits.iter().enumerate()).any(|(r, d)| d.is_none() && dead.contains(&r));
            if waits_for_dead || revoked {
                sh.revoked = true;
                hub.arrived.notify_all();
                return Err(self.lost(&dead));
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (ex.deposits.iter().enumerate())
                    .filter(|(_, d)| d.is_none())
                    .map(|(r, _)| r)
                    .collect();
                return Err(Error::Timeout {
                    op: self.op,
                    seq: self.seq,
                    keys: self.keys.clone(),
                    missing: missing.clone(),
                    detail: format!(
                        "rank {} waited {:.1} s in its {what} of call #{} ({}); ranks \
                         {missing:?} never joined it",
                        self.rank,
                        hub.timeout.as_secs_f64(),
                        self.seq,
                        self.summary
                    ),
                });
            }
            sh = hub
                .arrived
                .wait_timeout(sh, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// The element-wise sum of `parts` (each of `dtype`), in `float64` in order, rounded once.
fn sum(parts: &[&HostData], dtype: DType) -> HostData {
    let mut acc = vec![0f64; parts.first().map_or(0, |p| p.len())];
    for p in parts {
        for (a, v) in acc.iter_mut().zip(p.to_vec::<f64>()) {
            *a += v;
        }
    }
    HostData::F64(acc).cast(dtype)
}

impl Round for LoopRound<'_> {
    fn shut_link(&mut self, why: String) {
        self.st.failed.get_or_insert(why);
    }

    fn commit(&mut self) -> Result<()> {
        self.pass(Point::Commit, true)
    }

    fn end(&mut self, ok: bool) -> Result<()> {
        self.pass(Point::End, ok)
    }

    fn seq(&self) -> u64 {
        self.seq
    }

    fn start(&mut self, op: Op, send: HostData, recv: HostData) -> Result<Ticket> {
        if self.link.stall_at == Some(op) {
            return Err(Error::internal(
                "this loopback rank stops here (a test of a stalled rank)",
            ));
        }
        let id = self.deposit(Payload::Data(send.clone()))?;
        self.flights.push(Some(Flight {
            id,
            op,
            send,
            recv,
            lens: Vec::new(),
        }));
        Ok(Ticket(self.flights.len() - 1))
    }

    fn start_all_to_all_v(
        &mut self,
        send: HostData,
        lens: &[usize],
        recv: HostData,
    ) -> Result<Ticket> {
        let (rank, size) = (self.rank, self.hub.size);
        let row: usize = lens.iter().skip(rank * size).take(size).sum();
        let column: usize = lens.iter().skip(rank).step_by(size.max(1)).sum();
        if lens.len() != size * size || send.len() != row || recv.len() != column {
            return Err(Error::internal(
                "all-to-all blocks that do not fit their buffers",
            ));
        }
        let ticket = self.start(Op::AllToAll, send, recv)?;
        if let Some(Some(flight)) = self.flights.get_mut(ticket.0) {
            flight.lens = lens.to_vec();
        }
        Ok(ticket)
    }

    fn land(&mut self, ticket: Ticket) -> Result<(HostData, HostData)> {
        let Flight {
            id,
            op,
            send,
            recv,
            lens,
        } = (self.flights.get_mut(ticket.0).and_then(Option::take))
            .ok_or_else(|| Error::internal("a collective landed twice"))?;
        let all = self.collect(id, &format!("{op:?}"))?;
        let data: Vec<&HostData> = all
            .iter()
            .map(|p| match p {
                Payload::Data(d) => Ok(d),
                Payload::Words(_) => Err(Error::internal(
                    "ranks mixed data and words in one exchange",
                )),
            })
            .collect::<Result<_>>()?;
        if data.iter().any(|d| d.dtype() != send.dtype()) {
            return Err(Error::internal(
                "ranks sent different dtypes to one collective",
            ));
        }
        // Results are written into this rank's own buffers, as MPI writes them: a buffer keeps
        // the room it came with.
        let (rank, size) = (self.rank, self.hub.size);
        let at_root = |root: usize| {
            data.get(root)
                .ok_or_else(|| Error::internal("no such root"))
        };
        let mut recv = recv;
        let result = match op {
            Op::Reduce { root } if root == rank => sum(&data, send.dtype()),
            Op::Reduce { .. } => return Ok((send, recv)),
            Op::Broadcast { root } => {
                let from = at_root(root)?;
                let mut buf = send;
                copy_into(&mut buf, from);
                self.st.received += buf.len();
                return Ok((HostData::filled(buf.dtype(), 0, 0.0), buf));
            }
            Op::ReduceScatter => {
                let block = send.len() / size.max(1);
                sum(&data, send.dtype()).slice_of(rank * block..(rank + 1) * block)
            }
            Op::Scatter { root } => {
                let from = at_root(root)?;
                let block = recv.len();
                from.slice_of(rank * block..(rank + 1) * block)
            }
            // Every rank's buffer (all-gather) or its block for `rank` (all-to-all: `lens`, or
            // equal blocks), in rank order, bit for bit as MPI moves bytes (a NaN's payload, or
            // words carried as float bit patterns, must arrive as they left).
            Op::AllGather | Op::AllToAll => with_host!(&send, _v: T => {
                let lens = match lens.is_empty() {
                    true => vec![send.len() / size.max(1); size * size],
                    false => lens,
                };
                let mut got: Vec<T> = Vec::with_capacity(recv.len());
                for (s, d) in data.iter().enumerate() {
                    let row = &lens[s * size..(s + 1) * size];
                    let start: usize = row[..rank].iter().sum();
                    let theirs = <T as crate::Element>::slice(d)
                        .ok_or_else(|| Error::internal("ranks sent different dtypes"))?;
                    let piece = match op {
                        Op::AllGather => Some(theirs),
                        _ => theirs.get(start..start + row[rank]),
                    };
                    let piece = piece
                        .ok_or_else(|| Error::internal("ranks sent all-to-all blocks of other lengths"))?;
                    got.extend_from_slice(piece);
                }
                <T as crate::Element>::wrap(got)
            }),
        };
        if recv.len() != result.len() {
            return Err(Error::internal("a receive buffer of the wrong length"));
        }
        copy_into(&mut recv, &result);
        self.st.received += recv.len();
        Ok((send, recv))
    }

    fn in_place(&mut self, ops: &[ArrayOp<'_>]) -> Result<()> {
        // Every op starts before any lands, as an NCCL group goes out; results are written
        // into the arrays that receive them.
        let (rank, size) = (self.rank, self.hub.size);
        let mut flights = Vec::with_capacity(ops.len());
        for o in ops {
            let (op, send, into) = match *o {
                ArrayOp::Reduce { buf, root } => {
                    (Op::Reduce { root }, buf, (root == rank).then_some(buf))
                }
                ArrayOp::Broadcast { buf, root } => (Op::Broadcast { root }, buf, Some(buf)),
                ArrayOp::ReduceScatter { send, recv } => (Op::ReduceScatter, send, Some(recv)),
                ArrayOp::AllGather { send, recv } => (Op::AllGather, send, Some(recv)),
            };
            let data = send.read().host()?.into_owned();
            let len = op.recv_len(data.len(), rank, size);
            let recv = HostData::filled(data.dtype(), len, 0.0);
            flights.push((self.start(op, data, recv)?, into));
        }
        for (ticket, into) in flights {
            let (_, got) = self.land(ticket)?;
            let Some(a) = into else { continue };
            match &mut *a.write() {
                Storage::Host(h) if h.len() == got.len() => *h = got,
                _ => return Err(Error::internal("an in-place result that does not fit")),
            }
        }
        Ok(())
    }

    fn all_gather_words(&mut self, mine: &[u64]) -> Result<Vec<u64>> {
        let id = self.deposit(Payload::Words(mine.to_vec()))?;
        let all = self.collect(id, "all-gather of words")?;
        let mut out = Vec::with_capacity(mine.len() * all.len());
        for p in all {
            match p {
                Payload::Words(w) if w.len() == mine.len() => out.extend(w),
                _ => return Err(Error::internal("ranks gave different word counts")),
            }
        }
        Ok(out)
    }
}
