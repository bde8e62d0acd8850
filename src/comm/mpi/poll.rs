//! How a rank waits for a non-blocking MPI operation without taking the CPU its peers need.
//!
//! MPI progresses shared-memory transfers only inside MPI calls, so a rank that sleeps too early
//! stalls a large transfer, and one that spins takes a core from an oversubscribed peer. A wait
//! goes through three phases:
//!
//! 1. **spin** for [`SPIN`] (a small message completes here: no added latency);
//! 2. **yield** ([`std::thread::yield_now`] between tests, as Open MPI's own blocking calls do
//!    with `mpi_yield_when_idle`) for as long as the transfer itself may take: [`YIELD_MIN`], or
//!    [`YIELD_NS_PER_BYTE`] per byte for large buffers;
//! 3. **sleep** between tests, from [`SLEEP_MIN`] doubling up to [`SLEEP_MAX`]: the peer is
//!    elsewhere (computing, late, or gone), and the rank gives its core away.

use std::time::{Duration, Instant};

/// How long to spin before yielding.
pub(super) const SPIN: Duration = Duration::from_micros(20);
/// The shortest yield phase.
pub(super) const YIELD_MIN: Duration = Duration::from_millis(10);
/// The yield phase lasts this many nanoseconds per byte moved (50 MB/s, 5–20× slower than the
/// MPI collectives measured on the loaded 2-core CI machine), so large transfers are never slept
/// through: Open MPI's non-blocking collectives (libnbc) progress only inside `MPI_Test`, and a
/// transfer polled every millisecond ran 4–25× slower than with yields.
pub(super) const YIELD_NS_PER_BYTE: u64 = 20;
/// The first sleep.
pub(super) const SLEEP_MIN: Duration = Duration::from_micros(50);
/// The longest sleep: the most a completed operation can go unnoticed.
pub(super) const SLEEP_MAX: Duration = Duration::from_millis(1);

/// Which phase a wait is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    /// Testing in a tight loop.
    Spin,
    /// Yielding the core between tests.
    Yield,
    /// Sleeping between tests.
    Sleep,
}

/// The state of one wait: call [`Backoff::pause`] between two tests.
pub(super) struct Backoff {
    start: Instant,
    yield_until: Duration,
    sleep: Duration,
}

impl Backoff {
    /// A wait that began at `start` for an operation moving `bytes` bytes.
    pub(super) fn new(start: Instant, bytes: usize) -> Backoff {
        let per_byte = Duration::from_nanos(YIELD_NS_PER_BYTE.saturating_mul(bytes as u64));
        Backoff {
            start,
            yield_until: SPIN + per_byte.max(YIELD_MIN),
            sleep: SLEEP_MIN,
        }
    }

    /// Pauses between two tests, as the phase asks, and returns the phase.
    pub(super) fn pause(&mut self) -> Phase {
        let waited = self.start.elapsed();
        if waited < SPIN {
            std::hint::spin_loop();
            Phase::Spin
        } else if waited < self.yield_until {
            std::thread::yield_now();
            Phase::Yield
        } else {
            std::thread::sleep(self.sleep);
            self.sleep = (self.sleep * 2).min(SLEEP_MAX);
            Phase::Sleep
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_go_spin_yield_sleep_and_sleeps_are_capped() {
        let mut b = Backoff::new(Instant::now(), 0);
        assert_eq!(b.pause(), Phase::Spin);
        let mut b = Backoff::new(Instant::now() - SPIN, 0);
        assert_eq!(b.pause(), Phase::Yield);
        let mut b = Backoff::new(Instant::now() - SPIN - YIELD_MIN, 0);
        for _ in 0..8 {
            assert_eq!(b.pause(), Phase::Sleep);
        }
        assert_eq!(b.sleep, SLEEP_MAX);
        // 256 MiB keeps yielding for about five seconds.
        let mut b = Backoff::new(Instant::now() - SPIN - YIELD_MIN, 256 << 20);
        assert_eq!(b.pause(), Phase::Yield);
    }
}
