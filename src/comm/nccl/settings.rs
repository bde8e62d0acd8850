//! What the environment sets for NCCL between this process's GPUs, each variable read once
//! per process, and how often waits poll.
//!
//! - `KVSTORE_NCCL_TIMEOUT_MS`: how long a collective may run before it is aborted ([`timeout`]).
//! - `KVSTORE_NCCL_MAX_COMMS`: how many device sets keep their communicators ([`max_sets`]).
//! - `KVSTORE_NCCL_FORCE=1`: NCCL even for keys whose values are all on the home GPU
//!   ([`force_single`]).

use std::sync::OnceLock;
use std::time::Duration;

/// Whether `KVSTORE_NCCL_FORCE=1` (read once): a `nccl` store then uses NCCL for keys whose
/// values are all on the home GPU too (one-rank communicators), so that its NCCL path runs on
/// a one-GPU machine.
pub fn force_single() -> bool {
    static FORCE: OnceLock<bool> = OnceLock::new();
    *FORCE.get_or_init(|| std::env::var("KVSTORE_NCCL_FORCE").as_deref() == Ok("1"))
}

/// How long a collective may run before it is aborted: `KVSTORE_NCCL_TIMEOUT_MS` as the
/// process first reads it (polls run every 200 µs), else 60 s.
pub(super) fn timeout() -> Duration {
    static TIMEOUT: OnceLock<Duration> = OnceLock::new();
    *TIMEOUT.get_or_init(|| {
        let ms = std::env::var("KVSTORE_NCCL_TIMEOUT_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(60_000);
        Duration::from_millis(ms)
    })
}

/// How many device sets keep their communicators: `KVSTORE_NCCL_MAX_COMMS` (read once), else 8.
pub(super) fn max_sets() -> usize {
    static MAX: OnceLock<usize> = OnceLock::new();
    *MAX.get_or_init(|| {
        std::env::var("KVSTORE_NCCL_MAX_COMMS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n| n > 0)
            .unwrap_or(8)
    })
}

/// How often a host wait polls events and NCCL's async errors.
pub(super) const POLL_INTERVAL: Duration = Duration::from_micros(200);
