//! NCCL for GPU homes: communicators per device set, reduce and broadcast, async-error polling
//! with a timeout, and abort of a failed communicator.
//!
//! cudarc's safe `Comm` hides its raw handle, so it offers no `ncclCommGetAsyncError` and no
//! abort. This module creates communicators through `cudarc::nccl::{result, sys}` itself and
//! issues the collectives with raw device addresses.
//!
//! - Communicators are made per distinct sorted set of GPU ordinals (`ncclCommInitAll`) and
//!   cached. The rank of a GPU is its index in that sorted list, never its ordinal.
//! - Each rank runs on its GPU's single runtime stream, so NCCL calls are ordered with the
//!   kernels and copies around them.
//! - All collectives of one call are issued inside one `group_start`/`group_end`.
//! - After the group, an event per rank is recorded. Every host wait ([`wait_all`], and any
//!   read of a GPU buffer on the host, through `wait_stream`) polls those events and
//!   `ncclCommGetAsyncError`. On an error, or when a collective is still running
//!   `KVSTORE_NCCL_TIMEOUT_MS` (default 60 s) after it was issued, its communicators are
//!   aborted and dropped from the cache, and an [`Error::Nccl`] names the keys. A watchdog
//!   thread polls the same way every 100 ms, so a stalled collective is aborted even while
//!   every user thread is blocked inside the driver.

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::CStr;
use std::sync::{Arc, Mutex, MutexGuard, Once, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};
use cudarc::nccl::{result, sys};

use crate::backend::cuda::{self, cross_gpu_order, cuda_err};
use crate::backend::probe;
use crate::{DType, Error, Key, Result};

/// NCCL's message for a result code.
fn err_string(r: sys::ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString returns a pointer to a static NUL-terminated string for any
    // result code; it is only read here.
    let p = unsafe { sys::ncclGetErrorString(r) };
    if p.is_null() {
        return format!("{r:?}");
    }
    // SAFETY: non-null, static and NUL-terminated (see above).
    let s = unsafe { CStr::from_ptr(p) }.to_string_lossy();
    format!("{r:?}: {s}")
}

/// NCCL's last error text for a communicator (may be empty; always empty before NCCL 2.13,
/// which lacks `ncclGetLastError`: calling a missing symbol would panic).
fn last_error(comm: sys::ncclComm_t) -> String {
    if version().is_none_or(|v| v < 21300) {
        return String::new();
    }
    // SAFETY: `comm` is a live communicator (or null, which NCCL accepts); the returned string
    // is owned by NCCL and copied out at once.
    let p = unsafe { sys::ncclGetLastError(comm) };
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null and NUL-terminated, per NCCL's API.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn nccl_error(
    op: &'static str,
    keys: &[Key],
    r: sys::ncclResult_t,
    comm: sys::ncclComm_t,
) -> Error {
    let mut message = err_string(r);
    let last = last_error(comm);
    if !last.is_empty() {
        message = format!("{message} ({last})");
    }
    Error::Nccl {
        op,
        keys: keys.to_vec(),
        message,
    }
}

/// The NCCL library's version code (e.g. 23007 for 2.30.7), or `None` when it cannot be loaded.
pub fn version() -> Option<i32> {
    if !probe::nccl_present() {
        return None;
    }
    result::get_nccl_version().ok()
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

/// The NCCL element type of a dtype.
fn nccl_dtype(dtype: DType) -> sys::ncclDataType_t {
    match dtype {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F64 => sys::ncclDataType_t::ncclFloat64,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
    }
}

/// One rank: a raw communicator and the stream its collectives go on.
struct Rank {
    comm: sys::ncclComm_t,
    stream: Arc<CudaStream>,
}

/// The communicators of one device set, one per rank. Dropping it aborts them.
struct CommSet {
    ranks: Vec<Rank>,
}

impl CommSet {
    /// `ncclCommInitAll` over distinct ordinals, each rank on its GPU's runtime stream.
    fn init_all(ordinals: &[usize], keys: &[Key]) -> Result<CommSet> {
        let op = "create NCCL communicator";
        let mut streams = Vec::with_capacity(ordinals.len());
        for &o in ordinals {
            streams.push(cuda::gpu(o)?.stream().clone());
        }
        let devs: Vec<i32> = ordinals.iter().map(|&o| o as i32).collect();
        let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); devs.len()];
        // SAFETY: `comms` has room for one handle per device in `devs`, and both outlive the call.
        unsafe { result::comm_init_all(comms.as_mut_ptr(), devs.len() as i32, devs.as_ptr()) }
            .map_err(|e| nccl_error(op, keys, e.0, std::ptr::null_mut()))?;
        Ok(CommSet {
            ranks: comms
                .into_iter()
                .zip(streams)
                .map(|(comm, stream)| Rank { comm, stream })
                .collect(),
        })
    }

    /// The first asynchronous error any rank reports, if any.
    fn async_error(&self, op: &'static str, keys: &[Key]) -> Result<()> {
        async_error(&self.ranks, op, keys)
    }
}

/// The first asynchronous error any of `ranks` reports, if any.
fn async_error(ranks: &[Rank], op: &'static str, keys: &[Key]) -> Result<()> {
    for r in ranks {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `r.comm` is a live communicator owned by the caller's set, used under its
        // lock (or by its single owner); `state` is a valid out-pointer for the call.
        let rc = unsafe { sys::ncclCommGetAsyncError(r.comm, &mut state) };
        for code in [rc, state] {
            match code {
                sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => {}
                other => return Err(nccl_error(op, keys, other, r.comm)),
            }
        }
    }
    Ok(())
}

impl Drop for CommSet {
    fn drop(&mut self) {
        for r in &self.ranks {
            // SAFETY: each handle was created by NCCL for this set and is aborted exactly once,
            // here; abort frees it without waiting for (possibly stuck) work.
            let _ = unsafe { result::comm_abort(r.comm) };
        }
    }
}

/// NCCL work in flight: the events recorded after a group, per rank of one device set.
struct Pending {
    /// Issue order, so a wait covers only the work issued before it began.
    seq: u64,
    issued: Instant,
    set: Vec<usize>,
    events: Vec<CudaEvent>,
    keys: Vec<Key>,
    op: &'static str,
}

/// A collective that failed or stalled. Its device set's communicators are already aborted,
/// and with them every collective in flight on that set, whose keys the error names.
struct Failure {
    set: Vec<usize>,
    keys: Vec<Key>,
    error: Error,
}

/// The communicator cache and the work in flight.
#[derive(Default)]
struct Comms {
    sets: HashMap<Vec<usize>, CommSet>,
    pending: Vec<Pending>,
    next_seq: u64,
    /// Errors found while polling between calls, reported by the next [`wait_all`].
    deferred: Vec<Error>,
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
                let mut c = comms();
                if let Err(f) = c.poll() {
                    log::error!("kvstore: {}", f.error);
                    c.deferred.push(f.error);
                }
            });
        if let Err(e) = spawned {
            log::warn!("kvstore: no NCCL watchdog thread ({e}); only host waits will poll");
        }
    });
}

// SAFETY: `Comms` holds raw `ncclComm_t` handles, which are not `Send` in Rust's eyes. NCCL
// allows a communicator to be used from any thread as long as calls on it are not concurrent.
// The only `Comms` lives in a `Mutex` (`comms()`), and every use of a handle happens while that
// mutex is held, so calls are serialized.
unsafe impl Send for Comms {}

fn comms() -> MutexGuard<'static, Comms> {
    static COMMS: OnceLock<Mutex<Comms>> = OnceLock::new();
    COMMS
        .get_or_init(|| {
            // From now on every host read of a GPU polls this module's collectives.
            cuda::set_host_wait(wait_stream);
            Mutex::new(Comms::default())
        })
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

impl Comms {
    fn set(&mut self, ordinals: &[usize], keys: &[Key]) -> Result<&CommSet> {
        if !self.sets.contains_key(ordinals) {
            let set = CommSet::init_all(ordinals, keys)?;
            self.sets.insert(ordinals.to_vec(), set);
        }
        Ok(&self.sets[ordinals])
    }

    /// Aborts and forgets the communicators of `set`, and its pending work.
    fn abort(&mut self, set: &[usize]) {
        self.pending.retain(|p| p.set != set);
        self.sets.remove(set);
    }

    /// Drops the pending entries whose events have all completed. The first entry whose
    /// communicators report an asynchronous error, or that is still running [`timeout`] after
    /// it was issued (as PyTorch's NCCL watchdog counts), is aborted with its whole device set
    /// and returned, naming the keys of every collective the abort ended.
    fn poll(&mut self) -> std::result::Result<(), Box<Failure>> {
        let limit = timeout();
        let mut failure = None;
        self.pending.retain(|p| {
            if failure.is_some() {
                return true;
            }
            let fail = |error| {
                Some(Failure {
                    set: p.set.clone(),
                    keys: Vec::new(),
                    error,
                })
            };
            if let Some(set) = self.sets.get(&p.set) {
                if let Err(e) = set.async_error(p.op, &p.keys) {
                    failure = fail(e);
                    return true;
                }
            }
            match all_complete(&p.events, p.op) {
                Ok(true) => false,
                Ok(false) if p.issued.elapsed() > limit => {
                    failure = fail(Error::Nccl {
                        op: p.op,
                        keys: p.keys.clone(),
                        message: format!(
                            "no progress after {limit:?} (KVSTORE_NCCL_TIMEOUT_MS); the \
                             communicator for GPUs {:?} was aborted",
                            p.set
                        ),
                    });
                    true
                }
                Ok(false) => true,
                Err(e) => {
                    failure = fail(e);
                    true
                }
            }
        });
        let Some(mut f) = failure else {
            return Ok(());
        };
        f.keys = self
            .pending
            .iter()
            .filter(|p| p.set == f.set)
            .flat_map(|p| p.keys.iter().cloned())
            .collect();
        if let Error::Nccl { keys, .. } = &mut f.error {
            keys.clone_from(&f.keys);
        }
        self.abort(&f.set);
        Err(Box::new(f))
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
    if !probe::nccl_present() {
        return Ok(());
    }
    let last = comms().next_seq;
    loop {
        {
            let mut c = comms();
            if !c.deferred.is_empty() {
                return Err(c.deferred.remove(0));
            }
            c.poll().map_err(|f| f.error)?;
            if c.pending.iter().all(|p| p.seq >= last) {
                return Ok(());
            }
        }
        std::thread::sleep(POLL_INTERVAL);
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
    if !probe::nccl_present() {
        return gpu.synchronize();
    }
    // The event first: work another thread enqueues after it is not waited for.
    let done = gpu
        .stream()
        .record_event(None)
        .map_err(cuda_err(op, None))?;
    if comms().pending.is_empty() {
        return done.synchronize().map_err(cuda_err(op, None));
    }
    // A backstop for a stream still busy well after its collectives would have timed out.
    let deadline = Instant::now() + 2 * timeout();
    loop {
        if done.try_is_complete().map_err(cuda_err(op, None))? {
            return Ok(());
        }
        {
            let mut c = comms();
            if let Err(f) = c.poll() {
                // The pushing thread hears of it from wait_all; this reader, when its GPU was
                // in the set, gets an error of its own.
                let mine = f.set.contains(&gpu.ordinal()).then(|| Error::Nccl {
                    op,
                    keys: f.keys.clone(),
                    message: f.error.to_string(),
                });
                c.deferred.push(f.error);
                if let Some(e) = mine {
                    return Err(e);
                }
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
/// The caller keeps every buffer named by a job alive; they are freed on their GPU's stream,
/// so after the collective.
pub(crate) fn run(op: &'static str, jobs: &[Job]) -> Result<()> {
    if jobs.is_empty() {
        return Ok(());
    }
    let all_keys: Vec<Key> = jobs.iter().map(|j| j.key.clone()).collect();
    if !probe::nccl_present() {
        return Err(Error::Nccl {
            op,
            keys: all_keys,
            message: "libnccl.so cannot be loaded: put a folder with a libnccl.so symlink on \
                      LD_LIBRARY_PATH"
                .to_owned(),
        });
    }
    start_watchdog();
    let mut c = comms();
    // Errors of earlier work (other keys) do not fail this call: wait_all reports them.
    if let Err(f) = c.poll() {
        c.deferred.push(f.error);
    }
    let mut sets: Vec<Vec<usize>> = jobs.iter().map(|j| j.devices.clone()).collect();
    sets.sort();
    sets.dedup();
    for s in &sets {
        let keys: Vec<Key> = jobs
            .iter()
            .filter(|j| &j.devices == s)
            .map(|j| j.key.clone())
            .collect();
        c.set(s, &keys)?;
    }
    let first_error = issue(&c, op, jobs);
    for s in &sets {
        let keys: Vec<Key> = jobs
            .iter()
            .filter(|j| &j.devices == s)
            .map(|j| j.key.clone())
            .collect();
        if first_error.is_err() {
            c.abort(s);
            continue;
        }
        let mut events = Vec::new();
        for r in &c.sets[s].ranks {
            events.push(
                r.stream
                    .record_event(None)
                    .map_err(cuda_err("record NCCL event", None))?,
            );
        }
        let seq = c.next_seq;
        c.next_seq += 1;
        c.pending.push(Pending {
            seq,
            issued: Instant::now(),
            set: s.clone(),
            events,
            keys,
            op,
        });
    }
    first_error
}

/// The group itself: `group_end` is always called, even after a failed call inside.
fn issue(c: &Comms, op: &'static str, jobs: &[Job]) -> Result<()> {
    let all_keys: Vec<Key> = jobs.iter().map(|j| j.key.clone()).collect();
    let _order = cross_gpu_order();
    result::group_start().map_err(|e| nccl_error(op, &all_keys, e.0, std::ptr::null_mut()))?;
    let mut first: Result<()> = Ok(());
    for job in jobs {
        let set = &c.sets[&job.devices];
        for (rank, r) in set.ranks.iter().enumerate() {
            let dt = nccl_dtype(job.dtype);
            let stream = r.stream.cu_stream() as sys::cudaStream_t;
            let res = match &job.kind {
                // SAFETY: the addresses name live device buffers of `job.n` elements of
                // `job.dtype` on this rank's GPU (kept alive by the caller, freed on this
                // stream); `r.comm` is a live communicator used under the cache mutex.
                Kind::Reduce { sends, recv, root } => unsafe {
                    result::reduce(
                        sends[rank] as *const _,
                        if rank == *root { *recv } else { 0 } as *mut _,
                        job.n,
                        dt,
                        sys::ncclRedOp_t::ncclSum,
                        *root as i32,
                        r.comm,
                        stream,
                    )
                },
                // SAFETY: as for reduce.
                Kind::Broadcast { send, recvs, root } => unsafe {
                    result::broadcast(
                        if rank == *root { *send } else { 0 } as *const _,
                        recvs[rank] as *mut _,
                        job.n,
                        dt,
                        *root as i32,
                        r.comm,
                        stream,
                    )
                },
            };
            if let Err(e) = res {
                if first.is_ok() {
                    first = Err(nccl_error(op, std::slice::from_ref(&job.key), e.0, r.comm));
                }
            }
        }
    }
    if let Err(e) = result::group_end() {
        if first.is_ok() {
            first = Err(nccl_error(op, &all_keys, e.0, std::ptr::null_mut()));
        }
    }
    first
}

/// Several NCCL ranks on ONE GPU, for tests on one-GPU machines.
///
/// NCCL refuses two ranks on one GPU before 2.30; 2.30 and later allow it when the environment
/// has `NCCL_MULTI_RANK_GPU_ENABLE=1`. Each rank gets its own stream (two ranks of one
/// collective on one stream would wait for each other forever).
pub struct MultiRank {
    ordinal: usize,
    ranks: Vec<Rank>,
    /// Set once the communicators are aborted (after a failed or stalled call, or on drop).
    aborted: Cell<bool>,
    /// How long a call waits for the ranks before it aborts them.
    timeout: Duration,
}

impl MultiRank {
    /// `nranks` ranks on GPU `ordinal`, built with `ncclCommInitRank` inside one group.
    /// An error says why it is not possible here (no GPU, no NCCL, NCCL too old, env unset).
    pub fn new(ordinal: usize, nranks: usize) -> Result<MultiRank> {
        let op = "create multi-rank communicator";
        let gpu = cuda::gpu(ordinal)?;
        let unsupported = |message: String| Error::Nccl {
            op,
            keys: vec![],
            message,
        };
        let v = version().ok_or_else(|| unsupported("libnccl.so cannot be loaded".to_owned()))?;
        if v < 23000 {
            return Err(unsupported(format!(
                "NCCL {v} is older than 2.30, which is needed for several ranks on one GPU"
            )));
        }
        if std::env::var("NCCL_MULTI_RANK_GPU_ENABLE").as_deref() != Ok("1") {
            return Err(unsupported(
                "NCCL_MULTI_RANK_GPU_ENABLE=1 is not set in the environment".to_owned(),
            ));
        }
        let id =
            result::get_uniqueid().map_err(|e| nccl_error(op, &[], e.0, std::ptr::null_mut()))?;
        let mut streams = Vec::with_capacity(nranks);
        for _ in 0..nranks {
            streams.push(gpu.context().new_stream().map_err(cuda_err(op, None))?);
        }
        gpu.context().bind_to_thread().map_err(cuda_err(op, None))?;
        let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); nranks];
        result::group_start().map_err(|e| nccl_error(op, &[], e.0, std::ptr::null_mut()))?;
        let mut first: Result<()> = Ok(());
        for (rank, c) in comms.iter_mut().enumerate() {
            // SAFETY: `c` is a valid out-pointer, `id` came from ncclGetUniqueId, and the
            // current device is `ordinal` (bound just above), as ncclCommInitRank requires.
            let r = unsafe { result::comm_init_rank(c, nranks as i32, id, rank as i32) };
            if let (Err(e), true) = (r, first.is_ok()) {
                first = Err(nccl_error(op, &[], e.0, std::ptr::null_mut()));
            }
        }
        if let (Err(e), true) = (result::group_end(), first.is_ok()) {
            first = Err(nccl_error(op, &[], e.0, std::ptr::null_mut()));
        }
        let ranks: Vec<Rank> = comms
            .into_iter()
            .zip(streams)
            .filter(|(c, _)| !c.is_null())
            .map(|(comm, stream)| Rank { comm, stream })
            .collect();
        let this = MultiRank {
            ordinal,
            ranks,
            aborted: Cell::new(false),
            timeout: timeout(),
        };
        first?;
        Ok(this)
    }

    /// Sums `sends[r]` (one host vector per rank) on the GPU with NCCL; returns the root's result.
    pub fn reduce_f32(&self, sends: &[Vec<f32>], root: usize) -> Result<Vec<f32>> {
        let op = "multi-rank reduce";
        self.check_live(op)?;
        let n = sends.first().map_or(0, Vec::len);
        if sends.len() != self.ranks.len() || sends.iter().any(|s| s.len() != n) {
            return Err(self.bad_args(op, "one vector per rank, all of one length"));
        }
        self.check_root(op, root)?;
        let bufs = self.upload_all(sends)?;
        let recv: CudaSlice<f32> =
            cuda::alloc_zeros(&self.ranks[root].stream, n).map_err(cuda_err(op, None))?;
        let recv_ptr = device_addr(&recv, &self.ranks[root].stream);
        let send_ptrs: Vec<u64> = bufs
            .iter()
            .zip(&self.ranks)
            .map(|(b, r)| device_addr(b, &r.stream))
            .collect();
        self.group(op, |rank, r| {
            // SAFETY: every address names a live buffer of `n` f32 on this GPU; the buffers
            // outlive the call and are only read back after `sync` below.
            unsafe {
                result::reduce(
                    send_ptrs[rank] as *const _,
                    if rank == root { recv_ptr } else { 0 } as *mut _,
                    n,
                    sys::ncclDataType_t::ncclFloat32,
                    sys::ncclRedOp_t::ncclSum,
                    root as i32,
                    r.comm,
                    r.stream.cu_stream() as _,
                )
            }
        })?;
        self.sync(op)?;
        cuda::clone_dtoh(&self.ranks[root].stream, &recv).map_err(cuda_err(op, None))
    }

    /// Broadcasts `data` from rank `root`; returns what every rank received.
    pub fn broadcast_f32(&self, data: &[f32], root: usize) -> Result<Vec<Vec<f32>>> {
        let op = "multi-rank broadcast";
        self.check_live(op)?;
        let n = data.len();
        self.check_root(op, root)?;
        let send: CudaSlice<f32> =
            cuda::clone_htod(&self.ranks[root].stream, data).map_err(cuda_err(op, None))?;
        let mut recvs = Vec::new();
        for r in &self.ranks {
            // Poison the outputs so a broadcast that does nothing is seen.
            recvs
                .push(cuda::clone_htod(&r.stream, &vec![f32::NAN; n]).map_err(cuda_err(op, None))?);
        }
        let send_ptr = device_addr(&send, &self.ranks[root].stream);
        let recv_ptrs: Vec<u64> = recvs
            .iter()
            .zip(&self.ranks)
            .map(|(b, r)| device_addr(b, &r.stream))
            .collect();
        // The uploads above ran on each rank's stream; NCCL calls go on the same streams.
        self.group(op, |rank, r| {
            // SAFETY: as in `reduce_f32`.
            unsafe {
                result::broadcast(
                    if rank == root { send_ptr } else { 0 } as *const _,
                    recv_ptrs[rank] as *mut _,
                    n,
                    sys::ncclDataType_t::ncclFloat32,
                    root as i32,
                    r.comm,
                    r.stream.cu_stream() as _,
                )
            }
        })?;
        self.sync(op)?;
        recvs
            .iter()
            .zip(&self.ranks)
            .map(|(b, r)| cuda::clone_dtoh(&r.stream, b).map_err(cuda_err(op, None)))
            .collect()
    }

    /// The GPU the ranks share.
    pub fn ordinal(&self) -> usize {
        self.ordinal
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
            message: format!("expected {what} ({} ranks)", self.ranks.len()),
        }
    }

    /// `root` must name a rank (indexing with it would panic otherwise).
    fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        if root >= self.ranks.len() {
            return Err(self.bad_args(op, &format!("a root below the rank count, got {root}")));
        }
        Ok(())
    }

    fn upload_all(&self, sends: &[Vec<f32>]) -> Result<Vec<CudaSlice<f32>>> {
        sends
            .iter()
            .zip(&self.ranks)
            .map(|(s, r)| cuda::clone_htod(&r.stream, s).map_err(cuda_err("upload", None)))
            .collect()
    }

    fn group(
        &self,
        op: &'static str,
        call: impl Fn(usize, &Rank) -> std::result::Result<result::NcclStatus, result::NcclError>,
    ) -> Result<()> {
        // No `cross_gpu_order` here: these ranks use streams of their own, which no other
        // work waits on, and a group end that blocked must not hold up the whole process.
        result::group_start().map_err(|e| nccl_error(op, &[], e.0, std::ptr::null_mut()))?;
        let mut first = Ok(());
        for (rank, r) in self.ranks.iter().enumerate() {
            if let (Err(e), true) = (call(rank, r), first.is_ok()) {
                first = Err(nccl_error(op, &[], e.0, r.comm));
            }
        }
        if let (Err(e), true) = (result::group_end(), first.is_ok()) {
            first = Err(nccl_error(op, &[], e.0, std::ptr::null_mut()));
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
            .ranks
            .iter()
            .map(|r| r.stream.record_event(None).map_err(cuda_err(op, None)))
            .collect::<Result<Vec<_>>>()?;
        let failure = loop {
            match all_complete(&events, op) {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => break e,
            }
            if let Err(e) = async_error(&self.ranks, op, &[]) {
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
        self.abort();
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

    /// Fails once the communicators have been aborted.
    fn check_live(&self, op: &'static str) -> Result<()> {
        if self.aborted.get() {
            return Err(Error::Nccl {
                op,
                keys: vec![],
                message: "these communicators were aborted after an earlier failure; create a \
                          new MultiRank"
                    .to_owned(),
            });
        }
        Ok(())
    }

    /// Aborts every rank's communicator, once.
    fn abort(&self) {
        if self.aborted.replace(true) {
            return;
        }
        for r in &self.ranks {
            // SAFETY: each handle was created for this object; the flag above makes this the
            // only abort, and `check_live` keeps every later call from using the handle.
            let _ = unsafe { result::comm_abort(r.comm) };
        }
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
        if n == 0 || self.ranks.len() < 2 {
            return Err(self.bad_args(op, "n > 0 and at least 2 ranks"));
        }
        // In NCCL's GROUP launch mode the group call itself waits for the missing rank.
        if std::env::var("NCCL_LAUNCH_MODE").is_ok_and(|m| m.eq_ignore_ascii_case("group")) {
            return Err(self.bad_args(op, "NCCL_LAUNCH_MODE other than GROUP"));
        }
        let sends: Vec<Vec<f32>> = (0..self.ranks.len()).map(|_| vec![1.0; n]).collect();
        self.reduce_f32(&sends, 0)?;
        let stream = &self.ranks[0].stream;
        let buf: CudaSlice<f32> =
            cuda::clone_htod(stream, &sends[0]).map_err(cuda_err(op, None))?;
        let ptr = device_addr(&buf, stream);
        self.group(op, |rank, r| {
            if rank != 0 {
                return Ok(result::NcclStatus::Success);
            }
            // SAFETY: `ptr` names a live buffer of `n` f32 on this GPU, used in place (NCCL
            // allows send == recv); it is freed on this stream, so after the aborted kernel.
            unsafe {
                result::reduce(
                    ptr as *const _,
                    ptr as *mut _,
                    n,
                    sys::ncclDataType_t::ncclFloat32,
                    sys::ncclRedOp_t::ncclSum,
                    0,
                    r.comm,
                    r.stream.cu_stream() as _,
                )
            }
        })?;
        self.sync(op)
    }
}

impl Drop for MultiRank {
    fn drop(&mut self) {
        self.abort();
    }
}

/// The device address of `s`, for the raw NCCL calls. Event tracking is off, so the guard
/// cudarc returns records nothing and may be dropped at once.
fn device_addr(s: &CudaSlice<f32>, stream: &Arc<CudaStream>) -> u64 {
    use cudarc::driver::DevicePtr;
    s.device_ptr(stream).0
}
