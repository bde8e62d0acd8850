//! The result layer: one thin wrapper per NCCL function kvstore calls, over the function table
//! of [`super::loader`] (the sys layer).
//!
//! Every `ncclResult_t` is read in [`check`], and only there: `ncclSuccess` and
//! `ncclInProgress` are accepted, anything else becomes an [`NcclError`] with NCCL's own text.
//! Callers name the operation and keys with [`During::during`]. A wrapper is an `unsafe fn`
//! where soundness rests on what the types cannot show; its `# Safety` section says what.

#![deny(unsafe_op_in_unsafe_fn)]

use std::ffi::{c_int, c_void, CStr};

use cudarc::driver::CudaStream;

use super::loader::{self, Comm, Config, Nccl, UniqueId, IN_PROGRESS, SUCCESS};
use crate::{DType, Error, Key, Result};

/// What a wrapper returns.
pub(crate) type NcclResult<T = ()> = std::result::Result<T, NcclError>;

/// The loaded NCCL, or an error naming `op` and `keys` that says what was looked for and how
/// to fix it.
pub(crate) fn lib(op: &'static str, keys: &[Key]) -> Result<&'static Nccl> {
    loader::library().map_err(|e| nccl_error(op, keys, e.to_string()))
}

/// The crate's [`Error::Nccl`]: `message`, during `op` on `keys`.
pub(crate) fn nccl_error(op: &'static str, keys: &[Key], message: String) -> Error {
    let keys = keys.to_vec();
    Error::Nccl { op, keys, message }
}

/// What an accepted NCCL call reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Status {
    /// `ncclSuccess`: done.
    Done,
    /// `ncclInProgress`: a non-blocking communicator is still working on it.
    InProgress,
}

/// A failed NCCL call: NCCL's text for the code and its last error, or a missing function.
#[derive(Debug)]
pub(crate) struct NcclError {
    /// What is reported as [`Error::Nccl`]'s message.
    message: String,
}

impl NcclError {
    /// The error of return code `code`, read at once (NCCL's last error is per thread and
    /// overwritten by the next failure).
    fn from_code(lib: &Nccl, code: c_int, comm: Comm) -> NcclError {
        let mut message = error_string(lib, code);
        // SAFETY: `comm` is the communicator of the call that just returned `code`, or null;
        // NCCL accepts either.
        let last = unsafe { last_error(lib, comm) };
        if !last.is_empty() {
            message = format!("{message} ({last})");
        }
        NcclError { message }
    }

    /// The error of a call to `function`, which this NCCL does not have.
    fn missing(lib: &Nccl, function: &str) -> NcclError {
        let v = lib.version_string();
        let message = format!("NCCL {v} has no {function}; kvstore needs NCCL >= 2.14");
        NcclError { message }
    }

    /// The crate's error for this failure, during `op` on `keys`.
    pub(crate) fn during(self, op: &'static str, keys: &[Key]) -> Error {
        nccl_error(op, keys, self.message)
    }
}

/// Names the operation and keys of a failed NCCL call, making it the crate's [`Error::Nccl`].
pub(crate) trait During<T> {
    /// The value, or the error during `op` on `keys`.
    fn during(self, op: &'static str, keys: &[Key]) -> Result<T>;
}

impl<T> During<T> for NcclResult<T> {
    fn during(self, op: &'static str, keys: &[Key]) -> Result<T> {
        self.map_err(|e| e.during(op, keys))
    }
}

/// The one place a return code is read (`comm` names the call's communicator, or is null).
fn check(lib: &Nccl, code: c_int, comm: Comm) -> NcclResult<Status> {
    match code {
        SUCCESS => Ok(Status::Done),
        IN_PROGRESS => Ok(Status::InProgress),
        _ => Err(NcclError::from_code(lib, code, comm)),
    }
}

/// [`check`], for calls whose "in progress" the caller polls afterwards
/// ([`comm_get_async_error`]).
fn accepted(lib: &Nccl, code: c_int, comm: Comm) -> NcclResult {
    check(lib, code, comm).map(drop)
}

/// `ncclSum`.
const NCCL_SUM: c_int = 0;

/// The NCCL element type of a dtype (`ncclDataType_t`).
fn nccl_dtype(dtype: DType) -> c_int {
    match dtype {
        DType::F16 => 6,
        DType::F32 => 7,
        DType::F64 => 8,
        DType::BF16 => 9,
    }
}

/// `ncclGetErrorString`, as `NCCL error <code>: <text>`.
fn error_string(lib: &Nccl, code: c_int) -> String {
    // SAFETY: ncclGetErrorString takes any code and returns a static NUL-terminated string
    // (or null).
    let p = unsafe { (lib.get_error_string)(code) };
    if p.is_null() {
        return format!("NCCL error {code}");
    }
    // SAFETY: non-null, static and NUL-terminated (see above).
    let s = unsafe { CStr::from_ptr(p) }.to_string_lossy();
    format!("NCCL error {code}: {s}")
}

/// `ncclGetLastError` (empty when there is none, or before NCCL 2.13, which lacks it).
///
/// # Safety
///
/// `comm` is a live communicator or null.
unsafe fn last_error(lib: &Nccl, comm: Comm) -> String {
    let Some(f) = lib.get_last_error else {
        return String::new();
    };
    // SAFETY: `comm` is live or null (this function's contract); the string is NCCL's, copied
    // out below before any other NCCL call can replace it.
    let p = unsafe { f(comm) };
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null and NUL-terminated, per NCCL's API.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// `ncclGetUniqueId`: a fresh id for a new set of communicators.
pub(crate) fn get_unique_id(lib: &Nccl) -> NcclResult<UniqueId> {
    let mut id = UniqueId([0; 128]);
    // SAFETY: `id` is a valid, writable `ncclUniqueId`.
    let code = unsafe { (lib.get_unique_id)(&mut id) };
    accepted(lib, code, std::ptr::null_mut())?;
    Ok(id)
}

/// [`comm_init_rank_config`]'s error when this NCCL lacks it (before 2.14), so a caller can
/// find out before it starts a group.
pub(crate) fn require_comm_init_rank_config(lib: &Nccl) -> NcclResult {
    (lib.comm_init_rank_config.map(drop))
        .ok_or_else(|| NcclError::missing(lib, "ncclCommInitRankConfig"))
}

/// `ncclCommInitRankConfig`: writes rank `rank` of `nranks`'s communicator for `id` to `comm`.
///
/// # Safety
///
/// The calling thread's current CUDA device is the rank's. Inside a group, `comm` and `config`
/// stay valid (neither moved nor dropped) until the group ends.
pub(crate) unsafe fn comm_init_rank_config(
    lib: &Nccl,
    comm: &mut Comm,
    nranks: usize,
    id: UniqueId,
    rank: usize,
    config: &mut Config,
) -> NcclResult {
    let Some(f) = lib.comm_init_rank_config else {
        return Err(NcclError::missing(lib, "ncclCommInitRankConfig"));
    };
    // SAFETY: `comm` and `config` are valid pointers that outlive the call (and, inside a
    // group, the group: this function's contract); the current device is the rank's.
    let code = unsafe { f(comm, nranks as c_int, id, rank as c_int, config) };
    accepted(lib, code, *comm)
}

/// `ncclCommGetAsyncError`: whether the communicator is done or still working; an error when
/// the call, or the communicator's work, failed.
///
/// # Safety
///
/// `comm` is a live communicator, and no other call on it runs concurrently.
pub(crate) unsafe fn comm_get_async_error(lib: &Nccl, comm: Comm) -> NcclResult<Status> {
    let mut state = SUCCESS;
    // SAFETY: `comm` is live and not in concurrent use (this function's contract); `state` is a
    // valid out-pointer.
    let code = unsafe { (lib.comm_get_async_error)(comm, &mut state) };
    check(lib, code, comm)?;
    check(lib, state, comm)
}

/// `ncclCommFinalize` (non-blocking communicators report "in progress": poll with
/// [`comm_get_async_error`]); an error when this NCCL lacks it (before 2.14).
///
/// # Safety
///
/// `comm` is a live communicator with no call on it running concurrently.
pub(crate) unsafe fn comm_finalize(lib: &Nccl, comm: Comm) -> NcclResult {
    let Some(f) = lib.comm_finalize else {
        return Err(NcclError::missing(lib, "ncclCommFinalize"));
    };
    // SAFETY: `comm` is live and not in concurrent use (this function's contract).
    let code = unsafe { f(comm) };
    accepted(lib, code, comm)
}

/// Frees a communicator: `ncclCommAbort` when `abort` (which ends its work without waiting for
/// it), else `ncclCommDestroy`.
///
/// # Safety
///
/// `comm` is a live communicator, freed only here and never used again.
pub(crate) unsafe fn comm_free(lib: &Nccl, comm: Comm, abort: bool) -> NcclResult {
    let f = if abort {
        lib.comm_abort
    } else {
        lib.comm_destroy
    };
    // SAFETY: `comm` is live and used for the last time (this function's contract).
    let code = unsafe { f(comm) };
    // The handle is freed: no last error is asked of it.
    accepted(lib, code, std::ptr::null_mut())
}

/// Ends communicators that are done with: finalizes them where this NCCL can, waits with
/// `settle` (which says whether it succeeded), then destroys them; aborts them instead when
/// either step fails.
///
/// # Safety
///
/// `comms` are live communicators, used by nothing else now, and never used after this.
pub(crate) unsafe fn close(lib: &Nccl, comms: &[Comm], settle: impl FnOnce() -> bool) {
    let mut ok = true;
    if lib.comm_finalize.is_some() {
        for &c in comms {
            // SAFETY: live and not in use elsewhere (this function's contract).
            ok &= unsafe { comm_finalize(lib, c) }.is_ok();
        }
        ok = ok && settle();
    }
    for &c in comms {
        // SAFETY: each is freed once, here, and never used again (this function's contract);
        // closing has no use for the result.
        let _ = unsafe { comm_free(lib, c, !ok) };
    }
}

/// `ncclGroupStart`: the calls until [`group_end`] on this thread form one group.
pub(crate) fn group_start(lib: &Nccl) -> NcclResult {
    // SAFETY: no arguments; an open group only defers the calls made inside it.
    let code = unsafe { (lib.group_start)() };
    accepted(lib, code, std::ptr::null_mut())
}

/// `ncclGroupEnd`: issues the calls since [`group_start`].
pub(crate) fn group_end(lib: &Nccl) -> NcclResult {
    // SAFETY: no arguments; NCCL reports a group end with no group open as an error code.
    let code = unsafe { (lib.group_end)() };
    accepted(lib, code, std::ptr::null_mut())
}

/// Where a collective is issued: a live communicator and a live stream (`CUstream`) of its
/// rank's GPU.
#[derive(Clone, Copy)]
pub(crate) struct On<'a> {
    /// The loaded NCCL.
    pub lib: &'a Nccl,
    /// The rank's communicator.
    pub comm: Comm,
    /// The stream the collective is enqueued on.
    pub stream: *mut c_void,
}

impl<'a> On<'a> {
    /// `comm` with `stream`.
    pub(crate) fn new(lib: &'a Nccl, comm: Comm, stream: &CudaStream) -> On<'a> {
        let stream = stream.cu_stream() as *mut c_void;
        On { lib, comm, stream }
    }

    /// [`accepted`], for a call on this communicator.
    fn accepted(self, code: c_int) -> NcclResult {
        accepted(self.lib, code, self.comm)
    }
}

/// `ncclReduce` with `ncclSum`: sums every rank's `send` into `recv` on rank `root` (only the
/// root's `recv` is used).
///
/// # Safety
///
/// `on.comm` is a live communicator with no call on it running concurrently, and `on.stream` a
/// live stream of the rank's GPU. `send` (and, on the root, `recv`) are device addresses on
/// that GPU of `count` elements of `dtype`, which stay allocated until the collective is done
/// on the stream; `recv` may equal `send`.
pub(crate) unsafe fn reduce(
    on: On,
    send: u64,
    recv: u64,
    count: usize,
    dtype: DType,
    root: usize,
) -> NcclResult {
    let (dt, root) = (nccl_dtype(dtype), root as c_int);
    let (s, r) = (send as _, recv as _);
    // SAFETY: the communicator, stream and buffers are as this function's contract says.
    on.accepted(unsafe { (on.lib.reduce)(s, r, count, dt, NCCL_SUM, root, on.comm, on.stream) })
}

/// `ncclBroadcast`: copies `send` on rank `root` into every rank's `recv` (only the root's
/// `send` is used).
///
/// # Safety
///
/// As for [`reduce`] (`send` only on the root).
pub(crate) unsafe fn broadcast(
    on: On,
    send: u64,
    recv: u64,
    count: usize,
    dtype: DType,
    root: usize,
) -> NcclResult {
    let (dt, root) = (nccl_dtype(dtype), root as c_int);
    // SAFETY: the communicator, stream and buffers are as this function's contract says.
    on.accepted(unsafe {
        (on.lib.broadcast)(send as _, recv as _, count, dt, root, on.comm, on.stream)
    })
}

/// `ncclReduceScatter` with `ncclSum`: sums every rank's `send` (`recv_count` elements per
/// rank, in rank order), leaving this rank's slice of the sum in `recv`.
///
/// # Safety
///
/// As for [`reduce`], with `send` of `recv_count * nranks` elements and `recv` of `recv_count`.
pub(crate) unsafe fn reduce_scatter(
    on: On,
    send: u64,
    recv: u64,
    recv_count: usize,
    dtype: DType,
) -> NcclResult {
    let (n, dt) = (recv_count, nccl_dtype(dtype));
    // SAFETY: the communicator, stream and buffers are as this function's contract says.
    on.accepted(unsafe {
        (on.lib.reduce_scatter)(send as _, recv as _, n, dt, NCCL_SUM, on.comm, on.stream)
    })
}

/// `ncclAllGather`: gathers every rank's `send` (`send_count` elements) into every rank's
/// `recv`, in rank order.
///
/// # Safety
///
/// As for [`reduce`], with `send` of `send_count` elements and `recv` of `send_count * nranks`.
pub(crate) unsafe fn all_gather(
    on: On,
    send: u64,
    recv: u64,
    send_count: usize,
    dtype: DType,
) -> NcclResult {
    let (n, dt) = (send_count, nccl_dtype(dtype));
    // SAFETY: the communicator, stream and buffers are as this function's contract says.
    on.accepted(unsafe { (on.lib.all_gather)(send as _, recv as _, n, dt, on.comm, on.stream) })
}

/// `ncclSend`: sends `count` elements at `send` to rank `peer`'s matching [`recv`] (in a group
/// with the matching receives: one step of an all-to-all).
///
/// # Safety
///
/// As for [`reduce`], with one buffer of `count` elements.
pub(crate) unsafe fn send(
    on: On,
    send: u64,
    count: usize,
    dtype: DType,
    peer: usize,
) -> NcclResult {
    let (dt, peer) = (nccl_dtype(dtype), peer as c_int);
    // SAFETY: the communicator, stream and buffer are as this function's contract says.
    on.accepted(unsafe { (on.lib.send)(send as _, count, dt, peer, on.comm, on.stream) })
}

/// `ncclRecv`: receives `count` elements from rank `peer`'s matching [`send`] into `recv`.
///
/// # Safety
///
/// As for [`send`], with `recv` written.
pub(crate) unsafe fn recv(
    on: On,
    recv: u64,
    count: usize,
    dtype: DType,
    peer: usize,
) -> NcclResult {
    let (dt, peer) = (nccl_dtype(dtype), peer as c_int);
    // SAFETY: the communicator, stream and buffer are as this function's contract says.
    on.accepted(unsafe { (on.lib.recv)(recv as _, count, dt, peer, on.comm, on.stream) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_dtypes_match_nccl_h() {
        assert_eq!(
            [DType::F16, DType::F32, DType::F64, DType::BF16].map(nccl_dtype),
            [6, 7, 8, 9]
        );
    }
}
