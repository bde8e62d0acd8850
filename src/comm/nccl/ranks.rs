//! NCCL across processes: one rank per process, on the GPU its local rank picks. The engine of
//! `dist_device_sync` stores.
//!
//! # Bootstrap
//!
//! Every rank needs the same `ncclUniqueId`:
//! - **`mpirun`**: rank 0's [`RankComm::unique_id`] travels to every rank over MPI (as
//!   nccl-tests does it), and every rank calls [`RankComm::join`].
//! - **No MPI** (`torchrun --no-python`, srun wrappers): [`RankComm::from_env`] reads the
//!   launch ([`LaunchEnv`]); rank 0 makes a plain id and hands it to the ranks that present
//!   the job's token through [`rendezvous`](super::rendezvous) at
//!   `MASTER_ADDR:(MASTER_PORT + 1)`; nothing is set in the environment. If the user has set
//!   `NCCL_COMM_ID`, NCCL's own bootstrap is used instead: every rank computes the same id
//!   from that address (NCCL's `bootstrapGetUniqueId` in `src/bootstrap.cc`).
//!
//! # No hang
//!
//! The communicator is non-blocking. Every call polls `ncclCommGetAsyncError` and its stream
//! for at most `KVSTORE_TIMEOUT` (default [`DEFAULT_TIMEOUT`](crate::config::DEFAULT_TIMEOUT),
//! 30 minutes). When a rank stops calling or dies, the others abort the communicator when the
//! bound passes (see `order_after_abort` for why no array is freed under the aborted kernels)
//! and return [`Error::Timeout`] naming the op and keys; later calls return
//! [`Error::DistFailed`].
//!
//! Every rank must make the same calls, in the same order, with the same sizes (NCCL's
//! contract); the store checks a fingerprint of each call before its collectives.

use std::sync::MutexGuard;
use std::time::{Duration, Instant};

use super::comm_set::{Calls, CommSet, Rank};
use super::loader::{Comm, Config, Nccl, UniqueId};
use super::rendezvous::{self, JobToken, Root};
use super::result::{self, lib, nccl_error, During, NcclResult, On};
use super::POLL_INTERVAL;
use crate::backend::cuda::{self, cuda_err, stream_wait, GpuBuf};
use crate::comm::launch::LaunchEnv;
use crate::ndarray::Storage;
use crate::{DType, Device, Error, Key, NDArray, Result};

/// The most collectives [`RankComm::group`] issues in one NCCL group.
pub const GROUP_MAX: usize = 256;

/// One collective of [`RankComm::group`], in place on an array on the rank's GPU.
pub enum InPlace<'a> {
    /// Sums every rank's `buf` into rank `root`'s.
    Reduce {
        /// The buffer.
        buf: &'a NDArray,
        /// The rank that receives the sum.
        root: usize,
    },
    /// Copies rank `root`'s `buf` into every rank's.
    Broadcast {
        /// The buffer.
        buf: &'a NDArray,
        /// The rank whose buffer is copied.
        root: usize,
    },
}

impl InPlace<'_> {
    fn buf(&self) -> &NDArray {
        let (InPlace::Reduce { buf, .. } | InPlace::Broadcast { buf, .. }) = self;
        buf
    }

    fn root(&self) -> usize {
        let (InPlace::Reduce { root, .. } | InPlace::Broadcast { root, .. }) = self;
        *root
    }
}

/// Asked at every poll while the host waits for a collective: an error fails the call and aborts
/// the communicator. A launcher that learns of a lost rank by other means than NCCL (MPI's
/// fault tolerance) ends the wait with it: NCCL between the GPUs of one machine never reports a
/// peer that died, and would wait for it until the timeout.
pub(crate) type Watch<'a> = &'a mut dyn FnMut() -> Result<()>;

/// A communicator of one rank among the processes of a job.
pub struct RankComm {
    rank: usize,
    size: usize,
    ordinal: usize,
    /// The communicator and its stream, a set of one rank: its call lock serializes the calls
    /// and counts them, and holds the first failure once there is one.
    set: CommSet,
}

impl RankComm {
    /// A fresh id for a job, made by rank 0 and sent to the others (over MPI, for instance).
    pub fn unique_id() -> Result<UniqueId> {
        let op = "create NCCL id";
        let lib = lib(op, &[])?;
        result::get_unique_id(lib).during(op, &[])
    }

    /// Joins the job of `id` as rank `rank` of `size`, on GPU `ordinal`, once every rank has
    /// joined; fails after `KVSTORE_TIMEOUT`.
    pub fn join(id: UniqueId, rank: usize, size: usize, ordinal: usize) -> Result<RankComm> {
        let op = "join NCCL ranks";
        if rank >= size {
            return Err(Error::dist_env(
                "RANK",
                format!("rank {rank} of a job of {size} ranks: ranks run below the size"),
            ));
        }
        let timeout = crate::config::Config::from_env()?.timeout;
        let lib = lib(op, &[])?;
        result::require_comm_init_rank_config(lib).during(op, &[])?;
        let gpu = cuda::gpu(ordinal)?;
        gpu.context().bind_to_thread().map_err(cuda_err(op, None))?;
        let stream = gpu.context().new_stream().map_err(cuda_err(op, None))?;
        let mut comm: Comm = std::ptr::null_mut();
        let mut config = Config::new(false);
        // SAFETY: the current device is this rank's (bound just above), as
        // ncclCommInitRankConfig requires; no group is open, so `comm` and `config` need only
        // outlive the call.
        unsafe { result::comm_init_rank_config(lib, &mut comm, size, id, rank, &mut config) }
            .during(op, &[])?;
        let set = CommSet::new(vec![Rank { comm, stream }], timeout);
        let this = RankComm {
            rank,
            size,
            ordinal,
            set,
        };
        // Joining is a collective too: a rank that never comes is a timeout, not a hang.
        let mut st = this.set.lock();
        let ready = this.settle(lib, op, &[]);
        ready.map_err(|e| this.fail(&mut st, op, &[], e))?;
        drop(st);
        Ok(this)
    }

    /// Joins the job a launcher without MPI describes in the environment (see the
    /// [module documentation](self)), on GPU `LOCAL_RANK`; a missing or inconsistent variable
    /// is [`Error::DistEnv`] naming it.
    pub fn from_env() -> Result<RankComm> {
        let launch = LaunchEnv::from_process()?;
        let gpus = crate::backend::probe::gpu_count();
        // NCCL >= 2.30 lets several ranks share a GPU when asked to (tests on a one-GPU
        // machine); then local ranks wrap around the GPUs.
        let shared = std::env::var("NCCL_MULTI_RANK_GPU_ENABLE").is_ok_and(|v| v.trim() == "1");
        if launch.local_rank >= gpus && !(shared && gpus > 0) {
            return Err(Error::dist_env(
                "LOCAL_RANK",
                format!(
                    "is {}, but this machine has {}: start at most one rank per GPU on each \
                     machine (torchrun --nproc-per-node), or limit CUDA_VISIBLE_DEVICES",
                    launch.local_rank,
                    crate::backend::probe::describe_gpus()
                ),
            ));
        }
        let ordinal = launch.local_rank % gpus;
        let op = "join NCCL ranks";
        // A missing or too old NCCL fails here, before any rank waits for another.
        result::require_comm_init_rank_config(lib(op, &[])?).during(op, &[])?;
        if std::env::var_os("NCCL_COMM_ID").is_some() {
            // The user's own choice: NCCL's bootstrap at that address, as NCCL documents it.
            let id = RankComm::unique_id()?;
            return RankComm::join(id, launch.rank, launch.world_size, ordinal);
        }
        let deadline = Instant::now() + crate::config::Config::from_env()?.timeout;
        let make_id = || RankComm::unique_id().map(|id| id.0.map(|c| c as u8));
        let bytes = if launch.world_size == 1 {
            make_id()?
        } else {
            let token = JobToken::from_process()?;
            let (host, port) = launch.rendezvous_addr();
            if launch.rank == 0 {
                Root::bind(host, port)?.serve(&token, launch.world_size, deadline, make_id)?
            } else {
                rendezvous::fetch(host, port, &token, launch.rank, launch.world_size, deadline)?
            }
        };
        let id = UniqueId(bytes.map(|b| b as std::ffi::c_char));
        RankComm::join(id, launch.rank, launch.world_size, ordinal)
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// This rank's GPU.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// How long a call waits for the other ranks before it aborts the communicator.
    pub fn timeout(&self) -> Duration {
        self.set.timeout
    }

    /// Sets [`Self::timeout`] (by default `KVSTORE_TIMEOUT`).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.set.timeout = timeout;
    }

    /// Sums every rank's `send` into `recv` on rank `root`. `recv` is only written on the root;
    /// it may be `send` itself (in place).
    pub fn reduce_sum(&self, send: &NDArray, recv: &NDArray, root: usize) -> Result<()> {
        let op = "NCCL reduce across ranks";
        self.check_root(op, root)?;
        if send.storage_id() == recv.storage_id() {
            let b = recv.write();
            let b = self.buf(op, &b)?;
            let (n, dt, p) = (b.len(), b.dtype(), b.ptr());
            // SAFETY: as below, with one buffer in place (NCCL allows send == recv).
            return self.call(op, &[], &mut || Ok(()), |on| unsafe {
                result::reduce(on, p, p, n, dt, root)
            });
        }
        let (s, r) = (send.read(), recv.write());
        let (s, r) = (self.buf(op, &s)?, self.buf(op, &r)?);
        self.check_len(op, "recv", r.len(), s.len())?;
        self.check_dtype(op, s, r)?;
        let (n, dt, sp, rp) = (s.len(), s.dtype(), s.ptr(), r.ptr());
        // SAFETY: both addresses name live buffers of `n` elements of the dtype on this rank's
        // GPU, locked for the call, which returns only once the collective is done or the
        // runtime stream (where buffers are freed or reused) waits for this rank's stream after
        // an abort (`order_after_abort`); `call` hands over the live communicator, under the
        // set's call lock, and this rank's own stream.
        self.call(op, &[], &mut || Ok(()), |on| unsafe {
            result::reduce(on, sp, rp, n, dt, root)
        })
    }

    /// Copies rank `root`'s `buf` into every rank's `buf`.
    pub fn broadcast(&self, buf: &NDArray, root: usize) -> Result<()> {
        let op = "NCCL broadcast across ranks";
        self.check_root(op, root)?;
        let b = buf.write();
        let b = self.buf(op, &b)?;
        let (n, dt, p) = (b.len(), b.dtype(), b.ptr());
        // SAFETY: as in `reduce_sum`; NCCL allows the buffer in place.
        self.call(op, &[], &mut || Ok(()), |on| unsafe {
            result::broadcast(on, p, p, n, dt, root)
        })
    }

    /// Sums every rank's `send` and leaves slice `rank` of the sum in `recv`: `send` holds
    /// `size` contiguous slices of `recv`'s length.
    pub fn reduce_scatter(&self, send: &NDArray, recv: &NDArray) -> Result<()> {
        self.reduce_scatter_watched(send, recv, &mut || Ok(()))
    }

    /// [`RankComm::reduce_scatter`], asking `watch` while the host waits (see [`Watch`]).
    pub(crate) fn reduce_scatter_watched(
        &self,
        send: &NDArray,
        recv: &NDArray,
        watch: Watch<'_>,
    ) -> Result<()> {
        // SAFETY: as in `reduce_sum`, with `send` of `n * size` elements.
        let issue = |on: On, sp, rp, n, dt| unsafe { result::reduce_scatter(on, sp, rp, n, dt) };
        let op = "NCCL reduce-scatter across ranks";
        self.sliced(op, (send, recv), "send", watch, issue)
    }

    /// Gathers every rank's `send` into `recv`, in rank order: `recv` holds `size` slices of
    /// `send`'s length.
    pub fn all_gather(&self, send: &NDArray, recv: &NDArray) -> Result<()> {
        self.all_gather_watched(send, recv, &mut || Ok(()))
    }

    /// [`RankComm::all_gather`], asking `watch` while the host waits (see [`Watch`]).
    pub(crate) fn all_gather_watched(
        &self,
        send: &NDArray,
        recv: &NDArray,
        watch: Watch<'_>,
    ) -> Result<()> {
        // SAFETY: as in `reduce_sum`, with `recv` of `n * size` elements.
        let issue = |on: On, sp, rp, n, dt| unsafe { result::all_gather(on, sp, rp, n, dt) };
        let op = "NCCL all-gather across ranks";
        self.sliced(op, (send, recv), "recv", watch, issue)
    }

    /// Checks `send` and `recv` (distinct arrays of one dtype on this rank's GPU, `whole` of
    /// them, "send" or "recv", holding `size` slices of the other's length) and issues
    /// `issue(on, send, recv, slice length, dtype)` on their addresses.
    fn sliced(
        &self,
        op: &'static str,
        (send, recv): (&NDArray, &NDArray),
        whole: &str,
        watch: Watch<'_>,
        issue: impl FnOnce(On, u64, u64, usize, DType) -> NcclResult,
    ) -> Result<()> {
        self.check_distinct(op, send, recv)?;
        let (s, r) = (send.read(), recv.write());
        let (s, r) = (self.buf(op, &s)?, self.buf(op, &r)?);
        let (part, all) = if whole == "send" { (r, s) } else { (s, r) };
        self.check_len(op, whole, all.len(), part.len() * self.size)?;
        self.check_dtype(op, s, r)?;
        let (n, dt, sp, rp) = (part.len(), s.dtype(), s.ptr(), r.ptr());
        self.call(op, &[], watch, |on| issue(on, sp, rp, n, dt))
    }

    /// An all-to-all of blocks of their own lengths: this rank sends `send_counts[p]` elements
    /// to rank `p` and receives `recv_counts[p]` from it (the blocks lie one after another, in
    /// rank order). One NCCL group of a send and a receive per rank, this one included; a block
    /// may be empty (NCCL >= 2.12.10 takes zero-byte transfers, and every rank issues all of
    /// its, so the groups match). Each rank's `send_counts[p]` must be rank `p`'s `recv_counts`
    /// of it.
    pub fn all_to_all_v(
        &self,
        send: &NDArray,
        send_counts: &[usize],
        recv: &NDArray,
        recv_counts: &[usize],
    ) -> Result<()> {
        let op = "NCCL all-to-all across ranks";
        self.check_distinct(op, send, recv)?;
        self.check_len(op, "send_counts", send_counts.len(), self.size)?;
        self.check_len(op, "recv_counts", recv_counts.len(), self.size)?;
        let (s, r) = (send.read(), recv.write());
        let (s, r) = (self.buf(op, &s)?, self.buf(op, &r)?);
        self.check_dtype(op, s, r)?;
        let (sent, received) = (send_counts.iter().sum(), recv_counts.iter().sum());
        if s.len() < sent || r.len() < received {
            return Err(self.misuse(
                op,
                format!(
                    "blocks of {sent} and {received} elements for buffers of {} and {}",
                    s.len(),
                    r.len()
                ),
            ));
        }
        let (dt, es) = (s.dtype(), s.dtype().size() as u64);
        let starts = |counts: &[usize]| -> Vec<u64> {
            let mut at = 0u64;
            (counts.iter())
                .map(|&c| {
                    let start = at;
                    at += c as u64 * es;
                    start
                })
                .collect()
        };
        let (sp, rp) = (s.ptr(), r.ptr());
        let (send_at, recv_at) = (starts(send_counts), starts(recv_counts));
        self.call(op, &[], &mut || Ok(()), |on| {
            result::group_start(on.lib)?;
            let mut first = Ok(());
            for p in 0..self.size {
                // SAFETY: as in `reduce_sum`; each block lies inside its buffer (the counts'
                // sums were checked against the lengths).
                let sent = unsafe { result::send(on, sp + send_at[p], send_counts[p], dt, p) };
                // SAFETY: as for the send; the receive buffer is another array (checked).
                let received = unsafe { result::recv(on, rp + recv_at[p], recv_counts[p], dt, p) };
                first = first.and(sent).and(received);
            }
            // The group is always ended, even after a failed call inside it.
            first.and(result::group_end(on.lib))
        })
    }

    /// Issues `ops` in order, in NCCL groups of at most [`GROUP_MAX`] collectives, with one wait
    /// per group. Every array must be distinct and on this rank's GPU.
    pub fn group(&self, ops: &[InPlace<'_>]) -> Result<()> {
        self.group_watched(ops, &mut || Ok(()))
    }

    /// [`RankComm::group`], asking `watch` while the host waits (see [`Watch`]).
    pub(crate) fn group_watched(&self, ops: &[InPlace<'_>], watch: Watch<'_>) -> Result<()> {
        let op = "NCCL collectives across ranks";
        for chunk in ops.chunks(GROUP_MAX) {
            let mut seen = std::collections::HashSet::new();
            for o in chunk {
                self.check_root(op, o.root())?;
                if !seen.insert(o.buf().storage_id()) {
                    return Err(self.misuse(op, "an array named twice in one group".to_owned()));
                }
            }
            let guards: Vec<_> = chunk.iter().map(|o| o.buf().write()).collect();
            let items = guards
                .iter()
                .zip(chunk)
                .map(|(g, o)| {
                    let b = self.buf(op, g)?;
                    let reduce = matches!(o, InPlace::Reduce { .. });
                    Ok((b.ptr(), b.len(), b.dtype(), o.root(), reduce))
                })
                .collect::<Result<Vec<_>>>()?;
            self.call(op, &[], &mut *watch, |on| {
                result::group_start(on.lib)?;
                let mut first = Ok(());
                for &(p, n, dt, root, reduce) in &items {
                    // SAFETY: as in `reduce_sum`, with `p` write-locked and in place (NCCL
                    // allows it).
                    let issued = unsafe {
                        match reduce {
                            true => result::reduce(on, p, p, n, dt, root),
                            false => result::broadcast(on, p, p, n, dt, root),
                        }
                    };
                    first = first.and(issued);
                }
                // The group is always ended, even after a failed call inside it.
                first.and(result::group_end(on.lib))
            })?;
        }
        Ok(())
    }

    /// Waits until every collective issued so far has finished (each call already waits for
    /// its own, so this only reports a failure).
    pub fn synchronize(&self) -> Result<()> {
        let op = "wait for NCCL ranks";
        let mut st = self.live(op)?;
        self.wait_done(&mut st, (op, &[]), &mut || Ok(()))
    }

    /// Polls this rank's stream until its work is done, NCCL for errors and `watch`, for at most
    /// the timeout. A stall or an error aborts the communicator.
    fn wait_done(
        &self,
        st: &mut Calls,
        (op, keys): (&'static str, &[Key]),
        watch: Watch<'_>,
    ) -> Result<()> {
        let lib = lib(op, keys)?;
        let waited = (|| {
            let done = self.one().stream.record_event(None);
            let done = done.map_err(cuda_err(op, None))?;
            let deadline = Instant::now() + self.set.timeout;
            while !done.try_is_complete().map_err(cuda_err(op, None))? {
                self.set.async_error_locked(lib, op, keys)?;
                watch()?;
                if Instant::now() > deadline {
                    return Err(self.stall(op, keys));
                }
                std::thread::sleep(POLL_INTERVAL);
            }
            Ok(())
        })();
        waited.map_err(|e| self.fail(st, op, keys, e))
    }

    /// Issues one collective on the communicator's own stream, after the runtime stream's work,
    /// and polls until NCCL has taken it, then until it is done, so later work needs no stream
    /// dependency on it. The host waits, not the runtime stream: that would hold back every
    /// other rank that shares the GPU (tests).
    fn call(
        &self,
        op: &'static str,
        keys: &[Key],
        watch: Watch<'_>,
        issue: impl FnOnce(On) -> NcclResult,
    ) -> Result<()> {
        let lib = lib(op, keys)?;
        let mut st = self.live(op)?;
        st.seq += 1;
        let (gpu, one) = (cuda::gpu(self.ordinal)?, self.one());
        stream_wait(&one.stream, gpu.stream())?;
        gpu.context().bind_to_thread().map_err(cuda_err(op, None))?;
        let issued = issue(On::new(lib, one.comm, &one.stream))
            .during(op, keys)
            .and_then(|()| self.settle(lib, op, keys));
        issued.map_err(|e| self.fail(&mut st, op, keys, e))?;
        self.wait_done(&mut st, (op, keys), watch)
    }

    /// Aborts the communicator: a rank was lost, so its collectives could never complete (and
    /// a finalize could wait for it forever). Nothing may use it after.
    pub fn abort(&self) {
        self.set.abort();
    }

    /// Locks the communicator for a call; [`Error::DistFailed`] once a call has failed.
    fn live(&self, op: &'static str) -> Result<MutexGuard<'_, Calls>> {
        let st = self.set.lock();
        match &st.failed {
            Some(first) => Err(Error::DistFailed {
                op,
                first: first.clone(),
            }),
            None => Ok(st),
        }
    }

    /// The communicator and its stream.
    fn one(&self) -> &Rank {
        &self.set.ranks[0]
    }

    /// Polls until the communicator is no longer in progress, for at most the timeout.
    fn settle(&self, lib: &Nccl, op: &'static str, keys: &[Key]) -> Result<()> {
        let deadline = Instant::now() + self.set.timeout;
        self.set
            .settle_or(lib, op, keys, deadline, || self.stall(op, keys))
    }

    /// The error of a collective that made no progress within the timeout ([`Self::fail`]
    /// fills in the call's sequence number).
    fn stall(&self, op: &'static str, keys: &[Key]) -> Error {
        Error::Timeout {
            op,
            seq: 0,
            keys: keys.to_vec(),
            missing: vec![],
            detail: format!(
                "no progress for {:?} (KVSTORE_TIMEOUT) among {} NCCL ranks: a rank stopped \
                 calling kvstore, called something else, or died; this rank ({}) aborted the \
                 communicator. Every rank must make the same calls in the same order",
                self.set.timeout, self.size, self.rank
            ),
        }
    }

    /// Aborts the communicator after `error`, remembers it, and returns it (with the call's
    /// sequence number where the error has one).
    fn fail(&self, st: &mut Calls, op: &'static str, keys: &[Key], mut error: Error) -> Error {
        if let Error::Timeout {
            op: o,
            seq: s @ 0,
            keys: k,
            ..
        } = &mut error
        {
            (*o, *s) = (op, st.seq);
            if k.is_empty() {
                *k = keys.to_vec();
            }
        }
        if st.failed.is_none() {
            st.failed = Some(error.to_string());
            // Abort ends the kernels without waiting for the other ranks.
            self.set.abort_locked(st);
            self.order_after_abort(op);
        }
        error
    }

    /// Makes the GPU's runtime stream, where every array is freed (`cuMemFreeAsync`) or reused,
    /// wait for this rank's stream, so no free comes before the aborted kernels are done with
    /// the call's arrays. `ncclCommAbort` waits for NCCL's kernels only when it ends the
    /// process's last rank of the communicator (`commReclaim` -> `commDestroySync`: NCCL's
    /// `src/init.cc` and `src/enqueue.cc`); for another rank of the process (tests) it only sets
    /// the abort flag, and the kernels end later, on their own. No host wait.
    fn order_after_abort(&self, op: &'static str) {
        let joined =
            cuda::gpu(self.ordinal).and_then(|gpu| stream_wait(gpu.stream(), &self.one().stream));
        if let Err(e) = joined {
            // A GPU that cannot record or wait for an event has failed as a whole (a sticky
            // error): its memory goes with its context, and every later call fails.
            log::error!(
                "kvstore: {op}: ordering the GPU's stream after the NCCL abort failed: {e}"
            );
        }
    }

    /// The GPU buffer of `storage`, which must be on this rank's GPU.
    fn buf<'s>(&self, op: &'static str, storage: &'s Storage) -> Result<&'s GpuBuf> {
        match storage {
            Storage::Gpu(b) if b.ordinal() == self.ordinal => Ok(b),
            Storage::Gpu(b) => {
                let (on, mine) = (Device::Gpu(b.ordinal()), Device::Gpu(self.ordinal));
                Err(self.misuse(op, format!("an array on {on} for a rank on {mine}")))
            }
            Storage::Host(_) => {
                let mine = Device::Gpu(self.ordinal);
                let what = format!("a host array for a rank on {mine}: move it to the GPU first");
                Err(self.misuse(op, what))
            }
        }
    }

    /// `send` and `recv` must be different arrays (one would be locked twice).
    fn check_distinct(&self, op: &'static str, send: &NDArray, recv: &NDArray) -> Result<()> {
        let same = send.storage_id() == recv.storage_id();
        self.refuse_if(op, same, || "the same array as send and recv".to_owned())
    }

    fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        let what = || format!("root {root} of {} ranks", self.size);
        self.refuse_if(op, root >= self.size, what)
    }

    fn check_len(&self, op: &'static str, what: &str, len: usize, want: usize) -> Result<()> {
        let what = || format!("{what} of {len} elements, expected {want}");
        self.refuse_if(op, len != want, what)
    }

    fn check_dtype(&self, op: &'static str, a: &GpuBuf, b: &GpuBuf) -> Result<()> {
        let (a, b) = (a.dtype(), b.dtype());
        self.refuse_if(op, a != b, || format!("{a} and {b} buffers"))
    }

    /// [`Self::misuse`] when `bad`.
    fn refuse_if(&self, op: &'static str, bad: bool, what: impl FnOnce() -> String) -> Result<()> {
        match bad {
            true => Err(self.misuse(op, what())),
            false => Ok(()),
        }
    }

    /// Arguments that do not fit a collective: refused before anything is sent.
    fn misuse(&self, op: &'static str, what: String) -> Error {
        nccl_error(op, &[], format!("{what}; nothing was sent"))
    }
}
