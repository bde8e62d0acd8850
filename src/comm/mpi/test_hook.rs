//! A test-only hook, off unless its environment variables are set: it lets a fault test act at a
//! known point of a big transfer (cut a link, kill a host) instead of after a guessed sleep.
//!
//! - `KVSTORE_TEST_ANNOUNCE_BYTES=N`: the first collective of at least `N` bytes with requests
//!   to poll (every non-blocking one, and the root's receives of a blocking reduce over 3 or
//!   more ranks) prints one line on stderr just before it starts:
//!   `kvstore-test-hook: rank R (host H): call #S starts its reduce-scatter of B bytes`.
//! - `KVSTORE_TEST_HOLD_SECS=T`: the rank then sleeps `T` seconds before it starts the
//!   collective, so the other ranks wait inside it when the test acts on the line.
//!
//! A bad value turns the hook off. It exists only with the `test-util` feature (the crate's
//! tests and examples). Used by `scripts/cluster-faults.sh`, through `examples/dist_probe.rs`.

use std::fmt::Display;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use super::{control, World};

/// The hook's settings: (announce from this many bytes, hold this long).
fn settings() -> Option<(usize, Duration)> {
    static SETTINGS: OnceLock<Option<(usize, Duration)>> = OnceLock::new();
    *SETTINGS.get_or_init(|| {
        let bytes = std::env::var("KVSTORE_TEST_ANNOUNCE_BYTES")
            .ok()?
            .trim()
            .parse()
            .ok()?;
        // Unset: no hold. Not a number of seconds a Duration holds (negative, NaN, 1e300:
        // `from_secs_f64` would panic): the hook is off, and a test relying on it fails.
        let hold = match std::env::var("KVSTORE_TEST_HOLD_SECS") {
            Err(_) => Duration::ZERO,
            Ok(v) => Duration::try_from_secs_f64(v.trim().parse::<f64>().ok()?).ok()?,
        };
        Some((bytes, hold))
    })
}

/// Announces and holds the first big polled collective (`what`), just before it starts.
pub(super) fn before_collective(world: &World, seq: u64, what: &dyn Display, bytes: usize) {
    static DONE: AtomicBool = AtomicBool::new(false);
    let Some((from, hold)) = settings() else {
        return;
    };
    if bytes < from || DONE.swap(true, Ordering::Relaxed) {
        return;
    }
    let (rank, host) = (world.rank, world.host_of(world.rank));
    control::say(&format!(
        "kvstore-test-hook: rank {rank} (host {host}): call #{seq} starts its {what} of {bytes} \
         bytes"
    ));
    std::thread::sleep(hold);
}
