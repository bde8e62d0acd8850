//! Data-parallel training over 4 devices must match single-device training on the whole batch:
//! the store's sum over devices, `rescale_grad` and optimizer state make the shards invisible.
//!
//! The training tests run on both homes: `cpu::*` on cpu(i) devices with every store kind that
//! keeps its keys on the host, `gpu::*` (ignored: needs a GPU) on GPU devices with every kind
//! that keeps them on a GPU (with one GPU, all 4 devices are gpu(0): four values summed by one
//! kernel). The 1-device reference is trained on the same home. The gradient check of the
//! MLP itself involves no store and stays a plain test.

mod common;
#[path = "../examples/mlp/mod.rs"]
mod mlp;

use common::Home;
use kvstore::{Adam, Device, Sgd, Updater};
use mlp::{DataParallel, Dataset};

const STEPS: usize = 20;
const BATCH: usize = 96;
const SEED: u64 = 2024;

fn sgd(rescale: f64) -> Updater {
    Updater::Sgd(Sgd {
        lr: 0.1,
        momentum: 0.9,
        rescale_grad: rescale,
        ..Sgd::default()
    })
}

fn adam(rescale: f64) -> Updater {
    Updater::Adam(Adam {
        lr: 0.01,
        rescale_grad: rescale,
        ..Adam::default()
    })
}

/// Trains `STEPS` steps on the home's first `devices` devices with a `kind` store, pushing the
/// gradients of the first `pushed` devices; returns the stored parameters, after checking
/// every device's copy of them.
fn train(
    h: Home,
    kind: &str,
    devices: usize,
    pushed: usize,
    updater: Updater,
) -> anyhow::Result<Vec<Vec<f32>>> {
    let data = Dataset::spirals(STEPS * BATCH / 3 + 1, SEED);
    assert!(h.kinds().contains(&kind), "{kind} is not a {h:?} store");
    let devs: Vec<Device> = (0..devices).map(|i| h.dev(i)).collect();
    let model = DataParallel::new(kind, devs, updater, SEED)?;
    for s in 0..STEPS {
        model.step_with(data.batch(s * BATCH..(s + 1) * BATCH), pushed)?;
    }
    let stored = model.stored_params()?;
    for d in 0..devices {
        assert_eq!(
            model.device_params(d)?,
            stored,
            "device {d} did not get the stored parameters"
        );
    }
    Ok(stored)
}

/// The largest `max|a - b| / max|b|` over the parameter tensors.
fn max_rel_err(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(a, b)| {
            let diff = a
                .iter()
                .zip(b)
                .map(|(x, y)| f64::from((x - y).abs()))
                .fold(0.0, f64::max);
            let scale = b.iter().map(|y| f64::from(y.abs())).fold(1e-30, f64::max);
            diff / scale
        })
        .fold(0.0, f64::max)
}

fn check(h: Home, updater: fn(f64) -> Updater) -> anyhow::Result<()> {
    let rescale = 1.0 / BATCH as f64;
    let single = train(h, h.kind(), 1, 1, updater(rescale))?;
    let initial = mlp::init_params(SEED);
    // Training moved the parameters, so the comparison below is not trivially true.
    assert!(
        max_rel_err(&single, &initial) > 1e-2,
        "training did not move the parameters"
    );

    for kind in h.kinds() {
        let multi = train(h, kind, 4, 4, updater(rescale))?;
        let err = max_rel_err(&multi, &single);
        assert!(
            err <= 1e-5,
            "{kind}: 4 devices vs 1: max relative error {err:e}"
        );
    }

    // The comparison catches the mistakes it is there for.
    let dropped = max_rel_err(&train(h, h.kind(), 4, 3, updater(rescale))?, &single);
    assert!(
        dropped > 1e-3,
        "a dropped shard went unnoticed: {dropped:e}"
    );
    let unscaled = max_rel_err(&train(h, h.kind(), 4, 4, updater(rescale * 4.0))?, &single);
    assert!(
        unscaled > 1e-3,
        "a wrong rescale went unnoticed: {unscaled:e}"
    );
    Ok(())
}

fn four_devices_match_one_with_sgd_momentum(h: Home) -> anyhow::Result<()> {
    check(h, sgd)
}

fn four_devices_match_one_with_adam(h: Home) -> anyhow::Result<()> {
    check(h, adam)
}

on_every_home!(
    four_devices_match_one_with_sgd_momentum,
    four_devices_match_one_with_adam
);

/// The hand-written backward pass agrees with central differences of the loss.
#[test]
fn gradients_match_finite_differences() {
    let data = Dataset::spirals(4, 5);
    let batch = data.batch(0..data.len());
    let params = mlp::init_params(9);
    let grads = mlp::pass(&params, batch, true).grads;
    let loss = |p: &[Vec<f32>]| mlp::pass(p, batch, false).loss_sum;
    let numeric = |k: usize, i: usize, h: f32| {
        let mut p = params.clone();
        p[k][i] += h;
        let up = loss(&p);
        p[k][i] -= 2.0 * h;
        let down = loss(&p);
        (up - down) / (2.0 * f64::from(h))
    };
    let (mut checked, mut kinks) = (0, 0);
    for (k, g) in grads.iter().enumerate() {
        for i in (0..g.len()).step_by(7) {
            let analytic = f64::from(g[i]);
            let tol = 2e-2 * (1.0 + analytic.abs());
            checked += 1;
            // A step that moves a ReLU across zero for some sample gives a wrong difference;
            // such an element must agree with at least one of two smaller steps.
            if (numeric(k, i, 1e-3) - analytic).abs() > tol {
                kinks += 1;
                let agree = [3e-4, 1e-4]
                    .iter()
                    .any(|&h| (numeric(k, i, h) - analytic).abs() <= tol);
                assert!(
                    agree,
                    "param {k}[{i}]: backward {analytic}, finite differences {} / {} / {}",
                    numeric(k, i, 1e-3),
                    numeric(k, i, 3e-4),
                    numeric(k, i, 1e-4)
                );
            }
        }
    }
    assert!(
        kinks * 20 < checked,
        "{kinks} of {checked} elements needed a smaller step"
    );
    assert!(checked > 100);
}
