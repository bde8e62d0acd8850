//! The loopback link: N ranks as N threads of one process, so the rules of the distributed
//! stores run in `cargo test` in milliseconds, without `mpirun`.
//!
//! The k-th exchange of every rank is matched with the k-th of every other, as MPI matches
//! collectives by their order. A rank deposits its buffer when it starts a collective and takes
//! its result when it lands it, once every rank has deposited; a wait past the hub's timeout is
//! [`Error::Timeout`] naming the ranks that never came. Sums are taken in `float64` in rank
//! order and rounded once.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{ArrayOp, Link, Op, Round, Seat, Ticket};
use crate::comm::dist::copy_into;
use crate::comm::fingerprint::{check_across, Fingerprint};
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
}

/// What the ranks of one loopback world share.
struct Hub {
    size: usize,
    timeout: Duration,
    exchanges: Mutex<HashMap<u64, Exchange>>,
    arrived: Condvar,
}

/// The call numbering of one rank, shared by its stores (as MPI's world is by a process's).
#[derive(Default)]
struct RankState {
    seq: u64,
    stores: u64,
    exchanges: u64,
    /// The first desync: the link refuses calls after it, as a poisoned MPI world does.
    failed: Option<String>,
    /// Elements this rank has received from data collectives (what a transfer moved to it).
    received: usize,
}

/// One rank of a loopback world; clones are the same rank (they share its call numbering).
#[derive(Clone)]
pub(crate) struct Loopback {
    hub: Arc<Hub>,
    rank: usize,
    state: Arc<Mutex<RankState>>,
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
        let hub = Arc::new(Hub {
            size,
            timeout,
            exchanges: Mutex::new(HashMap::new()),
            arrived: Condvar::new(),
        });
        (0..size)
            .map(|rank| Loopback {
                hub: hub.clone(),
                rank,
                state: Arc::default(),
                check: true,
                stall_at: None,
                in_place: false,
                hosts: 1,
            })
            .collect()
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
        Seat {
            rank: self.rank,
            size: self.hub.size,
            local_rank: self.rank,
            hosts: self.hosts,
            check: self.check,
            timeout: self.hub.timeout,
        }
    }

    fn next_store_id(&self) -> u64 {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.stores += 1;
        st.stores - 1
    }

    fn in_place_home(&self) -> Option<Device> {
        self.in_place.then_some(Device::Cpu(0))
    }

    fn shut(&self, why: String) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.failed.get_or_insert(why);
    }

    fn begin(&self, fp: &Fingerprint) -> Result<Box<dyn Round + '_>> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(first) = &st.failed {
            return Err(Error::DistFailed {
                op: fp.op(),
                first: first.clone(),
            });
        }
        st.seq += 1;
        let mut round = LoopRound {
            link: self,
            seq: st.seq,
            st,
            op: fp.op(),
            keys: fp.keys(),
            summary: fp.summary(),
            flights: Vec::new(),
        };
        if self.check {
            let (seq, size) = (round.seq, self.hub.size);
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

impl LoopRound<'_> {
    /// Deposits `mine` into this rank's next exchange; returns the exchange's number.
    fn deposit(&mut self, mine: Payload) -> u64 {
        self.st.exchanges += 1;
        let id = self.st.exchanges;
        let hub = &self.link.hub;
        let mut all = hub.exchanges.lock().unwrap_or_else(|p| p.into_inner());
        let ex = all.entry(id).or_insert_with(|| Exchange {
            deposits: vec![None; hub.size],
            taken: 0,
        });
        ex.deposits[self.link.rank] = Some(mine);
        hub.arrived.notify_all();
        id
    }

    /// Every rank's deposit into exchange `id`, once all are there (bounded by the timeout).
    fn collect(&mut self, id: u64, what: &str) -> Result<Vec<Payload>> {
        let hub = &self.link.hub;
        let deadline = Instant::now() + hub.timeout;
        let mut all = hub.exchanges.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let ex = all
                .get_mut(&id)
                .ok_or_else(|| Error::internal("an exchange vanished"))?;
            if ex.deposits.iter().all(Option::is_some) {
                let got = ex.deposits.iter().flatten().cloned().collect();
                ex.taken += 1;
                if ex.taken == hub.size {
                    all.remove(&id);
                }
                return Ok(got);
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
                        self.link.rank,
                        hub.timeout.as_secs_f64(),
                        self.seq,
                        self.summary
                    ),
                });
            }
            all = hub
                .arrived
                .wait_timeout(all, deadline - now)
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

    fn seq(&self) -> u64 {
        self.seq
    }

    fn start(&mut self, op: Op, send: HostData, recv: HostData) -> Result<Ticket> {
        if self.link.stall_at == Some(op) {
            return Err(Error::internal(
                "this loopback rank stops here (a test of a stalled rank)",
            ));
        }
        let id = self.deposit(Payload::Data(send.clone()));
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
        let (rank, size) = (self.link.rank, self.link.hub.size);
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
        let (rank, size) = (self.link.rank, self.link.hub.size);
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
        let (rank, size) = (self.link.rank, self.link.hub.size);
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
        let id = self.deposit(Payload::Words(mine.to_vec()));
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
