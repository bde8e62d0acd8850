//! NCCL for GPU homes: non-blocking communicators per device set (an LRU cache), reduce and
//! broadcast, async-error polling with a timeout, and abort of a failed communicator.
//!
//! Each rank runs on its GPU's runtime stream, so NCCL calls are ordered with the kernels and
//! copies around them. Nothing blocks: what reports `ncclInProgress` is polled with the
//! timeout, and a stall is aborted. No lock the watchdog needs is held across a call that can
//! block: the cache and the work in flight have their own mutexes, held only for bookkeeping;
//! the calls on one set are serialized by its own mutex, whose holder polls with a bound and
//! gives up as soon as the watchdog asks for an abort.
//!
//! # Files, from the bottom up
//!
//! - `loader`: finds and opens the library (cudarc only looks for `libnccl.so`, which pip and
//!   the distros do not ship) and resolves its functions (the sys layer).
//! - `result`: one wrapper per NCCL function; return codes are read there and nowhere else.
//! - `crate::config::nccl` reads the environment once: `KVSTORE_NCCL_MAX_COMMS` (default 8)
//!   and `KVSTORE_NCCL_TIMEOUT_MS` (default 60 s), an invalid one failing every call that needs
//!   NCCL with an [`Error::InvalidEnv`](crate::Error::InvalidEnv); `KVSTORE_NCCL_FORCE=1` (a
//!   one-rank communicator even for values all on the home GPU: tests on one GPU).
//! - `comm_set`: the communicators of one sorted set of GPU ordinals (a GPU's rank is its index
//!   there), made with `ncclCommInitRankConfig` and `blocking = 0` (NCCL >= 2.14) in one group.
//! - `cache`: at most `KVSTORE_NCCL_MAX_COMMS` sets, the least recently used idle one destroyed,
//!   built before the store takes any key lock (`prepare`).
//! - `group`: one call's reduces and broadcasts, issued in one group, then an event per rank.
//! - `watchdog`: every host wait ([`wait_all`], and any host read of a GPU buffer) and a thread
//!   (every 100 ms, for user threads blocked in the driver) poll those events and
//!   `ncclCommGetAsyncError`; a failed collective, or one still running after the timeout, has
//!   its communicators aborted and dropped from the cache, and an
//!   [`Error::Nccl`](crate::Error::Nccl) names its keys.
//! - `ranks`: [`RankComm`], NCCL across processes (one rank each, bootstrapped over MPI or
//!   through `rendezvous`): the engine of `dist_device_sync`.
//! - `rendezvous`: the job-token rendezvous of a launch without MPI (std's TCP).
//! - `multi_rank`: test support (feature `test-util`), not API: several ranks on one GPU.

// Every `unsafe` block in this module says why it is sound.
#![deny(clippy::undocumented_unsafe_blocks)]

mod cache;
mod comm_set;
mod group;
pub mod loader;
#[cfg(feature = "test-util")]
mod multi_rank;
mod ranks;
mod rendezvous;
mod result;
mod watchdog;

pub use crate::config::nccl::force_single;
pub use cache::cached_sets;
pub(crate) use cache::prepare;
pub use group::collectives_issued;
pub(crate) use group::{run, Job, Kind};
#[doc(hidden)]
#[cfg(feature = "test-util")]
pub use multi_rank::MultiRank;
pub(crate) use ranks::Watch;
pub use ranks::{InPlace, RankComm, GROUP_MAX};

/// How often a host wait polls events and NCCL's async errors.
pub(crate) const POLL_INTERVAL: std::time::Duration = std::time::Duration::from_micros(200);
pub use watchdog::{abort_all, wait_all};

use std::path::PathBuf;
use std::sync::Once;

/// Whether a usable NCCL (>= 2.14) was found (see [`loader`]).
pub fn available() -> bool {
    loader::library().is_ok()
}

/// The NCCL library file this process loaded, if any.
pub fn library_path() -> Option<PathBuf> {
    loader::library().ok().map(|l| l.path.clone())
}

/// Warns once per process that a `nccl` store found no usable NCCL and uses peer copies, and
/// how to fix it: through `log` when a logger takes warnings, else on stderr (a user who asked
/// for NCCL must hear of it).
pub(crate) fn warn_unavailable() {
    static ONCE: Once = Once::new();
    if let Err(e) = loader::library() {
        ONCE.call_once(|| {
            let msg = format!(
                "kvstore: a 'nccl' store found no usable NCCL, so sums and broadcasts between \
                 GPUs use peer copies instead: {e}"
            );
            if log::log_enabled!(log::Level::Warn) {
                log::warn!("{msg}");
            } else {
                eprintln!("{msg}");
            }
        });
    }
}

/// The NCCL library's version code (e.g. 23007 for 2.30.7), or `None` when none is usable.
pub fn version() -> Option<i32> {
    loader::library().ok().map(|l| l.version)
}
