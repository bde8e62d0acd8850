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
//! Options: `--devices N` (4), `--optimizer sgd|adam` (sgd), `--epochs E` (20), `--batch B`
//! (128), `--lr LR` (0.1 for sgd, 0.01 for adam), `--kvstore KIND` (device), `--samples S` per
//! class (1000), `--seed SEED` (7). Devices are `gpu(0..N)` when this machine has N GPUs,
//! else the logical CPU devices `cpu(0..N)`.

mod mlp;

use std::time::Instant;

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use kvstore::gpu_count;
use kvstore::{cpu, gpu, Adam, Device, Sgd, Updater};
use mlp::{DataParallel, Dataset};

struct Options {
    devices: usize,
    optimizer: String,
    epochs: usize,
    batch: usize,
    lr: Option<f64>,
    kvstore: String,
    samples: usize,
    seed: u64,
}

const USAGE: &str = "usage: train_data_parallel [--devices N (4)] [--optimizer sgd|adam (sgd)] \
[--epochs E (20)] [--batch B (128)] [--lr LR (0.1 sgd, 0.01 adam)] [--kvstore KIND (device)] \
[--samples S per class (1000)] [--seed SEED (7)]";

fn parse_args() -> anyhow::Result<Options> {
    let mut o = Options {
        devices: 4,
        optimizer: "sgd".into(),
        epochs: 20,
        batch: 128,
        lr: None,
        kvstore: "device".into(),
        samples: 1000,
        seed: 7,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        let value = args
            .next()
            .with_context(|| format!("{flag} needs a value"))?;
        let bad = || format!("bad value '{value}' for {flag}");
        match flag.as_str() {
            "--devices" => o.devices = value.parse().with_context(bad)?,
            "--optimizer" => o.optimizer = value.clone(),
            "--epochs" => o.epochs = value.parse().with_context(bad)?,
            "--batch" => o.batch = value.parse().with_context(bad)?,
            "--lr" => o.lr = Some(value.parse().with_context(bad)?),
            "--kvstore" => o.kvstore = value.clone(),
            "--samples" => o.samples = value.parse().with_context(bad)?,
            "--seed" => o.seed = value.parse().with_context(bad)?,
            _ => bail!("unknown option {flag}\n{USAGE}"),
        }
    }
    if o.devices == 0 || o.batch < o.devices {
        bail!("need at least one device and a batch of at least one sample per device");
    }
    Ok(o)
}

fn main() -> anyhow::Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let o = parse_args()?;
    let device = |i| {
        if gpu_count() >= o.devices {
            gpu(i)
        } else {
            cpu(i)
        }
    };
    let devices: Vec<Device> = (0..o.devices).map(device).collect();

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
    let steps = train.len() / o.batch;
    println!(
        "training a 2x64 MLP on {} spiral points: {} devices {:?}, '{}' store, {:?}, batch {}",
        train.len(),
        devices.len(),
        devices.iter().map(ToString::to_string).collect::<Vec<_>>(),
        o.kvstore,
        updater,
        o.batch
    );

    let bar = ProgressBar::new((o.epochs * steps) as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} steps {msg}")
            .context("progress bar template")?,
    );
    let start = Instant::now();
    let mut seen = 0usize;
    for epoch in 1..=o.epochs {
        let (mut loss, mut correct) = (0.0, 0);
        for s in 0..steps {
            let batch = train.batch(s * o.batch..(s + 1) * o.batch);
            let (l, c) = model.step(batch)?;
            loss += l;
            correct += c;
            seen += o.batch;
            bar.inc(1);
        }
        let n = (steps * o.batch) as f64;
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
    bar.finish_and_clear();
    let elapsed = start.elapsed().as_secs_f64();
    println!(
        "done: {seen} samples in {elapsed:.2} s, {:.0} samples/s",
        seen as f64 / elapsed
    );
    Ok(())
}
