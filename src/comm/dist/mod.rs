//! Across ranks: a `dist_*` store's push sums every rank's values onto each key's home rank, and
//! its pull brings the home's value to every rank, over whichever [`Link`] joins the ranks.
//!
//! - A key homed whole on one rank: a push is a reduce to that rank, a pull a broadcast from it.
//! - A sliced key (more than `KVSTORE_BIGARRAY_BOUND` elements, as MXNet's; default 1 000 000):
//!   each rank holds one contiguous slice ([`slice_range`](super::spread::slice_range)). A push
//!   is a reduce-scatter, a pull an all-gather: the traffic of one allreduce (ZeRO-1).
//! - Small whole keys travel packed, one buffer per (home rank, dtype). Keys from
//!   [`PACK_MAX_BYTES`] up, and a call's only key, travel alone in their own buffer
//!   ([`travels_alone`]).
//!
//! A call's collectives are all started before any is waited for, so they overlap. Every rank
//! starts them in the same order: it depends only on the call's keys, shapes and dtypes (which
//! the fingerprint check compares) and on where keys live (which every rank computes alike).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::RwLockReadGuard;
use std::sync::{Arc, Mutex};

use smallvec::{smallvec, SmallVec};

mod blocks;
mod buddy;
pub(crate) mod in_place;
mod pool;

use super::fingerprint::Fingerprint;
use super::link::{self, Link, Op, Round};
use super::spread::{slice_block, Spread};
use crate::backend::cpu::Few;
use crate::config::{Config, ReplicaUpdate};
use crate::host::HostData;
use crate::ndarray::Storage;
use crate::{DType, Device, Element, Error, NDArray, Result};
#[cfg(test)]
pub(crate) use blocks::tests as blocks_tests;
pub(crate) use blocks::{all_to_all_words, Blocks};
pub(crate) use buddy::{to_buddy, Buddies, KeyPart};
pub(crate) use pool::{copy_into, Pool};

/// Whole keys of fewer bytes than this travel packed with other keys of their home and dtype.
pub(crate) const PACK_MAX_BYTES: usize = 256 << 10;

/// Whether a whole key of `bytes` bytes, in a call of `keys` keys, travels alone in a buffer of
/// its own rather than packed: a big key, or a call's only key, which a bucket would only copy.
pub(crate) fn travels_alone(bytes: usize, keys: usize) -> bool {
    bytes >= PACK_MAX_BYTES || keys == 1
}

/// A store's link to the other ranks, with the bound from which keys are sliced and the host
/// buffers kept between calls.
pub(crate) struct Dist {
    link: Box<dyn Link>,
    /// Keys of more elements than this are sliced over every rank (chosen again when the
    /// survivors of a lost rank go on: [`Dist::rejoin`]).
    bound: AtomicUsize,
    /// `KVSTORE_BIGARRAY_BOUND`, where set.
    asked_bound: Option<usize>,
    /// Who keeps whose copy, where the store keeps copies of every rank's parts: the link can
    /// go on after a lost rank and `KVSTORE_REPLICAS` is 1 (chosen again at [`Dist::rejoin`]).
    buddies: std::sync::RwLock<Option<Buddies>>,
    /// `KVSTORE_REPLICAS` and `KVSTORE_REPLICA_UPDATE` (`None`: no copies).
    replicas: Option<ReplicaUpdate>,
    /// Host buffers kept between calls, shared by the process's stores.
    pool: Arc<Pool>,
    /// This store's number on its link, in every fingerprint: calls of two stores never match.
    store: u64,
    /// The caller's tag, in every fingerprint from when it is set (see [`Dist::set_tag`]).
    tag: Mutex<Option<Arc<str>>>,
    /// Where values live when the link moves them in place ([`Link::in_place_home`]).
    in_place: Option<Device>,
    /// One rank alone (the single-process kinds): calls compare nothing.
    alone: bool,
}

impl Dist {
    /// One rank alone: the single-process kinds.
    pub(crate) fn solo() -> Dist {
        Dist {
            link: Box::new(link::solo::Solo),
            bound: AtomicUsize::new(crate::config::DEFAULT_BIGARRAY_BOUND),
            asked_bound: None,
            buddies: std::sync::RwLock::new(None),
            replicas: None,
            pool: Arc::new(Pool::with_max_bytes(0)),
            store: 0,
            tag: Mutex::new(None),
            in_place: None,
            alone: true,
        }
    }

    /// Joins the distributed world, with the bound and the pool size of `config`: over MPI and,
    /// for GPU ranks (`on_gpu`), an NCCL communicator of every rank on the GPU its local rank
    /// picks (NCCL alone for GPU ranks started without MPI: [`link::connect`]).
    pub(crate) fn connect(on_gpu: bool, config: &Config) -> Result<Dist> {
        let pool = Pool::process(config.pool_bytes)?;
        let link = link::connect(on_gpu, config)?;
        Dist::joined(link, config.bigarray_bound, config.replicas, pool)
    }

    /// A store's link over `link`, once the ranks agree on the setup (the crate version, the
    /// bound, the pool size, the check switch, the timeout): else [`Error::Desync`] on every
    /// rank, naming the settings. `bound`: `KVSTORE_BIGARRAY_BOUND` if set; else chosen from
    /// how many machines the link spans ([`crate::config::bigarray_bound`]).
    fn joined(
        link: Box<dyn Link>,
        asked: Option<usize>,
        replicas: Option<ReplicaUpdate>,
        pool: Arc<Pool>,
    ) -> Result<Dist> {
        let bound = crate::config::bigarray_bound(asked, link.seat().hosts);
        let store = link.next_store_id();
        let in_place = link.in_place_home();
        let buddies = std::sync::RwLock::new(buddies_of(&*link, replicas.is_some()));
        let dist = Dist {
            link,
            bound: AtomicUsize::new(bound),
            asked_bound: asked,
            buddies,
            replicas,
            pool,
            store,
            tag: Mutex::new(None),
            in_place,
            alone: false,
        };
        let seat = dist.link.seat();
        let setup = format!(
            "kvstore {}, KVSTORE_BIGARRAY_BOUND {}, KVSTORE_DIST_POOL_BYTES {}, check {}, \
             timeout {:?}, KVSTORE_REPLICAS {}, KVSTORE_REPLICA_UPDATE {}",
            env!("CARGO_PKG_VERSION"),
            bound,
            dist.pool.max_bytes(),
            seat.check,
            seat.timeout,
            u8::from(replicas.is_some()),
            replicas.map_or("-", ReplicaUpdate::name)
        );
        dist.begin(Fingerprint::new("create").note(setup))?;
        Ok(dist)
    }

    /// A store's link over `link` (tests: the loopback link), slicing keys of more than
    /// `bound` elements (`None`: the default for the machines the link spans).
    #[cfg(test)]
    pub(crate) fn over(link: Box<dyn Link>, bound: Option<usize>) -> Result<Dist> {
        Dist::over_keeping(link, bound, Some(ReplicaUpdate::Replay))
    }

    /// [`Dist::over`], keeping copies as `replicas` says.
    #[cfg(test)]
    pub(crate) fn over_keeping(
        link: Box<dyn Link>,
        bound: Option<usize>,
        replicas: Option<ReplicaUpdate>,
    ) -> Result<Dist> {
        let pool = Arc::new(Pool::with_max_bytes(64 << 20));
        Dist::joined(link, bound, replicas, pool)
    }

    /// Host buffers kept between calls.
    pub(crate) fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The room a buffer of a key of `len` elements needs for its transfers: a sliced key's
    /// send buffer is padded to one block per rank.
    pub(crate) fn room(&self, len: usize) -> usize {
        match self.is_sliced(len) {
            true => slice_block(len, self.size()) * self.size(),
            false => len,
        }
    }

    /// Whether the link moves this store's values in place where the ranks keep them (GPU
    /// ranks), rather than in host buffers.
    pub(crate) fn moves_in_place(&self) -> bool {
        self.in_place.is_some()
    }

    /// One rank alone (the single-process kinds).
    pub(crate) fn is_alone(&self) -> bool {
        self.alone
    }

    /// Where this rank keeps its parts of the values: its GPU, or host memory.
    pub(crate) fn home(&self) -> Device {
        self.in_place.unwrap_or(Device::Cpu(0))
    }

    /// This process's rank.
    pub(crate) fn rank(&self) -> usize {
        self.link.seat().rank
    }

    /// The number of ranks.
    pub(crate) fn size(&self) -> usize {
        self.link.seat().size
    }

    /// This process's rank among the ranks on its machine.
    pub(crate) fn local_rank(&self) -> usize {
        self.link.seat().local_rank
    }

    /// Whether a key of `len` elements is sliced over every rank: more than
    /// `KVSTORE_BIGARRAY_BOUND` elements, on more than one rank. Where values move in place
    /// (GPU ranks) every rank's slice must also hold an element (a GPU keeps no empty arrays).
    pub(crate) fn is_sliced(&self, len: usize) -> bool {
        let bound = self.bound.load(Ordering::Relaxed);
        len > bound && self.can_slice(len, self.size())
    }

    /// Whether a key of `len` elements can be sliced over `size` ranks of this link: more than
    /// one rank, and where values move in place (GPU ranks) an element for every rank's slice
    /// (a GPU keeps no empty arrays).
    pub(crate) fn can_slice(&self, len: usize, size: usize) -> bool {
        let every_rank_holds = || slice_block(len, size) * (size - 1) < len;
        size > 1 && (self.in_place.is_none() || every_rank_holds())
    }

    /// After a call failed: where a rank was lost and the link can go on without it, the
    /// survivors' link (see [`Link::rejoin`]), with the slicing bound chosen again for the
    /// machines left.
    pub(crate) fn rejoin(&self, after: &Error) -> Option<Result<link::Rejoined>> {
        let rejoined = self.link.rejoin(after)?;
        let bound = crate::config::bigarray_bound(self.asked_bound, self.link.seat().hosts);
        self.bound.store(bound, Ordering::Relaxed);
        *self.buddies.write().unwrap_or_else(|p| p.into_inner()) =
            buddies_of(&*self.link, self.replicas.is_some());
        Some(rejoined)
    }

    /// Who keeps whose copy, where this store keeps copies of every rank's parts.
    pub(crate) fn buddies(&self) -> Option<Buddies> {
        *self.buddies.read().unwrap_or_else(|p| p.into_inner())
    }

    /// How a push keeps the copies current, where this store keeps copies
    /// ([`Dist::buddies`]).
    pub(crate) fn replica_update(&self) -> ReplicaUpdate {
        self.replicas.unwrap_or(ReplicaUpdate::Replay)
    }

    /// Begins a collective call: numbers it and compares `fp` across ranks (see
    /// [`Link::begin`]).
    pub(crate) fn begin(&self, fp: Fingerprint) -> Result<Box<dyn Round + '_>> {
        self.begin_with(|| fp)
    }

    /// [`Dist::begin`] with the fingerprint made by `fp` only where it is compared (never by
    /// one rank alone).
    pub(crate) fn begin_with(
        &self,
        fp: impl FnOnce() -> Fingerprint,
    ) -> Result<Box<dyn Round + '_>> {
        if self.alone {
            return self.link.begin(&Fingerprint::new("local"));
        }
        self.link.begin(&fp().store(self.store).tag(self.tag()))
    }

    /// Sets the tag that every later call's fingerprint carries (see
    /// [`crate::KvStore::set_tag`]).
    pub(crate) fn set_tag(&self, tag: Option<&str>) {
        *self.tag.lock().unwrap_or_else(|e| e.into_inner()) = tag.map(Arc::from);
    }

    /// The tag in force.
    fn tag(&self) -> Option<Arc<str>> {
        self.tag.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Joins call `op` as a rank that rejected its input with `err`, so that every other rank
    /// fails it with [`Error::RankRejected`] instead of waiting, and gives `err` back (or, on a
    /// world that failed earlier, that failure: [`Error::DistFailed`]).
    pub(crate) fn reject(&self, op: &'static str, err: Error) -> Error {
        self.tell_rejected(op, &err.to_string())
            .err()
            .unwrap_or(err)
    }

    /// Joins call `op` as a rank that rejected its input because `why` (see [`Dist::reject`]).
    ///
    /// With the check off (`KVSTORE_DIST_CHECK=0`) the others cannot be told: this rank's link
    /// is shut instead ([`Link::shut`]), so that no later call of it is matched with the
    /// collectives the others started for this one (they time out). `Ok` when told (or shut);
    /// [`Error::DistFailed`] when the world failed earlier.
    pub(crate) fn tell_rejected(&self, op: &'static str, why: &str) -> Result<()> {
        if !self.link.seat().check {
            self.link.shut(format!(
                "rank {} rejected its input for {op} with KVSTORE_DIST_CHECK=0, so the other \
                 ranks could not be told: {why}",
                self.rank()
            ));
            return Ok(());
        }
        match self.begin(Fingerprint::rejected(op, why)) {
            Err(failed @ Error::DistFailed { .. }) => Err(failed),
            // The check's own error (the mismatch it was made to cause) only says that the
            // other ranks were told.
            _ => Ok(()),
        }
    }

    /// Checks that every rank passes the same `what` (see [`KvStore::agree`]).
    ///
    /// [`KvStore::agree`]: crate::KvStore::agree
    pub(crate) fn agree(&self, what: &str) -> Result<()> {
        if self.alone {
            return Ok(());
        }
        let mut round = self.begin_compared("agree", what)?;
        round.end(true)
    }

    /// For each of `flags`, whether any rank passed `true` (see [`crate::KvStore::any_of`]).
    pub(crate) fn any_of(&self, what: &str, flags: &[bool]) -> Result<Vec<bool>> {
        if self.alone {
            return Ok(flags.to_vec());
        }
        let note = format!("{what} ({} flags)", flags.len());
        let mut round = self.begin_compared("any_of", note)?;
        let mut words = vec![0u64; flags.len().div_ceil(64)];
        for (i, _) in flags.iter().enumerate().filter(|(_, &f)| f) {
            words[i / 64] |= 1 << (i % 64);
        }
        let all = round.all_gather_words(&words);
        let all = round.ended(all)?;
        // Every rank's words ORed together.
        for rank in all.chunks(words.len().max(1)) {
            words.iter_mut().zip(rank).for_each(|(w, r)| *w |= r);
        }
        Ok((0..flags.len())
            .map(|i| words[i / 64] >> (i % 64) & 1 == 1)
            .collect())
    }

    /// Begins call `op` with `note`, compared across ranks even with the per-call check off
    /// (`KVSTORE_DIST_CHECK=0`): comparing is what `agree` is for, and `any_of` gathers words
    /// of a length the note holds.
    fn begin_compared(
        &self,
        op: &'static str,
        note: impl Into<String>,
    ) -> Result<Box<dyn Round + '_>> {
        let fp = Fingerprint::new(op)
            .note(note)
            .store(self.store)
            .tag(self.tag());
        let mut round = self.link.begin(&fp)?;
        if !self.link.seat().check {
            let seq = round.seq();
            crate::comm::fingerprint::check_across(&fp, seq, self.size(), |w| {
                round.all_gather_words(w)
            })?;
        }
        Ok(round)
    }

    /// Waits until every rank has reached this barrier (bounded by `KVSTORE_TIMEOUT`).
    pub(crate) fn barrier(&self) -> Result<()> {
        let mut round = self.begin(Fingerprint::new("barrier"))?;
        let waited = round.barrier();
        round.ended(waited)
    }
}

/// The buddies of `link`'s ranks where a store on it keeps copies: `replicas` is on, the link
/// can go on after a lost rank, and there are two ranks or more.
fn buddies_of(link: &dyn Link, replicas: bool) -> Option<Buddies> {
    match replicas && link.survives_loss() {
        true => Buddies::of(&link.machines()),
        false => None,
    }
}

/// One key of a reduce: this rank's sum of its own values, and where the key lives.
pub(crate) struct Sum<'a> {
    pub data: SumData<'a>,
    pub spread: Spread,
}

/// This rank's sum of a key's values: computed, or the key's one value (in host memory, of the
/// key's dtype), read where it is.
pub(crate) enum SumData<'a> {
    Owned(HostData),
    Value(&'a NDArray),
}

impl SumData<'_> {
    fn len(&self) -> usize {
        match self {
            SumData::Owned(h) => h.len(),
            SumData::Value(a) => a.size(),
        }
    }

    fn dtype(&self) -> DType {
        match self {
            SumData::Owned(h) => h.dtype(),
            SumData::Value(a) => a.dtype(),
        }
    }

    /// Runs `f` on the elements (a value's are read in place, under its read lock).
    fn read<R>(&self, f: impl FnOnce(&HostData) -> R) -> Result<R> {
        match self {
            SumData::Owned(h) => Ok(f(h)),
            SumData::Value(a) => a.with_host(f),
        }
    }

    /// The elements in a buffer of their own with room for `room`: a computed sum as it is, a
    /// value copied into a buffer from `pool` (so a failed transfer cannot lose a caller's).
    fn into_buffer(self, pool: &Pool, room: usize) -> Result<HostData> {
        match self {
            SumData::Owned(h) => Ok(h),
            SumData::Value(a) => {
                let mut buf = pool.take(a.dtype(), 0, room);
                a.with_host(|h| append(&mut buf, h))?;
                Ok(buf)
            }
        }
    }
}

/// Sums every rank's [`Sum`]s onto where each key lives. Returns, per key, this rank's piece of
/// the total (whole on a whole key's home, its slice of a sliced key, `None` elsewhere).
pub(crate) fn reduce(
    round: &mut dyn Round,
    (rank, size): (usize, usize),
    pool: &Pool,
    sums: Vec<Sum<'_>>,
) -> Result<Vec<Option<HostData>>> {
    let mut out: Vec<Option<HostData>> = (0..sums.len()).map(|_| None).collect();
    let holds: Few<bool> = sums.iter().map(|s| s.spread.holds(rank)).collect();
    let keys = sums.len();
    let lent = read_in_place(&sums);
    let mut plan = Plan::new(pool);
    for s in &sums {
        if let Spread::Whole { rank: root } = s.spread {
            if !travels_alone(s.data.len() * s.data.dtype().size(), keys) {
                plan.reserve_len(Op::Reduce { root }, s.data.dtype(), s.data.len());
            }
        }
    }
    for (i, s) in sums.into_iter().enumerate() {
        let len = s.data.len();
        let bytes = len * s.data.dtype().size();
        match s.spread {
            Spread::Sliced => {
                let block = slice_block(len, size);
                let mine = s.spread.piece(len, rank, size).len();
                let mut send = s.data.into_buffer(pool, block * size)?;
                pad(&mut send, block * size);
                plan.transfer(Op::ReduceScatter, send, None, smallvec![(i, 0..mine)]);
            }
            Spread::Whole { rank: root } if travels_alone(bytes, keys) => {
                match lent[i].as_deref() {
                    Some(Storage::Host(h)) => {
                        plan.transfer_borrowed(Op::Reduce { root }, h, smallvec![(i, 0..len)])
                    }
                    _ => {
                        let send = s.data.into_buffer(pool, len)?;
                        plan.transfer(Op::Reduce { root }, send, None, smallvec![(i, 0..len)]);
                    }
                }
            }
            Spread::Whole { rank: root } => {
                s.data.read(|h| plan.pack(Op::Reduce { root }, i, h))?;
            }
        }
    }
    let done = plan.run(round, (rank, size))?;
    for (recv, members) in done {
        share(pool, recv, members, |i| holds[i], &mut out);
    }
    Ok(out)
}

/// Read locks on the caller's values that travel alone to a whole key's home, per sum, sent
/// from where they are if the link can. A value that several sums name is copied instead: two
/// read locks on one array from one thread could deadlock behind a waiting writer.
fn read_in_place<'a>(sums: &[Sum<'a>]) -> Vec<Option<RwLockReadGuard<'a, Storage>>> {
    let alone = |s: &Sum<'_>| {
        matches!(s.spread, Spread::Whole { .. })
            && travels_alone(s.data.len() * s.data.dtype().size(), sums.len())
    };
    // Most calls of many small keys send none alone: count array uses only when needed.
    if !sums.iter().any(alone) {
        return sums.iter().map(|_| None).collect();
    }
    let uses = Uses::of(sums.iter().filter_map(|s| match s.data {
        SumData::Value(a) => Some(a.storage_id()),
        SumData::Owned(_) => None,
    }));
    sums.iter()
        .map(|s| match s.data {
            SumData::Value(a) if alone(s) && uses.once(a.storage_id()) => Some(a.read()),
            _ => None,
        })
        .collect()
}

/// The storages a call's arrays name, to tell one named once (which a transfer may read or
/// fill in place) from one that several keys share.
pub(crate) struct Uses(Few<usize>);

impl Uses {
    /// The storages `ids` name, each as often as it is named.
    pub(crate) fn of(ids: impl Iterator<Item = usize>) -> Uses {
        let mut ids: Few<usize> = ids.collect();
        ids.sort_unstable();
        Uses(ids)
    }

    /// Whether storage `id` is named exactly once.
    pub(crate) fn once(&self, id: usize) -> bool {
        let first = self.0.partition_point(|&x| x < id);
        self.0.get(first) == Some(&id) && self.0.get(first + 1) != Some(&id)
    }
}

/// One key of a gather: this rank's piece of the value (the whole value on a whole key's home,
/// its slice of a sliced key, nothing elsewhere), the key's length and dtype, and its spread.
pub(crate) struct GatherPiece<'a> {
    pub data: Option<&'a HostData>,
    pub len: usize,
    pub dtype: DType,
    pub spread: Spread,
    /// A buffer of `len` elements to receive the whole value into (an out's own storage), for
    /// a key that [`receives_in_place`]; the value comes back in it.
    pub into: Option<HostData>,
}

/// Whether a key of `len` elements of `dtype` spread as `spread` over `size` ranks, in a call
/// of `keys` keys, travels in a buffer of its own that can be its destination
/// ([`GatherPiece::into`]): a sliced key whose slices fill it exactly, or a whole key that
/// [`travels_alone`].
pub(crate) fn receives_in_place(
    spread: Spread,
    len: usize,
    dtype: DType,
    (size, keys): (usize, usize),
) -> bool {
    match spread {
        Spread::Sliced => len % size.max(1) == 0,
        Spread::Whole { .. } => travels_alone(len * dtype.size(), keys),
    }
}

/// Brings every key's whole value to every rank, from where it lives, each in a buffer of its
/// own. The values come from `pool`; give them back when done.
pub(crate) fn gather(
    round: &mut dyn Round,
    ranks: (usize, usize),
    pool: &Pool,
    mut pieces: Vec<GatherPiece<'_>>,
) -> Result<Vec<HostData>> {
    let n = pieces.len();
    let Gathered { bufs, at } = gather_shared(round, ranks, pool, &mut pieces)?;
    let mut members: Vec<Members> = bufs.iter().map(|_| Members::new()).collect();
    for (i, (b, range)) in at.into_iter().enumerate() {
        members[b].push((i, range));
    }
    let mut out: Vec<Option<HostData>> = (0..n).map(|_| None).collect();
    for (recv, members) in bufs.into_iter().zip(members) {
        share(pool, recv, members, |_| true, &mut out);
    }
    out.into_iter()
        .map(|d| d.ok_or_else(|| Error::internal("gather: a key got no value")))
        .collect()
}

/// What [`gather_shared`] brings: the buffers received (from the pool), and where each key's
/// whole value is in them: (buffer, elements).
pub(crate) struct Gathered {
    pub bufs: Transfers<HostData>,
    pub at: Few<(usize, Range<usize>)>,
}

/// [`gather`], with the packed keys left where they arrived: a pull copies them into its outs
/// from there, saving an allocation per key (and the page faults of memory the allocator gives
/// back in between).
pub(crate) fn gather_shared(
    round: &mut dyn Round,
    (rank, size): (usize, usize),
    pool: &Pool,
    pieces: &mut [GatherPiece<'_>],
) -> Result<Gathered> {
    let mut at: Few<Option<(usize, Range<usize>)>> = smallvec![None; pieces.len()];
    let mut plan = Plan::new(pool);
    // This rank's part of each key, or a buffer of the right length that MPI fills in.
    let mine = |p: &GatherPiece<'_>, len: usize, room: usize| match p.data {
        Some(d) if p.spread.holds(rank) => {
            let mut buf = pool.take(p.dtype, d.len(), room);
            copy_into(&mut buf, d);
            buf
        }
        _ => pool.take(p.dtype, len, room),
    };
    let keys = pieces.len();
    for p in pieces.iter() {
        if let Spread::Whole { rank: root } = p.spread {
            if !travels_alone(p.len * p.dtype.size(), keys) {
                plan.reserve_len(Op::Broadcast { root }, p.dtype, p.len);
            }
        }
    }
    for (i, p) in pieces.iter_mut().enumerate() {
        let into = match receives_in_place(p.spread, p.len, p.dtype, (size, keys)) {
            true => p
                .into
                .take()
                .filter(|b| b.len() == p.len && b.dtype() == p.dtype),
            false => None,
        };
        match p.spread {
            Spread::Sliced => {
                let block = slice_block(p.len, size);
                let mut send = mine(p, p.spread.piece(p.len, rank, size).len(), block);
                pad(&mut send, block);
                plan.transfer(Op::AllGather, send, into, smallvec![(i, 0..p.len)]);
            }
            Spread::Whole { rank: root } if travels_alone(p.len * p.dtype.size(), keys) => {
                let data = match (into, p.data) {
                    // The home copies its value into the destination and sends from there.
                    (Some(mut buf), Some(d)) if p.spread.holds(rank) => {
                        copy_into(&mut buf, d);
                        buf
                    }
                    (Some(buf), _) => buf,
                    (None, _) => mine(p, p.len, p.len),
                };
                plan.transfer(Op::Broadcast { root }, data, None, smallvec![(i, 0..p.len)]);
            }
            Spread::Whole { rank: root } => match p.data {
                Some(d) if p.spread.holds(rank) => plan.pack(Op::Broadcast { root }, i, d),
                _ => plan.pack_len(Op::Broadcast { root }, i, p.dtype, p.len),
            },
        }
    }
    let done = plan.run(round, (rank, size))?;
    let mut bufs = Transfers::with_capacity(done.len());
    for (b, (recv, members)) in done.into_iter().enumerate() {
        for (i, range) in members {
            at[i] = Some((b, range));
        }
        bufs.push(recv);
    }
    let at = at
        .into_iter()
        .map(|a| a.ok_or_else(|| Error::internal("gather: a key got no value")))
        .collect::<Result<_>>()?;
    Ok(Gathered { bufs, at })
}

/// One sliced key of an init: rank 0's value (on rank 0), and the key's length and dtype.
pub(crate) struct Scattered<'a> {
    pub data: Option<&'a HostData>,
    pub len: usize,
    pub dtype: DType,
}

/// Scatters rank 0's value of every sliced key of an init: each rank receives only its own
/// slice (never the whole value), in a buffer from `pool`.
pub(crate) fn scatter(
    round: &mut dyn Round,
    (rank, size): (usize, usize),
    pool: &Pool,
    keys: Vec<Scattered<'_>>,
) -> Result<Vec<HostData>> {
    let mut out: Vec<Option<HostData>> = (0..keys.len()).map(|_| None).collect();
    let mut plan = Plan::new(pool);
    for (i, k) in keys.iter().enumerate() {
        let block = slice_block(k.len, size);
        let send = match k.data {
            Some(d) if rank == 0 => {
                let mut buf = pool.take(k.dtype, 0, block * size);
                append(&mut buf, d);
                pad(&mut buf, block * size);
                buf
            }
            _ => pool.take(k.dtype, 0, 0),
        };
        let recv = pool.take(k.dtype, block, block);
        let mine = Spread::Sliced.piece(k.len, rank, size).len();
        plan.transfer(
            Op::Scatter { root: 0 },
            send,
            Some(recv),
            smallvec![(i, 0..mine)],
        );
    }
    for (recv, members) in plan.run(round, (rank, size))? {
        share(pool, recv, members, |_| true, &mut out);
    }
    out.into_iter()
        .map(|d| d.ok_or_else(|| Error::internal("scatter: a key got no slice")))
        .collect()
}

/// Hands each member its elements of a transfer's result `recv`, for the members `wanted`
/// says: moved when one member takes a prefix of it, copied otherwise.
fn share(
    pool: &Pool,
    recv: HostData,
    members: Members,
    wanted: impl Fn(usize) -> bool,
    out: &mut [Option<HostData>],
) {
    match members.as_slice() {
        [(i, range)] if wanted(*i) && range.start == 0 && range.end <= recv.len() => {
            let mut recv = recv;
            crate::host::with_host!(&mut recv, v: T => v.truncate(range.end));
            out[*i] = Some(recv);
        }
        _ => {
            for (i, range) in members.into_iter().filter(|(i, _)| wanted(*i)) {
                out[i] = Some(recv.slice_of(range));
            }
            pool.give(recv);
        }
    }
}

/// Which keys a transfer's result holds: (key index, elements of the result); a transfer of
/// one key holds it inline.
type Members = SmallVec<[(usize, Range<usize>); 1]>;

/// The transfers of a plan, or their results: inline up to four, so a call of a few keys
/// allocates none.
type Transfers<T> = SmallVec<[T; 4]>;

/// The collectives of one call, in the order every rank starts them.
struct Plan<'p, 'a> {
    pool: &'p Pool,
    /// Transfers of one key each, in key order.
    alone: Transfers<Transfer<'a>>,
    /// Packed transfers by (op, dtype), each filled in key order.
    packed: BTreeMap<(Op, &'static str), (HostData, Members)>,
    /// The elements each packed transfer will hold, so its buffer is taken once, whole.
    sizes: BTreeMap<(Op, &'static str), usize>,
}

impl<'p, 'a> Plan<'p, 'a> {
    fn new(pool: &'p Pool) -> Plan<'p, 'a> {
        Plan {
            pool,
            alone: Transfers::new(),
            packed: BTreeMap::new(),
            sizes: BTreeMap::new(),
        }
    }

    /// Counts `len` elements of `dtype` towards the packed transfer of `op` and that dtype.
    fn reserve_len(&mut self, op: Op, dtype: DType, len: usize) {
        *self.sizes.entry((op, dtype.name())).or_default() += len;
    }

    /// A transfer of one buffer, received into `recv` when given.
    fn transfer(&mut self, op: Op, send: HostData, recv: Option<HostData>, members: Members) {
        self.alone.push(Transfer {
            op,
            send: Cow::Owned(send),
            recv,
            members,
        });
    }

    /// A transfer of one buffer the caller keeps (read where it is, if the link can).
    fn transfer_borrowed(&mut self, op: Op, send: &'a HostData, members: Members) {
        self.alone.push(Transfer {
            op,
            send: Cow::Borrowed(send),
            recv: None,
            members,
        });
    }

    /// The packed transfer of `op` and `dtype`, made on first use with room for all of it: empty
    /// when values are appended to it, of its full length when it only receives (a kept buffer
    /// then keeps its old contents, which MPI overwrites, instead of being zeroed).
    fn bucket(&mut self, op: Op, dtype: DType, receives: bool) -> &mut (HostData, Members) {
        let room = self.sizes.get(&(op, dtype.name())).copied().unwrap_or(0);
        let pool = self.pool;
        let len = if receives { room } else { 0 };
        self.packed
            .entry((op, dtype.name()))
            .or_insert_with(|| (pool.take(dtype, len, room), Members::new()))
    }

    /// Appends key `i`'s `data` to the packed transfer of `op` and its dtype.
    fn pack(&mut self, op: Op, i: usize, data: &HostData) {
        let (buf, members) = self.bucket(op, data.dtype(), false);
        let start = packed_len(members);
        truncate(buf, start);
        append(buf, data);
        members.push((i, start..buf.len()));
    }

    /// Places `len` elements (whose values do not matter: MPI writes them) for key `i` in the
    /// packed transfer of `op` and `dtype`.
    fn pack_len(&mut self, op: Op, i: usize, dtype: DType, len: usize) {
        let (buf, members) = self.bucket(op, dtype, true);
        let start = packed_len(members);
        if buf.len() < start + len {
            pad(buf, start + len);
        }
        members.push((i, start..start + len));
    }

    /// Starts every transfer, then waits for all of them. Returns each transfer's result with
    /// its members; the send buffers go back to the pool.
    fn run(
        self,
        round: &mut dyn Round,
        (rank, size): (usize, usize),
    ) -> Result<Transfers<(HostData, Members)>> {
        let pool = self.pool;
        let transfers = self.alone.into_iter().chain(self.packed.into_iter().map(
            |((op, _), (mut send, members))| {
                truncate(&mut send, packed_len(&members));
                Transfer {
                    op,
                    send: Cow::Owned(send),
                    recv: None,
                    members,
                }
            },
        ));
        let mut flights = Transfers::new();
        for t in transfers {
            let len = t.op.recv_len(t.send.len(), rank, size);
            let recv = match t.recv {
                Some(r) => r,
                None => pool.take(t.send.dtype(), len, len),
            };
            let flight = match t.send {
                Cow::Owned(send) => round.start(t.op, send, recv)?,
                Cow::Borrowed(send) if round.sends_borrowed(t.op) => {
                    round.start_borrowed(t.op, send, recv)?
                }
                // Copied into a buffer of the pool, which the next call takes again (a fresh
                // copy each call grew the pool to its cap: under fault tolerance nothing is sent
                // borrowed).
                Cow::Borrowed(send) => {
                    let mut copy = pool.take(send.dtype(), 0, send.len());
                    append(&mut copy, send);
                    round.start(t.op, copy, recv)?
                }
            };
            flights.push((flight, t.members));
        }
        let mut done = Transfers::with_capacity(flights.len());
        for (flight, members) in flights {
            let (send, recv) = round.land(flight)?;
            pool.give(send);
            done.push((recv, members));
        }
        Ok(done)
    }
}

/// One transfer of a [`Plan`]: the collective, its send buffer, the buffer to receive into
/// when given, and which keys' elements its result holds.
struct Transfer<'a> {
    op: Op,
    send: Cow<'a, HostData>,
    recv: Option<HostData>,
    members: Members,
}

/// The elements a packed transfer's members take up so far.
fn packed_len(members: &Members) -> usize {
    members.last().map_or(0, |(_, range)| range.end)
}

/// Shortens `data` to at most `len` elements.
fn truncate(data: &mut HostData, len: usize) {
    crate::host::with_host!(data, v: T => v.truncate(len));
}

/// Extends `data` with zeros to `len` elements.
fn pad(data: &mut HostData, len: usize) {
    crate::host::with_host!(data, v: T => v.resize(len, T::from_f64(0.0)));
}

/// Appends `more` to `buf`; both have the same dtype (packed transfers are per dtype).
fn append(buf: &mut HostData, more: &HostData) {
    crate::host::with_host!(buf, v: T => match T::slice(more) {
        Some(m) => crate::memcopy::extend(v, m),
        None => v.extend(more.to_vec::<T>()),
    });
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{Dist, Uses};
    use crate::comm::link::loopback::Loopback;

    /// Unset, the slicing bound is MXNet's on one machine and lower across machines; set, it
    /// holds on both.
    #[test]
    fn keys_are_sliced_from_a_lower_bound_across_machines() {
        let cases = [
            (1, None, [false, false, true]),
            (2, None, [false, true, true]),
            (3, Some(70_000), [false, true, true]),
            (2, Some(2_000_000), [false, false, false]),
        ];
        for (hosts, set, want) in cases {
            let links = Loopback::world(2, Duration::from_secs(10));
            let sliced: Vec<[bool; 3]> = std::thread::scope(|s| {
                let ranks: Vec<_> = (links.into_iter())
                    .map(|l| {
                        s.spawn(move || {
                            let d = Dist::over(Box::new(l.on_hosts(hosts)), set).expect("a dist");
                            [60_000, 100_000, 1_000_001].map(|len| d.is_sliced(len))
                        })
                    })
                    .collect();
                ranks
                    .into_iter()
                    .map(|h| h.join().expect("a rank"))
                    .collect()
            });
            assert_eq!(sliced, vec![want; 2], "{hosts} hosts, bound {set:?}");
        }
    }

    /// `Uses::once` against a plain count, on random lists of storage ids with repeats.
    #[test]
    fn uses_tells_storages_named_once() {
        let mut seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(7, |d| d.as_nanos() as u64)
            | 1;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n) as usize
        };
        for _ in 0..200 {
            let ids: Vec<usize> = (0..next(12)).map(|_| next(8)).collect();
            let uses = Uses::of(ids.iter().copied());
            for id in 0..9 {
                let count = ids.iter().filter(|&&x| x == id).count();
                assert_eq!(uses.once(id), count == 1, "id {id} in {ids:?}");
            }
        }
    }
}
