//! Call counts per exported entry point, to see how many driver and NCCL calls an operation of
//! the store makes (the stand-in is the only place they can be observed without a GPU), and a
//! few counters of what the calls did ([`PAGEABLE_HTOD_BYTES`], [`PINNED_HTOD_BYTES`],
//! [`BLOCKS_LAUNCHED`], [`BLOCKS_IDLE`]), kept the same way under those names.
//!
//! - `KVSTORE_STANDIN_COUNT_CALLS=1`: at process exit, every entry point called and its count
//!   (all threads) are printed to stderr, one `[stand-in calls] name count` line each.
//! - `KVSTORE_STANDIN_TOTALS=<file>`: at process exit, the same lines are appended to that
//!   file, so a run of many test processes can sum them (`scripts/standin-gpu-tests.sh`).
//! - [`kvstore_standin_thread_calls`] (exported, so a test can find it with `dlsym`): the
//!   calls made so far by the calling thread (one name, or all of them for a null name), so a
//!   test can take the difference across one operation, whatever other test threads do.

use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, CStr};
use std::io::Write;
use std::sync::{Arc, Mutex, Once};

/// Bytes copied to a device from pageable host memory (`cuMemcpyHtoD*` from memory that is
/// not `cuMemHostAlloc`'s). CUDA stages such a copy through a driver buffer, synchronously,
/// so an upload path that should be asynchronous shows here.
pub const PAGEABLE_HTOD_BYTES: &str = "pageable HtoD bytes";
/// Bytes copied to a device from page-locked host memory (`cuMemHostAlloc`'s): the uploads
/// that are asynchronous.
pub const PINNED_HTOD_BYTES: &str = "pinned HtoD bytes";
/// Blocks in the grids of the kernels launched.
pub const BLOCKS_LAUNCHED: &str = "blocks launched";
/// Blocks of those that did no work: none of their threads stored to global memory.
/// Counted when the kernel runs, for the thread that launched it.
pub const BLOCKS_IDLE: &str = "blocks idle";

/// The counters that are not calls.
const COUNTERS: [&str; 4] = [
    PAGEABLE_HTOD_BYTES,
    PINNED_HTOD_BYTES,
    BLOCKS_LAUNCHED,
    BLOCKS_IDLE,
];

/// Counts per name.
pub type Counts = Arc<Mutex<BTreeMap<&'static str, u64>>>;

/// Every thread's counts.
static ALL: Mutex<BTreeMap<&'static str, u64>> = Mutex::new(BTreeMap::new());

thread_local! {
    /// This thread's counts (shared with the operations it enqueued, which may add to them
    /// when they run on another thread).
    static MINE: Counts = Counts::default();
}

extern "C" {
    fn atexit(cb: extern "C" fn()) -> c_int;
}

extern "C" fn print_counts() {
    let all = ALL.lock().unwrap_or_else(|e| e.into_inner());
    if std::env::var("KVSTORE_STANDIN_COUNT_CALLS").is_ok_and(|v| v == "1") {
        for (name, n) in all.iter() {
            eprintln!("[stand-in calls] {name} {n}");
        }
    }
    if let Some(path) = std::env::var_os("KVSTORE_STANDIN_TOTALS") {
        let lines: String = all
            .iter()
            .map(|(name, n)| format!("{name}\t{n}\n"))
            .collect();
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(lines.as_bytes()));
        if let Err(e) = written {
            crate::state::report(&format!("cannot append the call counts to {path:?}: {e}"));
        }
    }
}

/// Counts one call of `name` (the first statement of every exported entry point).
pub fn count(name: &'static str) {
    add(name, 1);
}

/// Adds `n` to counter `name`, for this thread and in all.
pub fn add(name: &'static str, n: u64) {
    // During thread teardown the thread-local may be gone: it is still counted in all.
    let _ = MINE.try_with(|m| add_to_thread(m, name, n));
    add_to_all(name, n);
}

/// This thread's counts, for an operation that adds to them later, from another thread.
pub fn mine() -> Option<Counts> {
    MINE.try_with(Arc::clone).ok()
}

/// Adds `n` to counter `name` of `counts` (a thread's, from [`mine`]) and in all.
pub fn add_to(counts: &Counts, name: &'static str, n: u64) {
    add_to_thread(counts, name, n);
    add_to_all(name, n);
}

fn add_to_thread(counts: &Counts, name: &'static str, n: u64) {
    *counts
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(name)
        .or_default() += n;
}

fn add_to_all(name: &'static str, n: u64) {
    static AT_EXIT: Once = Once::new();
    AT_EXIT.call_once(|| {
        let wanted = std::env::var("KVSTORE_STANDIN_COUNT_CALLS").is_ok_and(|v| v == "1")
            || std::env::var_os("KVSTORE_STANDIN_TOTALS").is_some();
        if wanted {
            // SAFETY: `print_counts` is a plain `extern "C" fn()` that lives as long as the
            // library, which stays loaded until exit (cudarc never unloads it).
            unsafe { atexit(print_counts) };
        }
    });
    *ALL.lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(name)
        .or_default() += n;
}

/// The calls the calling thread has made so far to entry point `name` (a NUL-terminated C
/// string), or to every entry point when `name` is null; or, for a counter's name
/// ([`PAGEABLE_HTOD_BYTES`], [`PINNED_HTOD_BYTES`], [`BLOCKS_LAUNCHED`], [`BLOCKS_IDLE`]), its
/// count for this thread.
///
/// # Safety
/// `name` is null or a valid NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn kvstore_standin_thread_calls(name: *const c_char) -> u64 {
    let name = if name.is_null() {
        None
    } else {
        // SAFETY: non-null, and NUL-terminated by the caller's contract.
        Some(
            unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned(),
        )
    };
    MINE.with(|m| {
        let m = m.lock().unwrap_or_else(|e| e.into_inner());
        match name {
            None => m
                .iter()
                .filter(|(k, _)| !COUNTERS.contains(k))
                .map(|(_, v)| v)
                .sum(),
            Some(n) => m.get(n.as_str()).copied().unwrap_or(0),
        }
    })
}
