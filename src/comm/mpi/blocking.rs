//! The bound on a blocking collective.
//!
//! Open MPI's blocking collectives (`tuned`) are up to 4× faster on medium messages than the
//! non-blocking ones the transport polls (`libnbc`), so a call runs a collective blocking where
//! every rank has just agreed to make it ([`Call::set_blocking`](super::Call::set_blocking)).
//! Such a collective cannot be polled, timed out or cancelled, so this watchdog thread bounds
//! it, as PyTorch's NCCL watchdog does: past `KVSTORE_WAIT_LOG_SECS` it is logged; past
//! `KVSTORE_TIMEOUT` (a rank died or stopped inside it after agreeing) this process says why
//! on stderr and ends with exit code 1, and `mpirun` then ends the job.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::collective::Coll;
use super::{control, lock};

/// A blocking collective in progress.
#[derive(Clone, Copy)]
struct InFlight {
    start: Instant,
    seq: u64,
    op: &'static str,
    coll: Coll,
    /// How many "still inside" logs were written for it.
    logged: u32,
}

/// The blocking collective in progress, if any, shared with the watchdog's thread.
pub(super) struct Watchdog {
    now: Arc<Mutex<Option<InFlight>>>,
}

impl Watchdog {
    /// Starts the watchdog's thread for rank `rank`, or says why it could not: the world then
    /// fails to set up, as no rank may alone fall back to non-blocking collectives (MPI does
    /// not match a blocking collective with a non-blocking one).
    pub(super) fn start(
        (rank, hosts): (usize, &[String]),
        timeout: Duration,
        wait_log: Duration,
    ) -> Result<Watchdog, String> {
        let now: Arc<Mutex<Option<InFlight>>> = Arc::new(Mutex::new(None));
        let others = others_on_hosts(rank, hosts);
        let shared = now.clone();
        let tick = (timeout / 8).clamp(Duration::from_millis(10), Duration::from_secs(1));
        let watch = move || loop {
            std::thread::sleep(tick);
            // A copy: nothing below runs under the lock, which the collective's thread takes
            // again when it returns (a logger that blocks must not hold it up).
            let Some(f) = *lock(&shared) else {
                continue;
            };
            let waited = f.start.elapsed();
            let inside = format!(
                "kvstore: rank {rank}: call #{} ({}) has been inside its blocking {} for {:.0} s",
                f.seq,
                f.op,
                f.coll,
                waited.as_secs_f64()
            );
            if waited > timeout {
                // Written whatever happens to stderr (a closed pipe must not stop the exit).
                let _ = writeln!(
                    std::io::stderr(),
                    "{inside}, longer than KVSTORE_TIMEOUT ({} s). Every rank agreed to make \
                     this transfer, so a rank died or stopped inside it, or a link to its \
                     host is cut ({others}); MPI cannot cancel it, so this process ends with \
                     exit code 1",
                    timeout.as_secs_f64()
                );
                // SAFETY: `_exit` ends the process at once, without exit handlers, which would
                // call into MPI while another thread of this process is inside a collective.
                unsafe { libc::_exit(1) }
            }
            if waited >= wait_log * (f.logged + 1) {
                if let Some(now) = lock(&shared).as_mut().filter(|now| now.seq == f.seq) {
                    now.logged = f.logged + 1;
                }
                control::warn(&format!(
                    "{inside}; every rank agreed to make it, so a rank is slow inside it or \
                     stopped; it ends this process after KVSTORE_TIMEOUT ({} s)",
                    timeout.as_secs_f64()
                ));
            }
        };
        std::thread::Builder::new()
            .name("kvstore-mpi-watchdog".to_owned())
            .spawn(watch)
            .map(|_| Watchdog { now })
            .map_err(|e| {
                format!("could not start the watchdog thread of blocking collectives: {e}")
            })
    }

    /// Runs `f`, a blocking collective `coll` of call `seq` (`op`), under the watchdog.
    pub(super) fn bound<R>(
        &self,
        (seq, op, coll): (u64, &'static str, Coll),
        f: impl FnOnce() -> R,
    ) -> R {
        *lock(&self.now) = Some(InFlight {
            start: Instant::now(),
            seq,
            op,
            coll,
            logged: 0,
        });
        let r = f();
        *lock(&self.now) = None;
        r
    }
}

/// The other ranks and their hosts (up to 16), for the watchdog's last words, which cannot ask
/// which rank is missing (this thread may not call MPI): "the other ranks: rank 1 (host b)".
fn others_on_hosts(rank: usize, hosts: &[String]) -> String {
    let others: Vec<usize> = (0..hosts.len()).filter(|&r| r != rank).collect();
    if others.is_empty() || others.len() > 16 {
        return format!("{} other ranks", others.len());
    }
    format!(
        "the other ranks: {}",
        super::hosts::ranks_on_hosts(&others, hosts)
    )
}
