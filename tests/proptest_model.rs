//! Random sequences of store operations against a small, obviously correct model: a
//! `BTreeMap` from key to `Vec<f64>`, with the updater math written out plainly.
//!
//! The model also predicts which operations fail, and with which error; a failed operation
//! changes neither the model nor (as checked by pulling every key) the store.
//!
//! The same model runs on both homes: `cpu::*` with a `local` store and arrays on cpu(i) (512
//! cases), `gpu::*` (ignored: needs a GPU) with a `device` store and arrays on the GPUs (128
//! cases: every operation there is several GPU calls and host copies).

mod common;

use std::collections::BTreeMap;

use common::Home;
use half::{bf16, f16};
use kvstore::gpu_count;
use kvstore::{DType, Error, Key, KvStore, NDArray, Sgd, Shape, Updater};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The keys, by index; not in ascending order, so sorting is exercised.
const KEYS: [i32; 5] = [9, 2, 14, -3, 5];
const DTYPES: [DType; 5] = [DType::F32, DType::F32, DType::F64, DType::F16, DType::BF16];

#[derive(Clone, Copy, Debug)]
enum Fault {
    Shape,
    DType,
    Empty,
}

#[derive(Clone, Debug)]
enum UpdaterSpec {
    Assign,
    Axpby { a: f64, b: f64 },
    Sgd(Sgd),
}

#[derive(Clone, Debug)]
enum Op {
    Init(usize),
    InitList(Vec<usize>),
    Push(usize, usize, Option<Fault>),
    /// (key, number of values) per entry, and maybe a fault in one entry.
    PushList(Vec<(usize, usize)>, Option<(usize, Fault)>),
    Pull(usize, bool),
    PullList(Vec<usize>),
    PushPull(usize, usize),
    SetUpdater(UpdaterSpec),
}

fn key_index() -> impl Strategy<Value = usize> {
    0..KEYS.len()
}

fn fault() -> impl Strategy<Value = Fault> {
    prop_oneof![Just(Fault::Shape), Just(Fault::DType), Just(Fault::Empty)]
}

fn updater_spec() -> impl Strategy<Value = UpdaterSpec> {
    prop_oneof![
        Just(UpdaterSpec::Assign),
        (0.5f64..1.0, -1.0f64..1.0).prop_map(|(a, b)| UpdaterSpec::Axpby { a, b }),
        (
            0.01f64..0.5,
            prop_oneof![Just(0.0f64), 0.1f64..0.95],
            prop_oneof![Just(0.0f64), 0.0f64..0.1],
            0.5f64..2.0,
            proptest::option::of(0.1f64..1.0),
        )
            .prop_map(|(lr, momentum, wd, rescale_grad, clip_gradient)| {
                UpdaterSpec::Sgd(Sgd {
                    lr,
                    momentum,
                    wd,
                    rescale_grad,
                    clip_gradient,
                })
            }),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let nvals = 1usize..=3;
    prop_oneof![
        2 => key_index().prop_map(Op::Init),
        1 => prop::collection::vec(key_index(), 1..=3).prop_map(Op::InitList),
        4 => (key_index(), nvals.clone(), proptest::option::weighted(0.15, fault()))
            .prop_map(|(k, n, f)| Op::Push(k, n, f)),
        3 => (
            prop::collection::vec((key_index(), nvals.clone()), 1..=4),
            proptest::option::weighted(0.15, (0usize..4, fault())),
        )
            .prop_map(|(entries, f)| {
                let f = f.map(|(i, f)| (i % entries.len(), f));
                Op::PushList(entries, f)
            }),
        2 => (key_index(), any::<bool>()).prop_map(|(k, f64_out)| Op::Pull(k, f64_out)),
        1 => prop::collection::vec(key_index(), 1..=4).prop_map(Op::PullList),
        2 => (key_index(), nvals).prop_map(|(k, n)| Op::PushPull(k, n)),
        1 => updater_spec().prop_map(Op::SetUpdater),
    ]
}

fn shape() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1usize..=4, 0..=3)
}

fn round_to(dtype: DType, x: f64) -> f64 {
    match dtype {
        DType::F32 => f64::from(x as f32),
        DType::F16 => f16::from_f64(x).to_f64(),
        DType::BF16 => bf16::from_f64(x).to_f64(),
        _ => x,
    }
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-9,
        DType::F32 => 1e-5,
        DType::F16 => 1e-2,
        _ => 2e-2,
    }
}

/// The model: each key's value, its momentum, and the largest magnitude it has seen (the
/// scale of its rounding errors).
#[derive(Default)]
struct Model {
    values: BTreeMap<i32, Vec<f64>>,
    momentum: BTreeMap<i32, Vec<f64>>,
    scale: BTreeMap<i32, f64>,
    updater: Option<UpdaterSpec>,
    /// Whether a push may round partial sums to the key's dtype: on a GPU home with several
    /// GPUs, the values on a GPU other than the key's home are summed there into a buffer of
    /// the key's dtype before the home adds them. Such a sum is bounded by the sum of the
    /// values' magnitudes, not by the magnitude of their sum, so that is part of the scale.
    partial_sums_rounded: bool,
}

impl Model {
    /// One push whose values sum to `g`, with `magnitude` the sum of their absolute values.
    fn update(&mut self, key: i32, dtype: DType, g: &[f64], magnitude: &[f64]) {
        let w = self.values.get_mut(&key).unwrap();
        let mut scale = self.scale[&key];
        let n = w.len();
        let m = self.momentum.entry(key).or_insert_with(|| vec![0.0; n]);
        for i in 0..n {
            let new = match self.updater.clone().unwrap_or(UpdaterSpec::Assign) {
                UpdaterSpec::Assign => g[i],
                UpdaterSpec::Axpby { a, b } => a * w[i] + b * g[i],
                UpdaterSpec::Sgd(s) => {
                    let lr = s.lr;
                    let mut grad = s.rescale_grad * g[i];
                    if let Some(c) = s.clip_gradient {
                        grad = grad.clamp(-c, c);
                    }
                    if s.momentum == 0.0 {
                        (1.0 - lr * s.wd) * w[i] - lr * grad
                    } else {
                        m[i] = s.momentum * m[i] - lr * s.wd * w[i] - lr * grad;
                        w[i] + m[i]
                    }
                }
            };
            scale = scale.max(new.abs()).max(g[i].abs());
            if self.partial_sums_rounded {
                scale = scale.max(magnitude[i]);
            }
            w[i] = round_to(dtype, new);
        }
        self.scale.insert(key, scale);
    }
}

/// The store, the model and where random data comes from.
struct Run {
    h: Home,
    kv: KvStore,
    model: Model,
    shapes: Vec<Shape>,
    rng: StdRng,
}

/// What the model expects of a failing operation.
#[derive(Debug)]
enum Expect {
    UnknownKey(i32),
    DuplicateInit,
    Shape(i32),
    DType(i32),
    Empty(i32),
}

/// The values of one push entry, their sum and the sum of their absolute values.
struct Pushed {
    vals: Vec<NDArray>,
    sum: Vec<f64>,
    magnitude: Vec<f64>,
}

impl Run {
    /// Random values for key `k`, in [-1, 1) and rounded to its dtype, on the host.
    fn random(&mut self, k: usize) -> (NDArray, Vec<f64>) {
        let shape = self.shapes[k];
        let data: Vec<f64> = (0..shape.size())
            .map(|_| self.rng.gen_range(-1.0..1.0))
            .collect();
        let a = NDArray::from_vec(data, shape)
            .unwrap()
            .astype(DTYPES[k])
            .unwrap();
        let exact = a.to_vec::<f64>().unwrap();
        (a, exact)
    }

    /// `n` values for key `k` (the i-th on the home's i-th device), a fault applied to the
    /// last, and the sum of the good ones and of their absolute values.
    fn values(&mut self, k: usize, n: usize, fault: Option<Fault>) -> Pushed {
        let mut sum = vec![0.0; self.shapes[k].size()];
        let mut magnitude = vec![0.0; self.shapes[k].size()];
        let mut vals = Vec::new();
        for i in 0..n {
            let (a, x) = self.random(k);
            for ((s, m), x) in sum.iter_mut().zip(&mut magnitude).zip(x) {
                *s += x;
                *m += x.abs();
            }
            vals.push(self.h.put(&a, i));
        }
        match fault {
            None => {}
            Some(Fault::Empty) => {
                vals.clear();
                sum.iter_mut().for_each(|s| *s = 0.0);
                magnitude.iter_mut().for_each(|m| *m = 0.0);
            }
            Some(Fault::Shape) => {
                let mut dims = self.shapes[k].dims().to_vec();
                dims.push(2);
                let bad = Shape::new(&dims).unwrap();
                *vals.last_mut().unwrap() = self.h.full_typed(bad, 0.5, DTYPES[k], 1);
            }
            Some(Fault::DType) => {
                let other = if DTYPES[k] == DType::F32 {
                    DType::F64
                } else {
                    DType::F32
                };
                let last = vals.last_mut().unwrap();
                *last = last.astype(other).unwrap();
            }
        }
        Pushed {
            vals,
            sum,
            magnitude,
        }
    }

    fn expect_fault(k: usize, fault: Fault) -> Expect {
        match fault {
            Fault::Shape => Expect::Shape(KEYS[k]),
            Fault::DType => Expect::DType(KEYS[k]),
            Fault::Empty => Expect::Empty(KEYS[k]),
        }
    }

    fn known(&self, k: usize) -> bool {
        self.model.values.contains_key(&KEYS[k])
    }

    fn check_value(&self, key: i32, out: &NDArray) {
        let k = KEYS.iter().position(|&x| x == key).unwrap();
        let want = &self.model.values[&key];
        let got = out.to_vec::<f64>().unwrap();
        let tol = tolerance(DTYPES[k]);
        let scale = self.model.scale[&key];
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= tol * (w.abs() + scale),
                "key {key} ({}) element {i}: store has {g}, model {w}",
                DTYPES[k]
            );
        }
    }

    fn pull_and_check(&self, k: usize, f64_out: bool) {
        let dtype = if f64_out { DType::F64 } else { DTYPES[k] };
        let out = self.h.full_typed(self.shapes[k], 77.0, dtype, 2);
        self.kv.pull(KEYS[k], &out).unwrap();
        self.check_value(KEYS[k], &out);
    }

    fn check_all(&self) {
        let keys: Vec<Key> = self.model.values.keys().map(|&k| Key::Int(k)).collect();
        assert_eq!(self.kv.keys(), keys);
        for k in 0..KEYS.len() {
            if self.known(k) {
                self.pull_and_check(k, false);
            }
        }
    }

    /// Runs one op on the store and the model. Returns what went wrong, if the model
    /// predicted a failure, and the store's result.
    fn step(&mut self, op: &Op) -> (Option<Expect>, kvstore::Result<()>) {
        match op {
            Op::Init(k) => {
                let (a, x) = self.random(*k);
                if self.known(*k) {
                    let a = self.h.put(&a, 0);
                    return (Some(Expect::DuplicateInit), self.kv.init(KEYS[*k], &a));
                }
                let r = self.kv.init(KEYS[*k], &self.h.put(&a, 0));
                self.insert(*k, x);
                (None, r)
            }
            Op::InitList(ks) => {
                let made: Vec<(NDArray, Vec<f64>)> = ks.iter().map(|&k| self.random(k)).collect();
                let keys: Vec<i32> = ks.iter().map(|&k| KEYS[k]).collect();
                let vals: Vec<NDArray> = made
                    .iter()
                    .enumerate()
                    .map(|(i, (a, _))| self.h.put(a, i))
                    .collect();
                let r = self.kv.init_list(&keys, &vals);
                let dup = ks.iter().enumerate().any(|(i, k)| ks[..i].contains(k));
                if dup || ks.iter().any(|&k| self.known(k)) {
                    return (Some(Expect::DuplicateInit), r);
                }
                for (&k, (_, x)) in ks.iter().zip(made) {
                    self.insert(k, x);
                }
                (None, r)
            }
            Op::Push(k, n, fault) => {
                let p = self.values(*k, *n, *fault);
                let r = self.kv.push(KEYS[*k], &p.vals);
                if !self.known(*k) {
                    return (Some(Expect::UnknownKey(KEYS[*k])), r);
                }
                if let Some(f) = fault {
                    return (Some(Self::expect_fault(*k, *f)), r);
                }
                self.model
                    .update(KEYS[*k], DTYPES[*k], &p.sum, &p.magnitude);
                (None, r)
            }
            Op::PushList(entries, fault) => {
                let mut lists = Vec::new();
                // Per key: the sum of its values and of their magnitudes, over its entries.
                let mut sums: BTreeMap<usize, (Vec<f64>, Vec<f64>)> = BTreeMap::new();
                for (i, &(k, n)) in entries.iter().enumerate() {
                    let f = fault.filter(|(j, _)| *j == i).map(|(_, f)| f);
                    let p = self.values(k, n, f);
                    let size = self.shapes[k].size();
                    let (total, mag) = sums
                        .entry(k)
                        .or_insert_with(|| (vec![0.0; size], vec![0.0; size]));
                    for (t, g) in total.iter_mut().zip(p.sum) {
                        *t += g;
                    }
                    for (t, m) in mag.iter_mut().zip(p.magnitude) {
                        *t += m;
                    }
                    lists.push(p.vals);
                }
                let keys: Vec<i32> = entries.iter().map(|&(k, _)| KEYS[k]).collect();
                let r = self.kv.push_list(&keys, &lists);
                if let Some(&(k, _)) = entries.iter().find(|(k, _)| !self.known(*k)) {
                    return (Some(Expect::UnknownKey(KEYS[k])), r);
                }
                if let Some((i, f)) = fault {
                    let k = entries[*i].0;
                    // A key listed again still has values: its merged list is not empty.
                    let repeated = entries.iter().filter(|(x, _)| *x == k).count() > 1;
                    if !matches!(f, Fault::Empty) || !repeated {
                        return (Some(Self::expect_fault(k, *f)), r);
                    }
                }
                for (k, (g, mag)) in sums {
                    self.model.update(KEYS[k], DTYPES[k], &g, &mag);
                }
                (None, r)
            }
            Op::Pull(k, f64_out) => {
                if !self.known(*k) {
                    let out = self.h.full(self.shapes[*k], 0.0, 0);
                    return (
                        Some(Expect::UnknownKey(KEYS[*k])),
                        self.kv.pull(KEYS[*k], &out),
                    );
                }
                self.pull_and_check(*k, *f64_out);
                (None, Ok(()))
            }
            Op::PullList(ks) => {
                let keys: Vec<i32> = ks.iter().map(|&k| KEYS[k]).collect();
                let outs: Vec<NDArray> = ks
                    .iter()
                    .enumerate()
                    .map(|(i, &k)| self.h.full_typed(self.shapes[k], 77.0, DTYPES[k], i))
                    .collect();
                let r = self.kv.pull_list(&keys, &outs);
                if let Some(&k) = ks.iter().find(|&&k| !self.known(k)) {
                    return (Some(Expect::UnknownKey(KEYS[k])), r);
                }
                if r.is_ok() {
                    for (&k, out) in ks.iter().zip(&outs) {
                        self.check_value(KEYS[k], out);
                    }
                }
                (None, r)
            }
            Op::PushPull(k, n) => {
                let p = self.values(*k, *n, None);
                let outs = [
                    self.h.full_typed(self.shapes[*k], 77.0, DTYPES[*k], 0),
                    self.h.full_typed(self.shapes[*k], 77.0, DType::F64, 3),
                ];
                let r = self.kv.pushpull(KEYS[*k], &p.vals, &outs);
                if !self.known(*k) {
                    return (Some(Expect::UnknownKey(KEYS[*k])), r);
                }
                self.model
                    .update(KEYS[*k], DTYPES[*k], &p.sum, &p.magnitude);
                if r.is_ok() {
                    for out in &outs {
                        self.check_value(KEYS[*k], out);
                    }
                }
                (None, r)
            }
            Op::SetUpdater(spec) => {
                let u = match spec {
                    UpdaterSpec::Assign => Updater::Assign,
                    UpdaterSpec::Axpby { a, b } => Updater::Axpby { a: *a, b: *b },
                    UpdaterSpec::Sgd(s) => Updater::Sgd(*s),
                };
                let r = self.kv.set_updater(u);
                self.model.updater = Some(spec.clone());
                self.model.momentum.clear();
                (None, r)
            }
        }
    }

    fn insert(&mut self, k: usize, x: Vec<f64>) {
        let scale = x.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        self.model.values.insert(KEYS[k], x);
        self.model.scale.insert(KEYS[k], scale);
    }
}

fn matches_expect(e: &Error, want: &Expect) -> bool {
    match want {
        Expect::UnknownKey(k) => matches!(e, Error::UnknownKey { key: Key::Int(x), .. } if x == k),
        Expect::DuplicateInit => matches!(e, Error::DuplicateInit { .. }),
        Expect::Shape(k) => matches!(e, Error::ShapeMismatch { key: Key::Int(x), .. } if x == k),
        Expect::DType(k) => matches!(e, Error::DTypeMismatch { key: Key::Int(x), .. } if x == k),
        Expect::Empty(k) => matches!(e, Error::Empty { key: Key::Int(x), .. } if x == k),
    }
}

/// Random op sequences on a fresh store of the home, each checked against the model.
fn store_matches_model(h: Home) {
    // A GPU home without a GPU fails here with its own message, before proptest would catch the
    // panic and shrink.
    drop(h.store());
    let cases = match h {
        Home::Cpu => 512,
        Home::Gpu => 128,
    };
    let config = ProptestConfig {
        cases,
        ..ProptestConfig::default()
    };
    proptest!(config, |(
        shapes in prop::collection::vec(shape(), KEYS.len()),
        ops in prop::collection::vec(op(), 1..60),
        seed in any::<u64>(),
    )| {
        let mut run = Run {
            h,
            kv: h.store(),
            model: Model {
                partial_sums_rounded: h == Home::Gpu && gpu_count() > 1,
                ..Model::default()
            },
            shapes: shapes.iter().map(|d| Shape::new(d).unwrap()).collect(),
            rng: StdRng::seed_from_u64(seed),
        };
        for (i, op) in ops.iter().enumerate() {
            let (expect, result) = run.step(op);
            match (expect, result) {
                (None, Ok(())) => {}
                (None, Err(e)) => panic!("op {i} {op:?} failed: {e}"),
                (Some(want), Ok(())) => panic!("op {i} {op:?} should fail with {want:?}"),
                (Some(want), Err(e)) => {
                    prop_assert!(matches_expect(&e, &want), "op {i} {op:?}: got {e:?}, want {want:?}");
                    run.check_all();
                }
            }
        }
        run.check_all();
    });
}

on_every_home!(store_matches_model);
