//! The result layer: one thin wrapper per NCCL function kvstore calls, over the raw function
//! table of [`super::loader`] (the sys layer).
//!
//! Every `ncclResult_t` is read in [`check`], and only there: `ncclSuccess` and
//! `ncclInProgress` (a non-blocking call still running) are accepted, anything else becomes an
//! [`NcclError`] carrying NCCL's own text for the code and its last error message. The layer
//! above (the communicator sets, [`RankComm`](super::RankComm), the group runner) calls only
//! these wrappers and names the operation and keys with [`During::during`].
//!
//! A wrapper is an `unsafe fn` where the call is sound only under conditions the types cannot
//! show (a live communicator, device buffers of the right length, a config that outlives its
//! group); its `# Safety` section says which. The others are safe functions.

#![deny(unsafe_op_in_unsafe_fn)]

use std::ffi::{c_int, c_void, CStr};

use cudarc::driver::CudaStream;

use super::loader::{self, Comm, Config, Nccl, UniqueId, IN_PROGRESS, SUCCESS};
use crate::{DType, Error, Key, Result};

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

/// An NCCL call that failed: NCCL's text for the return code and its last error message, or
/// the name of a function the loaded library lacks.
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
        // NCCL accepts either (and reads the thread's last error regardless of it).
        let last = unsafe { last_error(lib, comm) };
        if !last.is_empty() {
            message = format!("{message} ({last})");
        }
        NcclError { message }
    }

    /// The error of a call to `function`, which this NCCL does not have.
    fn missing(lib: &Nccl, function: &str) -> NcclError {
        NcclError {
            message: format!(
                "NCCL {} has no {function}; kvstore needs NCCL >= 2.14",
                lib.version_string()
            ),
        }
    }

    /// The crate's error for this failure, during `op` on `keys`.
    pub(crate) fn during(self, op: &'static str, keys: &[Key]) -> Error {
        nccl_error(op, keys, self.message)
    }
}

/// Names the operation and keys of a failed NCCL call, making it the crate's [`Error::Nccl`].
pub(crate) trait During<T> {
    /// The crate's result: the value, or the error during `op` on `keys`.
    fn during(self, op: &'static str, keys: &[Key]) -> Result<T>;
}

impl<T> During<T> for std::result::Result<T, NcclError> {
    fn during(self, op: &'static str, keys: &[Key]) -> Result<T> {
        self.map_err(|e| e.during(op, keys))
    }
}

/// The one place a return code is read: success and "in progress" are accepted, anything else
/// is an error with NCCL's message (`comm` names the communicator the call was on, or null).
fn check(lib: &Nccl, code: c_int, comm: Comm) -> std::result::Result<Status, NcclError> {
    match code {
        SUCCESS => Ok(Status::Done),
        IN_PROGRESS => Ok(Status::InProgress),
        _ => Err(NcclError::from_code(lib, code, comm)),
    }
}

/// [`check`], for calls whose "in progress" needs no action here: the caller polls the
/// communicator with [`comm_get_async_error`] afterwards.
fn accepted(lib: &Nccl, code: c_int, comm: Comm) -> std::result::Result<(), NcclError> {
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

/// `ncclGetErrorString`: NCCL's message for a return code, as `NCCL error <code>: <text>`.
pub(crate) fn error_string(lib: &Nccl, code: c_int) -> String {
    // SAFETY: ncclGetErrorString takes any code and returns a pointer to a static
    // NUL-terminated string (or null); it is only read here.
    let p = unsafe { (lib.get_error_string)(code) };
    if p.is_null() {
        return format!("NCCL error {code}");
    }
    // SAFETY: non-null, static and NUL-terminated (see above).
    let s = unsafe { CStr::from_ptr(p) }.to_string_lossy();
    format!("NCCL error {code}: {s}")
}

/// `ncclGetLastError`: NCCL's last error text (empty when there is none, or before NCCL 2.13,
/// which lacks the function).
///
/// # Safety
///
/// `comm` is a live communicator or null.
pub(crate) unsafe fn last_error(lib: &Nccl, comm: Comm) -> String {
    let Some(f) = lib.get_last_error else {
        return String::new();
    };
    // SAFETY: `comm` is live or null (this function's contract); the string returned is owned
    // by NCCL and copied out below, before any other NCCL call can replace it.
    let p = unsafe { f(comm) };
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null and NUL-terminated, per NCCL's API.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// `ncclGetUniqueId`: a fresh id for a new set of communicators.
pub(crate) fn get_unique_id(lib: &Nccl) -> std::result::Result<UniqueId, NcclError> {
    let mut id = UniqueId([0; 128]);
    // SAFETY: `id` is a valid, writable `ncclUniqueId`.
    let code = unsafe { (lib.get_unique_id)(&mut id) };
    accepted(lib, code, std::ptr::null_mut())?;
    Ok(id)
}

/// Fails, with the message [`comm_init_rank_config`] would give, when this NCCL has no
/// `ncclCommInitRankConfig` (before 2.14), so a caller can find out before it starts a group.
pub(crate) fn require_comm_init_rank_config(lib: &Nccl) -> std::result::Result<(), NcclError> {
    match lib.comm_init_rank_config {
        Some(_) => Ok(()),
        None => Err(NcclError::missing(lib, "ncclCommInitRankConfig")),
    }
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
) -> std::result::Result<(), NcclError> {
    let Some(f) = lib.comm_init_rank_config else {
        return Err(NcclError::missing(lib, "ncclCommInitRankConfig"));
    };
    // SAFETY: `comm` and `config` are valid pointers that outlive the call (and, inside a
    // group, the group: this function's contract); the current device is the rank's.
    let code = unsafe { f(comm, nranks as c_int, id, rank as c_int, config) };
    accepted(lib, code, *comm)
}

/// `ncclCommGetAsyncError`: whether the communicator is done, or still working; an error when
/// the call, or the communicator's work, failed.
///
/// # Safety
///
/// `comm` is a live communicator, and no other call on it runs concurrently.
pub(crate) unsafe fn comm_get_async_error(
    lib: &Nccl,
    comm: Comm,
) -> std::result::Result<Status, NcclError> {
    let mut state = SUCCESS;
    // SAFETY: `comm` is live and not in concurrent use (this function's contract); `state` is a
    // valid out-pointer.
    let code = unsafe { (lib.comm_get_async_error)(comm, &mut state) };
    check(lib, code, comm)?;
    check(lib, state, comm)
}

/// `ncclCommFinalize` (non-blocking communicators report "in progress": poll with
/// [`comm_get_async_error`]). An error when this NCCL lacks the function (before 2.14).
///
/// # Safety
///
/// `comm` is a live communicator with no call on it running concurrently.
pub(crate) unsafe fn comm_finalize(lib: &Nccl, comm: Comm) -> std::result::Result<(), NcclError> {
    let Some(f) = lib.comm_finalize else {
        return Err(NcclError::missing(lib, "ncclCommFinalize"));
    };
    // SAFETY: `comm` is live and not in concurrent use (this function's contract).
    let code = unsafe { f(comm) };
    accepted(lib, code, comm)
}

/// `ncclCommDestroy`: frees a communicator.
///
/// # Safety
///
/// `comm` is a live communicator, destroyed or aborted only here and never used again.
pub(crate) unsafe fn comm_destroy(lib: &Nccl, comm: Comm) -> std::result::Result<(), NcclError> {
    // SAFETY: `comm` is live and used for the last time (this function's contract).
    let code = unsafe { (lib.comm_destroy)(comm) };
    // The handle is freed: no last error is asked of it.
    accepted(lib, code, std::ptr::null_mut())
}

/// `ncclCommAbort`: ends the communicator's work without waiting for it, and frees it.
///
/// # Safety
///
/// `comm` is a live communicator, aborted or destroyed only here and never used again.
pub(crate) unsafe fn comm_abort(lib: &Nccl, comm: Comm) -> std::result::Result<(), NcclError> {
    // SAFETY: `comm` is live and used for the last time (this function's contract).
    let code = unsafe { (lib.comm_abort)(comm) };
    // The handle is freed: no last error is asked of it.
    accepted(lib, code, std::ptr::null_mut())
}

/// Ends communicators that are done with: finalizes them where this NCCL can, waits with
/// `settle` (which says whether it succeeded) for the finalization, then destroys them; aborts
/// them instead when either step fails.
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
        // SAFETY: each is destroyed or aborted once, here, and never used again (this
        // function's contract); closing has no use for the result.
        let _ = unsafe {
            match ok {
                true => comm_destroy(lib, c),
                false => comm_abort(lib, c),
            }
        };
    }
}

/// `ncclGroupStart`: the calls until [`group_end`] on this thread form one group.
pub(crate) fn group_start(lib: &Nccl) -> std::result::Result<(), NcclError> {
    // SAFETY: no arguments; an open group only defers the calls made inside it.
    let code = unsafe { (lib.group_start)() };
    accepted(lib, code, std::ptr::null_mut())
}

/// `ncclGroupEnd`: issues the calls since [`group_start`].
pub(crate) fn group_end(lib: &Nccl) -> std::result::Result<(), NcclError> {
    // SAFETY: no arguments; NCCL reports a group end with no group open as an error code.
    let code = unsafe { (lib.group_end)() };
    accepted(lib, code, std::ptr::null_mut())
}

/// Where a collective is issued: a live communicator and a live stream of its rank's GPU (a
/// `CUstream`).
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
}

/// `ncclReduce` with `ncclSum`: sums every rank's `send` into `recv` on rank `root` (only the
/// root's `recv` is used).
///
/// # Safety
///
/// `on.comm` is a live communicator with no call on it running concurrently, and `on.stream` a
/// live stream of the rank's GPU. `send` (and, on the root, `recv`) are device addresses on that
/// GPU of `count` elements of `dtype`, which stay allocated until the collective is done on the
/// stream; `recv` may equal `send`.
pub(crate) unsafe fn reduce(
    on: On,
    send: u64,
    recv: u64,
    count: usize,
    dtype: DType,
    root: usize,
) -> std::result::Result<(), NcclError> {
    let (dt, root) = (nccl_dtype(dtype), root as c_int);
    // SAFETY: the communicator, stream and buffers are as this function's contract says.
    let code = unsafe {
        (on.lib.reduce)(
            send as _, recv as _, count, dt, NCCL_SUM, root, on.comm, on.stream,
        )
    };
    accepted(on.lib, code, on.comm)
}

/// `ncclBroadcast`: copies `send` on rank `root` into every rank's `recv` (only the root's
/// `send` is used).
///
/// # Safety
///
/// As for [`reduce`]: a live communicator and stream, and device buffers of `count` elements
/// of `dtype` on the rank's GPU (`send` only on the root) that outlive the collective on the
/// stream; `recv` may equal `send`.
pub(crate) unsafe fn broadcast(
    on: On,
    send: u64,
    recv: u64,
    count: usize,
    dtype: DType,
    root: usize,
) -> std::result::Result<(), NcclError> {
    let (dt, root) = (nccl_dtype(dtype), root as c_int);
    // SAFETY: the communicator, stream and buffers are as this function's contract says.
    let code =
        unsafe { (on.lib.broadcast)(send as _, recv as _, count, dt, root, on.comm, on.stream) };
    accepted(on.lib, code, on.comm)
}

/// `ncclReduceScatter` with `ncclSum`: sums every rank's `send` (`recv_count` elements per
/// rank, in rank order), leaving this rank's slice of the sum in `recv`.
///
/// # Safety
///
/// As for [`reduce`], with `send` of `recv_count * nranks` elements and `recv` of
/// `recv_count`.
pub(crate) unsafe fn reduce_scatter(
    on: On,
    send: u64,
    recv: u64,
    recv_count: usize,
    dtype: DType,
) -> std::result::Result<(), NcclError> {
    let (n, dt) = (recv_count, nccl_dtype(dtype));
    // SAFETY: the communicator, stream and buffers are as this function's contract says.
    let code = unsafe {
        (on.lib.reduce_scatter)(send as _, recv as _, n, dt, NCCL_SUM, on.comm, on.stream)
    };
    accepted(on.lib, code, on.comm)
}

/// `ncclAllGather`: gathers every rank's `send` (`send_count` elements) into every rank's
/// `recv`, in rank order.
///
/// # Safety
///
/// As for [`reduce`], with `send` of `send_count` elements and `recv` of
/// `send_count * nranks`.
pub(crate) unsafe fn all_gather(
    on: On,
    send: u64,
    recv: u64,
    send_count: usize,
    dtype: DType,
) -> std::result::Result<(), NcclError> {
    let (n, dt) = (send_count, nccl_dtype(dtype));
    // SAFETY: the communicator, stream and buffers are as this function's contract says.
    let code = unsafe { (on.lib.all_gather)(send as _, recv as _, n, dt, on.comm, on.stream) };
    accepted(on.lib, code, on.comm)
}

/// `ncclSend`: sends `count` elements at `send` to rank `peer`, which receives them with a
/// matching [`recv`]. Inside a group, with the matching receives, it is one step of an
/// all-to-all.
///
/// # Safety
///
/// As for [`reduce`]: a live communicator and stream, and a device buffer of `count` elements
/// of `dtype` on the rank's GPU that outlives the transfer on the stream.
pub(crate) unsafe fn send(
    on: On,
    send: u64,
    count: usize,
    dtype: DType,
    peer: usize,
) -> std::result::Result<(), NcclError> {
    let (dt, peer) = (nccl_dtype(dtype), peer as c_int);
    // SAFETY: the communicator, stream and buffer are as this function's contract says.
    let code = unsafe { (on.lib.send)(send as _, count, dt, peer, on.comm, on.stream) };
    accepted(on.lib, code, on.comm)
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
) -> std::result::Result<(), NcclError> {
    let (dt, peer) = (nccl_dtype(dtype), peer as c_int);
    // SAFETY: the communicator, stream and buffer are as this function's contract says.
    let code = unsafe { (on.lib.recv)(recv as _, count, dt, peer, on.comm, on.stream) };
    accepted(on.lib, code, on.comm)
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
