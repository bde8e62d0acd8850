//! GPU ranks: a `dist_device_sync` store's push and pull of one key, each rank's value on its
//! GPU, next to the raw NCCL collectives the store makes for it on the same GPU, timed as
//! nccl-tests times them (from a barrier to the end of the call, the slowest rank's time), the
//! store and the raw call in turn every repetition. Whole keys: `ncclReduce` to the key's home
//! and `ncclBroadcast` from it; keys over `KVSTORE_BIGARRAY_BOUND` (sliced): `ncclReduceScatter`
//! and `ncclAllGather`. Then 1000 keys of 4 KiB in one list call against one raw reduce and
//! broadcast of the same bytes.
//!
//! ```sh
//! cargo build --release --features mpi --example bench_gpu_ranks
//! mpirun -np 2 target/release/examples/bench_gpu_ranks --sizes 4K,64K,1M,16M,256M
//! ```
//!
//! Each rank takes GPU `local_rank % GPUs`: two ranks need two GPUs (or one GPU with NCCL
//! 2.30 or later and `NCCL_MULTI_RANK_GPU_ENABLE=1`). On the stand-in driver the numbers are
//! not GPU timings; it only shows that the bench runs.

use clap::Parser;
use kvstore::__internal::mpi::World;
use kvstore::__internal::nccl::RankComm;
use kvstore::__internal::probe;
use kvstore::{gpu, DType, Device, KvStore, NDArray};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

mod dist_bench;
use dist_bench::{fmt_time, label, median, parse_size, slowest, timed};

/// GPU ranks: the dist store's push and pull next to raw NCCL (run under mpirun; see the
/// example's docs).
#[derive(Parser)]
#[command(name = "bench_gpu_ranks")]
struct Options {
    /// The one-key sizes, in bytes: a comma-separated list of 4096, 64K, 16M, 1G, ...
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = parse_size,
        default_value = "4K,64K,1M,16M,256M"
    )]
    sizes: Vec<usize>,
    /// Repetitions of every size (default: by size).
    #[arg(long)]
    reps: Option<usize>,
}

/// NCCL between the ranks for the raw collectives: rank 0's id sent over MPI, as nccl-tests
/// does it.
fn raw_comm(comm: &SimpleCommunicator, world: &World, ordinal: usize) -> kvstore::Result<RankComm> {
    let mut id = [0u8; 128];
    if world.rank() == 0 {
        for (b, c) in id.iter_mut().zip(RankComm::unique_id()?.0) {
            *b = c as u8;
        }
    }
    comm.process_at_rank(0).broadcast_into(&mut id[..]);
    let mut unique = kvstore::__internal::nccl::loader::UniqueId([0; 128]);
    for (c, b) in unique.0.iter_mut().zip(id) {
        *c = b as std::ffi::c_char;
    }
    RankComm::join(unique, world.rank(), world.size(), ordinal)
}

fn main() -> kvstore::Result<()> {
    let o = Options::parse();
    let world = World::get()?;
    let comm = SimpleCommunicator::world();
    let (rank, size) = (world.rank(), world.size());
    let gpus = probe::gpu_count();
    if gpus == 0 {
        if rank == 0 {
            println!("SKIPPED: bench_gpu_ranks: no GPU");
        }
        return Ok(());
    }
    let ordinal = world.local_rank() % gpus;
    let raw = raw_comm(&comm, world, ordinal)?;
    let bound: usize = std::env::var("KVSTORE_BIGARRAY_BOUND")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(1_000_000);
    if rank == 0 {
        println!(
            "# {size} GPU ranks, float32, KVSTORE_BIGARRAY_BOUND {bound}, NCCL {}; medians of \
             the slowest rank's time",
            kvstore::__internal::nccl::version()
                .map(kvstore::__internal::nccl::loader::version_string)
                .unwrap_or_default()
        );
        println!("| ranks | size | key | op | store | raw NCCL | store/raw | store GB/s | reps |");
        println!("|---|---|---|---|---|---|---|---|---|");
    }
    for &bytes in &o.sizes {
        one_key(&comm, &raw, gpu(ordinal), bytes, bound, o.reps)?;
    }
    many_keys(&comm, &raw, gpu(ordinal), o.reps)?;
    Ok(())
}

/// Push and pull of one key of `bytes` bytes, next to the raw collectives.
fn one_key(
    comm: &SimpleCommunicator,
    raw: &RankComm,
    dev: Device,
    bytes: usize,
    bound: usize,
    reps: Option<usize>,
) -> kvstore::Result<()> {
    let (rank, size) = (raw.rank(), raw.size());
    let n = (bytes / 4).max(1);
    let sliced = size > 1 && n > bound;
    let block = n.div_ceil(size);
    let reps = reps.unwrap_or(match bytes {
        b if b <= 1 << 20 => 100,
        b if b <= 16 << 20 => 20,
        _ => 5,
    });
    let kv = KvStore::create("dist_device_sync")?;
    kv.init(0, &NDArray::full_on([n], 1.0, DType::F32, dev)?)?;
    let grad = NDArray::full_on([n], rank as f64 + 1.0, DType::F32, dev)?;
    let out = NDArray::full_on([n], 0.0, DType::F32, dev)?;
    // The raw collectives' buffers, on the same GPU (padded to a block per rank when sliced).
    let send = NDArray::full_on([block * size], rank as f64 + 1.0, DType::F32, dev)?;
    let part = NDArray::full_on([block], 0.0, DType::F32, dev)?;
    let whole = NDArray::full_on([n], 0.0, DType::F32, dev)?;
    // [store push, raw push, store pull, raw pull]
    let mut t: [Vec<f64>; 4] = Default::default();
    for rep in 0..=reps {
        let s = [
            timed(comm, || kv.push(0, &grad))?,
            timed(comm, || match sliced {
                true => raw.reduce_scatter(&send, &part),
                false => raw.reduce_sum(&grad, &whole, 0),
            })?,
            timed(comm, || kv.pull(0, &out))?,
            timed(comm, || match sliced {
                true => raw.all_gather(&part, &send),
                false => raw.broadcast(&whole, 0),
            })?,
        ];
        if rep > 0 {
            for (v, x) in t.iter_mut().zip(s) {
                v.push(x);
            }
        }
    }
    // The pull must have brought the stored value: 1, then the sum of the pushes.
    let want = (size * (size + 1) / 2) as f64;
    let got = out.to_vec::<f64>()?;
    assert!(
        got.iter().all(|&v| v == want),
        "the pull returned {} (and maybe more) instead of {want}",
        got[0]
    );
    let m: Vec<f64> = t.iter().map(|v| median(slowest(comm, v))).collect();
    if rank == 0 {
        let key = if sliced { "sliced" } else { "whole" };
        let size_label = label(bytes);
        for (op, raw_name, i) in [
            ("push", if sliced { "reduce_scatter" } else { "reduce" }, 0),
            ("pull", if sliced { "all_gather" } else { "broadcast" }, 2),
        ] {
            let (st, rw) = (m[i], m[i + 1]);
            println!(
                "| {size} | {size_label} | {key} | {op} | {} | {} ({raw_name}) | {:.2} | {:.2} | {reps} |",
                fmt_time(st),
                fmt_time(rw),
                st / rw,
                (n * 4) as f64 / st / 1e9,
            );
            println!(
                "json {{\"ranks\":{size},\"bytes\":{bytes},\"key\":\"{key}\",\"op\":\"{op}\",\"raw\":\"{raw_name}\",\"store_s\":{st:.9},\"raw_s\":{rw:.9},\"reps\":{reps}}}"
            );
        }
    }
    Ok(())
}

/// 1000 keys × 4 KiB in one `push_list` and one `pull_list`, next to one raw reduce and one
/// broadcast of the same bytes.
fn many_keys(
    comm: &SimpleCommunicator,
    raw: &RankComm,
    dev: Device,
    reps: Option<usize>,
) -> kvstore::Result<()> {
    let (rank, size) = (raw.rank(), raw.size());
    let (keys, len) = (1000usize, 1024usize);
    let reps = reps.unwrap_or(30);
    let kv = KvStore::create("dist_device_sync")?;
    let ids: Vec<i32> = (0..keys as i32).collect();
    let init: Vec<NDArray> = (0..keys)
        .map(|_| NDArray::full_on([len], 1.0, DType::F32, dev))
        .collect::<kvstore::Result<_>>()?;
    kv.init_list(&ids, &init)?;
    let grads: Vec<NDArray> = (0..keys)
        .map(|_| NDArray::full_on([len], rank as f64 + 1.0, DType::F32, dev))
        .collect::<kvstore::Result<_>>()?;
    let outs: Vec<NDArray> = (0..keys)
        .map(|_| NDArray::full_on([len], 0.0, DType::F32, dev))
        .collect::<kvstore::Result<_>>()?;
    let send = NDArray::full_on([keys * len], 1.0, DType::F32, dev)?;
    let recv = NDArray::full_on([keys * len], 0.0, DType::F32, dev)?;
    let mut t: [Vec<f64>; 4] = Default::default();
    for rep in 0..=reps {
        let s = [
            timed(comm, || kv.push_list(&ids, &grads))?,
            timed(comm, || raw.reduce_sum(&send, &recv, 0))?,
            timed(comm, || kv.pull_list(&ids, &outs))?,
            timed(comm, || raw.broadcast(&recv, 0))?,
        ];
        if rep > 0 {
            for (v, x) in t.iter_mut().zip(s) {
                v.push(x);
            }
        }
    }
    let m: Vec<f64> = t.iter().map(|v| median(slowest(comm, v))).collect();
    if rank == 0 {
        for (op, raw_name, i) in [("push_list", "reduce", 0), ("pull_list", "broadcast", 2)] {
            let (st, rw) = (m[i], m[i + 1]);
            println!(
                "| {size} | 1000 × 4K | list | {op} | {} ({:.2} µs/key) | {} ({raw_name}, packed) | {:.2} | {:.2} | {reps} |",
                fmt_time(st),
                st / keys as f64 * 1e6,
                fmt_time(rw),
                st / rw,
                (keys * len * 4) as f64 / st / 1e9,
            );
            println!(
                "json {{\"ranks\":{size},\"bytes\":{},\"key\":\"list\",\"op\":\"{op}\",\"raw\":\"{raw_name}\",\"store_s\":{st:.9},\"raw_s\":{rw:.9},\"reps\":{reps}}}",
                keys * len * 4
            );
        }
    }
    Ok(())
}
