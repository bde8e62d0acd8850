//! NCCL for GPU homes: non-blocking communicators per device set (an LRU cache), reduce and
//! broadcast, async-error polling with a timeout, and abort of a failed communicator.
//!
//! - NCCL is found and loaded by [`loader`] (cudarc only looks for `libnccl.so`, which pip and
//!   the distros do not ship); [`library_path`] and [`version`] say what was loaded.
//! - Communicators are made per distinct sorted set of GPU ordinals, with
//!   `ncclCommInitRankConfig` and `blocking = 0` (NCCL >= 2.14), all ranks in one group, then
//!   polled with `ncclCommGetAsyncError` while they report `ncclInProgress`. The rank of a GPU
//!   is its index in that sorted list, never its ordinal. At most `KVSTORE_NCCL_MAX_COMMS`
//!   (default 8) sets are cached; the least recently used one that no call is using is
//!   finalized and destroyed. The store builds them before it takes any key lock
//!   (`prepare`).
//! - Each rank runs on its GPU's single runtime stream, so NCCL calls are ordered with the
//!   kernels and copies around them. All collectives of one call are issued inside one
//!   `group_start`/`group_end`; since the communicators are non-blocking, neither the calls
//!   nor the group end can block: whatever reports `ncclInProgress` is polled, with the
//!   timeout, and a stall is aborted rather than waited for.
//! - No lock that the watchdog needs is held across a call that can block. The cache and the
//!   list of work in flight each have their own mutex, held only for bookkeeping; the calls on
//!   one set are serialized by that set's own mutex, whose holder polls with a bound and gives
//!   up as soon as the watchdog asks for an abort.
//! - After the group, an event per rank is recorded. Every host wait ([`wait_all`], and any
//!   read of a GPU buffer on the host, through `wait_stream`) polls those events and
//!   `ncclCommGetAsyncError`. On an error, or when a collective is still running
//!   `KVSTORE_NCCL_TIMEOUT_MS` (default 60 s) after it was issued, its communicators are
//!   aborted and dropped from the cache, and an [`Error::Nccl`] names the keys. A watchdog
//!   thread polls the same way every 100 ms, so a stalled collective is aborted even while
//!   every user thread is blocked inside the driver.
//! - [`RankComm`] is NCCL across processes (one rank per process, bootstrapped over MPI or
//!   from a torchrun-style environment through `NCCL_COMM_ID`): the engine of
//!   `dist_device_sync`.
//! - `KVSTORE_NCCL_FORCE=1` makes a `nccl` store use NCCL even for a key whose values are all
//!   on its home GPU: a one-rank communicator reduces them and broadcasts the pulls, so every
//!   NCCL call the store makes runs on a one-GPU machine too (for tests).

// Every `unsafe` block in this module says why it is sound.
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod loader;
mod ranks;
mod result;

pub use ranks::RankComm;

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Once, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};

use crate::backend::cuda::{self, cross_gpu_order, cuda_err};
use crate::{DType, Error, Key, Result};
use loader::{Comm, Config, Nccl};
use result::{lib, nccl_dtype, During, NcclError, Status, NCCL_SUM};

/// Whether a usable NCCL (>= 2.14) was found (see [`loader`]).
pub fn available() -> bool {
    loader::library().is_ok()
}

/// The NCCL library file this process loaded, if any.
pub fn library_path() -> Option<PathBuf> {
    loader::library().ok().map(|l| l.path.clone())
}

/// Warns once per process that a `nccl` store found no usable NCCL and uses peer copies:
/// what was found, and how to fix it. Through `log` when a logger takes warnings, else on
/// stderr (a user who asked for NCCL must hear of it).
pub(crate) fn warn_unavailable() {
    static ONCE: Once = Once::new();
    if let Err(e) = loader::library() {
        ONCE.call_once(|| {
            let msg = format!(
                "kvstore: a 'nccl' store found no usable NCCL, so sums and broadcasts between \
                 GPUs use peer copies instead: {e}"
            );
            if log::log_enabled!(log::Level::Warn) {
                log::warn!("{msg}");
            } else {
                eprintln!("{msg}");
            }
        });
    }
}

/// Whether `KVSTORE_NCCL_FORCE=1` (read once): a `nccl` store then uses NCCL for keys whose
/// values are all on the home GPU too (one-rank communicators), so that its NCCL path runs on
/// a one-GPU machine.
pub fn force_single() -> bool {
    static FORCE: OnceLock<bool> = OnceLock::new();
    *FORCE.get_or_init(|| std::env::var("KVSTORE_NCCL_FORCE").as_deref() == Ok("1"))
}

/// The NCCL library's version code (e.g. 23007 for 2.30.7), or `None` when none is usable.
pub fn version() -> Option<i32> {
    loader::library().ok().map(|l| l.version)
}

/// How long a collective may run before it is aborted: `KVSTORE_NCCL_TIMEOUT_MS` as the
/// process first reads it (polls run every 200 µs), else 60 s.
fn timeout() -> Duration {
    static TIMEOUT: OnceLock<Duration> = OnceLock::new();
    *TIMEOUT.get_or_init(|| {
        let ms = std::env::var("KVSTORE_NCCL_TIMEOUT_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(60_000);
        Duration::from_millis(ms)
    })
}

/// How many device sets keep their communicators: `KVSTORE_NCCL_MAX_COMMS` (read once), else 8.
fn max_sets() -> usize {
    static MAX: OnceLock<usize> = OnceLock::new();
    *MAX.get_or_init(|| {
        std::env::var("KVSTORE_NCCL_MAX_COMMS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n| n > 0)
            .unwrap_or(8)
    })
}

/// One rank: a raw communicator and the stream its collectives go on.
struct Rank {
    comm: Comm,
    stream: Arc<CudaStream>,
}

/// The non-blocking communicators of one device set, one per rank. Dropping it finalizes and
/// destroys them (or aborts them, if they failed).
struct CommSet {
    ranks: Vec<Rank>,
    /// Serializes every call on these communicators; `true` once they are aborted.
    calls: Mutex<bool>,
    /// Set by the watchdog: whoever polls these communicators stops and aborts them.
    abort_requested: AtomicBool,
}

// SAFETY: `CommSet` holds raw `ncclComm_t` handles, which Rust cannot see are thread-safe.
// NCCL allows a communicator to be used from any thread as long as calls on it are not
// concurrent, and every call on these handles is made while holding `calls`.
unsafe impl Send for CommSet {}
// SAFETY: as above: shared use goes through the `calls` mutex.
unsafe impl Sync for CommSet {}

impl CommSet {
    /// Non-blocking communicators, rank `r` on GPU `ordinals[r]` and stream `streams[r]`
    /// (ordinals may repeat: several ranks on one GPU, each with a stream of its own), created
    /// in one group and polled until ready, with the timeout.
    fn init(
        ordinals: &[usize],
        streams: Vec<Arc<CudaStream>>,
        op: &'static str,
        keys: &[Key],
    ) -> Result<CommSet> {
        let lib = lib(op, keys)?;
        result::require_comm_init_rank_config(lib).during(op, keys)?;
        let id = result::get_unique_id(lib).during(op, keys)?;
        let n = ordinals.len();
        let mut comms: Vec<Comm> = vec![std::ptr::null_mut(); n];
        // Each config must stay alive until the group ends.
        let mut configs: Vec<Config> = (0..n).map(|_| Config::new(false)).collect();
        // The matching group end is always called below.
        result::group_start(lib).during(op, keys)?;
        let mut first: Result<()> = Ok(());
        for (rank, (&o, (c, cfg))) in ordinals
            .iter()
            .zip(comms.iter_mut().zip(configs.iter_mut()))
            .enumerate()
        {
            let bound = cuda::gpu(o).and_then(|g| {
                g.context()
                    .bind_to_thread()
                    .map_err(cuda_err("create NCCL communicator", None))
            });
            if let Err(e) = bound {
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
        let set = CommSet {
            ranks: comms
                .into_iter()
                .zip(streams)
                .filter(|(c, _)| !c.is_null())
                .map(|(comm, stream)| Rank { comm, stream })
                .collect(),
            calls: Mutex::new(false),
            abort_requested: AtomicBool::new(false),
        };
        let mut calls = set.lock();
        let ready = first.and_then(|()| {
            if set.ranks.len() != n {
                return Err(Error::Nccl {
                    op,
                    keys: keys.to_vec(),
                    message: format!("only {} of {n} communicators were created", set.ranks.len()),
                });
            }
            set.settle(lib, op, keys, Instant::now() + timeout())
        });
        if ready.is_err() {
            set.abort_locked(&mut calls);
        }
        drop(calls);
        ready.map(|()| set)
    }

    fn lock(&self) -> MutexGuard<'_, bool> {
        self.calls.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Polls every rank with `ncclCommGetAsyncError` until none is in progress. An error, an
    /// abort the watchdog asked for, or `deadline` ends it with an error (the caller, which
    /// holds `calls`, aborts).
    fn settle(&self, lib: &Nccl, op: &'static str, keys: &[Key], deadline: Instant) -> Result<()> {
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
                return Err(Error::Nccl {
                    op,
                    keys: keys.to_vec(),
                    message: "aborted by the NCCL watchdog while in progress".to_owned(),
                });
            }
            if Instant::now() > deadline {
                return Err(Error::Nccl {
                    op,
                    keys: keys.to_vec(),
                    message: format!(
                        "still in progress after {:?} (KVSTORE_NCCL_TIMEOUT_MS); the \
                         communicators were aborted",
                        timeout()
                    ),
                });
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// Aborts every rank, once (the caller holds `calls`).
    fn abort_locked(&self, aborted: &mut bool) {
        if std::mem::replace(aborted, true) {
            return;
        }
        let Ok(lib) = loader::library() else {
            return;
        };
        for r in &self.ranks {
            // SAFETY: each handle was created by NCCL for this set, is aborted exactly once
            // (the flag above, under `calls`) and never used after; abort frees it without
            // waiting for (possibly stuck) work. Its result is of no use: the set is gone.
            let _ = unsafe { result::comm_abort(lib, r.comm) };
        }
    }

    /// Asks whoever is polling these communicators to stop, then aborts them. The holder of
    /// `calls` polls with a bound and checks the request every poll, so this waits briefly.
    fn abort(&self) {
        self.abort_requested.store(true, Ordering::Release);
        let mut calls = self.lock();
        self.abort_locked(&mut calls);
    }

    /// The first asynchronous error any rank reports, if any; `Ok` when the set is busy (a
    /// call in progress holds `calls`: its holder polls itself) or aborted.
    fn async_error(&self, op: &'static str, keys: &[Key]) -> Result<()> {
        let Ok(calls) = self.calls.try_lock() else {
            return Ok(());
        };
        if *calls {
            return Ok(());
        }
        let Ok(lib) = loader::library() else {
            return Ok(());
        };
        for r in &self.ranks {
            // SAFETY: a live communicator of this set (not aborted: checked above), used under
            // `calls`.
            unsafe { result::comm_get_async_error(lib, r.comm) }.during(op, keys)?;
        }
        Ok(())
    }
}

impl Drop for CommSet {
    fn drop(&mut self) {
        let mut calls = self.lock();
        if *calls {
            return;
        }
        let Ok(lib) = loader::library() else {
            return;
        };
        // Finalize (non-blocking: polled with the timeout), then destroy; abort on trouble.
        let mut ok = true;
        if lib.comm_finalize.is_some() {
            for r in &self.ranks {
                // SAFETY: a live communicator of this set (not aborted: checked above), under
                // `calls`.
                ok &= unsafe { result::comm_finalize(lib, r.comm) }.is_ok();
            }
            ok = ok
                && self
                    .settle(
                        lib,
                        "destroy NCCL communicator",
                        &[],
                        Instant::now() + timeout(),
                    )
                    .is_ok();
        }
        if !ok {
            self.abort_locked(&mut calls);
            return;
        }
        for r in &self.ranks {
            // SAFETY: finalized above, destroyed exactly once, here (`calls` is set below, so
            // nothing aborts or uses it after); its result is of no use to a drop.
            let _ = unsafe { result::comm_destroy(lib, r.comm) };
        }
        *calls = true;
    }
}

/// NCCL work in flight: the events recorded after a group, per rank of one device set.
struct Pending {
    /// Issue order, so a wait covers only the work issued before it began.
    seq: u64,
    issued: Instant,
    set: Vec<usize>,
    comms: Arc<CommSet>,
    events: Vec<CudaEvent>,
    keys: Vec<Key>,
    op: &'static str,
}

/// A collective that failed or stalled. Its device set's communicators are aborted by
/// [`fail`], and with them every collective in flight on that set, whose keys the error names.
struct Failure {
    set: Vec<usize>,
    comms: Arc<CommSet>,
    keys: Vec<Key>,
    error: Error,
}

/// The work in flight. Its mutex is only held for bookkeeping and non-blocking queries.
#[derive(Default)]
struct Inflight {
    pending: Vec<Pending>,
    next_seq: u64,
    /// Errors found while polling between calls, reported by the next [`wait_all`].
    deferred: Vec<Error>,
}

/// The communicator cache: device set -> communicators and when they were last used.
#[derive(Default)]
struct Cache {
    sets: HashMap<Vec<usize>, (Arc<CommSet>, u64)>,
    tick: u64,
}

/// How often a host wait polls events and NCCL's async errors.
const POLL_INTERVAL: Duration = Duration::from_micros(200);

/// How often the watchdog thread polls NCCL work in flight.
const WATCHDOG_INTERVAL: Duration = Duration::from_millis(100);

/// Starts, once, a thread that polls the NCCL work in flight every [`WATCHDOG_INTERVAL`] and
/// aborts a collective that failed or made no progress for [`timeout`], as PyTorch's NCCL
/// watchdog does. Host waits poll too, but a thread blocked inside the driver (a copy queued
/// behind a stalled collective) cannot: the abort ends the collective's kernels, the stream
/// drains, and that thread is freed. The error waits for the next [`wait_all`].
fn start_watchdog() {
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

fn inflight() -> MutexGuard<'static, Inflight> {
    static INFLIGHT: OnceLock<Mutex<Inflight>> = OnceLock::new();
    INFLIGHT
        .get_or_init(|| {
            // From now on every host read of a GPU polls this module's collectives.
            cuda::set_host_wait(wait_stream);
            Mutex::new(Inflight::default())
        })
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

fn cache() -> MutexGuard<'static, Cache> {
    static CACHE: OnceLock<Mutex<Cache>> = OnceLock::new();
    CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Which of `entries` (key, last use, in use) to evict so that at most `cap` remain: the least
/// recently used first, never one in use (so more than `cap` may remain).
fn lru_victims<K: Clone>(entries: &[(K, u64, bool)], cap: usize) -> Vec<K> {
    let excess = entries.len().saturating_sub(cap);
    let mut idle: Vec<&(K, u64, bool)> = entries.iter().filter(|e| !e.2).collect();
    idle.sort_by_key(|e| e.1);
    idle.into_iter().take(excess).map(|e| e.0.clone()).collect()
}

/// The communicators of `ordinals` (ascending, distinct), from the cache or built (outside
/// every lock but the cache's brief bookkeeping), evicting the least recently used sets
/// beyond [`max_sets`].
fn get_set(ordinals: &[usize], keys: &[Key]) -> Result<Arc<CommSet>> {
    {
        let mut c = cache();
        c.tick += 1;
        let tick = c.tick;
        if let Some((set, used)) = c.sets.get_mut(ordinals) {
            *used = tick;
            return Ok(set.clone());
        }
    }
    let mut streams = Vec::with_capacity(ordinals.len());
    for &o in ordinals {
        streams.push(cuda::gpu(o)?.stream().clone());
    }
    let built = Arc::new(CommSet::init(
        ordinals,
        streams,
        "create NCCL communicator",
        keys,
    )?);
    let (set, evicted) = {
        let mut c = cache();
        c.tick += 1;
        let tick = c.tick;
        // Another thread may have built the same set meanwhile: keep one.
        let set = c
            .sets
            .entry(ordinals.to_vec())
            .or_insert_with(|| (built.clone(), tick))
            .0
            .clone();
        let busy: Vec<Vec<usize>> = inflight().pending.iter().map(|p| p.set.clone()).collect();
        let entries: Vec<(Vec<usize>, u64, bool)> = c
            .sets
            .iter()
            .map(|(k, (s, used))| {
                let in_use =
                    k.as_slice() == ordinals || Arc::strong_count(s) > 1 || busy.contains(k);
                (k.clone(), *used, in_use)
            })
            .collect();
        let evicted: Vec<Arc<CommSet>> = lru_victims(&entries, max_sets())
            .into_iter()
            .filter_map(|k| c.sets.remove(&k).map(|(s, _)| s))
            .collect();
        (set, evicted)
    };
    // Finalized and destroyed here, outside the cache lock (and `built`, if unused).
    drop(evicted);
    drop(built);
    Ok(set)
}

/// Builds, before a call takes its key locks, the communicators it will need: one per device
/// set of at least two GPUs (or of one, with [`force_single`]).
pub(crate) fn prepare(sets: &[Vec<usize>]) -> Result<()> {
    if !available() {
        return Ok(());
    }
    for s in sets {
        if s.len() >= 2 || (s.len() == 1 && force_single()) {
            get_set(s, &[])?;
        }
    }
    Ok(())
}

/// How many collectives (one per key and call) this process has issued through the store's
/// NCCL path (for tests that NCCL really ran).
pub fn collectives_issued() -> u64 {
    ISSUED.load(Ordering::Relaxed)
}

static ISSUED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The device sets whose communicators are cached (for tests of the LRU bound).
pub fn cached_sets() -> Vec<Vec<usize>> {
    let mut v: Vec<Vec<usize>> = cache().sets.keys().cloned().collect();
    v.sort();
    v
}

/// Aborts every cached communicator and empties the cache; the next call builds afresh. Work
/// in flight on them is ended (its keys' next wait reports nothing: the caller asked for it).
pub fn abort_all() {
    let sets: Vec<Arc<CommSet>> = cache().sets.drain().map(|(_, (s, _))| s).collect();
    inflight().pending.clear();
    for s in &sets {
        s.abort();
    }
}

/// Aborts a failed set and drops it from the cache (if it is still the cached one).
fn fail(f: &Failure) {
    {
        let mut c = cache();
        if c.sets
            .get(&f.set)
            .is_some_and(|(s, _)| Arc::ptr_eq(s, &f.comms))
        {
            c.sets.remove(&f.set);
        }
    }
    f.comms.abort();
}

impl Inflight {
    /// Drops the pending entries whose events have all completed. The first entry whose
    /// communicators report an asynchronous error, or that is still running [`timeout`] after
    /// it was issued (as PyTorch's NCCL watchdog counts), is removed with every entry of its
    /// device set and returned, naming their keys; the caller aborts it with [`fail`], after
    /// releasing this lock.
    fn poll(&mut self) -> std::result::Result<(), Box<Failure>> {
        let limit = timeout();
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
            match all_complete(&p.events, p.op) {
                Ok(true) => false,
                Ok(false) if p.issued.elapsed() > limit => fail(Error::Nccl {
                    op: p.op,
                    keys: p.keys.clone(),
                    message: format!(
                        "no progress after {limit:?} (KVSTORE_NCCL_TIMEOUT_MS); the \
                         communicator for GPUs {:?} was aborted",
                        p.set
                    ),
                }),
                Ok(false) => true,
                Err(e) => fail(e),
            }
        });
        let Some((set, comms, mut error)) = failure else {
            return Ok(());
        };
        let keys: Vec<Key> = self
            .pending
            .iter()
            .filter(|p| Arc::ptr_eq(&p.comms, &comms))
            .flat_map(|p| p.keys.iter().cloned())
            .collect();
        self.pending.retain(|p| !Arc::ptr_eq(&p.comms, &comms));
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
fn all_complete(events: &[CudaEvent], op: &'static str) -> Result<bool> {
    for ev in events {
        if !ev.try_is_complete().map_err(cuda_err(op, None))? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Waits for every NCCL collective issued before the call, polling for asynchronous errors.
/// A collective that fails, or makes no progress for the timeout, has its communicators aborted
/// and dropped from the cache, and its error is returned.
pub fn wait_all() -> Result<()> {
    if !available() {
        return Ok(());
    }
    let last = inflight().next_seq;
    loop {
        let failure = {
            let mut c = inflight();
            if !c.deferred.is_empty() {
                return Err(c.deferred.remove(0));
            }
            match c.poll() {
                Err(f) => f,
                Ok(()) if c.pending.iter().all(|p| p.seq >= last) => return Ok(()),
                Ok(()) => {
                    drop(c);
                    std::thread::sleep(POLL_INTERVAL);
                    continue;
                }
            }
        };
        fail(&failure);
        return Err(failure.error);
    }
}

/// Waits on the host for the work enqueued so far on one GPU's stream.
///
/// With NCCL work in flight this polls instead of blocking: a collective that fails, or makes
/// no progress for [`timeout`], is aborted (which ends its kernels, so the stream drains)
/// rather than holding this thread forever. Its error is kept for the next [`wait_all`], and
/// also returned here when that collective ran on this GPU.
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
    // A backstop for a stream still busy well after its collectives would have timed out.
    let deadline = Instant::now() + 2 * timeout();
    loop {
        if done.try_is_complete().map_err(cuda_err(op, None))? {
            return Ok(());
        }
        let failure = inflight().poll().err();
        if let Some(f) = failure {
            fail(&f);
            // The pushing thread hears of it from wait_all; this reader, when its GPU was in
            // the set, gets an error of its own.
            let mine = f.set.contains(&gpu.ordinal()).then(|| Error::Nccl {
                op,
                keys: f.keys.clone(),
                message: f.error.to_string(),
            });
            inflight().deferred.push(f.error);
            if let Some(e) = mine {
                return Err(e);
            }
        }
        if Instant::now() > deadline {
            return Err(Error::Cuda {
                op,
                key: None,
                message: format!(
                    "gpu({}) was still busy after {:?}",
                    gpu.ordinal(),
                    2 * timeout()
                ),
                source: None,
            });
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

/// What one key's collective does. Ranks are indices into the job's `devices`.
pub(crate) enum Kind {
    /// Sum `sends[rank]` (one per rank) into `recv` on rank `root`.
    Reduce {
        sends: Vec<u64>,
        recv: u64,
        root: usize,
    },
    /// Copy `send` on rank `root` into `recvs[rank]` (the root's recv may equal `send`).
    Broadcast {
        send: u64,
        recvs: Vec<u64>,
        root: usize,
    },
}

/// One key's collective over a set of GPUs.
pub(crate) struct Job {
    pub key: Key,
    pub dtype: DType,
    pub n: usize,
    /// Distinct GPU ordinals, ascending: rank `r` is `devices[r]`.
    pub devices: Vec<usize>,
    pub kind: Kind,
}

/// Issues every job's collective in one NCCL group on the GPUs' runtime streams.
///
/// The communicators come from the cache (or are built first, holding no lock). The group is
/// issued holding [`cross_gpu_order`] and each set's call lock, never the cache's or the
/// in-flight list's; since the communicators are non-blocking, what reports `ncclInProgress`
/// is polled to completion with the timeout, and a stall is aborted.
///
/// The caller keeps every buffer named by a job alive; they are freed on their GPU's stream,
/// so after the collective.
pub(crate) fn run(op: &'static str, jobs: &[Job]) -> Result<()> {
    if jobs.is_empty() {
        return Ok(());
    }
    let all_keys: Vec<Key> = jobs.iter().map(|j| j.key.clone()).collect();
    let lib = lib(op, &all_keys)?;
    start_watchdog();
    // Errors of earlier work (other keys) do not fail this call: wait_all reports them.
    let failure = inflight().poll().err();
    if let Some(f) = failure {
        fail(&f);
        inflight().deferred.push(f.error);
    }
    let mut set_keys: Vec<Vec<usize>> = jobs.iter().map(|j| j.devices.clone()).collect();
    set_keys.sort();
    set_keys.dedup();
    let keys_of = |s: &Vec<usize>| -> Vec<Key> {
        jobs.iter()
            .filter(|j| &j.devices == s)
            .map(|j| j.key.clone())
            .collect()
    };
    let mut sets = Vec::with_capacity(set_keys.len());
    for s in &set_keys {
        sets.push(get_set(s, &keys_of(s))?);
    }
    let order = cross_gpu_order();
    // Always in ascending set order, so two calls never wait on each other's locks.
    let mut guards: Vec<MutexGuard<'_, bool>> = sets.iter().map(|s| s.lock()).collect();
    let mut result = if guards.iter().any(|g| **g) {
        Err(Error::Nccl {
            op,
            keys: all_keys.clone(),
            message: "the communicators were aborted after an earlier failure; retry the call"
                .to_owned(),
        })
    } else {
        issue(lib, &set_keys, &sets, op, jobs)
    };
    if result.is_ok() {
        let deadline = Instant::now() + timeout();
        for (s, k) in sets.iter().zip(&set_keys) {
            result = result.and_then(|()| s.settle(lib, op, &keys_of(k), deadline));
        }
    }
    let mut events = Vec::with_capacity(sets.len());
    if result.is_ok() {
        for s in &sets {
            let mut evs = Vec::with_capacity(s.ranks.len());
            for r in &s.ranks {
                match r.stream.record_event(None) {
                    Ok(e) => evs.push(e),
                    Err(e) => {
                        result = Err(cuda_err("record NCCL event", None)(e));
                        break;
                    }
                }
            }
            events.push(evs);
        }
    }
    if result.is_err() {
        // A failed group leaves the communicators in an unknown state: abort them all.
        for (s, g) in sets.iter().zip(guards.iter_mut()) {
            s.abort_locked(g);
        }
    }
    drop(guards);
    drop(order);
    if result.is_err() {
        let mut c = cache();
        for (k, s) in set_keys.iter().zip(&sets) {
            if c.sets.get(k).is_some_and(|(x, _)| Arc::ptr_eq(x, s)) {
                c.sets.remove(k);
            }
        }
        return result;
    }
    ISSUED.fetch_add(jobs.len() as u64, Ordering::Relaxed);
    let mut c = inflight();
    for ((k, s), events) in set_keys.iter().zip(sets).zip(events) {
        let seq = c.next_seq;
        c.next_seq += 1;
        c.pending.push(Pending {
            seq,
            issued: Instant::now(),
            set: k.clone(),
            comms: s,
            events,
            keys: keys_of(k),
            op,
        });
    }
    Ok(())
}

/// The group itself: `group_end` is always called, even after a failed call inside.
fn issue(
    lib: &Nccl,
    set_keys: &[Vec<usize>],
    sets: &[Arc<CommSet>],
    op: &'static str,
    jobs: &[Job],
) -> Result<()> {
    let all_keys: Vec<Key> = jobs.iter().map(|j| j.key.clone()).collect();
    // The matching group end is always called below.
    result::group_start(lib).during(op, &all_keys)?;
    let mut first: Result<()> = Ok(());
    for job in jobs {
        let at = set_keys
            .binary_search(&job.devices)
            .expect("every job's set is in the list");
        for (rank, r) in sets[at].ranks.iter().enumerate() {
            let dt = nccl_dtype(job.dtype);
            let stream = r.stream.cu_stream() as *mut c_void;
            let res = match &job.kind {
                // SAFETY: the addresses name live device buffers of `job.n` elements of
                // `job.dtype` on this rank's GPU (kept alive by the caller, freed on this
                // stream, so after the collective); `r.comm` is a live communicator used under
                // its set's call lock; `stream` is its rank's live runtime stream.
                Kind::Reduce { sends, recv, root } => unsafe {
                    result::reduce(
                        lib,
                        sends[rank] as *const c_void,
                        if rank == *root { *recv } else { 0 } as *mut c_void,
                        job.n,
                        dt,
                        NCCL_SUM,
                        *root,
                        r.comm,
                        stream,
                    )
                },
                // SAFETY: as for reduce.
                Kind::Broadcast { send, recvs, root } => unsafe {
                    result::broadcast(
                        lib,
                        if rank == *root { *send } else { 0 } as *const c_void,
                        recvs[rank] as *mut c_void,
                        job.n,
                        dt,
                        *root,
                        r.comm,
                        stream,
                    )
                },
            };
            first = first.and(res.during(op, std::slice::from_ref(&job.key)));
        }
    }
    first.and(result::group_end(lib).during(op, &all_keys))
}

/// Several NCCL ranks on ONE GPU, for tests on one-GPU machines.
///
/// NCCL refuses two ranks on one GPU before 2.30; 2.30 and later allow it when the environment
/// has `NCCL_MULTI_RANK_GPU_ENABLE=1`. Each rank gets its own stream (two ranks of one
/// collective on one stream would wait for each other forever). The communicators are
/// non-blocking, as the store's are.
pub struct MultiRank {
    ordinal: usize,
    set: CommSet,
    /// How long a call waits for the ranks before it aborts them.
    timeout: Duration,
    /// `CommSet` is `Sync`, but a `MultiRank` is used from one thread at a time.
    _not_sync: std::marker::PhantomData<Cell<()>>,
}

impl MultiRank {
    /// `nranks` ranks on GPU `ordinal`, built with `ncclCommInitRankConfig` inside one group.
    /// An error says why it is not possible here (no GPU, no NCCL, NCCL too old, env unset).
    pub fn new(ordinal: usize, nranks: usize) -> Result<MultiRank> {
        let op = "create multi-rank communicator";
        let gpu = cuda::gpu(ordinal)?;
        let unsupported = |message: String| Error::Nccl {
            op,
            keys: vec![],
            message,
        };
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
        let mut streams = Vec::with_capacity(nranks);
        for _ in 0..nranks {
            streams.push(gpu.context().new_stream().map_err(cuda_err(op, None))?);
        }
        let set = CommSet::init(&vec![ordinal; nranks], streams, op, &[])?;
        Ok(MultiRank {
            ordinal,
            set,
            timeout: timeout(),
            _not_sync: std::marker::PhantomData,
        })
    }

    fn ranks(&self) -> &[Rank] {
        &self.set.ranks
    }

    /// Sums `sends[r]` (one host vector per rank) on the GPU with NCCL; returns the root's result.
    pub fn reduce_f32(&self, sends: &[Vec<f32>], root: usize) -> Result<Vec<f32>> {
        let op = "multi-rank reduce";
        self.check_live(op)?;
        let n = sends.first().map_or(0, Vec::len);
        if sends.len() != self.ranks().len() || sends.iter().any(|s| s.len() != n) {
            return Err(self.bad_args(op, "one vector per rank, all of one length"));
        }
        self.check_root(op, root)?;
        let bufs = self.upload_all(sends)?;
        let recv: CudaSlice<f32> =
            cuda::alloc_zeros(&self.ranks()[root].stream, n).map_err(cuda_err(op, None))?;
        let recv_ptr = device_addr(&recv, &self.ranks()[root].stream);
        let send_ptrs: Vec<u64> = bufs
            .iter()
            .zip(self.ranks())
            .map(|(b, r)| device_addr(b, &r.stream))
            .collect();
        self.group(op, |lib, rank, r| {
            // SAFETY: every address names a live buffer of `n` f32 on this GPU; the buffers
            // outlive the call and are only read back after `sync` below (and freed on their
            // rank's stream, so after the collective); `r.comm` is a live communicator of this
            // set, used under its call lock (`group` holds it); `r.stream` is its rank's.
            unsafe {
                result::reduce(
                    lib,
                    send_ptrs[rank] as *const c_void,
                    if rank == root { recv_ptr } else { 0 } as *mut c_void,
                    n,
                    nccl_dtype(DType::F32),
                    NCCL_SUM,
                    root,
                    r.comm,
                    r.stream.cu_stream() as *mut c_void,
                )
            }
        })?;
        self.sync(op)?;
        cuda::clone_dtoh(&self.ranks()[root].stream, &recv).map_err(cuda_err(op, None))
    }

    /// Broadcasts `data` from rank `root`; returns what every rank received.
    pub fn broadcast_f32(&self, data: &[f32], root: usize) -> Result<Vec<Vec<f32>>> {
        let op = "multi-rank broadcast";
        self.check_live(op)?;
        let n = data.len();
        self.check_root(op, root)?;
        let send: CudaSlice<f32> =
            cuda::clone_htod(&self.ranks()[root].stream, data).map_err(cuda_err(op, None))?;
        let mut recvs = Vec::new();
        for r in self.ranks() {
            // Poison the outputs so a broadcast that does nothing is seen.
            recvs
                .push(cuda::clone_htod(&r.stream, &vec![f32::NAN; n]).map_err(cuda_err(op, None))?);
        }
        let send_ptr = device_addr(&send, &self.ranks()[root].stream);
        let recv_ptrs: Vec<u64> = recvs
            .iter()
            .zip(self.ranks())
            .map(|(b, r)| device_addr(b, &r.stream))
            .collect();
        // The uploads above ran on each rank's stream; NCCL calls go on the same streams.
        self.group(op, |lib, rank, r| {
            // SAFETY: as in `reduce_f32`.
            unsafe {
                result::broadcast(
                    lib,
                    if rank == root { send_ptr } else { 0 } as *const c_void,
                    recv_ptrs[rank] as *mut c_void,
                    n,
                    nccl_dtype(DType::F32),
                    root,
                    r.comm,
                    r.stream.cu_stream() as *mut c_void,
                )
            }
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

    /// Sets how long a call waits for the ranks before it aborts them (by default
    /// `KVSTORE_NCCL_TIMEOUT_MS`, or 60 s).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    fn bad_args(&self, op: &'static str, what: &str) -> Error {
        Error::Nccl {
            op,
            keys: vec![],
            message: format!("expected {what} ({} ranks)", self.ranks().len()),
        }
    }

    /// `root` must name a rank (indexing with it would panic otherwise).
    fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        if root >= self.ranks().len() {
            return Err(self.bad_args(op, &format!("a root below the rank count, got {root}")));
        }
        Ok(())
    }

    fn upload_all(&self, sends: &[Vec<f32>]) -> Result<Vec<CudaSlice<f32>>> {
        sends
            .iter()
            .zip(self.ranks())
            .map(|(s, r)| cuda::clone_htod(&r.stream, s).map_err(cuda_err("upload", None)))
            .collect()
    }

    /// One group over every rank, then polls the non-blocking communicators until the calls
    /// are issued (with the timeout; aborting on a stall).
    fn group(
        &self,
        op: &'static str,
        call: impl Fn(&Nccl, usize, &Rank) -> std::result::Result<(), NcclError>,
    ) -> Result<()> {
        // No `cross_gpu_order` here: these ranks use streams of their own, which no other
        // work waits on.
        let lib = lib(op, &[])?;
        let mut calls = self.set.lock();
        if *calls {
            return Err(self.aborted_error(op));
        }
        // The matching group end is always called below.
        result::group_start(lib).during(op, &[])?;
        let mut first = Ok(());
        for (rank, r) in self.ranks().iter().enumerate() {
            first = first.and(call(lib, rank, r).during(op, &[]));
        }
        first = first.and(result::group_end(lib).during(op, &[]));
        let deadline = Instant::now() + self.timeout;
        first = first.and_then(|()| self.set.settle(lib, op, &[], deadline));
        if first.is_err() {
            self.set.abort_locked(&mut calls);
        }
        first
    }

    /// Waits for every rank's stream, polling async errors, with the NCCL timeout. On an error
    /// or a timeout the communicators are aborted (which ends their kernels), the streams are
    /// given one more timeout to drain, and every later call fails.
    fn sync(&self, op: &'static str) -> Result<()> {
        let past = |d: Option<Instant>| d.is_some_and(|d| Instant::now() > d);
        let deadline = Instant::now().checked_add(self.timeout);
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
                break Error::Nccl {
                    op,
                    keys: vec![],
                    message: format!("no progress after {:?}", self.timeout),
                };
            }
            std::thread::sleep(POLL_INTERVAL);
        };
        self.set.abort();
        let drain = Instant::now().checked_add(self.timeout);
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
        Err(Error::Nccl {
            op,
            keys: vec![],
            message: format!("{message}; {after}"),
        })
    }

    fn aborted_error(&self, op: &'static str) -> Error {
        Error::Nccl {
            op,
            keys: vec![],
            message: "these communicators were aborted after an earlier failure; create a \
                      new MultiRank"
                .to_owned(),
        }
    }

    /// Fails once the communicators have been aborted.
    fn check_live(&self, op: &'static str) -> Result<()> {
        if *self.set.lock() {
            return Err(self.aborted_error(op));
        }
        Ok(())
    }

    /// Issues a reduce on rank 0 alone, which can never complete, then waits as every call
    /// does. For tests that a stalled collective is aborted after the timeout rather than left
    /// hanging. A full reduce runs first, so the ranks' connections exist and the group call
    /// itself does not wait for the missing rank (it would in `NCCL_LAUNCH_MODE=GROUP`, which
    /// is refused).
    #[doc(hidden)]
    pub fn stalled_reduce_f32(&self, n: usize) -> Result<()> {
        let op = "stalled reduce";
        self.check_live(op)?;
        if n == 0 || self.ranks().len() < 2 {
            return Err(self.bad_args(op, "n > 0 and at least 2 ranks"));
        }
        // In NCCL's GROUP launch mode the group call itself waits for the missing rank.
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
            let calls = self.set.lock();
            if *calls {
                return Err(self.aborted_error(op));
            }
            // Rank 0 alone, outside a group (one rank's part; the others never come).
            // SAFETY: `ptr` names a live buffer of `n` f32 on this GPU, used in place (NCCL
            // allows send == recv); it is freed on this stream, so after the aborted kernel.
            // Rank 0's communicator is live (checked just above) and used under `calls`.
            unsafe {
                result::reduce(
                    lib,
                    ptr as *const c_void,
                    ptr as *mut c_void,
                    n,
                    nccl_dtype(DType::F32),
                    NCCL_SUM,
                    0,
                    self.ranks()[0].comm,
                    stream.cu_stream() as *mut c_void,
                )
            }
            .during(op, &[])?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_evicts_the_least_recently_used_idle_sets() {
        let e = |k: u32, used: u64, busy: bool| (k, used, busy);
        // Within the bound: nothing goes.
        assert!(lru_victims(&[e(1, 5, false), e(2, 3, false)], 2).is_empty());
        // One over: the oldest idle one goes.
        assert_eq!(
            lru_victims(&[e(1, 5, false), e(2, 3, false), e(3, 9, false)], 2),
            vec![2]
        );
        // The oldest is in use: the next oldest goes instead.
        assert_eq!(
            lru_victims(&[e(1, 5, false), e(2, 3, true), e(3, 9, false)], 2),
            vec![1]
        );
        // Two over, in age order.
        assert_eq!(
            lru_victims(
                &[
                    e(1, 5, false),
                    e(2, 3, false),
                    e(3, 9, false),
                    e(4, 1, false)
                ],
                2
            ),
            vec![4, 2]
        );
        // Everything in use: the bound is exceeded rather than a set in use destroyed.
        assert!(lru_victims(&[e(1, 5, true), e(2, 3, true)], 1).is_empty());
    }
}
