//! A test-only hook, off unless its environment variables are set: it lets a fault test act at a
//! known point of a big transfer (cut a link, kill a host) instead of after a guessed sleep.
//!
//! - `KVSTORE_TEST_ANNOUNCE_BYTES=N`: the first collective of at least `N` bytes that this
//!   process starts with requests to poll (every non-blocking one: a sliced key's
//!   reduce-scatter and all-gather, a broadcast, a reduce that does not run blocking; and the
//!   root's receives of a blocking reduce over 3 or more ranks) prints one line on stderr just
//!   before it starts:
//!   `kvstore-test-hook: rank R (host H): call #S starts its reduce-scatter of B bytes`.
//! - `KVSTORE_TEST_HOLD_SECS=T`: after that line the rank sleeps `T` seconds before it starts
//!   the collective, so the other ranks are inside it, waiting for this one, when the test
//!   acts on the line.
//!
//! Neither is read by anything else, and a bad value turns the hook off. The hook exists only
//! with the `test-util` feature (on in the crate's own tests and examples, off in a library
//! built for users). Used by `scripts/cluster-faults.sh`, through `examples/dist_probe.rs`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use super::control;

/// The hook's settings: (announce from this many bytes, hold this long).
fn settings() -> Option<(usize, Duration)> {
    static SETTINGS: OnceLock<Option<(usize, Duration)>> = OnceLock::new();
    *SETTINGS.get_or_init(|| {
        let bytes = std::env::var("KVSTORE_TEST_ANNOUNCE_BYTES")
            .ok()?
            .trim()
            .parse()
            .ok()?;
        // Unset: no hold. Set but not a number of seconds that a Duration holds (negative,
        // NaN, 1e300: `Duration::from_secs_f64` would panic): the hook is off, as the module
        // says, so a test that relies on the hold fails for want of its line.
        let hold = match std::env::var("KVSTORE_TEST_HOLD_SECS") {
            Err(_) => Duration::ZERO,
            Ok(v) => Duration::try_from_secs_f64(v.trim().parse::<f64>().ok()?).ok()?,
        };
        Some((bytes, hold))
    })
}

/// Called just before a collective with requests to poll (`what`) of `bytes` starts in call `seq` on
/// rank `rank` of host `host`: announces the first big one, and holds it (see the module
/// documentation). Does nothing unless the hook is on.
pub(super) fn before_collective(
    (rank, host): (usize, &str),
    seq: u64,
    what: &dyn std::fmt::Display,
    bytes: usize,
) {
    static DONE: AtomicBool = AtomicBool::new(false);
    let Some((from, hold)) = settings() else {
        return;
    };
    if bytes < from || DONE.swap(true, Ordering::Relaxed) {
        return;
    }
    control::say(&format!(
        "kvstore-test-hook: rank {rank} (host {host}): call #{seq} starts its {what} of {bytes} \
         bytes"
    ));
    std::thread::sleep(hold);
}
