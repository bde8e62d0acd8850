//! Optimizer schedules: learning-rate schedules with warm-up, hyperparameter changes that keep
//! every key's state, and per-key multipliers, against an independent f64 reference of MXNet's
//! optimizer (its `lr_scheduler` classes written here as MXNet writes them, stateful, and its
//! `sgd_mom_update` / `adam_update`).
//!
//! The reference keeps each key's weight rounded to the key's dtype after every step, as the
//! store does, and its state in f64. `num_update` is the largest per-key update count; one push
//! call computes it once and all its keys use that call's rate.
//!
//! Data is fresh each run (the seed is printed, and named in every failure).
//!
//! Store tests run on both homes: `cpu::*` with a `local` store, `gpu::*` (ignored: needs a
//! GPU) with a `device` store, where f32 keys run the PTX kernels and f64 keys the host path.

mod common;

use std::collections::BTreeMap;
use std::f64::consts::PI;

use common::Home;
use half::{bf16, f16};
use kvstore::{Adam, DType, Decay, Error, KvStore, LrScheduler, NDArray, Sgd, Updater, WarmupMode};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

on_every_home!(
    sgd_momentum_with_warmup_and_multi_factor,
    sgd_momentum_with_warmup_and_factor,
    adam_with_warmup_and_cosine,
    adam_with_warmup_and_poly,
    learning_rate_change_keeps_momentum,
    hyperparameter_change_keeps_adam_state,
    multipliers_with_sgd_momentum,
    multipliers_with_adam,
);

const STEPS: u64 = 25;

fn fresh_seed() -> u64 {
    let seed = rand::random();
    eprintln!("seed {seed}");
    seed
}

fn round_to(dtype: DType, x: f64) -> f64 {
    match dtype {
        DType::F32 => f64::from(x as f32),
        DType::F64 => x,
        DType::F16 => f16::from_f64(x).to_f64(),
        DType::BF16 => bf16::from_f64(x).to_f64(),
    }
}

/// Relative tolerance of a key's weight after many steps (absolute below 1).
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-10,
        _ => 1e-4,
    }
}

// ---------------------------------------------------------------------------------------------
// The reference: MXNet's lr_scheduler.py, as stateful objects.

/// Warm-up as MXNet's `LRScheduler.get_warmup_lr`.
#[derive(Clone, Copy)]
struct RefWarmup {
    steps: u64,
    begin: f64,
    linear: bool,
}

impl RefWarmup {
    fn lr(&self, base: f64, n: u64) -> f64 {
        if self.linear {
            self.begin + (base - self.begin) * (n as f64) / (self.steps as f64)
        } else {
            self.begin
        }
    }
}

/// One of MXNet's schedulers with its mutable state (`base_lr`, `count`, `cur_step_ind`).
enum RefSched {
    Factor {
        base: f64,
        count: u64,
        step: u64,
        factor: f64,
        stop: f64,
    },
    MultiFactor {
        base: f64,
        ind: usize,
        steps: Vec<u64>,
        factor: f64,
    },
    Poly {
        orig: f64,
        last: f64,
        max: u64,
        pwr: f64,
        fin: f64,
    },
    Cosine {
        orig: f64,
        last: f64,
        max: u64,
        fin: f64,
    },
}

struct RefSchedule {
    sched: RefSched,
    warmup: RefWarmup,
}

impl RefSchedule {
    /// `__call__(num_update)`.
    fn call(&mut self, n: u64) -> f64 {
        let w = self.warmup;
        match &mut self.sched {
            RefSched::Factor {
                base,
                count,
                step,
                factor,
                stop,
            } => {
                if n < w.steps {
                    return w.lr(*base, n);
                }
                while n > *count + *step {
                    *count += *step;
                    *base *= *factor;
                    if *base < *stop {
                        *base = *stop;
                    }
                }
                *base
            }
            RefSched::MultiFactor {
                base,
                ind,
                steps,
                factor,
            } => {
                if n < w.steps {
                    return w.lr(*base, n);
                }
                while *ind < steps.len() {
                    if n > steps[*ind] {
                        *ind += 1;
                        *base *= *factor;
                    } else {
                        break;
                    }
                }
                *base
            }
            RefSched::Poly {
                orig,
                last,
                max,
                pwr,
                fin,
            } => {
                if n < w.steps {
                    return w.lr(*orig, n);
                }
                if n <= *max {
                    let frac = (n - w.steps) as f64 / (*max - w.steps) as f64;
                    *last = *fin + (*orig - *fin) * (1.0 - frac).powf(*pwr);
                }
                *last
            }
            RefSched::Cosine {
                orig,
                last,
                max,
                fin,
            } => {
                if n < w.steps {
                    return w.lr(*orig, n);
                }
                if n <= *max {
                    let frac = (n - w.steps) as f64 / (*max - w.steps) as f64;
                    *last = *fin + (*orig - *fin) * (1.0 + (PI * frac).cos()) / 2.0;
                }
                *last
            }
        }
    }
}

/// The reference optimizer rule, in f64.
#[derive(Clone, Copy, Debug)]
enum RefRule {
    SgdMom {
        lr: f64,
        momentum: f64,
        wd: f64,
        rescale: f64,
    },
    Adam {
        lr: f64,
        b1: f64,
        b2: f64,
        eps: f64,
        wd: f64,
        rescale: f64,
    },
}

impl RefRule {
    fn lr(&self) -> f64 {
        match *self {
            RefRule::SgdMom { lr, .. } | RefRule::Adam { lr, .. } => lr,
        }
    }

    fn updater(&self) -> Updater {
        match *self {
            RefRule::SgdMom {
                lr,
                momentum,
                wd,
                rescale,
            } => Updater::Sgd(Sgd {
                lr,
                momentum,
                wd,
                rescale_grad: rescale,
                clip_gradient: None,
            }),
            RefRule::Adam {
                lr,
                b1,
                b2,
                eps,
                wd,
                rescale,
            } => Updater::Adam(Adam {
                lr,
                beta1: b1,
                beta2: b2,
                epsilon: eps,
                wd,
                rescale_grad: rescale,
                clip_gradient: None,
                epsilon_after_correction: false,
            }),
        }
    }
}

/// One key of the reference.
struct RefKey {
    dtype: DType,
    w: Vec<f64>,
    m: Vec<f64>,
    v: Vec<f64>,
    t: u64,
    lr_mult: f64,
    wd_mult: f64,
}

/// The reference optimizer: MXNet's `Optimizer` with `num_update` and per-key multipliers.
struct Reference {
    rule: RefRule,
    schedule: Option<RefSchedule>,
    keys: BTreeMap<i32, RefKey>,
    num_update: u64,
}

impl Reference {
    fn new(rule: RefRule, schedule: Option<RefSchedule>) -> Reference {
        Reference {
            rule,
            schedule,
            keys: BTreeMap::new(),
            num_update: 0,
        }
    }

    /// The rate of the last push.
    fn lr_now(&mut self) -> f64 {
        let base = self.rule.lr();
        let n = self.num_update;
        self.schedule.as_mut().map_or(base, |s| s.call(n))
    }

    /// One push call whose summed inputs are `grads`, per key.
    fn push(&mut self, grads: &[(i32, Vec<f64>)]) {
        let most = grads.iter().map(|(k, _)| self.keys[k].t + 1).max().unwrap();
        self.num_update = self.num_update.max(most);
        let lr = self.lr_now();
        for (k, g) in grads {
            let r = self.keys.get_mut(k).unwrap();
            r.t += 1;
            let (lr, t) = (lr * r.lr_mult, r.t as i32);
            for i in 0..r.w.len() {
                let (w, g) = (r.w[i], g[i]);
                let new = match self.rule {
                    RefRule::SgdMom {
                        momentum,
                        wd,
                        rescale,
                        ..
                    } => {
                        let wd = wd * r.wd_mult;
                        r.m[i] = momentum * r.m[i] - lr * wd * w - lr * rescale * g;
                        w + r.m[i]
                    }
                    RefRule::Adam {
                        b1,
                        b2,
                        eps,
                        wd,
                        rescale,
                        ..
                    } => {
                        let grad = rescale * g + wd * r.wd_mult * w;
                        r.m[i] = b1 * r.m[i] + (1.0 - b1) * grad;
                        r.v[i] = b2 * r.v[i] + (1.0 - b2) * grad * grad;
                        let coef = lr * (1.0 - b2.powi(t)).sqrt() / (1.0 - b1.powi(t));
                        w - coef * r.m[i] / (r.v[i].sqrt() + eps)
                    }
                };
                r.w[i] = round_to(r.dtype, new);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Driving a store and the reference side by side.

/// Keys of the tests: an f32 "weight" matrix, an f32 "bias" and an f64 key.
fn key_specs() -> Vec<(i32, DType, usize)> {
    vec![
        (0, DType::F32, 5 * 7),
        (1, DType::F32, 7),
        (2, DType::F64, 11),
    ]
}

fn random(rng: &mut StdRng, dtype: DType, n: usize) -> (NDArray, Vec<f64>) {
    let data: Vec<f64> = (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let a = NDArray::from_vec(data, [n]).unwrap().astype(dtype).unwrap();
    let exact = a.to_vec::<f64>().unwrap();
    (a, exact)
}

/// A store and a reference with the same keys and random initial values.
struct Pair {
    h: Home,
    kv: KvStore,
    r: Reference,
    rng: StdRng,
    seed: u64,
}

impl Pair {
    fn new(h: Home, rule: RefRule, schedule: Option<RefSchedule>) -> Pair {
        Pair::with_seed(h, rule, schedule, fresh_seed())
    }

    /// As `new`, with the initial values and data drawn from `seed`.
    fn with_seed(h: Home, rule: RefRule, schedule: Option<RefSchedule>, seed: u64) -> Pair {
        let mut rng = StdRng::seed_from_u64(seed);
        let kv = h.store();
        let mut r = Reference::new(rule, schedule);
        for (key, dtype, n) in key_specs() {
            let (a, exact) = random(&mut rng, dtype, n);
            kv.init(key, &h.put(&a, 0)).unwrap();
            let keyref = RefKey {
                dtype,
                w: exact,
                m: vec![0.0; n],
                v: vec![0.0; n],
                t: 0,
                lr_mult: 1.0,
                wd_mult: 1.0,
            };
            r.keys.insert(key, keyref);
        }
        kv.set_updater(rule.updater()).unwrap();
        Pair {
            h,
            kv,
            r,
            rng,
            seed,
        }
    }

    /// One list push of two random values per key (on the home's devices 0 and 1).
    fn push(&mut self, keys: &[i32]) {
        let mut values = Vec::new();
        let mut grads = Vec::new();
        for k in keys {
            let (dtype, n) = (self.r.keys[k].dtype, self.r.keys[k].w.len());
            let mut g = vec![0.0; n];
            let mut vals = Vec::new();
            for d in 0..2 {
                let (a, x) = random(&mut self.rng, dtype, n);
                g.iter_mut().zip(x).for_each(|(g, x)| *g += x);
                vals.push(self.h.put(&a, d));
            }
            values.push(vals);
            grads.push((*k, g));
        }
        self.kv.push_list(keys, &values).unwrap();
        self.r.push(&grads);
    }

    /// Every key of the store against the reference, and the update count and rate.
    fn check(&mut self, what: &str) {
        let seed = self.seed;
        assert_eq!(
            self.kv.num_update(),
            self.r.num_update,
            "{what}: num_update (seed {seed})"
        );
        let want = self.r.lr_now();
        let got = self.kv.learning_rate().unwrap();
        assert!(
            (got - want).abs() <= 1e-12 * want.abs().max(1e-12),
            "{what}: learning_rate {got}, reference {want} (seed {seed})"
        );
        for (key, r) in &self.r.keys {
            let got = self.pull(key);
            let tol = tolerance(r.dtype);
            for (i, (&g, &w)) in got.iter().zip(&r.w).enumerate() {
                assert!(
                    (g - w).abs() <= tol * (w.abs() + 1.0),
                    "{what}: key {key} element {i} is {g}, the reference says {w} \
                     (tolerance {tol}, seed {seed})"
                );
            }
        }
    }

    fn pull(&self, key: &i32) -> Vec<f64> {
        let (dtype, n) = (self.r.keys[key].dtype, self.r.keys[key].w.len());
        let out = self.h.full_typed([n], 1234.0, dtype, 0);
        self.kv.pull(*key, &out).unwrap();
        out.to_vec::<f64>().unwrap()
    }
}

fn all_keys() -> Vec<i32> {
    key_specs().into_iter().map(|(k, _, _)| k).collect()
}

/// `STEPS` list pushes: keys 0 and 2 from the first, key 1 joins at the fourth (so its own
/// count, Adam's `t`, lags `num_update`, the max over keys). Checks after every push.
fn run_schedule(h: Home, rule: RefRule, sched: LrScheduler, reference: RefSchedule) {
    let mut p = Pair::new(h, rule, Some(reference));
    p.kv.set_lr_scheduler(Some(sched.clone())).unwrap();
    assert_eq!(p.kv.lr_scheduler(), Some(sched));
    p.check("before any push");
    let (early, all) = (vec![0, 2], all_keys());
    for s in 1..=STEPS {
        p.push(if s < 4 { &early } else { &all });
        p.check(&format!("{rule:?}, after push {s}"));
    }
}

fn sgd_mom() -> RefRule {
    RefRule::SgdMom {
        lr: 0.2,
        momentum: 0.9,
        wd: 0.01,
        rescale: 0.5,
    }
}

fn adam() -> RefRule {
    RefRule::Adam {
        lr: 0.05,
        b1: 0.9,
        b2: 0.99,
        eps: 1e-6,
        wd: 0.01,
        rescale: 0.5,
    }
}

fn sgd_momentum_with_warmup_and_multi_factor(h: Home) {
    let sched =
        LrScheduler::multi_factor(vec![8, 13, 20], 0.5).with_warmup(5, 0.02, WarmupMode::Linear);
    let reference = RefSchedule {
        sched: RefSched::MultiFactor {
            base: 0.2,
            ind: 0,
            steps: vec![8, 13, 20],
            factor: 0.5,
        },
        warmup: RefWarmup {
            steps: 5,
            begin: 0.02,
            linear: true,
        },
    };
    run_schedule(h, sgd_mom(), sched, reference);
}

fn sgd_momentum_with_warmup_and_factor(h: Home) {
    let sched = LrScheduler::new(Decay::Factor {
        step: 4,
        factor: 0.7,
        stop_factor_lr: 0.05,
    })
    .with_warmup(3, 0.1, WarmupMode::Constant);
    let reference = RefSchedule {
        sched: RefSched::Factor {
            base: 0.2,
            count: 0,
            step: 4,
            factor: 0.7,
            stop: 0.05,
        },
        warmup: RefWarmup {
            steps: 3,
            begin: 0.1,
            linear: false,
        },
    };
    run_schedule(h, sgd_mom(), sched, reference);
}

fn adam_with_warmup_and_cosine(h: Home) {
    let sched = LrScheduler::cosine(22, 0.001).with_warmup(6, 0.0, WarmupMode::Linear);
    let reference = RefSchedule {
        sched: RefSched::Cosine {
            orig: 0.05,
            last: 0.05,
            max: 22,
            fin: 0.001,
        },
        warmup: RefWarmup {
            steps: 6,
            begin: 0.0,
            linear: true,
        },
    };
    run_schedule(h, adam(), sched, reference);
}

fn adam_with_warmup_and_poly(h: Home) {
    let sched = LrScheduler::new(Decay::Poly {
        max_update: 20,
        pwr: 2.0,
        final_lr: 0.002,
    })
    .with_warmup(4, 0.01, WarmupMode::Linear);
    let reference = RefSchedule {
        sched: RefSched::Poly {
            orig: 0.05,
            last: 0.05,
            max: 20,
            pwr: 2.0,
            fin: 0.002,
        },
        warmup: RefWarmup {
            steps: 4,
            begin: 0.01,
            linear: true,
        },
    };
    run_schedule(h, adam(), sched, reference);
}

/// The largest difference between a key of two stores.
fn max_diff(a: &Pair, b: &Pair, key: &i32) -> f64 {
    let (x, y) = (a.pull(key), b.pull(key));
    x.iter()
        .zip(&y)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// Two stores fed the same data: `kept` changes its rate with `set_learning_rate` (the
/// reference keeps the momentum), `fresh` with a new `set_updater` (momentum restarts).
fn learning_rate_change_keeps_momentum(h: Home) {
    let mut kept = Pair::new(h, sgd_mom(), None);
    // The same initial values and data for both.
    let mut fresh = Pair::with_seed(h, sgd_mom(), None, kept.seed);
    let keys = all_keys();
    for s in 1..=10 {
        kept.push(&keys);
        fresh.push(&keys);
        kept.check(&format!("before the change, push {s}"));
        fresh.check(&format!("fresh store before the change, push {s}"));
    }
    kept.kv.set_learning_rate(0.05).unwrap();
    let RefRule::SgdMom {
        momentum,
        wd,
        rescale,
        ..
    } = sgd_mom()
    else {
        unreachable!()
    };
    kept.r.rule = RefRule::SgdMom {
        lr: 0.05,
        momentum,
        wd,
        rescale,
    };
    assert_eq!(kept.kv.learning_rate(), Some(0.05));
    let Updater::Sgd(s) = kept.kv.updater() else {
        panic!("the updater changed rule")
    };
    assert_eq!(s.lr, 0.05);
    // The fresh store restarts: momentum zero, counts from 0.
    fresh.kv.set_updater(kept.r.rule.updater()).unwrap();
    fresh.r.rule = kept.r.rule;
    fresh.r.num_update = 0;
    for k in fresh.r.keys.values_mut() {
        k.m.iter_mut().for_each(|m| *m = 0.0);
        k.t = 0;
    }
    assert_eq!(fresh.kv.num_update(), 0);
    assert_eq!(kept.kv.num_update(), 10);
    for s in 1..=10 {
        kept.push(&keys);
        fresh.push(&keys);
        kept.check(&format!("after set_learning_rate, push {s}"));
        fresh.check(&format!("after a fresh set_updater, push {s}"));
    }
    // Same data, same rate: only the kept momentum tells them apart.
    let d = max_diff(&kept, &fresh, &0);
    assert!(
        d > 1e-2,
        "keeping the momentum made no difference ({d:e}; seed {})",
        kept.seed
    );
}

/// Adam's moments and step count survive a change of lr, betas and wd.
fn hyperparameter_change_keeps_adam_state(h: Home) {
    let mut p = Pair::new(h, adam(), None);
    let keys = all_keys();
    for s in 1..=8 {
        p.push(&keys);
        p.check(&format!("before the change, push {s}"));
    }
    let changed = RefRule::Adam {
        lr: 0.02,
        b1: 0.8,
        b2: 0.999,
        eps: 1e-7,
        wd: 0.05,
        rescale: 0.25,
    };
    p.kv.update_hyperparameters(changed.updater()).unwrap();
    p.r.rule = changed;
    for s in 1..=12 {
        p.push(&keys);
        p.check(&format!("after update_hyperparameters, push {s}"));
    }
    assert_eq!(p.kv.num_update(), 20);
}

fn run_multipliers(h: Home, rule: RefRule) {
    let mut p = Pair::new(h, rule, None);
    // Key 1 is a bias: no weight decay. Key 2 learns at half the rate with double decay.
    // Any integer type names an int key, as for every other key-taking method.
    p.kv.set_wd_mult(1usize, 0.0).unwrap();
    p.kv.set_lr_mult(2i64, 0.5).unwrap();
    p.kv.set_wd_mult(2u8, 2.0).unwrap();
    assert_eq!(p.kv.wd_mult(1u64).unwrap(), 0.0);
    assert_eq!(p.kv.lr_mult(1).unwrap(), 1.0);
    assert_eq!(p.kv.lr_mult(2i16).unwrap(), 0.5);
    assert!(matches!(
        p.kv.set_lr_mult(i64::MAX, 1.0),
        Err(kvstore::Error::KeyOutOfRange { .. })
    ));
    p.r.keys.get_mut(&1).unwrap().wd_mult = 0.0;
    let k2 = p.r.keys.get_mut(&2).unwrap();
    k2.lr_mult = 0.5;
    k2.wd_mult = 2.0;
    let keys = all_keys();
    for s in 1..=20 {
        p.push(&keys);
        p.check(&format!("{rule:?} with multipliers, push {s}"));
        if s == 10 {
            // Multipliers change mid-run, keeping state.
            p.kv.set_lr_mult(0, 2.0).unwrap();
            p.r.keys.get_mut(&0).unwrap().lr_mult = 2.0;
        }
    }
}

fn multipliers_with_sgd_momentum(h: Home) {
    run_multipliers(h, sgd_mom());
}

fn multipliers_with_adam(h: Home) {
    run_multipliers(h, adam());
}

// ---------------------------------------------------------------------------------------------
// Errors: typed, and they change nothing.

fn invalid(e: Error) -> String {
    assert!(matches!(e, Error::InvalidUpdater(_)), "{e}");
    e.to_string()
}

#[test]
fn bad_hyperparameter_changes_are_errors_and_change_nothing() {
    let kv = KvStore::create("local").unwrap();
    kv.init_list(&[0, 1], &[NDArray::ones([3]), NDArray::ones([2])])
        .unwrap();
    // No learning rate to set or schedule.
    invalid(kv.set_learning_rate(0.1).unwrap_err());
    invalid(
        kv.set_lr_scheduler(Some(LrScheduler::cosine(10, 0.0)))
            .unwrap_err(),
    );
    assert_eq!(kv.learning_rate(), None);

    let sgd = Sgd {
        lr: 0.1,
        momentum: 0.9,
        ..Sgd::default()
    };
    kv.set_updater(Updater::Sgd(sgd)).unwrap();
    invalid(kv.set_learning_rate(-1.0).unwrap_err());
    invalid(kv.set_learning_rate(f64::NAN).unwrap_err());
    // Another rule, a closure, or a change of state buffers.
    let msg = invalid(
        kv.update_hyperparameters(Updater::Adam(Adam::default()))
            .unwrap_err(),
    );
    assert!(msg.contains("set_updater"), "{msg}");
    invalid(
        kv.update_hyperparameters(Updater::custom(|_, _, _| {}))
            .unwrap_err(),
    );
    let msg = invalid(
        kv.update_hyperparameters(Updater::Sgd(Sgd {
            momentum: 0.0,
            ..sgd
        }))
        .unwrap_err(),
    );
    assert!(msg.contains("momentum"), "{msg}");
    invalid(
        kv.update_hyperparameters(Updater::Sgd(Sgd { wd: -1.0, ..sgd }))
            .unwrap_err(),
    );
    // Bad schedules.
    invalid(
        kv.set_lr_scheduler(Some(LrScheduler::factor(0, 0.5)))
            .unwrap_err(),
    );
    invalid(
        kv.set_lr_scheduler(Some(LrScheduler::cosine(10, 0.0).with_warmup(
            3,
            0.5,
            WarmupMode::Linear,
        )))
        .unwrap_err(),
    );
    assert_eq!(kv.lr_scheduler(), None);
    // Multipliers: unknown keys, key kinds, bad values.
    assert!(matches!(
        kv.set_lr_mult(7, 0.5).unwrap_err(),
        Error::UnknownKey { .. }
    ));
    assert!(matches!(
        kv.wd_mult(7).unwrap_err(),
        Error::UnknownKey { .. }
    ));
    assert!(matches!(
        kv.set_wd_mult("bias", 0.0).unwrap_err(),
        Error::MixedKeyTypes { .. }
    ));
    invalid(kv.set_wd_mult(0, -0.5).unwrap_err());
    invalid(kv.set_lr_mult(0, f64::INFINITY).unwrap_err());
    assert_eq!(kv.lr_mult(0).unwrap(), 1.0);
    assert_eq!(kv.wd_mult(0).unwrap(), 1.0);
    match kv.updater() {
        Updater::Sgd(s) => assert_eq!(s, sgd),
        other => panic!("the updater changed: {other:?}"),
    }

    // With a schedule, the schedule decides the rate (MXNet's rule).
    let sched = LrScheduler::cosine(10, 0.0).with_warmup(2, 0.05, WarmupMode::Linear);
    kv.set_lr_scheduler(Some(sched.clone())).unwrap();
    invalid(kv.set_learning_rate(0.2).unwrap_err());
    // A new base below the warm-up's start does not fit.
    invalid(
        kv.update_hyperparameters(Updater::Sgd(Sgd { lr: 0.01, ..sgd }))
            .unwrap_err(),
    );
    invalid(
        kv.set_updater(Updater::Sgd(Sgd { lr: 0.01, ..sgd }))
            .unwrap_err(),
    );
    assert_eq!(kv.lr_scheduler(), Some(sched.clone()));
    kv.set_lr_scheduler(None).unwrap();
    kv.set_learning_rate(0.2).unwrap();
    assert_eq!(kv.learning_rate(), Some(0.2));
}

#[test]
fn set_updater_keeps_the_schedule_and_multipliers_and_restarts_the_count() {
    let kv = KvStore::create("local").unwrap();
    kv.init(0, &NDArray::ones([4])).unwrap();
    let sgd = Sgd {
        lr: 0.1,
        ..Sgd::default()
    };
    kv.set_updater(Updater::Sgd(sgd)).unwrap();
    let sched = LrScheduler::factor(2, 0.5);
    kv.set_lr_scheduler(Some(sched.clone())).unwrap();
    kv.set_lr_mult(0, 3.0).unwrap();
    for _ in 0..5 {
        kv.push(0, &NDArray::ones([4])).unwrap();
    }
    assert_eq!(kv.num_update(), 5);
    // num_update 5: (5 - 1) / 2 = 2 drops.
    assert_eq!(kv.learning_rate(), Some(0.1 * 0.25));
    kv.set_updater(Updater::Sgd(sgd)).unwrap();
    assert_eq!(kv.num_update(), 0);
    assert_eq!(kv.lr_scheduler(), Some(sched));
    assert_eq!(kv.lr_mult(0).unwrap(), 3.0);
    // One push from 0: rate 0.1 * 3 on a gradient of 1.
    let before = NDArray::zeros([4]);
    kv.pull(0, &before).unwrap();
    kv.push(0, &NDArray::ones([4])).unwrap();
    let after = NDArray::zeros([4]);
    kv.pull(0, &after).unwrap();
    let (b, a) = (
        before.to_vec::<f32>().unwrap(),
        after.to_vec::<f32>().unwrap(),
    );
    assert!((b[0] - a[0] - 0.3).abs() < 1e-6, "{b:?} -> {a:?}");
    // An updater without a learning rate ignores the schedule.
    kv.set_updater(Updater::Axpby { a: 1.0, b: 1.0 }).unwrap();
    kv.push(0, &NDArray::ones([4])).unwrap();
    kv.pull(0, &before).unwrap();
    assert!((before.to_vec::<f32>().unwrap()[0] - (a[0] + 1.0)).abs() < 1e-6);
    assert_eq!(kv.learning_rate(), None);
}
