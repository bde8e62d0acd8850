//! What the dist benches share (`bench_dist_store`, `bench_gpu_ranks`): the slowest rank's
//! time of a sample, timing from a barrier, and the sizes they read and print.

use std::time::Instant;

use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

#[path = "../../benches/common/size.rs"]
mod size;
pub(crate) use size::parse_size;

/// The median of `v`.
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The slowest rank's time of each sample.
pub(crate) fn slowest(comm: &SimpleCommunicator, local: &[f64]) -> Vec<f64> {
    let mut out = vec![0.0; local.len()];
    comm.all_reduce_into(local, &mut out[..], SystemOperation::max());
    out
}

/// Times `f` after a barrier.
pub(crate) fn timed(
    comm: &SimpleCommunicator,
    f: impl FnOnce() -> kvstore::Result<()>,
) -> kvstore::Result<f64> {
    comm.barrier();
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64())
}

/// `bytes` as the benches print it: `4K`, `16M`.
pub(crate) fn label(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 20 => format!("{}M", b >> 20),
        b if b >= 1 << 10 => format!("{}K", b >> 10),
        b => format!("{b}B"),
    }
}

/// A time in µs or ms.
pub(crate) fn fmt_time(t: f64) -> String {
    if t < 1e-3 {
        format!("{:.1} µs", t * 1e6)
    } else {
        format!("{:.2} ms", t * 1e3)
    }
}
