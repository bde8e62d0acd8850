//! The non-blocking communicators of one set of GPUs (one rank each), made in one group, and
//! the rules for using them: every call under the set's own mutex, polling with a bound, an
//! abort the watchdog can ask for, and finalize-then-destroy on drop. The core of both the
//! store's device sets and [`RankComm`](super::RankComm) (a set of one rank).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::CudaStream;

use super::loader::{self, Comm, Config, Nccl};
use super::result::{self, lib, nccl_error, During, Status};
use super::POLL_INTERVAL;
use crate::backend::cuda::{self, cuda_err};
use crate::config::nccl::timeout;
use crate::{Error, Key, Result};

/// One rank of a set.
pub(super) struct Rank {
    /// The rank's communicator.
    pub(super) comm: Comm,
    /// The stream its collectives go on.
    pub(super) stream: Arc<CudaStream>,
}

/// The non-blocking communicators of one device set, one per rank; dropping it finalizes and
/// destroys them.
pub(super) struct CommSet {
    /// The ranks, in rank order.
    pub(super) ranks: Vec<Rank>,
    /// Serializes every call on these communicators.
    calls: Mutex<Calls>,
    /// Set by the watchdog: whoever polls these communicators stops and aborts them.
    abort_requested: AtomicBool,
    /// How long its creation, a call on it, or its finalization may stay in progress
    /// (`KVSTORE_NCCL_TIMEOUT_MS` when a store's set was made).
    pub(super) timeout: Duration,
}

/// What the holder of a set's call lock sees.
#[derive(Default)]
pub(super) struct Calls {
    /// `true` once the communicators are aborted.
    pub(super) aborted: bool,
    /// Calls made so far (the first is 1), where the user counts them.
    pub(super) seq: u64,
    /// The first failure (the communicators were aborted), where the user keeps it.
    pub(super) failed: Option<String>,
}

// SAFETY: `CommSet` holds raw `ncclComm_t` handles, which Rust cannot see are thread-safe.
// NCCL allows a communicator to be used from any thread as long as calls on it are not
// concurrent, and every call on these handles is made while holding `calls`.
unsafe impl Send for CommSet {}
// SAFETY: as above: shared use goes through the `calls` mutex.
unsafe impl Sync for CommSet {}

impl CommSet {
    /// Rank `r` on GPU `ordinals[r]` and stream `streams[r]` (ordinals may repeat, each rank
    /// with a stream of its own), created in one group and polled until ready, with the timeout.
    pub(super) fn init(
        ordinals: &[usize],
        streams: Vec<Arc<CudaStream>>,
        op: &'static str,
        keys: &[Key],
    ) -> Result<CommSet> {
        let limit = timeout()?;
        let lib = lib(op, keys)?;
        result::require_comm_init_rank_config(lib).during(op, keys)?;
        let id = result::get_unique_id(lib).during(op, keys)?;
        let n = ordinals.len();
        let mut comms: Vec<Comm> = vec![std::ptr::null_mut(); n];
        // Each config stays alive until the group ends.
        let mut configs: Vec<Config> = (0..n).map(|_| Config::new(false)).collect();
        const BIND: &str = "create NCCL communicator";
        let bind = |g: &cuda::Gpu| g.context().bind_to_thread().map_err(cuda_err(BIND, None));
        // The matching group end is always called below.
        result::group_start(lib).during(op, keys)?;
        let mut first: Result<()> = Ok(());
        for (rank, (&o, (c, cfg))) in ordinals
            .iter()
            .zip(comms.iter_mut().zip(configs.iter_mut()))
            .enumerate()
        {
            if let Err(e) = cuda::gpu(o).and_then(&bind) {
                first = first.and(Err(e));
                continue;
            }
            // SAFETY: the current device is the rank's (bound just above); `c` and `cfg` are
            // elements of `comms` and `configs`, which are neither moved nor dropped until
            // after the group ends; `id` came from ncclGetUniqueId.
            let r = unsafe { result::comm_init_rank_config(lib, c, n, id, rank, cfg) };
            first = first.and(r.during(op, keys));
        }
        first = first.and(result::group_end(lib).during(op, keys));
        let ranks = (comms.into_iter().zip(streams))
            .filter(|(c, _)| !c.is_null())
            .map(|(comm, stream)| Rank { comm, stream });
        let set = CommSet::new(ranks.collect(), limit);
        let mut calls = set.lock();
        let ready = first.and_then(|()| {
            let made = set.ranks.len();
            if made != n {
                let why = format!("only {made} of {n} communicators were created");
                return Err(nccl_error(op, keys, why));
            }
            set.settle(lib, op, keys, Instant::now() + set.timeout)
        });
        if ready.is_err() {
            set.abort_locked(&mut calls);
        }
        drop(calls);
        ready.map(|()| set)
    }

    /// A set of the live communicators `ranks`, none of them aborted.
    pub(super) fn new(ranks: Vec<Rank>, timeout: Duration) -> CommSet {
        CommSet {
            ranks,
            calls: Mutex::default(),
            abort_requested: AtomicBool::new(false),
            timeout,
        }
    }

    /// Locks the set for a call.
    pub(super) fn lock(&self) -> MutexGuard<'_, Calls> {
        self.calls.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// [`Self::settle_or`], with the set's own error for a stall.
    pub(super) fn settle(
        &self,
        lib: &Nccl,
        op: &'static str,
        keys: &[Key],
        deadline: Instant,
    ) -> Result<()> {
        let stall = || {
            let detail = "(KVSTORE_NCCL_TIMEOUT_MS); the communicators were aborted";
            nccl_error(
                op,
                keys,
                format!("still in progress after {:?} {detail}", self.timeout),
            )
        };
        self.settle_or(lib, op, keys, deadline, stall)
    }

    /// Polls every rank until none is in progress. An error, an abort the watchdog asked for,
    /// or `deadline` (then `stall`'s error) ends it with an error; the caller, which holds
    /// `calls`, aborts.
    pub(super) fn settle_or(
        &self,
        lib: &Nccl,
        op: &'static str,
        keys: &[Key],
        deadline: Instant,
        stall: impl FnOnce() -> Error,
    ) -> Result<()> {
        loop {
            let mut busy = false;
            for r in &self.ranks {
                // SAFETY: a live communicator of this set (aborted ones are never polled: the
                // caller holds `calls` and checked it), used under `calls`.
                match unsafe { result::comm_get_async_error(lib, r.comm) }.during(op, keys)? {
                    Status::Done => {}
                    Status::InProgress => busy = true,
                }
            }
            if !busy {
                return Ok(());
            }
            if self.abort_requested.load(Ordering::Acquire) {
                return Err(nccl_error(
                    op,
                    keys,
                    "aborted by the NCCL watchdog while in progress".to_owned(),
                ));
            }
            if Instant::now() > deadline {
                return Err(stall());
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// Aborts every rank, once (the caller holds `calls`).
    pub(super) fn abort_locked(&self, calls: &mut Calls) {
        if std::mem::replace(&mut calls.aborted, true) {
            return;
        }
        let Ok(lib) = loader::library() else {
            return;
        };
        for r in &self.ranks {
            // SAFETY: each handle is live, aborted exactly once (the flag above, under `calls`)
            // and never used after; the result is of no use: the set is gone.
            let _ = unsafe { result::comm_free(lib, r.comm, true) };
        }
    }

    /// Asks whoever polls these communicators to stop (it checks every poll), then aborts them.
    pub(super) fn abort(&self) {
        self.abort_requested.store(true, Ordering::Release);
        let mut calls = self.lock();
        self.abort_locked(&mut calls);
    }

    /// The first asynchronous error any rank reports; `Ok` when the set is busy (the holder of
    /// `calls` polls itself) or aborted.
    pub(super) fn async_error(&self, op: &'static str, keys: &[Key]) -> Result<()> {
        let Ok(calls) = self.calls.try_lock() else {
            return Ok(());
        };
        match loader::library() {
            Ok(lib) if !calls.aborted => self.async_error_locked(lib, op, keys),
            _ => Ok(()),
        }
    }

    /// [`Self::async_error`], for a caller that holds `calls` of a set not aborted.
    pub(super) fn async_error_locked(
        &self,
        lib: &Nccl,
        op: &'static str,
        keys: &[Key],
    ) -> Result<()> {
        for r in &self.ranks {
            // SAFETY: a live communicator of this set (not aborted: the caller checked), used
            // under `calls`.
            unsafe { result::comm_get_async_error(lib, r.comm) }.during(op, keys)?;
        }
        Ok(())
    }
}

impl Drop for CommSet {
    fn drop(&mut self) {
        let mut calls = self.lock();
        if calls.aborted {
            return;
        }
        let Ok(lib) = loader::library() else {
            return;
        };
        let comms: Vec<Comm> = self.ranks.iter().map(|r| r.comm).collect();
        let op = "destroy NCCL communicator";
        let settle = || (self.settle(lib, op, &[], Instant::now() + self.timeout)).is_ok();
        // SAFETY: live communicators of this set (not aborted: checked above), under `calls`,
        // which is set just below, so nothing aborts or uses them after.
        unsafe { result::close(lib, &comms, settle) };
        calls.aborted = true;
    }
}
