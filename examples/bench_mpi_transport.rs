//! The MPI transport of `dist_*` stores next to raw blocking rsmpi calls on the same buffers.
//!
//! ```sh
//! cargo build --release --features mpi --example bench_mpi_transport
//! OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 \
//!   OMPI_MCA_btl_vader_single_copy_mechanism=none \
//!   mpirun --oversubscribe -np 4 target/release/examples/bench_mpi_transport [MiB...]
//! ```
//!
//! For each size (4 KiB, then 16, 64 and 256 MiB of f32 unless sizes in MiB are given) and each
//! of reduce, broadcast, reduce-scatter and all-gather, the transport's call (start + wait) and
//! the raw blocking rsmpi call alternate on the same buffers. Before each timed op, a barrier;
//! each sample is the slowest rank's time; the table shows medians. Bandwidth is the
//! nccl-tests algbw: bytes of the full buffer / time. A third column times rsmpi's non-blocking
//! call + `MPI_Wait` (the same algorithm the transport starts, without its polling), so the cost
//! of polling is told apart from the cost of the non-blocking algorithm. Then the cost of `World::begin` (the
//! fingerprint check) per call, with 1 and 1000 keys, next to a raw 32-byte all-gather.

use std::time::Instant;

use clap::Parser;
use kvstore::__internal::mpi::{Fingerprint, World};
use kvstore::DType;
use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The slowest rank's time of each sample.
fn max_over_ranks(comm: &SimpleCommunicator, local: &[f64]) -> Vec<f64> {
    let mut out = vec![0.0; local.len()];
    comm.all_reduce_into(local, &mut out[..], SystemOperation::max());
    out
}

/// The MPI transport next to raw rsmpi calls (run under mpirun; see the example's docs).
#[derive(Parser)]
#[command(name = "bench_mpi_transport")]
struct Options {
    /// Sizes in MiB, timed after 4 KiB (default: 16 64 256).
    #[arg(value_name = "MiB")]
    mib: Vec<usize>,
}

fn main() -> kvstore::Result<()> {
    let o = Options::parse();
    let w = World::get()?;
    let comm = SimpleCommunicator::world();
    let (rank, size) = (w.rank(), w.size());
    let mut sizes: Vec<usize> = vec![4 << 10];
    if o.mib.is_empty() {
        sizes.extend([16 << 20, 64 << 20, 256 << 20]);
    } else {
        sizes.extend(o.mib.iter().map(|m| m << 20));
    }
    if rank == 0 {
        println!(
            "{size} ranks, f32, fingerprint check {}; medians of the slowest rank",
            if w.check_enabled() { "on" } else { "off" }
        );
        println!(
            "{:>9} {:>15} {:>12} {:>12} {:>8} {:>10} {:>10} {:>12} {:>8}",
            "size",
            "op",
            "transport",
            "raw rsmpi",
            "raw/t",
            "t GB/s",
            "raw GB/s",
            "raw nb+wait",
            "nb/t"
        );
    }
    for &bytes in &sizes {
        let n = (bytes / 4 / size) * size;
        let block = n / size;
        let reps = match bytes {
            b if b <= 1 << 20 => 300,
            b if b <= 16 << 20 => 10,
            b if b <= 64 << 20 => 5,
            _ => 3,
        };
        let mut send = vec![rank as f32 + 1.0; n];
        let mut recv = vec![0f32; n];
        // The block-sized buffers: reduce-scatter's receive and all-gather's send.
        let mut small = vec![rank as f32 + 1.0; block];
        for op in ["reduce", "broadcast", "reduce-scatter", "all-gather"] {
            let fp = Fingerprint::new("bench").entry(0, &[n], DType::F32);
            let (mut t_ours, mut t_raw, mut t_nb) = (Vec::new(), Vec::new(), Vec::new());
            for rep in 0..reps + 1 {
                // Ours.
                let mut call = w.begin(&fp)?;
                call.barrier()?;
                let s = std::mem::take(&mut send);
                let r = std::mem::take(&mut recv);
                let b = std::mem::take(&mut small);
                let t = Instant::now();
                let (s, r, b) = match op {
                    "reduce" if rank == 0 => {
                        let d = call.reduce_sum(s, r, 0).and_then(|p| call.wait(p))?;
                        (d.send, d.recv, b)
                    }
                    "reduce" => {
                        let d = call
                            .reduce_sum(s, Vec::new(), 0)
                            .and_then(|p| call.wait(p))?;
                        (d.send, r, b)
                    }
                    "broadcast" => {
                        let d = call.broadcast(s, 0).and_then(|p| call.wait(p))?;
                        (d.recv, r, b)
                    }
                    "reduce-scatter" => {
                        let d = call.reduce_scatter(s, b).and_then(|p| call.wait(p))?;
                        (d.send, r, d.recv)
                    }
                    _ => {
                        let d = call.all_gather(b, r).and_then(|p| call.wait(p))?;
                        (s, d.recv, d.send)
                    }
                };
                let dt = t.elapsed().as_secs_f64();
                drop(call);
                (send, recv, small) = (s, r, b);
                // Raw blocking rsmpi on the same buffers.
                comm.barrier();
                let t = Instant::now();
                let root = comm.process_at_rank(0);
                match op {
                    "reduce" if rank == 0 => {
                        root.reduce_into_root(&send[..], &mut recv[..], SystemOperation::sum())
                    }
                    "reduce" => root.reduce_into(&send[..], SystemOperation::sum()),
                    "broadcast" => root.broadcast_into(&mut send[..]),
                    "reduce-scatter" => comm.reduce_scatter_block_into(
                        &send[..],
                        &mut small[..],
                        SystemOperation::sum(),
                    ),
                    _ => comm.all_gather_into(&small[..], &mut recv[..]),
                }
                let dr = t.elapsed().as_secs_f64();
                // Raw non-blocking rsmpi + MPI_Wait: the same algorithm as ours (libnbc in Open
                // MPI), without our polling.
                comm.barrier();
                let t = Instant::now();
                let sum = SystemOperation::sum();
                mpi::request::scope(|sc| match op {
                    "reduce" if rank == 0 => {
                        root.immediate_reduce_into_root(sc, &send[..], &mut recv[..], sum)
                            .wait();
                    }
                    "reduce" => {
                        root.immediate_reduce_into(sc, &send[..], sum).wait();
                    }
                    "broadcast" => {
                        root.immediate_broadcast_into(sc, &mut send[..]).wait();
                    }
                    "reduce-scatter" => {
                        comm.immediate_reduce_scatter_block_into(
                            sc,
                            &send[..],
                            &mut small[..],
                            sum,
                        )
                        .wait();
                    }
                    _ => {
                        comm.immediate_all_gather_into(sc, &small[..], &mut recv[..])
                            .wait();
                    }
                });
                let dn = t.elapsed().as_secs_f64();
                if rep > 0 {
                    t_ours.push(dt);
                    t_raw.push(dr);
                    t_nb.push(dn);
                }
            }
            let ours = median(max_over_ranks(&comm, &t_ours));
            let raw = median(max_over_ranks(&comm, &t_raw));
            let nb = median(max_over_ranks(&comm, &t_nb));
            if rank == 0 {
                let gbs = |t: f64| (n * 4) as f64 / t / 1e9;
                let f = |t: f64| {
                    if bytes < 1 << 20 {
                        format!("{:.1} µs", t * 1e6)
                    } else {
                        format!("{:.1} ms", t * 1e3)
                    }
                };
                let (a, b, c) = (f(ours), f(raw), f(nb));
                println!(
                    "{:>9} {:>15} {:>12} {:>12} {:>8.3} {:>10.2} {:>10.2} {:>12} {:>8.3}",
                    if bytes < 1 << 20 {
                        format!("{} KiB", bytes >> 10)
                    } else {
                        format!("{} MiB", bytes >> 20)
                    },
                    op,
                    a,
                    b,
                    raw / ours,
                    gbs(ours),
                    gbs(raw),
                    c,
                    nb / ours
                );
            }
        }
    }

    // The fingerprint: `begin` per call (check on: one 32-byte all-gather), next to a raw
    // 32-byte all-gather, interleaved.
    for keys in [1usize, 1000] {
        let mut fp = Fingerprint::new("push");
        for k in 0..keys {
            fp.push((k as i32).into(), &[256, 4], DType::F32);
        }
        let (mut t_begin, mut t_raw) = (Vec::new(), Vec::new());
        let mine = [1u64; 4];
        let mut all = vec![0u64; 4 * size];
        for rep in 0..501 {
            comm.barrier();
            let t = Instant::now();
            drop(w.begin(&fp)?);
            let db = t.elapsed().as_secs_f64();
            comm.barrier();
            let t = Instant::now();
            comm.all_gather_into(&mine[..], &mut all[..]);
            let dr = t.elapsed().as_secs_f64();
            if rep > 0 {
                t_begin.push(db);
                t_raw.push(dr);
            }
        }
        let b = median(max_over_ranks(&comm, &t_begin));
        let r = median(max_over_ranks(&comm, &t_raw));
        if rank == 0 {
            println!(
                "begin() with {keys} keys: {:.1} µs per call; raw 32-byte all-gather {:.1} µs",
                b * 1e6,
                r * 1e6
            );
        }
    }
    Ok(())
}
