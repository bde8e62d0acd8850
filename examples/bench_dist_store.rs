//! The `dist_sync` store's push and pull of one key next to the raw MPI collectives on buffers of
//! the same size, interleaved in one run; then 1000 small keys in one list call.
//!
//! ```sh
//! cargo build --release --features mpi --example bench_dist_store
//! export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
//! mpirun --oversubscribe -np 4 target/release/examples/bench_dist_store            # every table
//! mpirun --oversubscribe -np 4 target/release/examples/bench_dist_store --sizes 4K,16M
//! mpirun --oversubscribe -np 4 target/release/examples/bench_dist_store --small-only
//! ```
//!
//! **One key** of each size (default 4K, 64K, 1M, 16M, 64M, 256M bytes of f32), in a store of
//! its own, so that a whole key lives on rank 0. Per repetition, each of these runs once, after
//! a barrier, and a sample is the slowest rank's time:
//!
//! - `push`: `kv.push(0, &grad)` (no updater: the sum is assigned), next to the raw collective
//!   the store starts: `MPI_Reduce` to rank 0 for a whole key, `MPI_Reduce_scatter_block` for a
//!   key of more than `KVSTORE_BIGARRAY_BOUND` elements (sliced over the ranks; unset: as the store
//!   chooses for the machines the ranks span);
//! - `pull`: `kv.pull(0, &out)`, next to `MPI_Bcast` from rank 0, or `MPI_Allgather`.
//!
//! The raw collectives are rsmpi's blocking calls (Open MPI's `tuned` component), the reference
//! of the target, and, as a third column, the non-blocking ones plus `MPI_Wait` (`libnbc`: the
//! algorithm the store's transport starts and polls). Odd repetitions run the raw calls first.
//! The first repetition is a warm-up. Each cell is the median; `store/raw` is raw MPI's time
//! over the store's, i.e. the store's share of raw MPI's bandwidth.
//!
//! **1000 keys × 1 KiB** (f32 [256]) in one `push_list` and one `pull_list`, next to the raw
//! collectives the store packs them into: one `MPI_Reduce` (push) or `MPI_Bcast` (pull) per home
//! rank of that rank's keys, packed.
//!
//! Every table line starts with `|`; a line `json {...}` per cell carries the same numbers
//! (`benches/dist_bench.sh` runs everything and `benches/dist_summary.py` makes the tables).
//! Environment: `KVSTORE_DIST_CHECK=0` turns the per-call fingerprint check off (compare runs
//! with it on and off for its cost), `KVSTORE_BIGARRAY_BOUND` as for the store.
//!
//! Options: `--sizes 4K,64K,1M,...`, `--reps N` (every size), `--small-only`, `--no-small`,
//! `--store-only` (skip the raw collectives, for a profile), `--breakdown`: the steps of a
//! store push and pull replayed one by one on the transport, each timed alone (see
//! [`breakdown`]), `--compression`: a push of one key into three stores, uncompressed,
//! 2-bit and bfloat16, interleaved, with the bytes each rank sends (see [`compression`]), and
//! `--row-sparse ROWS`: an embedding of ROWS x 64 float32 with 1 % of its rows touched per
//! step (`--density P` for P %), pushed and pulled dense and by rows (see [`row_sparse`]).
//! `--dtype float16|bfloat16` makes the store's one-key values 16-bit (the same element
//! count, so half the bytes a size names; the raw collectives stay float32).

use std::time::Instant;

use clap::Parser;
use kvstore::__internal::bigarray_bound;
use kvstore::__internal::mpi::{Fingerprint, World};
use kvstore::{DType, KvStore, NDArray};
use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

mod dist_bench;
use dist_bench::{fmt_time, label, median, parse_size, slowest, timed};

/// The dist store's push and pull next to raw MPI collectives (run under mpirun; see the
/// example's docs).
#[derive(Parser)]
#[command(name = "bench_dist_store")]
struct Options {
    /// The one-key sizes, in bytes: a comma-separated list of 4096, 64K, 16M, 1G, ...
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = parse_size,
        default_value = "4K,64K,1M,16M,64M,256M"
    )]
    sizes: Vec<usize>,
    /// Repetitions of every size (default: by size).
    #[arg(long)]
    reps: Option<usize>,
    /// Only the 1000 small keys, not the one-key table.
    #[arg(long)]
    small_only: bool,
    /// Only the one-key table, not the 1000 small keys.
    #[arg(long)]
    no_small: bool,
    /// Skip the raw collectives (for a profile of the store's calls alone).
    #[arg(long)]
    store_only: bool,
    /// Time the steps of a push and a pull one by one instead.
    #[arg(long)]
    breakdown: bool,
    /// Time compressed pushes against uncompressed ones instead.
    #[arg(long)]
    compression: bool,
    /// Time an embedding of this many rows dense and row-sparse instead.
    #[arg(long, value_name = "ROWS")]
    row_sparse: Option<usize>,
    /// The percentage of its rows each rank touches per step (with --row-sparse).
    #[arg(long, default_value_t = 1.0)]
    density: f64,
    /// The dtype of the store's one-key values (the raw collectives stay float32).
    #[arg(long, value_parser = parse_dtype, default_value = "float32")]
    dtype: DType,
}

/// A float dtype by its name: float32, float16 or bfloat16.
fn parse_dtype(name: &str) -> Result<DType, String> {
    [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .find(|d| d.name() == name)
        .ok_or_else(|| format!("not a dtype here: '{name}'; use float32, float16 or bfloat16"))
}

fn main() -> kvstore::Result<()> {
    let o = Options::parse();
    let world = World::get()?;
    let comm = SimpleCommunicator::world();
    let (rank, size) = (world.rank(), world.size());
    let check = if world.check_enabled() { "on" } else { "off" };
    // The store's bound: the variable, else the default for the machines the ranks span.
    let set = std::env::var("KVSTORE_BIGARRAY_BOUND").ok();
    let bound = bigarray_bound(set.and_then(|v| v.trim().parse().ok()), world.host_count());
    let b = Bench {
        comm: &comm,
        rank,
        size,
        check,
        bound,
        reps: o.reps,
        store_only: o.store_only,
        dtype: o.dtype,
    };
    let lead = rank == 0;
    if lead {
        println!(
            "# {size} ranks, {} (the store's one-key values; raw MPI in f32), fingerprint check \
             {check}, KVSTORE_BIGARRAY_BOUND {bound}; medians of the slowest rank's time",
            o.dtype.name()
        );
    }

    if o.breakdown {
        for &bytes in &o.sizes {
            breakdown(&b, bytes)?;
        }
        return Ok(());
    }
    if let Some(rows) = o.row_sparse {
        return row_sparse(&b, rows, o.density);
    }
    if o.compression {
        if lead {
            println!(
                "| ranks | size | key | f32 push | 2-bit push | bf16 push | 2-bit/f32 time | \
                 bf16/f32 time | bytes sent per rank: f32 / 2-bit / bf16 | reps |"
            );
            println!("|---|---|---|---|---|---|---|---|---|---|");
        }
        for &bytes in &o.sizes {
            compression(&b, bytes)?;
        }
        return Ok(());
    }
    if !o.small_only {
        if lead {
            println!(
                "| ranks | size | key | op | store | raw MPI | store/raw | raw nb+wait | store GB/s | raw GB/s | reps |"
            );
            println!("|---|---|---|---|---|---|---|---|---|---|---|");
        }
        for &bytes in &o.sizes {
            one_key(&b, bytes)?;
        }
    }
    if !o.no_small {
        small_keys(&b)?;
    }
    Ok(())
}

/// What every measurement needs.
struct Bench<'a> {
    comm: &'a SimpleCommunicator,
    rank: usize,
    size: usize,
    /// `on` or `off`: the fingerprint check.
    check: &'static str,
    /// Keys of more elements are sliced.
    bound: usize,
    reps: Option<usize>,
    store_only: bool,
    dtype: DType,
}

/// Push and pull of one key of `bytes` bytes, next to the raw collectives.
fn one_key(b: &Bench<'_>, bytes: usize) -> kvstore::Result<()> {
    let Bench {
        comm,
        rank,
        size,
        check,
        bound,
        reps,
        store_only,
        ..
    } = *b;
    let n = (bytes / 4 / size).max(1) * size;
    let block = n / size;
    let sliced = size > 1 && n > bound;
    let reps = reps.unwrap_or(match bytes {
        b if b <= 64 << 10 => 200,
        b if b <= 1 << 20 => 50,
        b if b <= 16 << 20 => 10,
        b if b <= 64 << 20 => 7,
        _ => 5,
    });

    let kv = KvStore::create("dist_sync")?;
    let dtype = b.dtype;
    kv.init(0, &NDArray::from_vec(vec![1.0f32; n], [n])?.astype(dtype)?)?;
    let grad = NDArray::from_vec(vec![rank as f32 + 1.0; n], [n])?.astype(dtype)?;
    let out = NDArray::from_vec(vec![0.0f32; n], [n])?.astype(dtype)?;
    let mut send = vec![rank as f32 + 1.0; n];
    let mut recv = vec![0.0f32; n];
    let mut small = vec![rank as f32 + 1.0; block];
    let root = comm.process_at_rank(0);
    let sum = SystemOperation::sum;

    // [store push, raw push, nb push, store pull, raw pull, nb pull]
    let mut t: [Vec<f64>; 6] = Default::default();
    for rep in 0..=reps {
        let mut s = [0.0f64; 6];
        let raw_first = rep % 2 == 1;
        for half in 0..2 {
            let store_turn = (half == 0) != raw_first;
            if store_turn {
                s[0] = timed(comm, || kv.push(0, &grad))?;
                s[3] = timed(comm, || kv.pull(0, &out))?;
                continue;
            }
            if store_only {
                continue;
            }
            s[1] = timed(comm, || {
                if sliced {
                    comm.reduce_scatter_block_into(&send[..], &mut small[..], sum());
                } else if rank == 0 {
                    root.reduce_into_root(&send[..], &mut recv[..], sum());
                } else {
                    root.reduce_into(&send[..], sum());
                }
                Ok(())
            })?;
            s[2] = timed(comm, || {
                mpi::request::scope(|sc| {
                    if sliced {
                        comm.immediate_reduce_scatter_block_into(
                            sc,
                            &send[..],
                            &mut small[..],
                            sum(),
                        )
                        .wait();
                    } else if rank == 0 {
                        root.immediate_reduce_into_root(sc, &send[..], &mut recv[..], sum())
                            .wait();
                    } else {
                        root.immediate_reduce_into(sc, &send[..], sum()).wait();
                    }
                });
                Ok(())
            })?;
            s[4] = timed(comm, || {
                if sliced {
                    comm.all_gather_into(&small[..], &mut recv[..]);
                } else {
                    root.broadcast_into(&mut send[..]);
                }
                Ok(())
            })?;
            s[5] = timed(comm, || {
                mpi::request::scope(|sc| {
                    if sliced {
                        comm.immediate_all_gather_into(sc, &small[..], &mut recv[..])
                            .wait();
                    } else {
                        root.immediate_broadcast_into(sc, &mut send[..]).wait();
                    }
                });
                Ok(())
            })?;
        }
        if rep > 0 {
            for (v, x) in t.iter_mut().zip(s) {
                v.push(x);
            }
        }
    }
    // The pull must have brought the stored value: 1 after init, then the sum of pushes.
    let want = (size * (size + 1) / 2) as f32;
    let got = out.astype(DType::F32)?.to_vec::<f32>()?;
    assert!(
        got.iter().all(|&v| v == want),
        "pull returned {} (and maybe more) instead of {want}",
        got[0]
    );
    let m: Vec<f64> = t.iter().map(|v| median(slowest(comm, v))).collect();
    if rank == 0 {
        let key = if sliced { "sliced" } else { "whole" };
        let gbs = |t: f64| (n * 4) as f64 / t / 1e9;
        for (op, raw_name, i) in [
            ("push", if sliced { "reduce_scatter" } else { "reduce" }, 0),
            ("pull", if sliced { "allgather" } else { "bcast" }, 3),
        ] {
            let (st, raw, nb) = (m[i], m[i + 1], m[i + 2]);
            println!(
                "| {size} | {} | {key} | {op} | {} | {} ({raw_name}) | {:.0}% | {} | {:.2} | {:.2} | {reps} |",
                label(bytes),
                fmt_time(st),
                fmt_time(raw),
                100.0 * raw / st,
                fmt_time(nb),
                gbs(st),
                gbs(raw),
            );
            println!(
                "json {{\"ranks\":{size},\"bytes\":{bytes},\"key\":\"{key}\",\"op\":\"{op}\",\"raw\":\"{raw_name}\",\"check\":\"{check}\",\"store_s\":{st:.9},\"raw_s\":{raw:.9},\"nb_s\":{nb:.9},\"reps\":{reps}}}"
            );
        }
    }
    Ok(())
}

/// 1000 keys × 1 KiB in one `push_list` and one `pull_list`, next to the packed raw
/// collectives the store starts for them.
fn small_keys(b: &Bench<'_>) -> kvstore::Result<()> {
    let Bench {
        comm,
        rank,
        size,
        check,
        reps,
        store_only,
        ..
    } = *b;
    const KEYS: usize = 1000;
    const ELEMS: usize = 256;
    let reps = reps.unwrap_or(200);
    let kv = KvStore::create("dist_sync")?;
    let keys: Vec<i32> = (0..KEYS as i32).collect();
    let init: Vec<NDArray> = (0..KEYS)
        .map(|_| NDArray::from_vec(vec![1.0f32; ELEMS], [ELEMS]))
        .collect::<kvstore::Result<_>>()?;
    kv.init_list(&keys, &init)?;
    let grads: Vec<NDArray> = (0..KEYS)
        .map(|_| NDArray::from_vec(vec![rank as f32 + 1.0; ELEMS], [ELEMS]))
        .collect::<kvstore::Result<_>>()?;
    let outs: Vec<NDArray> = (0..KEYS)
        .map(|_| NDArray::from_vec(vec![0.0f32; ELEMS], [ELEMS]))
        .collect::<kvstore::Result<_>>()?;
    // Keys of one size are spread evenly: key i's home gets KEYS/size of them. The raw peer
    // packs the same number of elements per home rank.
    let per_home: Vec<usize> = (0..size)
        .map(|r| (KEYS * (r + 1) / size - KEYS * r / size) * ELEMS)
        .collect();
    let mut send: Vec<Vec<f32>> = per_home.iter().map(|&n| vec![1.0; n]).collect();
    let mut recv: Vec<Vec<f32>> = per_home.iter().map(|&n| vec![0.0; n]).collect();

    let mut t: [Vec<f64>; 4] = Default::default();
    for rep in 0..=reps {
        let mut s = [0.0f64; 4];
        let raw_first = rep % 2 == 1;
        for half in 0..2 {
            if (half == 0) != raw_first {
                s[0] = timed(comm, || kv.push_list(&keys, &grads))?;
                s[2] = timed(comm, || kv.pull_list(&keys, &outs))?;
                continue;
            }
            if store_only {
                continue;
            }
            s[1] = timed(comm, || {
                for (r, (snd, rcv)) in send.iter().zip(recv.iter_mut()).enumerate() {
                    let home = comm.process_at_rank(r as i32);
                    if r == rank {
                        home.reduce_into_root(&snd[..], &mut rcv[..], SystemOperation::sum());
                    } else {
                        home.reduce_into(&snd[..], SystemOperation::sum());
                    }
                }
                Ok(())
            })?;
            s[3] = timed(comm, || {
                for (r, buf) in send.iter_mut().enumerate() {
                    comm.process_at_rank(r as i32).broadcast_into(&mut buf[..]);
                }
                Ok(())
            })?;
        }
        if rep > 0 {
            for (v, x) in t.iter_mut().zip(s) {
                v.push(x);
            }
        }
    }
    let m: Vec<f64> = t.iter().map(|v| median(slowest(comm, v))).collect();
    if rank == 0 {
        println!();
        println!(
            "| ranks | keys | op | store per call | store per key | raw MPI per call ({size} packed collectives) | store/raw | reps |"
        );
        println!("|---|---|---|---|---|---|---|---|");
        for (op, raw_name, i) in [("push_list", "reduce", 0), ("pull_list", "bcast", 2)] {
            let (st, raw) = (m[i], m[i + 1]);
            println!(
                "| {size} | {KEYS} × 1K | {op} | {} | {:.2} µs | {} ({raw_name}) | {:.0}% | {reps} |",
                fmt_time(st),
                st * 1e6 / KEYS as f64,
                fmt_time(raw),
                100.0 * raw / st,
            );
            println!(
                "json {{\"ranks\":{size},\"keys\":{KEYS},\"bytes\":1024,\"op\":\"{op}\",\"raw\":\"{raw_name}\",\"check\":\"{check}\",\"store_s\":{st:.9},\"raw_s\":{raw:.9},\"reps\":{reps}}}"
            );
        }
    }
    Ok(())
}

/// The steps of a store push and pull of one key, replayed one by one on the transport
/// (`World::begin` and its non-blocking collectives) with a barrier before each step, so that
/// each is timed alone; a cell is the median over repetitions of the slowest rank's time. Next
/// to them, the same collective on buffers used before (no page faults), and the raw blocking
/// MPI call.
fn breakdown(b: &Bench<'_>, bytes: usize) -> kvstore::Result<()> {
    let Bench {
        comm,
        rank,
        size,
        bound,
        reps,
        ..
    } = *b;
    let world = World::get()?;
    let n = (bytes / 4 / size).max(1) * size;
    let block = n / size;
    let sliced = size > 1 && n > bound;
    let reps = reps.unwrap_or(match bytes {
        b if b <= 1 << 20 => 50,
        b if b <= 64 << 20 => 7,
        _ => 5,
    });
    let fp = Fingerprint::new("bench").entry(0, &[n], DType::F32);
    let grad = vec![rank as f32 + 1.0; n];
    // This rank's part of the stored value, and the pull's out.
    let part = if sliced { block } else { n };
    let mut stored = vec![1.0f32; part];
    let mut out = vec![0.0f32; n];
    // Buffers kept from one repetition to the next (warm pages).
    let mut warm_send = vec![rank as f32 + 1.0; n];
    let mut warm_recv = vec![0.0f32; n];
    let mut warm_block = vec![0.0f32; block];
    let root = comm.process_at_rank(0);
    let home = rank == 0;

    let steps: &[&str] = if sliced {
        &[
            "push: local sum (fresh zeroed n + copy)",
            "push: fingerprint check",
            "push: Ireduce_scatter_block, fresh recv n/N",
            "push: assign into the stored slice",
            "push: free the buffers",
            "push: sum of the steps",
            "  Ireduce_scatter_block on warm buffers",
            "  MPI_Reduce_scatter_block (blocking) on warm buffers",
            "pull: copy of this rank's slice",
            "pull: fingerprint check",
            "pull: Iallgather, fresh recv n",
            "pull: copy into the out",
            "pull: free the buffers",
            "pull: sum of the steps",
            "  Iallgather on warm buffers",
            "  MPI_Allgather (blocking) on warm buffers",
        ]
    } else {
        &[
            "push: local sum (fresh zeroed n + copy)",
            "push: fingerprint check",
            "push: Ireduce, fresh recv n at the home",
            "push: assign into the stored value (home)",
            "push: free the buffers",
            "push: sum of the steps",
            "  Ireduce on warm buffers",
            "  MPI_Reduce (blocking) on warm buffers",
            "pull: copy of the value (home) / zeroed n (others)",
            "pull: fingerprint check",
            "pull: Ibcast",
            "pull: copy into the out",
            "pull: free the buffers",
            "pull: sum of the steps",
            "  Ibcast on warm buffers",
            "  MPI_Bcast (blocking) on warm buffers",
        ]
    };
    let mut t: Vec<Vec<f64>> = vec![Vec::new(); steps.len()];
    for rep in 0..=reps {
        let mut s = vec![0.0f64; steps.len()];
        // `lap` gives the time since the last `lap` or `sync`; `sync` is an untimed barrier, so
        // that each step is timed from a common start and waits for no earlier step.
        let last = std::cell::Cell::new(Instant::now());
        let lap = || {
            let now = Instant::now();
            let dt = now.duration_since(last.get()).as_secs_f64();
            last.set(now);
            dt
        };
        let sync = || {
            comm.barrier();
            last.set(Instant::now());
        };
        // Push.
        sync();
        let mut sum = vec![0.0f32; n];
        sum.copy_from_slice(&grad);
        s[0] = lap();
        sync();
        let mut call = world.begin(&fp)?;
        s[1] = lap();
        sync();
        let recv_len = match (sliced, home) {
            (true, _) => block,
            (false, true) => n,
            (false, false) => 0,
        };
        let p = if sliced {
            call.reduce_scatter(sum, vec![0.0f32; recv_len])?
        } else {
            call.reduce_sum(sum, vec![0.0f32; recv_len], 0)?
        };
        let done = call.wait(p)?;
        drop(call);
        s[2] = lap();
        sync();
        if sliced || home {
            stored.copy_from_slice(&done.recv);
        }
        s[3] = lap();
        sync();
        drop(done);
        s[4] = lap();
        s[5] = s[..5].iter().sum();
        // The same collective on warm buffers, then blocking.
        sync();
        let mut call = world.begin(&fp)?;
        let ws = std::mem::take(&mut warm_send);
        let p = if sliced {
            call.reduce_scatter(ws, std::mem::take(&mut warm_block))?
        } else if home {
            call.reduce_sum(ws, std::mem::take(&mut warm_recv), 0)?
        } else {
            call.reduce_sum(ws, Vec::new(), 0)?
        };
        let done = call.wait(p)?;
        drop(call);
        warm_send = done.send;
        if sliced {
            warm_block = done.recv;
        } else if home {
            warm_recv = done.recv;
        }
        s[6] = lap();
        sync();
        if sliced {
            comm.reduce_scatter_block_into(
                &warm_send[..],
                &mut warm_block[..],
                SystemOperation::sum(),
            );
        } else if home {
            root.reduce_into_root(&warm_send[..], &mut warm_recv[..], SystemOperation::sum());
        } else {
            root.reduce_into(&warm_send[..], SystemOperation::sum());
        }
        s[7] = lap();

        // Pull.
        sync();
        let send = if sliced || home {
            stored.clone()
        } else {
            vec![0.0f32; n]
        };
        s[8] = lap();
        sync();
        let mut call = world.begin(&fp)?;
        s[9] = lap();
        sync();
        let recv = if sliced {
            let p = call.all_gather(send, vec![0.0f32; n])?;
            call.wait(p)?.recv
        } else {
            let p = call.broadcast(send, 0)?;
            call.wait(p)?.recv
        };
        drop(call);
        s[10] = lap();
        sync();
        out.copy_from_slice(&recv);
        s[11] = lap();
        sync();
        drop(recv);
        s[12] = lap();
        s[13] = s[8..13].iter().sum();
        sync();
        let mut call = world.begin(&fp)?;
        if sliced {
            let p = call.all_gather(
                std::mem::take(&mut warm_block),
                std::mem::take(&mut warm_recv),
            )?;
            let done = call.wait(p)?;
            (warm_block, warm_recv) = (done.send, done.recv);
        } else {
            let p = call.broadcast(std::mem::take(&mut warm_recv), 0)?;
            warm_recv = call.wait(p)?.recv;
        }
        drop(call);
        s[14] = lap();
        sync();
        if sliced {
            comm.all_gather_into(&warm_block[..], &mut warm_recv[..]);
        } else {
            root.broadcast_into(&mut warm_recv[..]);
        }
        s[15] = lap();
        if rep > 0 {
            for (v, x) in t.iter_mut().zip(s) {
                v.push(x);
            }
        }
    }
    let m: Vec<f64> = t.iter().map(|v| median(slowest(comm, v))).collect();
    if rank == 0 {
        println!(
            "\n{size} ranks, one {} key of {} ({}), {reps} reps: each step's median of the slowest rank\n",
            if sliced { "sliced" } else { "whole" },
            label(bytes),
            if sliced { "reduce-scatter / all-gather" } else { "reduce / broadcast to and from rank 0" },
        );
        println!("| step | time |");
        println!("|---|---|");
        for (name, v) in steps.iter().zip(&m) {
            println!("| {name} | {} |", fmt_time(*v));
        }
    }
    Ok(())
}

/// A push of one key of `bytes` bytes into three `dist_sync` stores, the same key in each:
/// uncompressed, 2-bit (threshold 0.5) and the bfloat16 wire. Each repetition pushes into all
/// three after a barrier each, in an order that rotates; a sample is the slowest rank's time,
/// and each cell the median. The gradients are fresh values of ±0.25 to ±1, so that 2-bit
/// sends some of them. Bytes sent per rank, counted from the algorithms: an uncompressed
/// sliced push is a ring reduce-scatter (`(size - 1) / size` of the key's float32 bytes), a
/// whole one a reduce to rank 0 (the key's bytes from every other rank); a compressed push an
/// all-to-all of the parts (`(size - 1) / size` of the key in 2-bit words or bfloat16).
fn compression(b: &Bench<'_>, bytes: usize) -> kvstore::Result<()> {
    use kvstore::Compression;
    let Bench {
        comm,
        rank,
        size,
        bound,
        reps,
        ..
    } = *b;
    let n = (bytes / 4 / size).max(1) * size;
    let sliced = size > 1 && n > bound;
    let reps = reps.unwrap_or(match bytes {
        b if b <= 1 << 20 => 30,
        b if b <= 16 << 20 => 8,
        _ => 5,
    });
    let settings = [
        Compression::None,
        Compression::two_bit(0.5),
        Compression::bf16(),
    ];
    let mut stores = Vec::new();
    for c in settings {
        let kv = KvStore::create("dist_sync")?;
        kv.set_gradient_compression(c)?;
        kv.init(0, &NDArray::from_vec(vec![0.0f32; n], [n])?)?;
        stores.push(kv);
    }
    let grad: Vec<f32> = (0..n)
        .map(|i| {
            let x = ((i * 2654435761 + rank * 40503) % 1000) as f32 / 1000.0;
            (0.25 + 0.75 * x) * if i % 3 == 0 { -1.0 } else { 1.0 }
        })
        .collect();
    let grad = NDArray::from_vec(grad, [n])?;
    let mut t: [Vec<f64>; 3] = Default::default();
    for rep in 0..=reps {
        let mut s = [0.0f64; 3];
        for k in 0..3 {
            let which = (k + rep) % 3;
            s[which] = timed(comm, || stores[which].push(0, &grad))?;
        }
        let s = slowest(comm, &s);
        if rep > 0 {
            for (col, v) in t.iter_mut().zip(s) {
                col.push(v);
            }
        }
    }
    if rank == 0 {
        let [f, w, h] = t.map(median);
        let share = (size - 1) as f64 / size as f64;
        let (bf, bw, bh) = match sliced {
            true => (
                share * (n * 4) as f64,
                share * (n.div_ceil(16) * 4) as f64,
                share * (n * 2) as f64,
            ),
            false => (
                (n * 4) as f64,
                share * (n.div_ceil(16) * 4) as f64,
                share * (n * 2) as f64,
            ),
        };
        println!(
            "| {size} | {} | {} | {} | {} | {} | {:.2} | {:.2} | {} / {} / {} | {reps} |",
            label(bytes),
            if sliced { "sliced" } else { "whole" },
            fmt_time(f),
            fmt_time(w),
            fmt_time(h),
            w / f,
            h / f,
            label(bf as usize),
            label(bw as usize),
            label(bh as usize),
        );
    }
    Ok(())
}

/// An embedding of `rows` x 64 float32 (SGD with momentum in the store), each rank touching
/// `density` % of the rows per step (fresh random ids, repeats allowed), in two `dist_sync` stores:
/// one dense (the step pushes the whole gradient, zeros in the rows not touched, and pulls the
/// whole table) and one row-sparse (the step pushes the touched rows and pulls the rows of
/// the next batch with `row_sparse_pull`). Both first push every row once (the steady state of
/// a long training, where the optimizer state of every row exists). Interleaved, a sample is
/// the slowest rank's time, each cell the median. Then, on rank 0 alone, the same in a
/// single-process `local` store.
fn row_sparse(b: &Bench<'_>, rows: usize, density: f64) -> kvstore::Result<()> {
    use kvstore::{RowSparse, Sgd, Updater};
    let Bench {
        comm,
        rank,
        size,
        reps,
        bound,
        ..
    } = *b;
    let width = 64;
    let touched = ((rows as f64 * density / 100.0) as usize).max(1);
    let reps = reps.unwrap_or(7);
    let sgd = Updater::Sgd(Sgd {
        lr: 0.01,
        momentum: 0.9,
        ..Sgd::default()
    });
    let init = NDArray::from_vec(vec![0.5f32; rows * width], [rows, width])?;
    let mut seed = 0x9e37_79b9_u64 ^ (rank as u64) << 32;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let batch = |next: &mut dyn FnMut() -> u64| -> (Vec<u64>, Vec<f32>) {
        let ids: Vec<u64> = (0..touched).map(|_| next() % rows as u64).collect();
        let g = (0..touched * width)
            .map(|i| (i % 7) as f32 * 0.01 - 0.03)
            .collect();
        (ids, g)
    };
    let grads = |ids: &[u64], g: &[f32]| {
        let full = {
            let mut full = vec![0.0f32; rows * width];
            for (j, &id) in ids.iter().enumerate() {
                let row = &mut full[id as usize * width..(id as usize + 1) * width];
                for (x, y) in row.iter_mut().zip(&g[j * width..(j + 1) * width]) {
                    *x += y;
                }
            }
            NDArray::from_vec(full, [rows, width])
        };
        let rsp = NDArray::from_vec(g.to_vec(), [ids.len(), width])
            .and_then(|r| RowSparse::new(ids.to_vec(), r));
        (full, rsp)
    };
    let table = NDArray::zeros([rows, width]);
    let mut run = |kind: &str, comm_timed: bool| -> kvstore::Result<Option<[f64; 4]>> {
        let dense = KvStore::create(kind)?;
        let sparse = KvStore::create(kind)?;
        dense.init(0, &init)?;
        sparse.init_row_sparse(0, &init)?;
        dense.set_updater(sgd.clone())?;
        sparse.set_updater(sgd.clone())?;
        // Steady state: one push of every row first, so that the optimizer state exists and its
        // memory is mapped (a fresh state's pages are mapped on first touch, which would make
        // the first steps of the row-sparse store pay a page fault per row).
        let all: Vec<u64> = (0..rows as u64).collect();
        sparse.push_row_sparse(0, &[RowSparse::new(all, init.clone())?])?;
        dense.push(0, &init)?;
        let mut t: [Vec<f64>; 4] = Default::default();
        for rep in 0..=reps {
            let (ids, g) = batch(&mut next);
            let (next_ids, _) = batch(&mut next);
            let (full, rsp) = grads(&ids, &g);
            let (full, rsp) = (full?, rsp?);
            let time = |f: &mut dyn FnMut() -> kvstore::Result<()>| -> kvstore::Result<f64> {
                match comm_timed {
                    true => timed(comm, f),
                    false => {
                        let t = Instant::now();
                        f()?;
                        Ok(t.elapsed().as_secs_f64())
                    }
                }
            };
            let mut s = [0.0f64; 4];
            let order: [usize; 4] = if rep % 2 == 0 {
                [0, 1, 2, 3]
            } else {
                [2, 3, 0, 1]
            };
            for which in order {
                s[which] = match which {
                    0 => time(&mut || dense.push(0, &full))?,
                    1 => time(&mut || dense.pull(0, &table))?,
                    2 => time(&mut || sparse.push_row_sparse(0, std::slice::from_ref(&rsp)))?,
                    _ => time(&mut || sparse.row_sparse_pull(0, &next_ids).map(drop))?,
                };
            }
            let s = match comm_timed {
                true => slowest(comm, &s),
                false => s.to_vec(),
            };
            if rep > 0 {
                for (col, v) in t.iter_mut().zip(s) {
                    col.push(v);
                }
            }
        }
        Ok(Some(t.map(median)))
    };
    let dist = run("dist_sync", true)?;
    comm.barrier();
    let local = match rank {
        0 => run("local", false)?,
        _ => None,
    };
    comm.barrier();
    if rank == 0 {
        println!(
            "| store | ranks | rows x 64 f32 | key | rows touched per rank | dense push | \
             row-sparse push | dense/row-sparse | dense pull | row_sparse_pull | \
             dense/row-sparse | reps |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
        let sliced = size > 1 && rows * width > bound;
        for (name, ranks, t) in [("dist_sync", size, dist), ("local", 1, local)] {
            let Some([dp, dl, sp, sl]) = t else { continue };
            let key = match (ranks, sliced) {
                (1, _) => "one process",
                (_, true) => "sliced",
                _ => "whole",
            };
            println!(
                "| {name} | {ranks} | {rows} | {key} | {touched} | {} | {} | {:.1}x | {} | {} | \
                 {:.1}x | {reps} |",
                fmt_time(dp),
                fmt_time(sp),
                dp / sp,
                fmt_time(dl),
                fmt_time(sl),
                dl / sl,
            );
        }
    }
    Ok(())
}
