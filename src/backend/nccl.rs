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
//! - After the group, an event per rank is recorded. [`wait_all`] polls those events and
//!   `ncclCommGetAsyncError`; on an error or after `KVSTORE_NCCL_TIMEOUT_MS` (default 60 s) the
//!   communicator is aborted and dropped from the cache, and an [`Error::Nccl`] names the keys.

use std::collections::HashMap;
use std::ffi::CStr;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
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

/// NCCL's last error text for a communicator (may be empty).
fn last_error(comm: sys::ncclComm_t) -> String {
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

/// How long [`wait_all`] waits for NCCL work before it aborts the communicator.
fn timeout() -> Duration {
    let ms = std::env::var("KVSTORE_NCCL_TIMEOUT_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60_000);
    Duration::from_millis(ms)
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
    set: Vec<usize>,
    events: Vec<CudaEvent>,
    keys: Vec<Key>,
    op: &'static str,
}

/// The communicator cache and the work in flight.
#[derive(Default)]
struct Comms {
    sets: HashMap<Vec<usize>, CommSet>,
    pending: Vec<Pending>,
    /// Errors found while polling between calls, reported by the next [`wait_all`].
    deferred: Vec<Error>,
}

// SAFETY: `Comms` holds raw `ncclComm_t` handles, which are not `Send` in Rust's eyes. NCCL
// allows a communicator to be used from any thread as long as calls on it are not concurrent.
// The only `Comms` lives in a `Mutex` (`comms()`), and every use of a handle happens while that
// mutex is held, so calls are serialized.
unsafe impl Send for Comms {}

fn comms() -> MutexGuard<'static, Comms> {
    static COMMS: OnceLock<Mutex<Comms>> = OnceLock::new();
    COMMS
        .get_or_init(Default::default)
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

    /// Drops pending entries whose events have all completed; reports async errors.
    fn poll(&mut self, wait: bool) -> Result<()> {
        let deadline = Instant::now() + timeout();
        loop {
            let mut failure = None;
            self.pending.retain(|p| {
                if failure.is_some() {
                    return true;
                }
                if let Some(set) = self.sets.get(&p.set) {
                    if let Err(e) = set.async_error(p.op, &p.keys) {
                        failure = Some((p.set.clone(), e));
                        return true;
                    }
                }
                match all_complete(&p.events, p.op) {
                    Ok(done) => !done,
                    Err(e) => {
                        failure = Some((p.set.clone(), e));
                        true
                    }
                }
            });
            if let Some((set, e)) = failure {
                self.abort(&set);
                return Err(e);
            }
            if self.pending.is_empty() || !wait {
                return Ok(());
            }
            if Instant::now() > deadline {
                let p = &self.pending[0];
                let (set, keys, op) = (p.set.clone(), p.keys.clone(), p.op);
                self.abort(&set);
                return Err(Error::Nccl {
                    op,
                    keys,
                    message: format!(
                        "timed out after {:?} (KVSTORE_NCCL_TIMEOUT_MS); the communicator for \
                         GPUs {set:?} was aborted",
                        timeout()
                    ),
                });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
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

/// Waits for every NCCL collective in flight, polling for asynchronous errors, with a timeout.
/// A failed or stuck communicator is aborted and dropped from the cache.
pub fn wait_all() -> Result<()> {
    if !probe::nccl_present() {
        return Ok(());
    }
    let mut c = comms();
    if !c.deferred.is_empty() {
        return Err(c.deferred.remove(0));
    }
    c.poll(true)
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
    let mut c = comms();
    // Errors of earlier work (other keys) do not fail this call: wait_all reports them.
    if let Err(e) = c.poll(false) {
        c.deferred.push(e);
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
        c.pending.push(Pending {
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
        let this = MultiRank { ordinal, ranks };
        first?;
        Ok(this)
    }

    /// Sums `sends[r]` (one host vector per rank) on the GPU with NCCL; returns the root's result.
    pub fn reduce_f32(&self, sends: &[Vec<f32>], root: usize) -> Result<Vec<f32>> {
        let op = "multi-rank reduce";
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
        let _order = cross_gpu_order();
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

    /// Waits for every rank's stream, polling async errors, with the NCCL timeout.
    fn sync(&self, op: &'static str) -> Result<()> {
        let deadline = Instant::now() + timeout();
        let events = self
            .ranks
            .iter()
            .map(|r| r.stream.record_event(None).map_err(cuda_err(op, None)))
            .collect::<Result<Vec<_>>>()?;
        while !all_complete(&events, op)? {
            async_error(&self.ranks, op, &[])?;
            if Instant::now() > deadline {
                return Err(Error::Nccl {
                    op,
                    keys: vec![],
                    message: format!("timed out after {:?}", timeout()),
                });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    }
}

impl Drop for MultiRank {
    fn drop(&mut self) {
        for r in &self.ranks {
            // SAFETY: each handle was created for this object and is aborted exactly once.
            let _ = unsafe { result::comm_abort(r.comm) };
        }
    }
}

/// The device address of `s`, for the raw NCCL calls. Event tracking is off, so the guard
/// cudarc returns records nothing and may be dropped at once.
fn device_addr(s: &CudaSlice<f32>, stream: &Arc<CudaStream>) -> u64 {
    use cudarc::driver::DevicePtr;
    s.device_ptr(stream).0
}
