//! NCCL work in flight, and what ends it when it fails or stalls: the events recorded after
//! each group are polled, with `ncclCommGetAsyncError`, by every host wait ([`wait_all`],
//! [`wait_stream`]) and by a watchdog thread.

use std::sync::{Arc, Mutex, MutexGuard, Once, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::CudaEvent;

use super::available;
use super::cache::{cache, forget};
use super::comm_set::CommSet;
use super::result::nccl_error;
use super::POLL_INTERVAL;
use crate::backend::cuda::{self, cuda_err};
use crate::config::nccl::timeout;
use crate::{Error, Key, Result};

/// One device set's part of a group in flight.
pub(super) struct Pending {
    /// Issue order, so a wait covers only the work issued before it began.
    pub(super) seq: u64,
    /// When the group was issued.
    pub(super) issued: Instant,
    /// The device set (ascending ordinals).
    pub(super) set: Vec<usize>,
    /// Its communicators.
    pub(super) comms: Arc<CommSet>,
    /// One event per rank.
    pub(super) events: Vec<CudaEvent>,
    /// The keys of the collectives.
    pub(super) keys: Vec<Key>,
    /// The operation, for errors.
    pub(super) op: &'static str,
}

/// A collective that failed or stalled; [`fail`] aborts its set, and with it every collective
/// in flight on that set, whose keys the error names.
pub(super) struct Failure {
    /// The device set.
    pub(super) set: Vec<usize>,
    /// Its communicators.
    pub(super) comms: Arc<CommSet>,
    /// Every key in flight on them.
    pub(super) keys: Vec<Key>,
    /// What happened.
    pub(super) error: Error,
}

/// The work in flight (its mutex is held only for bookkeeping and non-blocking queries).
#[derive(Default)]
pub(super) struct Inflight {
    /// The groups issued and not known to be done, in issue order.
    pub(super) pending: Vec<Pending>,
    /// The `seq` of the next group.
    pub(super) next_seq: u64,
    /// Errors found while polling between calls, reported by the next [`wait_all`].
    pub(super) deferred: Vec<Error>,
}

/// How often the watchdog thread polls NCCL work in flight.
const WATCHDOG_INTERVAL: Duration = Duration::from_millis(100);

/// Starts, once, a thread that polls the work in flight every [`WATCHDOG_INTERVAL`], as
/// PyTorch's NCCL watchdog does: a thread blocked inside the driver (a copy queued behind a
/// stalled collective) cannot poll, but the abort ends the collective's kernels and frees it.
/// The error waits for the next [`wait_all`].
pub(super) fn start_watchdog() {
    static STARTED: Once = Once::new();
    STARTED.call_once(|| {
        let spawned = std::thread::Builder::new()
            .name("kvstore-nccl-watchdog".to_owned())
            .spawn(|| loop {
                std::thread::sleep(WATCHDOG_INTERVAL);
                let failure = inflight().poll().err();
                if let Some(f) = failure {
                    log::error!("kvstore: {}", f.error);
                    fail(&f);
                    inflight().deferred.push(f.error);
                }
            });
        if let Err(e) = spawned {
            log::warn!("kvstore: no NCCL watchdog thread ({e}); only host waits will poll");
        }
    });
}

/// The process's work in flight, locked. Its first use routes every host wait on a GPU through
/// [`wait_stream`].
pub(super) fn inflight() -> MutexGuard<'static, Inflight> {
    static INFLIGHT: OnceLock<Mutex<Inflight>> = OnceLock::new();
    INFLIGHT
        .get_or_init(|| {
            cuda::set_host_wait(wait_stream);
            Mutex::new(Inflight::default())
        })
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Aborts a failed set and drops it from the cache (if it is still the cached one).
pub(super) fn fail(f: &Failure) {
    forget(&f.set, &f.comms);
    f.comms.abort();
}

impl Inflight {
    /// Drops the entries whose events have all completed. The first entry whose communicators
    /// report an error, or still running its set's [`CommSet::timeout`] after it was issued
    /// (as PyTorch's watchdog counts), is removed with every entry of its set and returned,
    /// naming their keys; the caller aborts it with [`fail`] after releasing this lock.
    pub(super) fn poll(&mut self) -> std::result::Result<(), Box<Failure>> {
        let mut failure: Option<(Vec<usize>, Arc<CommSet>, Error)> = None;
        self.pending.retain(|p| {
            if failure.is_some() {
                return true;
            }
            let mut fail = |error| {
                failure = Some((p.set.clone(), p.comms.clone(), error));
                true
            };
            if let Err(e) = p.comms.async_error(p.op, &p.keys) {
                return fail(e);
            }
            let limit = p.comms.timeout;
            match all_complete(&p.events, p.op) {
                Ok(true) => false,
                Ok(false) if p.issued.elapsed() > limit => fail(nccl_error(
                    p.op,
                    &p.keys,
                    format!(
                        "no progress after {limit:?} (KVSTORE_NCCL_TIMEOUT_MS); the \
                         communicator for GPUs {:?} was aborted",
                        p.set
                    ),
                )),
                Ok(false) => true,
                Err(e) => fail(e),
            }
        });
        let Some((set, comms, mut error)) = failure else {
            return Ok(());
        };
        let (gone, kept) = (self.pending.drain(..)).partition(|p| Arc::ptr_eq(&p.comms, &comms));
        self.pending = kept;
        let keys: Vec<Key> = gone.into_iter().flat_map(|p: Pending| p.keys).collect();
        if let Error::Nccl { keys: k, .. } = &mut error {
            k.clone_from(&keys);
        }
        Err(Box::new(Failure {
            set,
            comms,
            keys,
            error,
        }))
    }
}

/// Whether every event has completed. A CUDA error on the stream (an illegal address, say) is
/// returned at once: `CudaEvent::is_complete` would read it as "not yet" until the timeout.
pub(super) fn all_complete(events: &[CudaEvent], op: &'static str) -> Result<bool> {
    for ev in events {
        if !ev.try_is_complete().map_err(cuda_err(op, None))? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Waits for every NCCL collective issued before the call. A collective that fails, or makes
/// no progress for the timeout, has its communicators aborted and dropped from the cache, and
/// its error is returned.
pub fn wait_all() -> Result<()> {
    if !available() {
        return Ok(());
    }
    let last = inflight().next_seq;
    loop {
        let mut c = inflight();
        if !c.deferred.is_empty() {
            return Err(c.deferred.remove(0));
        }
        let polled = c.poll();
        let done = c.pending.iter().all(|p| p.seq >= last);
        drop(c);
        match polled {
            Err(f) => {
                fail(&f);
                return Err(f.error);
            }
            Ok(()) if done => return Ok(()),
            Ok(()) => std::thread::sleep(POLL_INTERVAL),
        }
    }
}

/// Waits on the host for the work enqueued so far on one GPU's stream. With NCCL work in
/// flight it polls: a collective that fails or stalls is aborted (so the stream drains), its
/// error kept for the next [`wait_all`] and also returned here when it ran on this GPU.
pub(crate) fn wait_stream(gpu: &cuda::Gpu) -> Result<()> {
    let op = "wait for GPU";
    if !available() {
        return gpu.synchronize();
    }
    // The event first: work another thread enqueues after it is not waited for.
    let done = gpu
        .stream()
        .record_event(None)
        .map_err(cuda_err(op, None))?;
    if inflight().pending.is_empty() {
        return done.synchronize().map_err(cuda_err(op, None));
    }
    // A backstop for a stream still busy well after its collectives would have timed out
    // (work in flight means a set was made, so the setting is valid).
    let limit = 2 * timeout()?;
    let deadline = Instant::now() + limit;
    loop {
        if done.try_is_complete().map_err(cuda_err(op, None))? {
            return Ok(());
        }
        let failure = inflight().poll().err();
        if let Some(f) = failure {
            fail(&f);
            // The pushing thread hears of it from wait_all; this reader, when its GPU was in
            // the set, gets an error of its own.
            let mine = f
                .set
                .contains(&gpu.ordinal())
                .then(|| nccl_error(op, &f.keys, f.error.to_string()));
            inflight().deferred.push(f.error);
            if let Some(e) = mine {
                return Err(e);
            }
        }
        if Instant::now() > deadline {
            return Err(Error::Cuda {
                op,
                key: None,
                message: format!("gpu({}) was still busy after {:?}", gpu.ordinal(), limit),
                source: None,
            });
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

/// Aborts every cached communicator and empties the cache. Work in flight on them is ended,
/// and its keys' next wait reports nothing (the caller asked for it).
pub fn abort_all() {
    let sets: Vec<Arc<CommSet>> = cache().sets.drain().map(|(_, (s, _))| s).collect();
    inflight().pending.clear();
    for s in &sets {
        s.abort();
    }
}
