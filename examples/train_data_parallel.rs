//! Data-parallel training of a small MLP on a 3-class spiral data set, with the optimizer
//! running as the store's updater.
//!
//! Every step, each device computes the gradients of its shard of the batch (in parallel, one
//! rayon task per device); all gradients of all devices go to the store in ONE `push_list`,
//! where they are summed and the optimizer (`Sgd` with momentum or `Adam`, `rescale_grad = 1 / batch`) updates the parameters;
//! ONE `pull_list` copies the new parameters back to every device.
//!
//! ```text
//! cargo run --release --example train_data_parallel -- --devices 4 --optimizer adam
//! ```
//!
//! **Across processes** (cargo feature `mpi`): with `--kind dist_sync` every MPI rank takes its
//! shard of every batch (rank `r` of `N` gets the `r`-th of `N` contiguous runs of its rows, split again over its
//! own `--devices`, 1 by default), pushes its gradients in ONE `push_list` (summed over the ranks
//! onto each key's home rank, where the optimizer runs), and pulls the parameters back with ONE
//! `pull_list`. Loss and accuracy are summed over the ranks and printed by rank 0 only. At the
//! end rank 0 also trains the same model in one process, with a `local` store and one device on
//! the whole batch, and prints how far the final parameters are from it (`--check 0` skips
//! this; the run fails if they differ by more than `--tolerance`, default 1e-4, as the largest
//! `max |diff| / max |param|` over the tensors). The two runs add the same gradients in another
//! order (per rank, then across ranks), so f32 rounding makes them drift apart slowly: measured
//! at 4 ranks, about 4e-7 after one epoch (23 steps) and 1e-6 to 3e-6 after the default 20
//! epochs (460 steps), 1.1e-5 with SGD when `KVSTORE_BIGARRAY_BOUND=100` slices the big keys;
//! a 4-device `local` run (`--kind local --check 1`) drifts as far, 1.3e-5.
//!
//! ```text
//! cargo build --release --features mpi --example train_data_parallel
//! OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 \
//!   mpirun --oversubscribe -np 4 target/release/examples/train_data_parallel --kind dist_sync
//! ```
//!
//! **Overlap** (`--overlap`): backward hands each layer's gradients to an [`AsyncKvStore`] as
//! soon as it has them, so they are summed across ranks and the optimizer runs on them while
//! backward computes the layers below; the parameters are pulled at the end of the step. Every
//! other step is run the plain way (one blocking `push_list`, then `pull_list`), and the run
//! ends with the median time of each kind of step, side by side, and their ratio. Both kinds
//! push the same sums, so the parameters are the same as without `--overlap`.
//!
//! ```text
//! mpirun --oversubscribe -np 2 target/release/examples/train_data_parallel --kind dist_sync --overlap 1
//! ```
//!
//! [`AsyncKvStore`]: kvstore::AsyncKvStore
//!
//! Options: `--devices N` (4; 1 per rank for `dist_*` kinds), `--optimizer sgd|adam` (sgd),
//! `--epochs E` (20), `--batch B` (128, the global batch over all ranks), `--lr LR` (0.1 for
//! sgd, 0.01 for adam), `--kind KIND` or `--kvstore KIND` (device), `--samples S` per class
//! (1000), `--seed SEED` (7), `--check 0|1` (1 for `dist_*` kinds, 0 otherwise),
//! `--tolerance T` (1e-4), `--overlap 0|1` (0). Devices are `gpu(0..N)` when this machine has N GPUs and the kind is
//! not `dist_*`, else the logical CPU devices `cpu(0..N)`.

mod mlp;

use std::time::Instant;

use anyhow::{bail, Context};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use kvstore::gpu_count;
use kvstore::{
    cpu, gpu, Adam, AsyncKvStore, DType, Device, KvStore, NDArray, Sgd, StoreKind, Updater,
};
use mlp::{shard, DataParallel, Dataset};

/// Data-parallel training of a small MLP, the optimizer running as the store's updater (see the
/// example's docs).
#[derive(Parser)]
#[command(name = "train_data_parallel")]
struct Options {
    /// Devices per process [default: 4; 1 per rank for dist_* kinds].
    #[arg(long)]
    devices: Option<usize>,
    /// The optimizer: sgd (with momentum) or adam.
    #[arg(long, value_parser = ["sgd", "adam"], default_value = "sgd")]
    optimizer: String,
    /// Passes over the training set.
    #[arg(long, default_value_t = 20)]
    epochs: usize,
    /// The global batch, over all ranks.
    #[arg(long, default_value_t = 128)]
    batch: usize,
    /// The learning rate [default: 0.1 for sgd, 0.01 for adam].
    #[arg(long)]
    lr: Option<f64>,
    /// The store kind (local, device, dist_sync, ...).
    #[arg(long, visible_alias = "kind", default_value = "device")]
    kvstore: String,
    /// Samples per class.
    #[arg(long, default_value_t = 1000)]
    samples: usize,
    /// The seed of the data set and of the initial parameters.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// 1: rank 0 trains the same model in one process and fails if the parameters differ
    /// [default: 1 for dist_* kinds, 0 otherwise].
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=1))]
    check: Option<u8>,
    /// The largest `max |diff| / max |param|` over the tensors that --check accepts.
    #[arg(long, default_value_t = 1e-4)]
    tolerance: f64,
    /// 1: overlap every other step's communication with backward, and compare step times.
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=1), default_value_t = 0)]
    overlap: u8,
}

/// `[loss, correct]` summed over every rank (as is, in one process): a push to a store with no
/// updater sums over the ranks and assigns, and a pull brings the sum back.
struct Totals {
    kv: Option<KvStore>,
}

impl Totals {
    fn new(kind: StoreKind) -> anyhow::Result<Totals> {
        if !kind.is_dist() {
            return Ok(Totals { kv: None });
        }
        let kv = KvStore::create(kind)?;
        kv.init(0, &NDArray::from_vec(vec![0.0f64; 2], [2])?)?;
        Ok(Totals { kv: Some(kv) })
    }

    fn sum(&self, loss: f64, correct: usize) -> anyhow::Result<(f64, usize)> {
        let Some(kv) = &self.kv else {
            return Ok((loss, correct));
        };
        let mine = NDArray::from_f64(&[loss, correct as f64], [2], DType::F64, cpu(0))?;
        kv.push(0, &mine)?;
        kv.pull(0, &mine)?;
        let all = mine.to_vec::<f64>()?;
        Ok((all[0], all[1].round() as usize))
    }
}

fn main() -> anyhow::Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let o = Options::parse();
    let kind = StoreKind::parse(&o.kvstore)?;
    let n_devices = o.devices.unwrap_or(if kind.is_dist() { 1 } else { 4 });
    let device = |i| {
        if !kind.is_dist() && gpu_count() >= n_devices {
            gpu(i)
        } else {
            cpu(i)
        }
    };
    let devices: Vec<Device> = (0..n_devices).map(device).collect();

    let rescale_grad = 1.0 / o.batch as f64;
    let updater = match o.optimizer.as_str() {
        "sgd" => Updater::Sgd(Sgd {
            lr: o.lr.unwrap_or(0.1),
            momentum: 0.9,
            rescale_grad,
            ..Sgd::default()
        }),
        "adam" => Updater::Adam(Adam {
            lr: o.lr.unwrap_or(0.01),
            rescale_grad,
            ..Adam::default()
        }),
        other => bail!("unknown optimizer '{other}': use sgd or adam"),
    };

    let train = Dataset::spirals(o.samples, o.seed);
    let test = Dataset::spirals(o.samples / 4, o.seed + 1);
    let model = DataParallel::new(&o.kvstore, devices.clone(), updater.clone(), o.seed)?;
    let (rank, ranks) = (model.kv.rank(), model.kv.num_workers());
    if n_devices == 0 || o.batch < n_devices * ranks {
        bail!("need at least one device and a batch of at least one sample per device and rank");
    }
    let totals = Totals::new(kind)?;
    let lead = rank == 0;
    let steps = train.len() / o.batch;
    if lead {
        println!(
            "training a 2x64 MLP on {} spiral points: {ranks} rank(s) x {} devices {:?}, '{}' store, {:?}, batch {}",
            train.len(),
            devices.len(),
            devices.iter().map(ToString::to_string).collect::<Vec<_>>(),
            o.kvstore,
            updater,
            o.batch
        );
    }

    let bar = if lead {
        ProgressBar::new((o.epochs * steps) as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} steps {msg}")
            .context("progress bar template")?,
    );
    // With --overlap: the queue the overlapped steps push through, and each kind's step times.
    let queue = (o.overlap == 1).then(|| AsyncKvStore::new(model.kv.clone()));
    let (mut blocking_s, mut overlapped_s) = (Vec::new(), Vec::new());
    let start = Instant::now();
    let mut seen = 0usize;
    for epoch in 1..=o.epochs {
        let (mut loss, mut correct) = (0.0, 0);
        for s in 0..steps {
            let batch = train.batch(s * o.batch..(s + 1) * o.batch);
            // This rank's shard of the global batch (the whole batch in one process).
            let mine = shard(batch, rank, ranks);
            let t = Instant::now();
            let (l, c) = match &queue {
                // Every other step overlapped: the same step on every rank, as the calls of
                // the ranks must match.
                Some(q) if s % 2 == 0 => {
                    let r = model.step_overlapped(q, mine)?;
                    overlapped_s.push(t.elapsed().as_secs_f64());
                    r
                }
                _ => {
                    let r = model.step(mine)?;
                    blocking_s.push(t.elapsed().as_secs_f64());
                    r
                }
            };
            loss += l;
            correct += c;
            seen += o.batch;
            bar.inc(1);
        }
        let (loss, correct) = totals.sum(loss, correct)?;
        if lead {
            let n = (steps * o.batch) as f64;
            // Every rank holds the same parameters: rank 0 evaluates them.
            let (test_loss, test_acc) = model.evaluate(&test)?;
            let rate = seen as f64 / start.elapsed().as_secs_f64();
            bar.set_message(format!("{rate:.0} samples/s"));
            // `suspend` prints even when the bar is hidden (output not a terminal).
            bar.suspend(|| {
                println!(
                    "epoch {epoch:3}: train loss {:.4} acc {:.3} | test loss {test_loss:.4} acc {test_acc:.3} | {rate:.0} samples/s",
                    loss / n,
                    correct as f64 / n,
                )
            });
        }
    }
    bar.finish_and_clear();
    let elapsed = start.elapsed().as_secs_f64();
    if lead {
        println!(
            "done: {seen} samples in {elapsed:.2} s, {:.0} samples/s",
            seen as f64 / elapsed
        );
        let blocking = median_ms(&mut blocking_s);
        match median_ms(&mut overlapped_s) {
            Some(overlapped) => println!(
                "step time, median of this rank's steps: overlapped {overlapped:.3} ms ({} steps), \
                 blocking {:.3} ms ({} steps): overlap is {:.2}x as fast",
                overlapped_s.len(),
                blocking.unwrap_or(f64::NAN),
                blocking_s.len(),
                blocking.unwrap_or(f64::NAN) / overlapped
            ),
            None => println!(
                "step time, median of this rank's steps: {:.3} ms ({} steps, blocking)",
                blocking.unwrap_or(f64::NAN),
                blocking_s.len()
            ),
        }
    }

    if lead && o.check.map_or(kind.is_dist(), |c| c == 1) {
        // The same training in this process alone: a `local` store, one device, whole batches.
        let reference = DataParallel::new("local", vec![cpu(0)], updater, o.seed)?;
        for _ in 0..o.epochs {
            for s in 0..steps {
                reference.step(train.batch(s * o.batch..(s + 1) * o.batch))?;
            }
        }
        let ours = model.device_params(0)?;
        let want = reference.stored_params()?;
        let (mut max_abs, mut max_rel) = (0.0f64, 0.0f64);
        let (mut sum_ours, mut sum_want) = (0.0f64, 0.0f64);
        for (a, b) in ours.iter().zip(&want) {
            let diff = a
                .iter()
                .zip(b)
                .map(|(x, y)| f64::from((x - y).abs()))
                .fold(0.0, f64::max);
            let scale = b.iter().map(|y| f64::from(y.abs())).fold(1e-30, f64::max);
            max_abs = max_abs.max(diff);
            max_rel = max_rel.max(diff / scale);
            sum_ours += a.iter().map(|&x| f64::from(x)).sum::<f64>();
            sum_want += b.iter().map(|&x| f64::from(x)).sum::<f64>();
        }
        let count: usize = ours.iter().map(Vec::len).sum();
        println!(
            "final parameters ({count} numbers) vs one process with a 'local' store on the whole \
             batch: checksum {sum_ours:.6} vs {sum_want:.6}, max |diff| {max_abs:.3e}, max \
             |diff| / max |param| per tensor {max_rel:.3e} (tolerance {:e})",
            o.tolerance
        );
        if max_rel > o.tolerance {
            bail!(
                "the final parameters differ from the single-process run by {max_rel:.3e} \
                 (relative), more than --tolerance {:e}",
                o.tolerance
            );
        }
        println!("equal within the tolerance");
    }
    Ok(())
}

/// The median of `seconds`, in milliseconds; `None` for none.
fn median_ms(seconds: &mut [f64]) -> Option<f64> {
    seconds.sort_by(f64::total_cmp);
    let n = seconds.len();
    (n > 0).then(|| 1e3 * (seconds[(n - 1) / 2] + seconds[n / 2]) / 2.0)
}
