//! Across ranks: the step of a `dist_*` store's push that sums every rank's values onto each
//! key's home rank, and the step of its pull that brings the home's value to every rank, over
//! the MPI transport ([`super::mpi`]).
//!
//! - A key homed whole on one rank: a push is a reduce to that rank, a pull a broadcast from it.
//! - A sliced key (more than `KVSTORE_BIGARRAY_BOUND` elements, as MXNet's
//!   `MXNET_KVSTORE_BIGARRAY_BOUND`; default 1 000 000): each rank holds one contiguous slice
//!   ([`slice_range`](super::spread::slice_range)). A push is a reduce-scatter, a pull an
//!   all-gather: the traffic of one allreduce, as ZeRO-1 has it.
//! - Small whole keys travel packed, one buffer per (home rank, dtype): a list push of many
//!   small keys is one reduce per home rank and dtype, a list pull one broadcast each. Keys from
//!   [`PACK_MAX_BYTES`] up travel alone, in their own buffer, with no copy into a bucket.
//!
//! All the collectives of a call are started before any is waited for, so they overlap. Every
//! rank starts the same collectives in the same order: the order depends only on the call's
//! keys, shapes and dtypes (which the fingerprint check compares) and on where keys live (which
//! every rank computes alike).

use std::collections::BTreeMap;
use std::ops::Range;

use half::{bf16, f16};

mod gpu;
mod pool;
mod round;

use super::launch::LaunchEnv;
use super::mpi::{Call, Fingerprint, Pending, World};
use super::nccl::RankComm;
use super::spread::{slice_block, Spread};
use crate::host::HostData;
use crate::{DType, Device, Element, Error, NDArray, Result};
pub(crate) use pool::Pool;
use round::NcclCalls;
pub(crate) use round::Round;

pub(crate) use gpu::GpuPiece;

/// The default of `KVSTORE_BIGARRAY_BOUND`: keys of more elements are sliced over every rank.
pub(crate) const DEFAULT_BIGARRAY_BOUND: usize = 1_000_000;

/// Whole keys of fewer bytes than this travel packed with other keys of their home and dtype.
pub(crate) const PACK_MAX_BYTES: usize = 256 << 10;

/// A `dist_*` store's link to the other ranks.
pub(crate) struct Dist {
    link: Link,
    /// Keys of more elements than this are sliced over every rank.
    bound: usize,
    /// NCCL between the ranks' GPUs, for ranks whose values live on a GPU.
    gpu: Option<RankComm>,
    /// Host buffers kept between calls.
    pool: Pool,
}

/// What carries a call's checks and control messages.
enum Link {
    /// The MPI transport (`mpirun`).
    Mpi(&'static World),
    /// NCCL alone, for GPU ranks started without MPI (`torchrun --no-python`, srun).
    Nccl {
        calls: NcclCalls,
        check: bool,
        local_rank: usize,
    },
}

/// Whether this process was started by a launcher without MPI: `WORLD_SIZE` is set and no MPI
/// launcher's variables are.
fn launched_without_mpi() -> bool {
    const MPI_VARS: [&str; 4] = [
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
        "PMIX_RANK",
        "MPI_LOCALNRANKS",
    ];
    std::env::var_os("WORLD_SIZE").is_some()
        && MPI_VARS.iter().all(|v| std::env::var_os(v).is_none())
}

impl Dist {
    /// Joins the distributed world and reads `KVSTORE_BIGARRAY_BOUND`.
    ///
    /// - Host-memory ranks (`on_gpu` false) join over MPI (initialised once per process).
    /// - GPU ranks also join an NCCL communicator of every rank, each on the GPU its local rank
    ///   picks (a collective: every rank creates its store together). Started by `mpirun`,
    ///   the NCCL id travels over MPI; started without MPI (`RANK`, `WORLD_SIZE`,
    ///   `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, as torchrun sets them), NCCL's own
    ///   bootstrap exchanges it and NCCL carries everything, MPI is never initialised.
    pub fn connect(on_gpu: bool) -> Result<Dist> {
        let bound = bound_from_env()?;
        let pool = Pool::from_env()?;
        if on_gpu && launched_without_mpi() {
            let launch = LaunchEnv::from_process()?;
            let check = super::mpi::env_switch("KVSTORE_DIST_CHECK", true)?;
            let rc = RankComm::from_env()?;
            return Ok(Dist {
                link: Link::Nccl {
                    calls: NcclCalls::default(),
                    check,
                    local_rank: launch.local_rank,
                },
                bound,
                gpu: Some(rc),
                pool,
            });
        }
        let world = World::get()?;
        let gpu = match on_gpu {
            true => Some(gpu::join(world)?),
            false => None,
        };
        Ok(Dist {
            link: Link::Mpi(world),
            bound,
            gpu,
            pool,
        })
    }

    /// Host buffers kept between calls: take a call's big buffers from here, and give them
    /// back when done.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The room a buffer of a key of `len` elements needs for its transfers: a sliced key's
    /// send buffer is padded to one block per rank.
    pub fn room(&self, len: usize) -> usize {
        match self.is_sliced(len) {
            true => slice_block(len, self.size()) * self.size(),
            false => len,
        }
    }

    /// NCCL between the ranks' GPUs, when this store keeps its values on GPUs.
    pub fn gpu(&self) -> Option<&RankComm> {
        self.gpu.as_ref()
    }

    /// Where this rank keeps its parts of the values: its GPU, or host memory.
    pub fn home(&self) -> Device {
        match &self.gpu {
            Some(rc) => Device::Gpu(rc.ordinal()),
            None => Device::Cpu(0),
        }
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        match (&self.link, &self.gpu) {
            (Link::Nccl { .. }, Some(rc)) => rc.rank(),
            (Link::Mpi(w), _) => w.rank(),
            (Link::Nccl { .. }, None) => 0,
        }
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        match (&self.link, &self.gpu) {
            (Link::Nccl { .. }, Some(rc)) => rc.size(),
            (Link::Mpi(w), _) => w.size(),
            (Link::Nccl { .. }, None) => 1,
        }
    }

    /// This process's rank among the ranks on its machine.
    pub fn local_rank(&self) -> usize {
        match &self.link {
            Link::Mpi(w) => w.local_rank(),
            Link::Nccl { local_rank, .. } => *local_rank,
        }
    }

    /// Whether a key of `len` elements is sliced over every rank (never on GPU ranks).
    pub fn is_sliced(&self, len: usize) -> bool {
        self.gpu.is_none() && self.size() > 1 && len > self.bound
    }

    /// Begins a collective call: numbers it and compares `fp` across ranks (see
    /// [`World::begin`]).
    pub fn begin(&self, fp: &Fingerprint) -> Result<Round<'_>> {
        match (&self.link, &self.gpu) {
            (Link::Mpi(w), _) => Ok(Round::Mpi(w.begin(fp)?)),
            (Link::Nccl { calls, check, .. }, Some(rc)) => calls.begin(rc, fp, *check),
            (Link::Nccl { .. }, None) => Err(internal("a NCCL link without a communicator")),
        }
    }

    /// Joins call `op` as a rank that rejected its input with `err`, so that every other rank
    /// fails the same call with [`Error::RankRejected`] instead of waiting for this one, and
    /// gives `err` back.
    pub fn reject(&self, op: &'static str, err: Error) -> Error {
        // This rank's own error is the one to report; the check's error only says that the
        // other ranks were told.
        let _ = self.begin(&Fingerprint::rejected(op, &err.to_string()));
        err
    }

    /// Waits until every rank has reached this barrier (bounded by `KVSTORE_TIMEOUT`).
    pub fn barrier(&self) -> Result<()> {
        let mut round = self.begin(&Fingerprint::new("barrier"))?;
        round.barrier()
    }
}

/// `KVSTORE_BIGARRAY_BOUND`, or [`DEFAULT_BIGARRAY_BOUND`].
fn bound_from_env() -> Result<usize> {
    const VAR: &str = "KVSTORE_BIGARRAY_BOUND";
    let expected = "a whole number of elements (keys with more are sliced over every rank)";
    match std::env::var(VAR) {
        Err(std::env::VarError::NotPresent) => Ok(DEFAULT_BIGARRAY_BOUND),
        Ok(v) => v.trim().parse().map_err(|_| Error::InvalidEnv {
            var: VAR,
            value: v,
            expected,
        }),
        Err(std::env::VarError::NotUnicode(v)) => Err(Error::InvalidEnv {
            var: VAR,
            value: v.to_string_lossy().into_owned(),
            expected,
        }),
    }
}

/// One key of a reduce: this rank's sum of its own values (every element), and where the key
/// lives.
pub(crate) struct Sum<'a> {
    pub data: SumData<'a>,
    pub spread: Spread,
}

/// This rank's sum of a key's values: computed, or the key's one value itself (in host memory,
/// of the key's dtype), read where it is.
pub(crate) enum SumData<'a> {
    Owned(HostData),
    Value(&'a NDArray),
    /// The one value's own storage, lent by the caller under its write lock: sent as it is,
    /// and handed back by [`reduce`].
    Lent(HostData),
}

impl SumData<'_> {
    fn len(&self) -> usize {
        match self {
            SumData::Owned(h) | SumData::Lent(h) => h.len(),
            SumData::Value(a) => a.size(),
        }
    }

    fn dtype(&self) -> DType {
        match self {
            SumData::Owned(h) | SumData::Lent(h) => h.dtype(),
            SumData::Value(a) => a.dtype(),
        }
    }

    /// Runs `f` on the elements (a value's are read in place, under its read lock).
    fn read<R>(&self, f: impl FnOnce(&HostData) -> R) -> Result<R> {
        match self {
            SumData::Owned(h) | SumData::Lent(h) => Ok(f(h)),
            SumData::Value(a) => a.with_host(f),
        }
    }

    /// The elements in a buffer of their own with room for `room` elements: a computed sum or
    /// a lent value as it is, a value copied into a buffer from `pool`.
    fn into_buffer(self, pool: &Pool, room: usize) -> Result<HostData> {
        match self {
            SumData::Owned(h) | SumData::Lent(h) => Ok(h),
            SumData::Value(a) => {
                let mut buf = pool.take(a.dtype(), 0, room);
                a.with_host(|h| append(&mut buf, h))?;
                Ok(buf)
            }
        }
    }
}

/// Sums every rank's [`Sum`]s onto where each key lives. Returns, per key, this rank's piece of
/// the total: the whole sum on the home of a whole key, this rank's slice of a sliced key, and
/// `None` where this rank holds nothing of the key.
/// Lent values ([`SumData::Lent`]) come back, unchanged, in the second list, by key index.
pub(crate) fn reduce(
    round: &mut Round<'_>,
    pool: &Pool,
    sums: Vec<Sum<'_>>,
) -> Result<(Vec<Option<HostData>>, LentBack)> {
    let call = round.mpi()?;
    let (rank, size) = (call.world().rank(), call.world().size());
    let mut out: Vec<Option<HostData>> = (0..sums.len()).map(|_| None).collect();
    let holds: Vec<bool> = sums.iter().map(|s| s.spread.holds(rank)).collect();
    let mut plan = Plan::new(pool);
    for s in &sums {
        if let Spread::Whole { rank: root } = s.spread {
            if s.data.len() * s.data.dtype().size() < PACK_MAX_BYTES {
                plan.reserve_len(Op::Reduce { root }, s.data.dtype(), s.data.len());
            }
        }
    }
    let mut returned = Vec::new();
    for (i, s) in sums.into_iter().enumerate() {
        let len = s.data.len();
        let bytes = len * s.data.dtype().size();
        let lent = matches!(s.data, SumData::Lent(_)).then_some(i);
        match s.spread {
            Spread::Sliced => {
                let block = slice_block(len, size);
                let mine = s.spread.piece(len, rank, size).len();
                let mut lent = lent;
                let mut send = s.data.into_buffer(pool, block * size)?;
                if send.len() != block * size {
                    if let Some(i) = lent.take() {
                        // A lent value is never padded: it goes back, and a copy is sent.
                        let mut copy = pool.take(send.dtype(), 0, block * size);
                        append(&mut copy, &send);
                        returned.push((i, std::mem::replace(&mut send, copy)));
                    }
                    pad(&mut send, block * size);
                }
                plan.transfer(Op::ReduceScatter, send, None, vec![(i, 0..mine)], lent);
            }
            Spread::Whole { rank: root } if bytes >= PACK_MAX_BYTES => {
                let send = s.data.into_buffer(pool, len)?;
                plan.transfer(Op::Reduce { root }, send, None, vec![(i, 0..len)], lent);
            }
            Spread::Whole { rank: root } => {
                s.data.read(|h| plan.pack(Op::Reduce { root }, i, h))?;
                if let (Some(i), SumData::Lent(h)) = (lent, s.data) {
                    returned.push((i, h));
                }
            }
        }
    }
    let (done, lent_back) = plan.run(call)?;
    returned.extend(lent_back);
    for (recv, members) in done {
        share(pool, recv, members, |i| holds[i], &mut out);
    }
    Ok((out, returned))
}

/// One key of a gather: this rank's piece of the value (the whole value on the home of a whole
/// key, this rank's slice of a sliced key, nothing elsewhere), the key's length and dtype, and
/// where it lives.
pub(crate) struct Piece<'a> {
    pub data: Option<&'a HostData>,
    pub len: usize,
    pub dtype: DType,
    pub spread: Spread,
    /// A buffer of `len` elements to receive the whole value into (an out's own storage), for
    /// a key that [`receives_in_place`]; the value comes back in it.
    pub into: Option<HostData>,
}

/// Whether a key of `len` elements of `dtype` spread as `spread` over `size` ranks travels in
/// a buffer of its own that can be its destination: a sliced key whose slices fill it exactly,
/// or a whole key too big to pack. [`gather`] then receives it into [`Piece::into`] when given.
pub(crate) fn receives_in_place(spread: Spread, len: usize, dtype: DType, size: usize) -> bool {
    match spread {
        Spread::Sliced => len % size.max(1) == 0,
        Spread::Whole { .. } => len * dtype.size() >= PACK_MAX_BYTES,
    }
}

/// Brings every key's whole value to every rank, from where it lives. The values come from
/// `pool`; give them back when done.
pub(crate) fn gather(
    round: &mut Round<'_>,
    pool: &Pool,
    mut pieces: Vec<Piece<'_>>,
) -> Result<Vec<HostData>> {
    let call = round.mpi()?;
    let (rank, size) = (call.world().rank(), call.world().size());
    let mut out: Vec<Option<HostData>> = (0..pieces.len()).map(|_| None).collect();
    let mut plan = Plan::new(pool);
    // This rank's part of each key, or a buffer of the right length that MPI fills in.
    let mine = |p: &Piece<'_>, len: usize, room: usize| match p.data {
        Some(d) if p.spread.holds(rank) => {
            let mut buf = pool.take(p.dtype, d.len(), room);
            pool::copy_into(&mut buf, d);
            buf
        }
        _ => pool.take(p.dtype, len, room),
    };
    for p in &pieces {
        if let Spread::Whole { rank: root } = p.spread {
            let len = p.len * p.dtype.size();
            if len < PACK_MAX_BYTES {
                plan.reserve_len(Op::Broadcast { root }, p.dtype, p.len);
            }
        }
    }
    for (i, p) in pieces.iter_mut().enumerate() {
        let into = match receives_in_place(p.spread, p.len, p.dtype, size) {
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
                plan.transfer(Op::AllGather, send, into, vec![(i, 0..p.len)], None);
            }
            Spread::Whole { rank: root } if p.len * p.dtype.size() >= PACK_MAX_BYTES => {
                let data = match (into, p.data) {
                    // The home copies its value into the destination and sends from there.
                    (Some(mut buf), Some(d)) if p.spread.holds(rank) => {
                        pool::copy_into(&mut buf, d);
                        buf
                    }
                    (Some(buf), _) => buf,
                    (None, _) => mine(p, p.len, p.len),
                };
                plan.alone(Op::Broadcast { root }, data, vec![(i, 0..p.len)]);
            }
            Spread::Whole { rank: root } => match p.data {
                Some(d) if p.spread.holds(rank) => plan.pack(Op::Broadcast { root }, i, d),
                _ => plan.pack_len(Op::Broadcast { root }, i, p.dtype, p.len),
            },
        }
    }
    let (done, _) = plan.run(call)?;
    for (recv, members) in done {
        share(pool, recv, members, |_| true, &mut out);
    }
    out.into_iter()
        .map(|d| d.ok_or_else(|| internal("gather: a key got no value")))
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

/// [`reduce`] on GPU ranks: each key's sum (on this rank's GPU) with its home rank. Returns the
/// total on the home rank.
pub(crate) fn reduce_on_gpus(
    rc: &RankComm,
    sums: Vec<(NDArray, usize)>,
) -> Result<Vec<Option<NDArray>>> {
    gpu::reduce(rc, sums)
}

/// [`gather`] on GPU ranks: every key's value from its home rank to every rank's GPU.
pub(crate) fn gather_on_gpus(rc: &RankComm, pieces: Vec<GpuPiece>) -> Result<Vec<NDArray>> {
    gpu::gather(rc, pieces)
}

/// A collective of a [`Plan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Op {
    Reduce { root: usize },
    Broadcast { root: usize },
    ReduceScatter,
    AllGather,
}

/// Lent values handed back after their transfer: (key index, the value's storage).
pub(crate) type LentBack = Vec<(usize, HostData)>;

/// Which keys a transfer's result holds: (key index, elements of the result).
type Members = Vec<(usize, Range<usize>)>;

/// The collectives of one call, in the order every rank starts them.
struct Plan<'p> {
    pool: &'p Pool,
    /// Transfers of one key each, in key order.
    alone: Vec<Transfer>,
    /// Packed transfers by (op, dtype), each filled in key order.
    packed: BTreeMap<(Op, &'static str), (HostData, Members)>,
    /// The elements each packed transfer will hold, so its buffer is taken once, whole.
    sizes: BTreeMap<(Op, &'static str), usize>,
}

impl<'p> Plan<'p> {
    fn new(pool: &'p Pool) -> Plan<'p> {
        Plan {
            pool,
            alone: Vec::new(),
            packed: BTreeMap::new(),
            sizes: BTreeMap::new(),
        }
    }

    /// Counts `len` elements of `dtype` towards the packed transfer of `op` and that dtype.
    fn reserve_len(&mut self, op: Op, dtype: DType, len: usize) {
        *self.sizes.entry((op, dtype.name())).or_default() += len;
    }

    /// A transfer of one buffer.
    fn alone(&mut self, op: Op, data: HostData, members: Members) {
        self.transfer(op, data, None, members, None);
    }

    /// A transfer of one buffer, received into `recv` when given; the send buffer is key
    /// `lent`'s lent value when given, which goes back to the caller instead of the pool.
    fn transfer(
        &mut self,
        op: Op,
        send: HostData,
        recv: Option<HostData>,
        members: Members,
        lent: Option<usize>,
    ) {
        self.alone.push(Transfer {
            op,
            send,
            recv,
            members,
            lent,
        });
    }

    /// The packed transfer of `op` and `dtype`, made on first use with room for all of it.
    fn bucket(&mut self, op: Op, dtype: DType) -> &mut (HostData, Members) {
        let room = self.sizes.get(&(op, dtype.name())).copied().unwrap_or(0);
        let pool = self.pool;
        self.packed
            .entry((op, dtype.name()))
            .or_insert_with(|| (pool.take(dtype, 0, room), Vec::new()))
    }

    /// Appends key `i`'s `data` to the packed transfer of `op` and its dtype.
    fn pack(&mut self, op: Op, i: usize, data: &HostData) {
        let (buf, members) = self.bucket(op, data.dtype());
        let start = buf.len();
        append(buf, data);
        members.push((i, start..buf.len()));
    }

    /// Appends `len` elements (whose values do not matter: MPI writes them) for key `i` to the
    /// packed transfer of `op` and `dtype`.
    fn pack_len(&mut self, op: Op, i: usize, dtype: DType, len: usize) {
        let (buf, members) = self.bucket(op, dtype);
        let start = buf.len();
        pad(buf, start + len);
        members.push((i, start..buf.len()));
    }

    /// Starts every transfer, then waits for all of them. Returns each transfer's result with
    /// its members; the send buffers go back to the pool.
    /// Lent send buffers come back in the second list, by key index.
    fn run(self, call: &mut Call) -> Result<(Vec<(HostData, Members)>, LentBack)> {
        let rank = call.world().rank();
        let size = call.world().size();
        let pool = self.pool;
        let transfers = self.alone.into_iter().chain(self.packed.into_iter().map(
            |((op, _), (send, members))| Transfer {
                op,
                send,
                recv: None,
                members,
                lent: None,
            },
        ));
        let mut flights = Vec::new();
        for t in transfers {
            let flight = start(call, pool, t.op, t.send, t.recv, rank, size)?;
            flights.push((flight, t.members, t.lent));
        }
        let mut done = Vec::with_capacity(flights.len());
        let mut lent_back = Vec::new();
        for (flight, members, lent) in flights {
            let (send, recv) = flight.land(call)?;
            match lent {
                Some(i) => lent_back.push((i, send)),
                None => pool.give(send),
            }
            done.push((recv, members));
        }
        Ok((done, lent_back))
    }
}

/// One transfer of a [`Plan`]: the collective, its send buffer, the buffer to receive into
/// when given, which keys' elements its result holds, and the key whose lent value the send
/// buffer is, if it is one.
struct Transfer {
    op: Op,
    send: HostData,
    recv: Option<HostData>,
    members: Members,
    lent: Option<usize>,
}

/// A started collective, of any dtype.
enum Flight {
    F32(Pending<f32>),
    F64(Pending<f64>),
    F16(Pending<f16>),
    BF16(Pending<bf16>),
}

/// Starts `op` on `data` (this rank's send buffer, or the buffer a broadcast fills).
fn start(
    call: &mut Call,
    pool: &Pool,
    op: Op,
    data: HostData,
    recv: Option<HostData>,
    rank: usize,
    size: usize,
) -> Result<Flight> {
    let recv_len = match op {
        Op::Reduce { root } if root == rank => data.len(),
        Op::Reduce { .. } | Op::Broadcast { .. } => 0,
        Op::ReduceScatter => data.len() / size,
        Op::AllGather => data.len() * size,
    };
    let recv = match recv {
        Some(r) if r.len() == recv_len => r,
        _ => pool.take(data.dtype(), recv_len, recv_len),
    };
    macro_rules! typed {
        (|$s:ident, $r:ident| $e:expr) => {
            match (data, recv) {
                (HostData::F32($s), HostData::F32($r)) => Flight::F32($e),
                (HostData::F64($s), HostData::F64($r)) => Flight::F64($e),
                (HostData::F16($s), HostData::F16($r)) => Flight::F16($e),
                (HostData::BF16($s), HostData::BF16($r)) => Flight::BF16($e),
                _ => return Err(internal("a receive buffer of another dtype")),
            }
        };
    }
    Ok(match op {
        Op::Reduce { root } => typed!(|s, r| call.reduce_sum(s, r, root)?),
        Op::Broadcast { root } => typed!(|s, _r| call.broadcast(s, root)?),
        Op::ReduceScatter => typed!(|s, r| call.reduce_scatter(s, r)?),
        Op::AllGather => typed!(|s, r| call.all_gather(s, r)?),
    })
}

impl Flight {
    /// Waits for the collective (bounded by the timeout) and returns its send and result
    /// buffers.
    fn land(self, call: &mut Call) -> Result<(HostData, HostData)> {
        Ok(match self {
            Flight::F32(p) => wrap(call.wait(p)?),
            Flight::F64(p) => wrap(call.wait(p)?),
            Flight::F16(p) => wrap(call.wait(p)?),
            Flight::BF16(p) => wrap(call.wait(p)?),
        })
    }
}

/// The buffers of a finished collective: (send, result). A broadcast's result is its one
/// buffer, which the transport hands back as `recv`.
fn wrap<T: Element>(done: super::mpi::Done<T>) -> (HostData, HostData) {
    (T::wrap(done.send), T::wrap(done.recv))
}

/// Extends `data` with zeros to `len` elements.
fn pad(data: &mut HostData, len: usize) {
    crate::host::with_host!(data, v: T => v.resize(len, T::from_f64(0.0)));
}

/// Appends `more` to `buf`; both have the same dtype (packed transfers are per dtype).
fn append(buf: &mut HostData, more: &HostData) {
    crate::host::with_host!(buf, v: T => match T::slice(more) {
        Some(m) => v.extend_from_slice(m),
        None => v.extend(more.to_vec::<T>()),
    });
}

/// An error for a broken invariant of this module, rather than a panic.
fn internal(what: &str) -> Error {
    Error::Mpi {
        op: "dist",
        message: format!("internal error: {what}; please report it"),
    }
}
