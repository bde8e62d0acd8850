//! Call counts per exported entry point, to see how many driver and NCCL calls an operation of
//! the store makes (the stand-in is the only place they can be observed without a GPU).
//!
//! - `KVSTORE_STANDIN_COUNT_CALLS=1`: at process exit, every entry point called and its count
//!   (all threads) are printed to stderr, one `[stand-in calls] name count` line each.
//! - [`kvstore_standin_thread_calls`] (exported, so a test can find it with `dlsym`): the
//!   calls made so far by the calling thread (one name, or all of them for a null name), so a
//!   test can take the difference across one operation, whatever other test threads do.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, CStr};
use std::sync::{Mutex, Once};

/// Every thread's calls, per entry point.
static ALL: Mutex<BTreeMap<&'static str, u64>> = Mutex::new(BTreeMap::new());

thread_local! {
    /// This thread's calls, per entry point.
    static MINE: RefCell<BTreeMap<&'static str, u64>> = const { RefCell::new(BTreeMap::new()) };
}

extern "C" {
    fn atexit(cb: extern "C" fn()) -> c_int;
}

extern "C" fn print_counts() {
    let all = ALL.lock().unwrap_or_else(|e| e.into_inner());
    for (name, n) in all.iter() {
        eprintln!("[stand-in calls] {name} {n}");
    }
}

/// Counts one call of `name` (the first statement of every exported entry point).
pub fn count(name: &'static str) {
    static PRINT: Once = Once::new();
    PRINT.call_once(|| {
        if std::env::var("KVSTORE_STANDIN_COUNT_CALLS").is_ok_and(|v| v == "1") {
            // SAFETY: `print_counts` is a plain `extern "C" fn()` that lives as long as the
            // library, which stays loaded until exit (cudarc never unloads it).
            unsafe { atexit(print_counts) };
        }
    });
    *ALL.lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(name)
        .or_default() += 1;
    // During thread teardown the thread-local may be gone: the call is still counted above.
    let _ = MINE.try_with(|m| *m.borrow_mut().entry(name).or_default() += 1);
}

/// The calls the calling thread has made so far to entry point `name` (a NUL-terminated C
/// string), or to every entry point when `name` is null.
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
        let m = m.borrow();
        match name {
            None => m.values().sum(),
            Some(n) => m.get(n.as_str()).copied().unwrap_or(0),
        }
    })
}
