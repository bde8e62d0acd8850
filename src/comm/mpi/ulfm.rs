//! Open MPI 5's fault tolerance (ULFM, `mpirun --with-ft ulfm`), where the MPI library has it:
//! a rank lost during a call is named, and the world's communicators are revoked, so every
//! survivor's call ends at once with the same cause instead of an MPI error code.
//!
//! The `MPIX_` functions are looked up at run time in the MPI library already loaded. An MPI
//! without them (Debian's Open MPI 4.1, which has the same library name, `libmpi.so.40`)
//! cannot link them, and its error classes 75 to 77 mean something else: without the functions
//! no error is read as ULFM's.

use std::ffi::CStr;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use mpi::ffi;

/// ULFM's error classes (Open MPI's `MPIX_ERR_PROC_FAILED`, `_PROC_FAILED_PENDING`, `_REVOKED`).
const PROC_FAILED: c_int = 75;
const PROC_FAILED_PENDING: c_int = 76;
const REVOKED: c_int = 77;

/// How long a rank whose MPI call failed waits to hear of a lost rank before it takes the
/// failure for another kind (Open MPI's runtime told every process within 5 ms in the probe).
pub(super) const HEAR_WITHIN: std::time::Duration = std::time::Duration::from_millis(500);

type Revoke = unsafe extern "C" fn(ffi::MPI_Comm) -> c_int;
type AckFailed = unsafe extern "C" fn(ffi::MPI_Comm, c_int, *mut c_int) -> c_int;
type GetFailed = unsafe extern "C" fn(ffi::MPI_Comm, *mut ffi::MPI_Group) -> c_int;
type IsRevoked = unsafe extern "C" fn(ffi::MPI_Comm, *mut c_int) -> c_int;
type Shrink = unsafe extern "C" fn(ffi::MPI_Comm, *mut ffi::MPI_Comm) -> c_int;
type Iagree = unsafe extern "C" fn(ffi::MPI_Comm, *mut c_int, *mut ffi::MPI_Request) -> c_int;

/// The functions this module calls.
struct Fns {
    revoke: Revoke,
    ack_failed: AckFailed,
    get_failed: GetFailed,
    is_revoked: IsRevoked,
    shrink: Shrink,
    iagree: Iagree,
}

/// The MPI library's ULFM functions, looked up once; `None` where it has none.
fn fns() -> Option<&'static Fns> {
    static FNS: OnceLock<Option<Fns>> = OnceLock::new();
    FNS.get_or_init(|| {
        let lib = loaded_mpi()?;
        let find = |name: &CStr| {
            // SAFETY: `lib` is a handle dlopen returned, and `name` a NUL-terminated string.
            let f = unsafe { libc::dlsym(lib, name.as_ptr()) };
            (!f.is_null()).then_some(f)
        };
        let (revoke, ack, get, is_revoked, shrink, iagree) = (
            find(c"MPIX_Comm_revoke")?,
            find(c"MPIX_Comm_ack_failed")?,
            find(c"MPIX_Comm_get_failed")?,
            find(c"MPIX_Comm_is_revoked")?,
            find(c"MPIX_Comm_shrink")?,
            find(c"MPIX_Comm_iagree")?,
        );
        // SAFETY: each symbol is the function of that name, whose C signature (Open MPI 5's
        // mpiext_ftmpi_c.h) is the type it is transmuted to.
        unsafe {
            Some(Fns {
                revoke: std::mem::transmute::<*mut libc::c_void, Revoke>(revoke),
                ack_failed: std::mem::transmute::<*mut libc::c_void, AckFailed>(ack),
                get_failed: std::mem::transmute::<*mut libc::c_void, GetFailed>(get),
                is_revoked: std::mem::transmute::<*mut libc::c_void, IsRevoked>(is_revoked),
                shrink: std::mem::transmute::<*mut libc::c_void, Shrink>(shrink),
                iagree: std::mem::transmute::<*mut libc::c_void, Iagree>(iagree),
            })
        }
    })
    .as_ref()
}

/// A handle of the MPI library this process linked (found from the address of one of its
/// functions: a Python extension loads it privately, out of `RTLD_DEFAULT`'s reach).
fn loaded_mpi() -> Option<*mut libc::c_void> {
    let mut info: libc::Dl_info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    let probe = ffi::MPI_Error_class as *const libc::c_void;
    // SAFETY: `probe` is the address of a function of the loaded MPI library, and `info` a
    // valid out-pointer.
    if unsafe { libc::dladdr(probe, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: `dli_fname` names a library already loaded (RTLD_NOLOAD: nothing new is loaded);
    // the handle is never closed, so the library's functions stay valid.
    let lib = unsafe { libc::dlopen(info.dli_fname, libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    (!lib.is_null()).then_some(lib)
}

/// Whether MPI error `code` says a rank was lost (or the communicator revoked after a loss),
/// under an MPI with ULFM.
pub(super) fn is_loss(code: c_int) -> bool {
    if fns().is_none() || code == ffi::MPI_SUCCESS as c_int {
        return false;
    }
    let mut class: c_int = 0;
    // SAFETY: MPI_Error_class may be called at any time with any code; `class` is a valid
    // out-pointer.
    let rc = unsafe { ffi::MPI_Error_class(code, &mut class) };
    rc == ffi::MPI_SUCCESS as c_int && matches!(class, PROC_FAILED | PROC_FAILED_PENDING | REVOKED)
}

/// The ranks of `comm` this rank knows to have failed, in order (then acknowledged); empty
/// without ULFM.
///
/// # Safety
/// MPI is initialised and not finalised, the caller holds the world's state lock, and `comm`
/// is valid.
pub(super) unsafe fn failed(comm: ffi::MPI_Comm) -> Vec<usize> {
    let Some(f) = fns() else {
        return Vec::new();
    };
    // SAFETY: RSMPI_GROUP_NULL is a constant handle that rsmpi's C shim exports.
    let null = unsafe { ffi::RSMPI_GROUP_NULL };
    let (mut failed, mut all) = (null, null);
    // SAFETY: the communicator is valid; the out-pointers are valid.
    let ok = unsafe {
        (f.get_failed)(comm, &mut failed) == ffi::MPI_SUCCESS as c_int
            && ffi::MPI_Comm_group(comm, &mut all) == ffi::MPI_SUCCESS as c_int
    };
    let mut ranks = Vec::new();
    if ok {
        let mut n: c_int = 0;
        // SAFETY: `failed` is a group MPI returned; `n` a valid out-pointer.
        unsafe { ffi::MPI_Group_size(failed, &mut n) };
        let inside: Vec<c_int> = (0..n.max(0)).collect();
        let mut theirs = vec![0 as c_int; inside.len()];
        // SAFETY: both groups are valid, and the arrays hold `n` ranks each.
        let rc = unsafe {
            ffi::MPI_Group_translate_ranks(failed, n, inside.as_ptr(), all, theirs.as_mut_ptr())
        };
        if rc == ffi::MPI_SUCCESS as c_int {
            ranks = theirs
                .into_iter()
                .filter_map(|r| usize::try_from(r).ok())
                .collect();
            ranks.sort_unstable();
        }
        // Acknowledged, so that a later agree on this communicator does not report them again.
        let mut acked: c_int = 0;
        // SAFETY: as above; `n` failures are known, so `n` may be acknowledged.
        unsafe { (f.ack_failed)(comm, n, &mut acked) };
    }
    for g in [&mut failed, &mut all] {
        if *g != null {
            // SAFETY: a group MPI returned, freed once.
            unsafe { ffi::MPI_Group_free(g) };
        }
    }
    ranks
}

/// How many ranks of `comm` this rank knows to have failed, acknowledging none (0 without
/// ULFM).
///
/// # Safety
/// As for [`failed`].
pub(super) unsafe fn failed_count(comm: ffi::MPI_Comm) -> usize {
    let Some(f) = fns() else {
        return 0;
    };
    // SAFETY: RSMPI_GROUP_NULL is a constant handle that rsmpi's C shim exports.
    let mut failed = unsafe { ffi::RSMPI_GROUP_NULL };
    // SAFETY: the communicator is valid; the out-pointer is valid.
    if unsafe { (f.get_failed)(comm, &mut failed) } != ffi::MPI_SUCCESS as c_int {
        return 0;
    }
    let mut n: c_int = 0;
    // SAFETY: `failed` is a group MPI returned, freed once below; `n` a valid out-pointer.
    unsafe {
        ffi::MPI_Group_size(failed, &mut n);
        ffi::MPI_Group_free(&mut failed);
    }
    usize::try_from(n).unwrap_or(0)
}

/// Whether another process revoked `comm` (after it saw a rank lost).
///
/// # Safety
/// As for [`failed`].
pub(super) unsafe fn is_revoked(comm: ffi::MPI_Comm) -> bool {
    let Some(f) = fns() else {
        return false;
    };
    let mut flag: c_int = 0;
    // SAFETY: a valid communicator (the caller's contract) and a valid out-pointer.
    unsafe { (f.is_revoked)(comm, &mut flag) == ffi::MPI_SUCCESS as c_int && flag != 0 }
}

/// Whether this process revoked its world after a loss ([`revoke`]).
static WORLD_REVOKED: AtomicBool = AtomicBool::new(false);

/// Revokes `comms`: every survivor's operation on them then ends at once. Nothing without ULFM.
///
/// # Safety
/// As for [`failed`], for every communicator.
pub(super) unsafe fn revoke(comms: &[ffi::MPI_Comm]) {
    if let Some(f) = fns() {
        WORLD_REVOKED.store(true, Ordering::Relaxed);
        for &c in comms {
            // SAFETY: a valid communicator (the caller's contract); revoking twice is allowed.
            unsafe { (f.revoke)(c) };
        }
    }
}

/// Whether this process revoked its world after a lost rank. Its exit then skips
/// `MPI_Abort`: Open MPI 5.0.11's mpirun (PRRTE) under `--with-ft ulfm` sometimes never
/// returns after it (measured: `research/ulfm-open-mpi-5.md` in the design notes), while the
/// processes' own exits end the job.
pub(super) fn revoked() -> bool {
    WORLD_REVOKED.load(Ordering::Relaxed)
}

/// Whether this MPI has ULFM's functions.
pub(super) fn available() -> bool {
    fns().is_some()
}

/// Whether the job runs with fault tolerance on (`mpirun --with-ft ulfm`, which sets
/// `OMPI_MCA_mpi_ft_enable=1`) under an MPI with ULFM: a lost rank then leaves the others
/// running, and the store goes on without it.
pub(super) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        let asked = std::env::var("OMPI_MCA_mpi_ft_enable")
            .is_ok_and(|v| matches!(v.trim(), "1" | "true" | "yes" | "on"));
        asked && available()
    })
}

/// Starts a fault-tolerant agreement on `comm` (`MPIX_Comm_iagree`: every survivor must join;
/// `flag` becomes the AND of every survivor's, and every survivor's completes with the same
/// flag and the same error code, even after a loss or a revoke).
///
/// # Safety
/// As for [`failed`]; `flag` and `request` stay valid, untouched, until the request completes.
pub(super) unsafe fn iagree(
    comm: ffi::MPI_Comm,
    flag: *mut c_int,
    request: *mut ffi::MPI_Request,
) -> c_int {
    match fns() {
        // SAFETY: as the caller promises.
        Some(f) => unsafe { (f.iagree)(comm, flag, request) },
        None => ffi::MPI_ERR_OTHER as c_int,
    }
}

/// The survivors of `comm` in a new communicator (`MPIX_Comm_shrink`: every survivor must
/// call it; it returns when all have), or the MPI error code.
///
/// # Safety
/// As for [`failed`].
pub(super) unsafe fn shrink(comm: ffi::MPI_Comm) -> Result<ffi::MPI_Comm, c_int> {
    let Some(f) = fns() else {
        return Err(ffi::MPI_ERR_OTHER as c_int);
    };
    // SAFETY: RSMPI_COMM_NULL is a constant handle that rsmpi's C shim exports.
    let mut out = unsafe { ffi::RSMPI_COMM_NULL };
    // SAFETY: a valid communicator (the caller's contract) and a valid out-pointer.
    match unsafe { (f.shrink)(comm, &mut out) } {
        rc if rc == ffi::MPI_SUCCESS as c_int => Ok(out),
        rc => Err(rc),
    }
}
