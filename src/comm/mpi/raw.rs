//! Thin wrappers of the MPI C API the transport calls directly: handles that may cross
//! threads, error codes as messages, datatypes and `MPI_SUM`. rsmpi's safe collectives panic
//! when a request is dropped unfinished, and one that timed out can never finish, so the
//! transport owns its requests and buffers itself.

use std::os::raw::{c_char, c_int, c_void};

use mpi::datatype::Equivalence;
use mpi::ffi;
use mpi::raw::AsRaw;

use crate::{Error, Result};

/// A communicator handle.
#[derive(Clone, Copy)]
pub(super) struct Comm(pub(super) ffi::MPI_Comm);

// SAFETY: an MPI communicator handle is an opaque identifier that the library accepts from any
// thread. The transport asks for MPI_THREAD_SERIALIZED and makes every MPI call on its
// communicators while holding the world's one state mutex, so no two threads use MPI at once.
unsafe impl Send for Comm {}
// SAFETY: as for `Send`: shared references only hand the identifier to calls made under the mutex.
unsafe impl Sync for Comm {}

/// A request handle; transparent, so a slice of them is an array of `MPI_Request`.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub(super) struct Request(pub(super) ffi::MPI_Request);

// SAFETY: as for `Comm`: an opaque identifier, used only under the world's state mutex.
unsafe impl Send for Request {}
// SAFETY: as for `Send`.
unsafe impl Sync for Request {}

impl Request {
    /// `MPI_REQUEST_NULL`: what MPI leaves in a request once it has completed.
    pub(super) fn null() -> Request {
        // SAFETY: RSMPI_REQUEST_NULL is a constant handle that rsmpi's C shim exports; reading it
        // has no side effect.
        Request(unsafe { ffi::RSMPI_REQUEST_NULL })
    }

    /// Whether the request has completed (or never started).
    pub(super) fn is_null(self) -> bool {
        self.0 == Request::null().0
    }
}

/// Turns an MPI return code into a result; `op` says what was being done.
pub(super) fn check(op: &'static str, code: c_int) -> Result<()> {
    if code == ffi::MPI_SUCCESS as c_int {
        Ok(())
    } else {
        Err(Error::Mpi {
            op,
            message: error_string(code),
        })
    }
}

/// MPI's text for an error code.
pub(super) fn error_string(code: c_int) -> String {
    let mut buf = [0 as c_char; ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: `buf` holds MPI_MAX_ERROR_STRING characters as MPI requires, and `len` is a valid
    // out-pointer. MPI_Error_string may be called at any time, before init and after finalize.
    let rc = unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr(), &mut len) };
    if rc != ffi::MPI_SUCCESS as c_int {
        return format!("MPI error code {code}");
    }
    let text: &[u8] = bytemuck::cast_slice(&buf[..len.clamp(0, buf.len() as c_int) as usize]);
    format!("{} (code {code})", String::from_utf8_lossy(text))
}

/// The MPI datatype of a Rust type rsmpi knows.
pub(super) fn datatype<T: Equivalence>() -> ffi::MPI_Datatype {
    T::equivalent_datatype().as_raw()
}

/// `MPI_SUM`.
pub(super) fn op_sum() -> ffi::MPI_Op {
    mpi::collective::SystemOperation::sum().as_raw()
}

/// A buffer as MPI's `const void *`.
pub(super) fn ptr<T>(v: &[T]) -> *const c_void {
    v.as_ptr().cast()
}

/// A buffer as MPI's `void *`.
pub(super) fn ptr_mut<T>(v: &mut [T]) -> *mut c_void {
    v.as_mut_ptr().cast()
}

/// An element count as MPI's `int`, or an error naming the op.
pub(super) fn count(op: &'static str, n: usize) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| Error::Mpi {
        op,
        message: format!(
            "{n} elements exceed MPI's int count ({}); split the value into smaller keys",
            c_int::MAX
        ),
    })
}

/// `MPI_Abort`: ends the job with `code`. Never calls `exit` (exit hooks call this).
pub(super) fn abort(code: c_int) -> ! {
    // SAFETY: MPI_Abort may be called at any time after MPI_Init and from any thread; the world
    // communicator handle is a constant that rsmpi's C shim exports.
    unsafe {
        ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code);
    }
    // MPI_Abort should not return; if it does, end without exit hooks (`exit` inside an exit
    // hook is undefined behaviour).
    // SAFETY: `_exit` ends the process at once; it is async-signal-safe and never returns.
    unsafe { libc::_exit(if code == 0 { 1 } else { code }) }
}
