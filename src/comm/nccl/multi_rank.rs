//! Test support, not part of the API: [`MultiRank`], several NCCL ranks on one GPU, so that
//! tests on a one-GPU machine (`tests/gpu_store.rs`) can run collectives, and a stalled one,
//! over real non-blocking communicators. It lives here, re-exported `#[doc(hidden)]` as
//! `kvstore::__internal::nccl::MultiRank`, because it is built from the crate-private
//! [`CommSet`]; the store never uses it.

use std::cell::Cell;
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, CudaStream};

use super::comm_set::{Calls, CommSet, Rank};
use super::result::{self, lib, nccl_error, During, NcclResult, On};
use super::watchdog::all_complete;
use super::POLL_INTERVAL;
use crate::backend::cuda::{self, cuda_err};
use crate::{DType, Error, Result};

/// Several NCCL ranks on ONE GPU, for tests on one-GPU machines: NCCL >= 2.30 allows it with
/// `NCCL_MULTI_RANK_GPU_ENABLE=1`. Each rank has its own stream (two ranks of one collective
/// on one stream would wait for each other forever).
pub struct MultiRank {
    ordinal: usize,
    set: CommSet,
    /// `CommSet` is `Sync`, but a `MultiRank` is used from one thread at a time.
    _not_sync: std::marker::PhantomData<Cell<()>>,
}

impl MultiRank {
    /// `nranks` ranks on GPU `ordinal`, built with `ncclCommInitRankConfig` inside one group.
    /// An error says why it is not possible here (no GPU, no NCCL, NCCL too old, env unset).
    pub fn new(ordinal: usize, nranks: usize) -> Result<MultiRank> {
        let op = "create multi-rank communicator";
        let gpu = cuda::gpu(ordinal)?;
        let unsupported = |message: String| nccl_error(op, &[], message);
        let lib = lib(op, &[])?;
        if lib.version < 23000 {
            return Err(unsupported(format!(
                "NCCL {} is older than 2.30, which is needed for several ranks on one GPU",
                lib.version_string()
            )));
        }
        if std::env::var("NCCL_MULTI_RANK_GPU_ENABLE").as_deref() != Ok("1") {
            return Err(unsupported(
                "NCCL_MULTI_RANK_GPU_ENABLE=1 is not set in the environment".to_owned(),
            ));
        }
        let stream = || gpu.context().new_stream().map_err(cuda_err(op, None));
        let streams = (0..nranks).map(|_| stream()).collect::<Result<Vec<_>>>()?;
        let set = CommSet::init(&vec![ordinal; nranks], streams, op, &[])?;
        Ok(MultiRank {
            ordinal,
            set,
            _not_sync: std::marker::PhantomData,
        })
    }

    fn ranks(&self) -> &[Rank] {
        &self.set.ranks
    }

    /// Sums `sends[r]` (one host vector per rank) on the GPU with NCCL; returns the root's result.
    pub fn reduce_f32(&self, sends: &[Vec<f32>], root: usize) -> Result<Vec<f32>> {
        let op = "multi-rank reduce";
        drop(self.live(op)?);
        let n = sends.first().map_or(0, Vec::len);
        if sends.len() != self.ranks().len() || sends.iter().any(|s| s.len() != n) {
            return Err(self.bad_args(op, "one vector per rank, all of one length"));
        }
        self.check_root(op, root)?;
        let bufs = (sends.iter().zip(self.ranks()))
            .map(|(s, r)| cuda::clone_htod(&r.stream, s).map_err(cuda_err("upload", None)))
            .collect::<Result<Vec<_>>>()?;
        let recv: CudaSlice<f32> =
            cuda::alloc_zeros(&self.ranks()[root].stream, n).map_err(cuda_err(op, None))?;
        let recv_ptr = device_addr(&recv, &self.ranks()[root].stream);
        let send_ptrs = self.device_addrs(&bufs);
        self.group(op, |on, rank| {
            let recv = if rank == root { recv_ptr } else { 0 };
            // SAFETY: every address names a live buffer of `n` f32 on this GPU; the buffers
            // outlive the call and are only read back after `sync` below (and freed on their
            // rank's stream, so after the collective); `on.comm` is a live communicator of this
            // set, used under its call lock (`group` holds it); `on.stream` is its rank's.
            unsafe { result::reduce(on, send_ptrs[rank], recv, n, DType::F32, root) }
        })?;
        self.sync(op)?;
        cuda::clone_dtoh(&self.ranks()[root].stream, &recv).map_err(cuda_err(op, None))
    }

    /// Broadcasts `data` from rank `root`; returns what every rank received.
    pub fn broadcast_f32(&self, data: &[f32], root: usize) -> Result<Vec<Vec<f32>>> {
        let op = "multi-rank broadcast";
        drop(self.live(op)?);
        let n = data.len();
        self.check_root(op, root)?;
        let send: CudaSlice<f32> =
            cuda::clone_htod(&self.ranks()[root].stream, data).map_err(cuda_err(op, None))?;
        // Poison the outputs so a broadcast that does nothing is seen.
        let poisoned = |r: &Rank| cuda::clone_htod(&r.stream, &vec![f32::NAN; n]);
        let recvs: std::result::Result<Vec<_>, _> = self.ranks().iter().map(poisoned).collect();
        let recvs = recvs.map_err(cuda_err(op, None))?;
        let send_ptr = device_addr(&send, &self.ranks()[root].stream);
        let recv_ptrs = self.device_addrs(&recvs);
        // The uploads above ran on each rank's stream; NCCL calls go on the same streams.
        self.group(op, |on, rank| {
            let send = if rank == root { send_ptr } else { 0 };
            // SAFETY: as in `reduce_f32`.
            unsafe { result::broadcast(on, send, recv_ptrs[rank], n, DType::F32, root) }
        })?;
        self.sync(op)?;
        recvs
            .iter()
            .zip(self.ranks())
            .map(|(b, r)| cuda::clone_dtoh(&r.stream, b).map_err(cuda_err(op, None)))
            .collect()
    }

    /// The GPU the ranks share.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The number of ranks.
    pub fn nranks(&self) -> usize {
        self.ranks().len()
    }

    /// Sets how long a call waits before it aborts the ranks (`KVSTORE_NCCL_TIMEOUT_MS`).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.set.timeout = timeout;
    }

    fn bad_args(&self, op: &'static str, what: &str) -> Error {
        nccl_error(
            op,
            &[],
            format!("expected {what} ({} ranks)", self.ranks().len()),
        )
    }

    /// `root` must name a rank (indexing with it would panic otherwise).
    fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        if root >= self.ranks().len() {
            return Err(self.bad_args(op, &format!("a root below the rank count, got {root}")));
        }
        Ok(())
    }

    /// The device address of each rank's buffer.
    fn device_addrs(&self, bufs: &[CudaSlice<f32>]) -> Vec<u64> {
        let ranks = bufs.iter().zip(self.ranks());
        ranks.map(|(b, r)| device_addr(b, &r.stream)).collect()
    }

    /// One group over every rank, polled until the calls are issued (aborted on a stall).
    fn group(&self, op: &'static str, call: impl Fn(On, usize) -> NcclResult) -> Result<()> {
        // No `cross_gpu_order` here: these ranks use streams of their own, which no other
        // work waits on.
        let lib = lib(op, &[])?;
        let mut calls = self.live(op)?;
        // The matching group end is always called below.
        result::group_start(lib).during(op, &[])?;
        let mut first = Ok(());
        for (rank, r) in self.ranks().iter().enumerate() {
            first = first.and(call(On::new(lib, r.comm, &r.stream), rank).during(op, &[]));
        }
        first = first.and(result::group_end(lib).during(op, &[]));
        let deadline = Instant::now() + self.set.timeout;
        first = first.and_then(|()| self.set.settle(lib, op, &[], deadline));
        if first.is_err() {
            self.set.abort_locked(&mut calls);
        }
        first
    }

    /// Waits for every rank's stream, polling async errors, with the timeout. On an error or a
    /// timeout the communicators are aborted, the streams get one more timeout to drain, and
    /// every later call fails.
    fn sync(&self, op: &'static str) -> Result<()> {
        let past = |d: Option<Instant>| d.is_some_and(|d| Instant::now() > d);
        let deadline = Instant::now().checked_add(self.set.timeout);
        let events = self
            .ranks()
            .iter()
            .map(|r| r.stream.record_event(None).map_err(cuda_err(op, None)))
            .collect::<Result<Vec<_>>>()?;
        let failure = loop {
            match all_complete(&events, op) {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => break e,
            }
            if let Err(e) = self.set.async_error(op, &[]) {
                break e;
            }
            if past(deadline) {
                break nccl_error(op, &[], format!("no progress after {:?}", self.set.timeout));
            }
            std::thread::sleep(POLL_INTERVAL);
        };
        self.set.abort();
        let drain = Instant::now().checked_add(self.set.timeout);
        let drained = loop {
            match all_complete(&events, op) {
                Ok(false) if !past(drain) => std::thread::sleep(POLL_INTERVAL),
                Ok(done) => break done,
                Err(_) => break false,
            }
        };
        let Error::Nccl { message, .. } = failure else {
            return Err(failure);
        };
        let after = if drained {
            "the communicators were aborted and their streams drained"
        } else {
            "the communicators were aborted but their streams are still busy"
        };
        Err(nccl_error(op, &[], format!("{message}; {after}")))
    }

    /// Locks the communicators for a call; fails once they have been aborted.
    fn live(&self, op: &'static str) -> Result<MutexGuard<'_, Calls>> {
        let calls = self.set.lock();
        if calls.aborted {
            let message = "these communicators were aborted after an earlier failure; create a \
                           new MultiRank";
            return Err(nccl_error(op, &[], message.to_owned()));
        }
        Ok(calls)
    }

    /// Issues a reduce on rank 0 alone, which can never complete, then waits as every call
    /// does: for tests that a stall is aborted after the timeout. A full reduce runs first, so
    /// the ranks' connections exist and the call itself does not wait for the missing rank (it
    /// would in `NCCL_LAUNCH_MODE=GROUP`, which is refused).
    #[doc(hidden)]
    pub fn stalled_reduce_f32(&self, n: usize) -> Result<()> {
        let op = "stalled reduce";
        drop(self.live(op)?);
        if n == 0 || self.ranks().len() < 2 {
            return Err(self.bad_args(op, "n > 0 and at least 2 ranks"));
        }
        if std::env::var("NCCL_LAUNCH_MODE").is_ok_and(|m| m.eq_ignore_ascii_case("group")) {
            return Err(self.bad_args(op, "NCCL_LAUNCH_MODE other than GROUP"));
        }
        let sends: Vec<Vec<f32>> = (0..self.ranks().len()).map(|_| vec![1.0; n]).collect();
        self.reduce_f32(&sends, 0)?;
        let stream = &self.ranks()[0].stream;
        let buf: CudaSlice<f32> =
            cuda::clone_htod(stream, &sends[0]).map_err(cuda_err(op, None))?;
        let ptr = device_addr(&buf, stream);
        let lib = lib(op, &[])?;
        {
            let _calls = self.live(op)?;
            // Rank 0 alone, outside a group (one rank's part; the others never come).
            let on = On::new(lib, self.ranks()[0].comm, stream);
            // SAFETY: `ptr` names a live buffer of `n` f32 on this GPU, used in place (NCCL
            // allows send == recv); it is freed on this stream, so after the aborted kernel.
            // Rank 0's communicator is live (checked just above) and used under `calls`.
            unsafe { result::reduce(on, ptr, ptr, n, DType::F32, 0) }.during(op, &[])?;
        }
        self.sync(op)
    }
}

/// The device address of `s`, for the raw NCCL calls. Event tracking is off, so the guard
/// cudarc returns records nothing and may be dropped at once.
fn device_addr(s: &CudaSlice<f32>, stream: &Arc<CudaStream>) -> u64 {
    use cudarc::driver::DevicePtr;
    s.device_ptr(stream).0
}
