//! Non-blocking collectives on owned host buffers, and waiting for them.
//!
//! A collective owns its buffers until it completes ([`Done`] gives them back): one that times
//! out can never be finished or cancelled, so MPI may still write into them, and they are
//! leaked. Owned buffers also make f32 and f64 zero-copy.
//!
//! f16 and bf16 have no MPI sum; the rule is "sum in f32, round once". A two-rank reduce widens
//! them to f32 for `MPI_Reduce` and rounds the sum once; the store's own point-to-point sums
//! (the reduce in rank order, the reduce-scatter) move 16-bit values and sum them in f32 where
//! they arrive. Copies move the bits as `u16`.

use std::os::raw::{c_int, c_void};
use std::time::Instant;

use half::{bf16, f16};
use mpi::ffi;
use smallvec::{smallvec, SmallVec};

use super::raw::{self, Request};
use super::{Call, World};
use crate::{Error, Result};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for u64 {}
}

/// An element type the transport moves: `f32`, `f64`, `half::f16`, `half::bf16` (and `u64`).
pub trait Wire: Copy + Default + Send + Sync + 'static + sealed::Sealed {
    /// Whether sums are made in f32 (f16, bf16): a reduce's partial sums travel as f32.
    const SUM_IN_F32: bool;
    /// The MPI datatype the elements travel as (copied, or summed unless [`Wire::SUM_IN_F32`]).
    fn datatype() -> ffi::MPI_Datatype;
    /// Widens to f32 (used only when [`Wire::SUM_IN_F32`]).
    fn to_f32(self) -> f32;
    /// Rounds from f32 to nearest (used only when [`Wire::SUM_IN_F32`]).
    fn from_f32(v: f32) -> Self;
    /// `self + other`, as `MPI_SUM` adds (unused where [`Wire::SUM_IN_F32`]).
    fn add(self, other: Self) -> Self;
}

/// Implements [`Wire`] for `$t`, which travels as `$bits` (f16 and bf16 are
/// `#[repr(transparent)]` over their `u16` bits), with its conversions and `MPI_SUM`'s addition.
macro_rules! wire {
    ($t:ty as $bits:ty, wide: $wide:expr, $to:expr, $from:expr, $add:expr) => {
        impl Wire for $t {
            const SUM_IN_F32: bool = $wide;
            fn datatype() -> ffi::MPI_Datatype {
                raw::datatype::<$bits>()
            }
            fn to_f32(self) -> f32 {
                $to(self)
            }
            fn from_f32(v: f32) -> Self {
                $from(v)
            }
            fn add(self, other: Self) -> Self {
                $add(self, other)
            }
        }
    };
}

wire!(f32 as f32, wide: false, |x| x, |v| v, |a, b| a + b);
wire!(f64 as f64, wide: false, |x| x as f32, f64::from, |a, b| a + b);
wire!(u64 as u64, wide: false, |x| x as f32, |v| v as u64, u64::wrapping_add);
wire!(f16 as u16, wide: true, f16::to_f32, f16::from_f32, |a: f16, b: f16| {
    f16::from_f32(a.to_f32() + b.to_f32())
});
wire!(bf16 as u16, wide: true, bf16::to_f32, bf16::from_f32, |a: bf16, b: bf16| {
    bf16::from_f32(a.to_f32() + b.to_f32())
});

/// Per element type, the buffers that receive the other ranks' blocks (of a reduce-scatter, or
/// at the root of a reduce in rank order) and those of a collective's steps
/// ([`Call::scratch`]), kept between calls up to a bound of bytes per type, so that receives
/// land in pages already mapped, with no zeros written first. A bigger buffer is allocated (and
/// zeroed) for its call alone.
pub(super) struct Staged {
    /// The most bytes kept per element type.
    cap: usize,
    f32: Vec<Vec<f32>>,
    f64: Vec<Vec<f64>>,
    f16: Vec<Vec<f16>>,
    bf16: Vec<Vec<bf16>>,
    u64: Vec<Vec<u64>>,
}

impl Default for Staged {
    fn default() -> Staged {
        Staged::with_cap(KEPT_STAGED_BYTES)
    }
}

impl Staged {
    /// Keeping at most `cap` bytes per element type.
    pub(super) fn with_cap(cap: usize) -> Staged {
        Staged {
            cap,
            f32: Vec::new(),
            f64: Vec::new(),
            f16: Vec::new(),
            bf16: Vec::new(),
            u64: Vec::new(),
        }
    }

    /// A buffer of `len`: the smallest kept one that fits, else the biggest, grown with zeros.
    fn take<T: Wire>(&mut self, len: usize) -> Vec<T> {
        let mut v = match self.of::<T>() {
            Some(kept) if !kept.is_empty() => {
                let smallest_fit = kept.iter().rposition(|v| v.capacity() >= len);
                kept.remove(smallest_fit.unwrap_or(0))
            }
            _ => Vec::new(),
        };
        v.resize(len, T::default());
        v
    }

    /// Keeps `v` for a later [`Staged::take`], within the bound (smallest go first).
    fn keep<T: Wire>(&mut self, v: Vec<T>) {
        let bytes = |v: &Vec<T>| v.capacity() * std::mem::size_of::<T>();
        let cap = self.cap;
        let Some(kept) = self.of::<T>() else {
            return;
        };
        if v.capacity() == 0 || bytes(&v) > cap {
            return;
        }
        kept.push(v);
        kept.sort_by_key(|v| std::cmp::Reverse(v.capacity()));
        while kept.iter().map(bytes).sum::<usize>() > cap {
            kept.pop();
        }
    }

    /// The kept buffers of `T` (the sealed trait has these five types).
    fn of<T: Wire>(&mut self) -> Option<&mut Vec<Vec<T>>> {
        let any: [&mut dyn std::any::Any; 5] = [
            &mut self.f32,
            &mut self.f64,
            &mut self.f16,
            &mut self.bf16,
            &mut self.u64,
        ];
        any.into_iter().find_map(|v| v.downcast_mut())
    }
}

/// The most bytes of [`Staged`] buffers kept per element type, at least: a whole f32 key's
/// blocks on up to 17 ranks at the default bound, or a sliced f32 key of up to 128 MiB on two
/// ranks.
const KEPT_STAGED_BYTES: usize = 64 << 20;

/// The most bytes of [`Staged`] buffers the world keeps per element type in use, with
/// `KVSTORE_DIST_POOL_BYTES` at `pool_bytes`: a quarter of it (256 MiB by default: the buffers
/// of a sliced f32 key of 64 MiB in two stages, about 2.25 times the key), at least
/// [`KEPT_STAGED_BYTES`].
pub(super) fn staged_cap(pool_bytes: usize) -> usize {
    (pool_bytes / 4).max(KEPT_STAGED_BYTES)
}

/// The most bytes of each f32 buffer of a blocking f16/bf16 reduce kept for the next one (a
/// whole key's sum: keys over `KVSTORE_BIGARRAY_BOUND` are sliced, so 4 MiB by default).
const KEPT_WIDE_BYTES: usize = 64 << 20;

/// The kinds of point-to-point message; each tag also carries its call's number ([`Call::tag`]).
#[derive(Clone, Copy)]
enum Tagged {
    ReduceScatter = 0,
    ReduceInOrder = 1,
}

/// Which collective, for messages.
#[derive(Clone, Copy, Debug)]
pub(super) enum Coll {
    Reduce { root: usize },
    ReduceInOrder { root: usize },
    Broadcast { root: usize },
    ReduceScatter,
    AllGather,
    Scatter { root: usize },
    AllToAll,
    Barrier,
    Fingerprint,
}

impl std::fmt::Display for Coll {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Coll::Reduce { root } => write!(f, "reduce to rank {root}"),
            Coll::ReduceInOrder { root } => write!(f, "reduce to rank {root} (in rank order)"),
            Coll::Broadcast { root } => write!(f, "broadcast from rank {root}"),
            Coll::ReduceScatter => f.write_str("reduce-scatter"),
            Coll::AllGather => f.write_str("all-gather"),
            Coll::Scatter { root } => write!(f, "scatter from rank {root}"),
            Coll::AllToAll => f.write_str("all-to-all"),
            Coll::Barrier => f.write_str("barrier"),
            Coll::Fingerprint => f.write_str("fingerprint check (an all-gather)"),
        }
    }
}

/// A started collective: finish it with [`Call::wait`] or [`Call::wait_all`] (poll it with
/// [`Call::test`]) in the same call. Dropped unfinished, it leaks its buffers and poisons the
/// world.
pub struct Pending<T: Wire> {
    world: &'static World,
    seq: u64,
    /// One request for a collective (inline: MPI keeps no pointer to it, it only writes the
    /// handle when it starts or tests one); one per message for the point-to-point ones.
    reqs: SmallVec<[Request; 1]>,
    coll: Coll,
    /// Whether this rank receives the result of a reduce (it is the root).
    is_root: bool,
    send: Vec<T>,
    recv: Vec<T>,
    /// The f32 (send, partial sums) of a reduce where [`Wire::SUM_IN_F32`].
    wide: (Vec<f32>, Vec<f32>),
    /// An all-to-all-v's counts and displacements, which MPI reads until completion.
    counts: Vec<c_int>,
    /// The other ranks' blocks, in rank order (a [`Staged`] buffer, given back when done).
    staged: Vec<T>,
    /// Whether every receive of the staged blocks completed with its whole block.
    whole: bool,
    /// This rank's rank in the collective's group, and the group's size ([`Group`]).
    group: (usize, usize),
    bytes: usize,
    start: Instant,
}

/// The ranks a collective runs among.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Group {
    /// Every rank.
    World,
    /// The ranks of this rank's machine (with a [`super::hierarchy::Layout`] only).
    Machine,
    /// The ranks of this rank's local rank, one per machine (likewise).
    Across,
}

/// The buffers of a completed collective.
///
/// | collective | `send` | `recv` |
/// |---|---|---|
/// | [`Call::reduce_sum`] | the input, unchanged | at the root, the sum; elsewhere as given |
/// | [`Call::broadcast`] | empty | the root's data |
/// | [`Call::reduce_scatter`] | the input, unchanged | this rank's block of the sum |
/// | [`Call::all_gather`] | the input, unchanged | every rank's block, in rank order |
#[derive(Debug)]
pub struct Done<T> {
    /// The send buffer, given back.
    pub send: Vec<T>,
    /// The receive buffer, holding the result.
    pub recv: Vec<T>,
}

impl<T: Wire> Drop for Pending<T> {
    fn drop(&mut self) {
        if self.reqs.iter().all(|r| r.is_null()) {
            return;
        }
        // MPI may still read or write these: never free them.
        std::mem::forget(std::mem::take(&mut self.send));
        std::mem::forget(std::mem::take(&mut self.recv));
        std::mem::forget(std::mem::take(&mut self.wide));
        std::mem::forget(std::mem::take(&mut self.counts));
        std::mem::forget(std::mem::take(&mut self.staged));
        self.world.poison_with(format!(
            "the {} of call #{} was abandoned before it completed",
            self.coll, self.seq
        ));
    }
}

impl<T: Wire> Pending<T> {
    /// When the collective started: its wait's timeout counts from here.
    pub(crate) fn started_at(&self) -> Instant {
        self.start
    }

    /// The collective, its wait's timeout counted from `start` (a later step of a collective
    /// in steps, so that the whole is bounded by one timeout).
    pub(crate) fn counting_from(mut self, start: Instant) -> Pending<T> {
        self.start = start;
        self
    }

    fn new(call: &Call, coll: Coll, send: Vec<T>, recv: Vec<T>, bytes: usize) -> Pending<T> {
        #[cfg(feature = "test-util")]
        super::test_hook::before_collective(call.world, call.seq, &coll, bytes);
        Pending {
            world: call.world,
            seq: call.seq,
            reqs: smallvec![Request::null()],
            coll,
            is_root: false,
            send,
            recv,
            wide: Default::default(),
            counts: Vec::new(),
            staged: Vec::new(),
            whole: false,
            group: (call.world.rank, call.world.size),
            bytes,
            start: Instant::now(),
        }
    }

    /// The send and receive buffers, as MPI takes them.
    fn ptrs(&mut self) -> (*const c_void, *mut c_void) {
        (raw::ptr(&self.send), raw::ptr_mut(&mut self.recv))
    }

    /// The buffers and datatype a sum travels in (the f32 ones where [`Wire::SUM_IN_F32`]).
    fn sum_buffers(&mut self) -> (*const c_void, *mut c_void, ffi::MPI_Datatype) {
        match T::SUM_IN_F32 {
            true => (
                raw::ptr(&self.wide.0),
                raw::ptr_mut(&mut self.wide.1),
                f32::datatype(),
            ),
            false => {
                let (send, recv) = self.ptrs();
                (send, recv, T::datatype())
            }
        }
    }

    /// Whether its receives' counts are checked ([`Pending::received_in_full`]).
    fn counts_received(&self) -> bool {
        match self.coll {
            Coll::ReduceScatter => true,
            Coll::ReduceInOrder { .. } => self.is_root,
            _ => false,
        }
    }

    /// Whether its counts are still to check: not once complete (the test that saw it did).
    fn counts_unchecked(&self) -> bool {
        self.counts_received() && self.reqs.iter().any(|r| !r.is_null())
    }

    /// Checks that a completed reduce-scatter, or the root of a reduce in rank order, got a
    /// whole block from every other rank (`statuses`: one per request, receives first). A
    /// shorter block means the ranks disagree on the key's size (only `KVSTORE_DIST_CHECK=0`
    /// lets that reach the transfer) and summing would use zeros in its place; a longer one is
    /// MPI's truncation error.
    fn received_in_full(&mut self, statuses: &[ffi::MPI_Status], op: &'static str) -> Result<()> {
        if !self.counts_received() {
            return Ok(());
        }
        let (rank, size) = self.group;
        let want = self.staged.len() / (size - 1).max(1);
        for (k, status) in statuses.iter().take(size - 1).enumerate() {
            let mut got: c_int = 0;
            // SAFETY: `status` is the status MPI_Testall wrote for this completed receive, and
            // the datatype is the one it received.
            let rc = unsafe { ffi::MPI_Get_count(status, T::datatype(), &mut got) };
            raw::check(op, rc)?;
            if usize::try_from(got).ok() != Some(want) {
                let from = if k < rank { k } else { k + 1 };
                return Err(Error::Mpi {
                    op,
                    message: format!(
                        "{} of call #{}: rank {from} sent a block of {got} elements where rank \
                         {rank} expected {want}: the ranks disagree on the key's size (with \
                         KVSTORE_DIST_CHECK=0 nothing compared it first)",
                        self.coll, self.seq
                    ),
                });
            }
        }
        self.whole = true;
        Ok(())
    }

    /// An error unless every staged block was received whole (a [`Call::test`] that found one
    /// short already failed; waiting for it again must fail too, not hand out its buffers).
    fn staged_whole(&self, op: &'static str) -> Result<()> {
        match self.staged.is_empty() || self.whole {
            true => Ok(()),
            false => Err(Error::Mpi {
                op,
                message: format!(
                    "the {} of call #{} received a block of the wrong length (see the error \
                     its test gave)",
                    self.coll, self.seq
                ),
            }),
        }
    }

    /// Takes the buffers out of a completed collective: sums the staged blocks and rounds an
    /// f16/bf16 reduce's f32 sum once. The staged buffer goes back to `kept`; the f32 buffers
    /// are returned, for the next f16/bf16 reduce.
    fn finish(mut self, kept: &mut Staged) -> (Done<T>, (Vec<f32>, Vec<f32>)) {
        debug_assert!(self.reqs.iter().all(|r| r.is_null()));
        let (rank, size) = self.group;
        // Waits hand out no buffers of a collective whose blocks were short
        // (`staged_whole`): the staged blocks are summed only when whole.
        let whole = self.staged.is_empty() || self.whole;
        match self.coll {
            _ if !whole => {}
            Coll::ReduceScatter => {
                let n = self.recv.len();
                let own = &self.send[rank * n..(rank + 1) * n];
                sum_blocks(&mut self.recv, own, &self.staged, (rank, size));
            }
            Coll::ReduceInOrder { .. } if self.is_root => {
                sum_blocks(&mut self.recv, &self.send, &self.staged, (rank, size));
            }
            _ => {}
        }
        if T::SUM_IN_F32 && self.is_root && matches!(self.coll, Coll::Reduce { .. }) {
            for (o, &s) in self.recv.iter_mut().zip(&self.wide.1) {
                *o = T::from_f32(s);
            }
        }
        let wide = std::mem::take(&mut self.wide);
        let done = Done {
            send: std::mem::take(&mut self.send),
            recv: std::mem::take(&mut self.recv),
        };
        kept.keep(std::mem::take(&mut self.staged));
        (done, wide)
    }
}

/// Sums one block over the ranks into `out`, on `rank` of `size` (`own`: this rank's block;
/// `staged`: the others', in rank order), adding rank 0's block, then rank 1's, and so on: the
/// same order for every element, whichever rank holds it and whatever its message carried.
fn sum_blocks<T: Wire>(out: &mut [T], own: &[T], staged: &[T], (rank, size): (usize, usize)) {
    let n = own.len();
    let block = |r: usize| match r.cmp(&rank) {
        std::cmp::Ordering::Equal => own,
        // Block r of the staged blocks is r's, below `rank`, and r - 1 is r's above it.
        std::cmp::Ordering::Less => &staged[r * n..(r + 1) * n],
        std::cmp::Ordering::Greater => &staged[(r - 1) * n..r * n],
    };
    // A chunk at a time, so that the partial sums stay in the cache while every block is
    // added to them (each element's order is the same).
    const CHUNK: usize = 2048;
    if T::SUM_IN_F32 {
        let mut acc = [0f32; CHUNK];
        for start in (0..n).step_by(CHUNK) {
            let end = (start + CHUNK).min(n);
            let acc = &mut acc[..end - start];
            for (a, x) in acc.iter_mut().zip(&block(0)[start..end]) {
                *a = x.to_f32();
            }
            for r in 1..size {
                for (a, x) in acc.iter_mut().zip(&block(r)[start..end]) {
                    *a += x.to_f32();
                }
            }
            for (o, &a) in out[start..end].iter_mut().zip(acc.iter()) {
                *o = T::from_f32(a);
            }
        }
    } else {
        for start in (0..n).step_by(CHUNK) {
            let end = (start + CHUNK).min(n);
            let out = &mut out[start..end];
            crate::memcopy::copy(out, &block(0)[start..end]);
            for r in 1..size {
                for (o, &x) in out.iter_mut().zip(&block(r)[start..end]) {
                    *o = o.add(x);
                }
            }
        }
    }
}

/// `n` statuses for MPI to fill.
fn no_statuses(n: usize) -> Vec<ffi::MPI_Status> {
    // SAFETY: `MPI_Status` is a plain C struct of integers, for which all zeros is a value.
    (0..n).map(|_| unsafe { std::mem::zeroed() }).collect()
}

/// Starts `$p`'s collective: `$blocking` under the watchdog where the call runs blocking
/// ([`Call::set_blocking`]), else `$immediate` with `$p`'s request; gives `$p` back. A
/// `// SAFETY:` comment where it is invoked says why both are sound.
macro_rules! start {
    ($call:ident, $p:ident, $blocking:ident | $immediate:ident ($($arg:expr),*)) => {{
        let rc = match $call.blocking {
            // SAFETY: as stated where the macro is invoked.
            true => $call.bound($p.coll, || unsafe { ffi::$blocking($($arg),*) }),
            // SAFETY: as stated where the macro is invoked.
            false => unsafe { ffi::$immediate($($arg,)* &mut $p.reqs[0].0) },
        };
        $call.started(rc)?;
        Ok($p)
    }};
}

impl Call {
    /// The error of a collective that does not fit its buffers (nothing was started).
    fn misuse(&self, message: String) -> Error {
        Error::Mpi {
            op: self.op,
            message,
        }
    }

    /// An error unless `buf`'s `len` is one block per rank (of `size`) of the `other` buffer's
    /// `block`.
    fn holds_blocks(
        &self,
        buf: &str,
        (len, size): (usize, usize),
        block: usize,
        other: &str,
    ) -> Result<()> {
        if block.checked_mul(size) == Some(len) {
            return Ok(());
        }
        Err(self.misuse(format!(
            "{buf} has {len} elements but must hold {size} blocks of {block} (the {other} \
             buffer's length)"
        )))
    }

    fn check_root(&self, root: usize) -> Result<()> {
        if root < self.world.size {
            Ok(())
        } else {
            Err(self.misuse(format!(
                "root rank {root} does not exist in a world of {} ranks",
                self.world.size
            )))
        }
    }

    /// Makes the collectives this call starts next blocking (`on`) or polled (the default). A
    /// blocking one cannot be timed out or cancelled (a watchdog bounds it): turn it on only
    /// where every rank has just agreed, in this call, to start the same collectives, with
    /// nothing that can fail on one rank in between. Every rank must choose alike: MPI does not
    /// match a blocking collective with a non-blocking one.
    pub fn set_blocking(&mut self, on: bool) {
        self.blocking = on;
    }

    /// The tag of this call's point-to-point messages of `kind`: the kind and the call's number
    /// modulo 8192 (at most 16383; every MPI allows 32767), so a message of another call, or of
    /// a rank that disagrees with the check off, never matches this call's receives.
    fn tag(&self, kind: Tagged) -> c_int {
        (kind as c_int) + 2 * (self.seq % 8192) as c_int
    }

    /// Whether a reduce adds in rank order, point to point (see [`Call::reduce_sum`]).
    fn sums_in_rank_order(&self) -> bool {
        self.world.size >= 3
    }

    /// Runs the blocking collective `f`, of `coll`, under the watchdog.
    fn bound(&self, coll: Coll, f: impl FnOnce() -> c_int) -> c_int {
        self.world.watchdog.bound((self.seq, self.op, coll), f)
    }

    /// Records the result of starting a collective: an MPI error poisons the world.
    fn started(&mut self, rc: c_int) -> Result<()> {
        self.st.note_failure(rc, None);
        raw::check(self.op, rc)
            .map_err(|e| self.named_loss().unwrap_or(e))
            .inspect_err(|e| self.world.poison_with(e.to_string()))
    }

    /// Starts a sum of every rank's `send` into `recv` at rank `root` (as long as `send` there;
    /// elsewhere pass `Vec::new()`). Each element's sum is the same bits whatever else the
    /// message carries: on two ranks it is `MPI_Ireduce` (`a0 + a1` is the same float in either
    /// order); on three or more it adds in rank order ([`Call::reduce_in_order`]), as
    /// `MPI_Reduce` picks its algorithm, so its order of additions, by message size.
    pub fn reduce_sum<T: Wire>(
        &mut self,
        send: Vec<T>,
        recv: Vec<T>,
        root: usize,
    ) -> Result<Pending<T>> {
        if self.sums_in_rank_order() {
            return self.reduce_in_order(send, recv, root);
        }
        let (n, is_root) = self.reduce_fits(send.len(), recv.len(), root)?;
        let bytes = send.len() * std::mem::size_of::<T>();
        let mut p = Pending::new(self, Coll::Reduce { root }, send, recv, bytes);
        p.is_root = is_root;
        let comm = self.st.data.0;
        if T::SUM_IN_F32 {
            p.wide = self.widened(&p.send, is_root);
        }
        let (send, recv, dt) = p.sum_buffers();
        let (root_c, sum) = (root as c_int, raw::op_sum());
        // SAFETY: both buffers hold `n` elements of `dt` (the receive buffer only matters at
        // the root, where it was sized above) and live in `p`'s vectors, which stay where they
        // are until the request completes or `Pending::drop` leaks them; the communicator is
        // valid; `root` < size.
        start!(
            self,
            p,
            MPI_Reduce | MPI_Ireduce(send, recv, n, dt, sum, root_c, comm)
        )
    }

    /// Checks a reduce's root and buffers: its count for MPI, and whether this rank is the root.
    fn reduce_fits(&self, send: usize, recv: usize, root: usize) -> Result<(c_int, bool)> {
        self.check_root(root)?;
        let is_root = root == self.world.rank;
        if is_root && recv != send {
            return Err(self.misuse(format!(
                "reduce: the root's receive buffer has {recv} elements but the send buffer {send}"
            )));
        }
        Ok((raw::count(self.op, send)?, is_root))
    }

    /// [`Call::reduce_sum`] from a borrowed send buffer, for a call that runs blocking
    /// ([`Call::set_blocking`]): MPI is done with `send` when this returns. [`Done::send`] comes
    /// back empty. On two ranks f16/bf16 are widened from `send` into f32 buffers that the world
    /// keeps for the next such reduce (up to [`KEPT_WIDE_BYTES`] each): fresh ones cost a page
    /// fault per 4 KiB on every push (a 256 K-element bf16 push took 5x an f32 one's time).
    pub fn reduce_sum_borrowed<T: Wire>(
        &mut self,
        send: &[T],
        mut recv: Vec<T>,
        root: usize,
    ) -> Result<Done<T>> {
        if !self.blocking {
            return Err(self.misuse(
                "a reduce from a borrowed buffer must run blocking: a non-blocking one could \
                 outlive the borrow"
                    .to_owned(),
            ));
        }
        if self.sums_in_rank_order() {
            return self.reduce_in_order_blocking(send, recv, root);
        }
        let (n, is_root) = self.reduce_fits(send.len(), recv.len(), root)?;
        let (mut wide_send, mut wide_recv): (Vec<f32>, Vec<f32>) = Default::default();
        let (sp, rp, dt) = match T::SUM_IN_F32 {
            true => {
                (wide_send, wide_recv) = self.widened(send, is_root);
                (
                    raw::ptr(&wide_send),
                    raw::ptr_mut(&mut wide_recv),
                    f32::datatype(),
                )
            }
            false => (raw::ptr(send), raw::ptr_mut(&mut recv), T::datatype()),
        };
        let (root_c, sum, comm) = (root as c_int, raw::op_sum(), self.st.data.0);
        // SAFETY: both buffers hold `n` elements of `dt` (the receive buffer only matters at the
        // root, where it was sized above); the call is blocking, so MPI is done with both when
        // it returns, while `send` is still borrowed and the others still owned here; the
        // communicator is valid; `root` < size.
        let rc = self.bound(Coll::Reduce { root }, || unsafe {
            ffi::MPI_Reduce(sp, rp, n, dt, sum, root_c, comm)
        });
        self.started(rc)?;
        if T::SUM_IN_F32 && is_root {
            for (o, &s) in recv.iter_mut().zip(&wide_recv) {
                *o = T::from_f32(s);
            }
        }
        // Empty unless SUM_IN_F32: then a no-op.
        self.keep_wide((wide_send, wide_recv));
        Ok(Done {
            send: Vec::new(),
            recv,
        })
    }

    /// Starts a reduce of `send` to `root` in rank order, point to point: the root receives the
    /// others' buffers into a [`Staged`] one and its wait adds rank 0's, rank 1's, ... values
    /// into `recv`. Where the call runs blocking, the requests complete here, under the watchdog.
    fn reduce_in_order<T: Wire>(
        &mut self,
        send: Vec<T>,
        recv: Vec<T>,
        root: usize,
    ) -> Result<Pending<T>> {
        let (n, is_root) = self.reduce_fits(send.len(), recv.len(), root)?;
        let bytes = send.len() * std::mem::size_of::<T>();
        let coll = Coll::ReduceInOrder { root };
        let mut p = Pending::new(self, coll, send, recv, bytes);
        p.is_root = is_root;
        let (dt, comm) = (T::datatype(), self.st.data.0);
        let (root_c, tag) = (root as c_int, self.tag(Tagged::ReduceInOrder));
        if !is_root {
            let (buf, req) = (raw::ptr(&p.send), &mut p.reqs[0].0);
            // SAFETY: the send buffer holds `n` elements of `dt` (checked by `reduce_fits`) and
            // lives in `p` until the request completes or `Pending::drop` leaks it; the
            // communicator is valid and `root` < size.
            let rc = unsafe { ffi::MPI_Isend(buf, n, dt, root_c, tag, comm, req) };
            self.started(rc)?;
        } else {
            p.reqs = smallvec![Request::null(); self.world.size - 1];
            let len = p.send.len();
            let comm = self.st.data.0;
            self.receive_staged(&mut p, (len, n), (tag, comm))?;
        }
        if self.blocking {
            self.complete_blocking(&mut p)?;
        }
        Ok(p)
    }

    /// Completes `p`'s requests (`MPI_Waitall`, under the watchdog); checks what they received.
    fn complete_blocking<T: Wire>(&mut self, p: &mut Pending<T>) -> Result<()> {
        let mut statuses = no_statuses(p.reqs.len());
        let (reqs, stats) = (
            p.reqs.as_mut_ptr().cast::<ffi::MPI_Request>(),
            statuses.as_mut_ptr(),
        );
        let count = raw::count(self.op, p.reqs.len())?;
        // SAFETY: `Request` is `#[repr(transparent)]` over `MPI_Request`, so `reqs` is an
        // array of `count` requests, started on `p`'s buffers, which live until they complete
        // (or are leaked with `p` if this fails); `statuses` has one per request.
        let rc = self.bound(p.coll, || unsafe { ffi::MPI_Waitall(count, reqs, stats) });
        self.started(rc)?;
        p.reqs.iter_mut().for_each(|r| *r = Request::null());
        p.received_in_full(&statuses, self.op)
            .inspect_err(|e| self.world.poison_with(e.to_string()))
    }

    /// Receives every other rank's block of `len` (`n` for MPI) with `tag` into `p.staged`, in
    /// rank order, on the first `size - 1` requests of `p`.
    fn receive_staged<T: Wire>(
        &mut self,
        p: &mut Pending<T>,
        (len, n): (usize, c_int),
        (tag, comm): (c_int, ffi::MPI_Comm),
    ) -> Result<()> {
        let (rank, size) = p.group;
        p.staged = self.st.staged.take::<T>((size - 1) * len);
        let (dt, width) = (T::datatype(), std::mem::size_of::<T>());
        let staged = raw::ptr_mut(&mut p.staged).cast::<u8>();
        for (k, req) in p.reqs.iter_mut().take(size - 1).enumerate() {
            let from = (if k < rank { k } else { k + 1 }) as c_int;
            // SAFETY: `p.staged` holds (size - 1) × len elements of `dt` (taken above); block k
            // starts k × len elements in and holds len (`n`). It lives in `p` until the request
            // completes or `Pending::drop` leaks it. The communicator is valid and `from` <
            // size.
            let rc = unsafe {
                let block = staged.add(k * len * width).cast();
                ffi::MPI_Irecv(block, n, dt, from, tag, comm, &mut req.0)
            };
            self.started(rc)?;
        }
        Ok(())
    }

    /// [`Call::reduce_in_order`] from a borrowed send buffer, blocking under the watchdog.
    fn reduce_in_order_blocking<T: Wire>(
        &mut self,
        send: &[T],
        recv: Vec<T>,
        root: usize,
    ) -> Result<Done<T>> {
        let (n, is_root) = self.reduce_fits(send.len(), recv.len(), root)?;
        let coll = Coll::ReduceInOrder { root };
        let (dt, comm, buf) = (T::datatype(), self.st.data.0, raw::ptr(send));
        let (root_c, tag) = (root as c_int, self.tag(Tagged::ReduceInOrder));
        if !is_root {
            // SAFETY: `send` holds `n` elements of `dt` (checked by `reduce_fits`) and stays
            // borrowed until the blocking send returns, when MPI is done with it; the
            // communicator is valid and `root` < size.
            let rc = self.bound(coll, || unsafe {
                ffi::MPI_Send(buf, n, dt, root_c, tag, comm)
            });
            self.started(rc)?;
            return Ok(Done {
                send: Vec::new(),
                recv,
            });
        }
        let bytes = std::mem::size_of_val(send);
        let mut p = Pending::new(self, coll, Vec::new(), recv, bytes);
        p.is_root = true;
        p.reqs = smallvec![Request::null(); self.world.size - 1];
        let comm = self.st.data.0;
        self.receive_staged(&mut p, (send.len(), n), (tag, comm))?;
        self.complete_blocking(&mut p)?;
        let (rank, size) = (self.world.rank, self.world.size);
        sum_blocks(&mut p.recv, send, &p.staged, (rank, size));
        self.st.staged.keep(std::mem::take(&mut p.staged));
        Ok(Done {
            send: Vec::new(),
            recv: std::mem::take(&mut p.recv),
        })
    }

    /// The kept f32 buffers, for a reduce of `send`: `send` widened, and at the root zeros.
    fn widened<T: Wire>(&mut self, send: &[T], is_root: bool) -> (Vec<f32>, Vec<f32>) {
        let (mut wide_send, mut wide_recv) = std::mem::take(&mut self.st.wide);
        wide_send.clear();
        wide_send.extend(send.iter().map(|x| x.to_f32()));
        wide_recv.clear();
        if is_root {
            wide_recv.resize(send.len(), 0.0);
        }
        (wide_send, wide_recv)
    }

    /// Keeps a reduce's f32 buffers for the next, unless too big or emptier than those kept.
    fn keep_wide(&mut self, wide: (Vec<f32>, Vec<f32>)) {
        let room = |w: &(Vec<f32>, Vec<f32>)| w.0.capacity() + w.1.capacity();
        let fits = (wide.0.capacity().max(wide.1.capacity())) * std::mem::size_of::<f32>()
            <= KEPT_WIDE_BYTES;
        if fits && room(&wide) > room(&self.st.wide) {
            self.st.wide = wide;
        }
    }

    /// Starts a broadcast of the root's `buf` into every rank's `buf` of its length (`MPI_Ibcast`).
    pub fn broadcast<T: Wire>(&mut self, buf: Vec<T>, root: usize) -> Result<Pending<T>> {
        self.check_root(root)?;
        let n = raw::count(self.op, buf.len())?;
        let bytes = buf.len() * std::mem::size_of::<T>();
        let mut p = Pending::new(self, Coll::Broadcast { root }, Vec::new(), buf, bytes);
        let (buf, dt, root_c, comm) = (p.ptrs().1, T::datatype(), root as c_int, self.st.data.0);
        // SAFETY: the buffer holds `n` elements of T's MPI datatype and lives in `p` until the
        // request completes or is leaked; the communicator is valid; `root` < size.
        start!(self, p, MPI_Bcast | MPI_Ibcast(buf, n, dt, root_c, comm))
    }

    /// Starts a reduce-scatter of equal blocks: `send` holds `size` blocks of `recv.len()`
    /// elements; rank `r` receives the sum over ranks of block `r`, added in rank order.
    ///
    /// Point to point: each rank sends block `r` to rank `r` and receives its own from every
    /// other rank into a [`Staged`] buffer, and [`Call::wait`] sums them; each byte crosses
    /// once. Open MPI 4.1's `MPI_Reduce_scatter_block`, blocking or not, was 2–3× slower from
    /// 16 MiB at 2–4 ranks (BENCHMARKS.md, "A reduce-scatter of its own"). Always polled, so
    /// bounded. Ranks must start their reduce-scatters in the same order (MPI matches a pair's
    /// messages in the order posted); a block of the wrong length is an error, never a sum. A
    /// push holds about twice the key in transfer buffers (MPI's needed a key and a block).
    pub fn reduce_scatter<T: Wire>(&mut self, send: Vec<T>, recv: Vec<T>) -> Result<Pending<T>> {
        self.reduce_scatter_in(Group::World, send, recv)
    }

    /// [`Call::reduce_scatter`] among the ranks of `group`: blocks in the group's rank order,
    /// summed in that order.
    pub(crate) fn reduce_scatter_in<T: Wire>(
        &mut self,
        group: Group,
        send: Vec<T>,
        recv: Vec<T>,
    ) -> Result<Pending<T>> {
        let (comm, rank, size) = self.group(group)?;
        let what = "reduce-scatter: the send buffer";
        self.holds_blocks(what, (send.len(), size), recv.len(), "receive")?;
        let n = recv.len();
        let count = raw::count(self.op, n)?;
        let bytes = send.len() * std::mem::size_of::<T>();
        let mut p = Pending::new(self, Coll::ReduceScatter, send, recv, bytes);
        p.group = (rank, size);
        p.reqs = smallvec![Request::null(); 2 * (size - 1)];
        let tag = self.tag(Tagged::ReduceScatter);
        self.receive_staged(&mut p, (n, count), (tag, comm))?;
        let (dt, width) = (T::datatype(), std::mem::size_of::<T>());
        let send_ptr = raw::ptr(&p.send).cast::<u8>();
        let sends = &mut p.reqs[size - 1..];
        // Each rank starts with its next rank up, so no rank is everyone's first.
        for (j, req) in sends.iter_mut().enumerate() {
            let to = (rank + 1 + j) % size;
            // SAFETY: the send buffer holds size × n elements of `dt` (checked above); block
            // `to` starts `to` × n elements in. It lives in `p` until the request completes or
            // is leaked. The communicator is valid and `to` < its size.
            let rc = unsafe {
                let block = send_ptr.add(to * n * width).cast();
                ffi::MPI_Isend(block, count, dt, to as c_int, tag, comm, &mut req.0)
            };
            self.started(rc)?;
        }
        Ok(p)
    }

    /// A buffer of `len` elements for a collective's steps, from those kept between calls
    /// (its contents are any values).
    pub(crate) fn scratch<T: Wire>(&mut self, len: usize) -> Vec<T> {
        self.st.staged.take(len)
    }

    /// Keeps `v` for a later [`Call::scratch`].
    pub(crate) fn keep_scratch<T: Wire>(&mut self, v: Vec<T>) {
        self.st.staged.keep(v);
    }

    /// The communicator of `group`, this rank's rank in it and its size.
    fn group(&self, group: Group) -> Result<(ffi::MPI_Comm, usize, usize)> {
        let w = self.world;
        let staged = || {
            let layout = w.layout();
            let comms = self.st.stages.as_ref();
            layout.zip(comms).ok_or_else(|| {
                Error::internal("a collective among machines in a world of one machine")
            })
        };
        Ok(match group {
            Group::World => (self.st.data.0, w.rank, w.size),
            Group::Machine => {
                let (layout, (machine, _)) = staged()?;
                (machine.0, layout.place(w.rank).1, layout.local)
            }
            Group::Across => {
                let (layout, (_, across)) = staged()?;
                (across.0, layout.place(w.rank).0, layout.hosts)
            }
        })
    }

    /// Starts an all-gather (`MPI_Iallgather`): block `r` of `recv` gets rank `r`'s `send`.
    pub fn all_gather<T: Wire>(&mut self, send: Vec<T>, recv: Vec<T>) -> Result<Pending<T>> {
        self.all_gather_as(Group::World, send, recv, Coll::AllGather)
    }

    /// [`Call::all_gather`] among the ranks of `group`, in the group's rank order.
    pub(crate) fn all_gather_in<T: Wire>(
        &mut self,
        group: Group,
        send: Vec<T>,
        recv: Vec<T>,
    ) -> Result<Pending<T>> {
        self.all_gather_as(group, send, recv, Coll::AllGather)
    }

    pub(super) fn all_gather_as<T: Wire>(
        &mut self,
        group: Group,
        send: Vec<T>,
        recv: Vec<T>,
        coll: Coll,
    ) -> Result<Pending<T>> {
        let (comm, rank, size) = self.group(group)?;
        let what = "all-gather: the receive buffer";
        self.holds_blocks(what, (recv.len(), size), send.len(), "send")?;
        let n = raw::count(self.op, send.len())?;
        let bytes = recv.len() * std::mem::size_of::<T>();
        let mut p = Pending::new(self, coll, send, recv, bytes);
        p.group = (rank, size);
        let ((send, recv), dt) = (p.ptrs(), T::datatype());
        // SAFETY: the send buffer holds n elements and the receive buffer size × n (checked
        // above), of T's MPI datatype; both live in `p` until completion or are leaked; the
        // communicator is valid.
        start!(
            self,
            p,
            MPI_Allgather | MPI_Iallgather(send, n, dt, recv, n, dt, comm)
        )
    }

    /// Starts an all-to-all of equal blocks (`MPI_Ialltoall`): block `r` of `send` goes to rank
    /// `r`, block `s` of `recv` comes from rank `s`.
    pub fn all_to_all<T: Wire>(&mut self, send: Vec<T>, recv: Vec<T>) -> Result<Pending<T>> {
        let size = self.world.size;
        if recv.len() != send.len() || send.len() % size != 0 {
            return Err(self.misuse(format!(
                "all-to-all: send and receive buffers must hold {size} equal blocks each, but \
                 they have {} and {} elements",
                send.len(),
                recv.len()
            )));
        }
        let n = raw::count(self.op, send.len() / size)?;
        let bytes = recv.len() * std::mem::size_of::<T>();
        let mut p = Pending::new(self, Coll::AllToAll, send, recv, bytes);
        let ((send, recv), dt, comm) = (p.ptrs(), T::datatype(), self.st.data.0);
        // SAFETY: both buffers hold size × n elements of T's MPI datatype (checked above) and
        // live in `p` until completion or are leaked; the communicator is valid.
        start!(
            self,
            p,
            MPI_Alltoall | MPI_Ialltoall(send, n, dt, recv, n, dt, comm)
        )
    }

    /// Starts an all-to-all of blocks of their own lengths (`MPI_Ialltoallv`, no padding): rank
    /// `s` sends rank `r` `lens[s * size + r]` elements (the same lengths on every rank); `send`
    /// holds this rank's blocks for ranks 0, 1, ..., and `recv` its blocks from ranks 0, 1, ...
    pub fn all_to_all_v<T: Wire>(
        &mut self,
        send: Vec<T>,
        lens: &[usize],
        recv: Vec<T>,
    ) -> Result<Pending<T>> {
        let (rank, size) = (self.world.rank, self.world.size);
        let sent: Vec<usize> = lens.iter().skip(rank * size).take(size).copied().collect();
        let received: Vec<usize> = lens.iter().skip(rank).step_by(size).copied().collect();
        if lens.len() != size * size
            || send.len() != sent.iter().sum::<usize>()
            || recv.len() != received.iter().sum::<usize>()
        {
            return Err(self.misuse(format!(
                "all-to-all: {} block lengths for {size} ranks (one per pair), a send buffer of \
                 {} elements for blocks of {} and a receive buffer of {} for blocks of {}",
                lens.len(),
                send.len(),
                sent.iter().sum::<usize>(),
                recv.len(),
                received.iter().sum::<usize>()
            )));
        }
        // Send counts, send displacements, receive counts, receive displacements.
        let count = |n: usize| raw::count(self.op, n);
        let starts = |lens: &[usize]| -> Vec<usize> {
            lens.iter()
                .scan(0, |at, &len| {
                    let start = *at;
                    *at += len;
                    Some(start)
                })
                .collect()
        };
        let counts: Vec<c_int> = (sent.iter().copied())
            .chain(starts(&sent))
            .chain(received.iter().copied())
            .chain(starts(&received))
            .map(count)
            .collect::<Result<_>>()?;
        let bytes = (send.len() + recv.len()) * std::mem::size_of::<T>() / 2;
        let mut p = Pending::new(self, Coll::AllToAll, send, recv, bytes);
        p.counts = counts;
        let ((send, recv), dt, comm) = (p.ptrs(), T::datatype(), self.st.data.0);
        let at = |k: usize| p.counts[k * size..].as_ptr();
        let (send_counts, send_displs, recv_counts, recv_displs) = (at(0), at(1), at(2), at(3));
        // SAFETY: `send` holds the sum of this rank's sent lengths and `recv` of its received
        // ones (checked above), of T's MPI datatype; the four arrays of `size` counts and
        // displacements stay in `p.counts` (never resized) until completion, or are leaked
        // with the buffers; every block lies inside its buffer by construction; the
        // communicator is valid.
        start!(
            self,
            p,
            MPI_Alltoallv
                | MPI_Ialltoallv(
                    send,
                    send_counts,
                    send_displs,
                    dt,
                    recv,
                    recv_counts,
                    recv_displs,
                    dt,
                    comm
                )
        )
    }

    /// Starts a scatter of equal blocks from rank `root` (`MPI_Iscatter`): at the root `send`
    /// holds `size` blocks of `recv.len()` elements, and rank `r` receives block `r` into
    /// `recv`; elsewhere `send` is not touched (pass `Vec::new()`).
    pub fn scatter<T: Wire>(
        &mut self,
        send: Vec<T>,
        recv: Vec<T>,
        root: usize,
    ) -> Result<Pending<T>> {
        self.check_root(root)?;
        if root == self.world.rank {
            let what = "scatter: the root's send buffer";
            self.holds_blocks(what, (send.len(), self.world.size), recv.len(), "receive")?;
        }
        let n = raw::count(self.op, recv.len())?;
        let bytes = recv.len() * std::mem::size_of::<T>();
        let mut p = Pending::new(self, Coll::Scatter { root }, send, recv, bytes);
        let ((send, recv), dt) = (p.ptrs(), T::datatype());
        let (root_c, comm) = (root as c_int, self.st.data.0);
        // SAFETY: at the root the send buffer holds size × n elements (checked above), and the
        // receive buffer n on every rank, of T's MPI datatype (MPI reads the send buffer only at
        // the root); both live in `p` until completion or are leaked; the communicator is
        // valid; `root` < size.
        start!(
            self,
            p,
            MPI_Scatter | MPI_Iscatter(send, n, dt, recv, n, dt, root_c, comm)
        )
    }

    /// A barrier (`MPI_Ibarrier`), waited for within the timeout.
    pub fn barrier(&mut self) -> Result<()> {
        let mut p = Pending::<f32>::new(self, Coll::Barrier, Vec::new(), Vec::new(), 0);
        // SAFETY: the communicator is valid and `p.reqs[0]` is a valid out-pointer.
        let rc = unsafe { ffi::MPI_Ibarrier(self.st.data.0, &mut p.reqs[0].0) };
        self.started(rc)?;
        self.wait(p).map(drop)
    }

    /// Whether `p` has completed (one `MPI_Test`); [`Call::wait`] for it then returns at once.
    pub fn test<T: Wire>(&mut self, p: &mut Pending<T>) -> Result<bool> {
        self.same_call(p)?;
        // Statuses only where counts are still to check: no allocation per call otherwise.
        let check = p.counts_unchecked();
        let mut statuses = no_statuses(if check { p.reqs.len() } else { 0 });
        let given = (!statuses.is_empty()).then_some(&mut statuses[..]);
        let r = self
            .st
            .test(&mut p.reqs, given, self.op)
            .and_then(|done| match done && check {
                true => p.received_in_full(&statuses, self.op).map(|()| true),
                false => Ok(done),
            });
        r.inspect_err(|e| self.world.poison_with(e.to_string()))
    }

    /// Waits for `p` (within the timeout, from its start) and gives its buffers back.
    pub fn wait<T: Wire>(&mut self, mut p: Pending<T>) -> Result<Done<T>> {
        self.complete(std::slice::from_mut(&mut p))?;
        Ok(self.finished(p))
    }

    /// Waits for all of `ps` (within the timeout, from the first start); their buffers, in order.
    pub fn wait_all<T: Wire>(&mut self, mut ps: Vec<Pending<T>>) -> Result<Vec<Done<T>>> {
        self.complete(&mut ps)?;
        Ok(ps.into_iter().map(|p| self.finished(p)).collect())
    }

    /// The buffers of a completed `p`; its f32 buffers are kept for the next f16/bf16 reduce.
    fn finished<T: Wire>(&mut self, p: Pending<T>) -> Done<T> {
        let (done, wide) = p.finish(&mut self.st.staged);
        self.keep_wide(wide);
        done
    }

    /// Polls `ps` until all complete and checks what they received. On an error the caller
    /// drops `ps`, leaking the buffers of requests still pending.
    fn complete<T: Wire>(&mut self, ps: &mut [Pending<T>]) -> Result<()> {
        for p in ps.iter() {
            self.same_call(p)?;
        }
        let Some(first) = ps.first() else {
            return Ok(());
        };
        let start = ps.iter().map(|p| p.start).min().unwrap_or(first.start);
        let bytes = ps.iter().map(|p| p.bytes).sum();
        let (coll, more) = (first.coll, ps.len() - 1);
        let what = move || match more {
            0 => coll.to_string(),
            _ => format!("{coll} (and {more} more collectives)"),
        };
        let check: SmallVec<[bool; 4]> = ps.iter().map(Pending::counts_unchecked).collect();
        // One collective is polled in place; several, on a copy of all their requests.
        let mut joined: Vec<Request> = Vec::new();
        let reqs: &mut [Request] = match more {
            0 => &mut ps[0].reqs,
            _ => {
                joined = ps.iter().flat_map(|p| p.reqs.iter().copied()).collect();
                &mut joined
            }
        };
        let mut statuses = no_statuses(if check.contains(&true) { reqs.len() } else { 0 });
        let given = (!statuses.is_empty()).then_some(&mut statuses[..]);
        self.poll(reqs, given, bytes, start, &what)?;
        let (mut done, mut at) = (joined.into_iter(), 0);
        for (p, check) in ps.iter_mut().zip(check) {
            let range = at..at + p.reqs.len();
            at = range.end;
            if check {
                p.received_in_full(&statuses[range], self.op)
                    .inspect_err(|e| self.world.poison_with(e.to_string()))?;
            }
            p.staged_whole(self.op)?;
            if more > 0 {
                p.reqs
                    .fill_with(|| done.next().unwrap_or_else(Request::null));
            }
        }
        Ok(())
    }

    fn same_call<T: Wire>(&self, p: &Pending<T>) -> Result<()> {
        if p.seq == self.seq {
            Ok(())
        } else {
            Err(self.misuse(format!(
                "a {} started in call #{} was waited for in call #{}; wait for every collective \
                 in the call that started it",
                p.coll, p.seq, self.seq
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Whichever rank holds a block, its sum is rank 0's part plus rank 1's, and so on: checked
    /// against that fold written out, on values where another order gives another sum.
    #[test]
    fn a_reduce_scatter_adds_in_rank_order_on_every_rank() {
        let mut rng = rand::rngs::StdRng::from_entropy();
        let (size, n) = (4, 5);
        // Rank r's send buffer: `size` blocks of n. Element 0 of every block is 1e8, 1, -1e8,
        // 1 across the ranks: 1 in rank order, 0 in reverse order.
        let sends: Vec<Vec<f32>> = (0..size)
            .map(|r| {
                (0..size * n)
                    .map(|i| match i % n {
                        0 => [1e8, 1.0, -1e8, 1.0][r],
                        _ => rng.gen_range(-1e4..1e4),
                    })
                    .collect()
            })
            .collect();
        for owner in 0..size {
            let block = |r: usize| &sends[r][owner * n..(owner + 1) * n];
            // As MPI leaves them: the other ranks' blocks, in rank order.
            let staged: Vec<f32> = (0..size)
                .filter(|&r| r != owner)
                .flat_map(|r| block(r).to_vec())
                .collect();
            let mut got: Vec<f32> = vec![f32::NAN; n];
            sum_blocks(&mut got, block(owner), &staged, (owner, size));
            let reversed: Vec<f32> = (0..n)
                .map(|i| block(3)[i] + block(2)[i] + block(1)[i] + block(0)[i])
                .collect();
            let mut in_order = block(0).to_vec();
            for r in 1..size {
                for (a, b) in in_order.iter_mut().zip(block(r)) {
                    *a += b;
                }
            }
            assert_eq!(got, in_order, "rank {owner}'s block");
            assert_eq!(
                got[0], 1.0,
                "rank {owner}'s block: 1e8 + 1 - 1e8 + 1 in rank order"
            );
            assert_ne!(reversed[0], got[0], "the order shows");
        }
    }

    /// The kept buffers: a take gets the smallest that fits (its old contents stay, no zeros
    /// written), else the biggest grown; the bytes kept per type stay within the bound, the
    /// smallest going first.
    #[test]
    fn staged_buffers_are_reused_within_their_bound() {
        const CAP: usize = 64 << 10;
        let mut st = Staged::with_cap(CAP);
        st.keep(vec![1.0f32; 1000]);
        st.keep(vec![2.0f32; 10]);
        st.keep(vec![3.0f64; 10]);
        let small = st.take::<f32>(8);
        assert_eq!((small.len(), small[0]), (8, 2.0));
        let big = st.take::<f32>(2000);
        assert_eq!((big.len(), big[0], big[1999]), (2000, 1.0, 0.0));
        assert!(st.take::<f32>(5).capacity() >= 5, "none kept: a fresh one");
        assert_eq!(st.take::<f64>(10)[9], 3.0);
        let n = CAP / 4 / 2;
        for fill in [1.0f32, 2.0, 3.0] {
            let mut v = Vec::with_capacity(n);
            v.resize(n, fill);
            st.keep(v);
        }
        let kept: usize = st.f32.iter().map(|v| v.capacity() * 4).sum();
        assert!(kept <= CAP && st.f32.len() == 2, "{kept} bytes kept");
        st.keep(vec![0.0f32; CAP / 4 + 1]);
        assert_eq!(st.f32.len(), 2, "a buffer over the bound is not kept");
    }

    /// bf16 blocks are summed in f32 and rounded once: 256 + 1 + 1 is 258 (in bf16 steps it
    /// would stay 256, as 257 rounds to even), and random blocks match that rule written out.
    #[test]
    fn a_bf16_reduce_scatter_sums_in_f32_and_rounds_once() {
        let mut rng = rand::rngs::StdRng::from_entropy();
        let (size, n) = (3, 4100);
        let sends: Vec<Vec<bf16>> = (0..size)
            .map(|r| {
                (0..size * n)
                    .map(|i| match i % n {
                        0 => bf16::from_f32([256.0, 1.0, 1.0][r]),
                        _ => bf16::from_f32(rng.gen_range(-300.0..300.0)),
                    })
                    .collect()
            })
            .collect();
        for owner in 0..size {
            let block = |r: usize| &sends[r][owner * n..(owner + 1) * n];
            let staged: Vec<bf16> = (0..size)
                .filter(|&r| r != owner)
                .flat_map(|r| block(r).to_vec())
                .collect();
            let mut got: Vec<bf16> = vec![bf16::NAN; n];
            sum_blocks(&mut got, block(owner), &staged, (owner, size));
            let want: Vec<bf16> = (0..n)
                .map(|i| bf16::from_f32((0..size).map(|r| block(r)[i].to_f32()).sum()))
                .collect();
            assert_eq!(got.len(), n);
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(g, w)| g.to_bits() == w.to_bits()),
                "rank {owner}'s block"
            );
            assert_eq!(got[0].to_f32(), 258.0);
        }
    }
}
