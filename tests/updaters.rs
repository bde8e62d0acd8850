//! The built-in updaters against a straightforward f64 reference of MXNet's formulas
//! (`sgd_update`, `sgd_mom_update`, `adam_update`, and `a * w + b * g`), for every dtype, on
//! tiny arrays and on arrays large enough (3,000,001 elements, odd) for the parallel CPU path.
//!
//! The reference keeps the weight in the key's dtype, as the store does (it rounds the weight
//! to that dtype after each step); updater state is kept in f64.
//!
//! Every test runs on both homes: `cpu::*` with a `local` store, `gpu::*` (ignored: needs a GPU)
//! with a `device` store, where f32, f16 and bf16 keys run the PTX kernels and f64 keys the host
//! path. The kernels compute in f32 like the CPU loops (f16 and bf16 stored, math in f32), so
//! the tolerances are the same on both homes.

mod common;

use common::reference::RefKey;
use common::Home;
use kvstore::{Adam, DType, Key, KvStore, NDArray, Sgd, Updater};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const LARGE: usize = 3_000_001;

/// Relative tolerance per dtype; the absolute floor is the same number, as values are O(1).
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-12,
        DType::F32 => 1e-6,
        _ => 1e-2,
    }
}

/// A random array of `dtype` with values in [-1, 1), and its exact values as f64.
fn random(rng: &mut StdRng, dtype: DType, n: usize) -> (NDArray, Vec<f64>) {
    let data: Vec<f64> = (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let a = NDArray::from_vec(data, [n]).unwrap().astype(dtype).unwrap();
    let exact = a.to_vec::<f64>().unwrap();
    (a, exact)
}

/// Pushes `nvals` random values to `key` (the i-th on the home's i-th device), steps the
/// reference.
fn push_random(
    kv: &KvStore,
    h: Home,
    key: i32,
    r: &mut RefKey,
    u: &Updater,
    rng: &mut StdRng,
    nvals: usize,
) {
    let n = r.w.len();
    let mut g = vec![0.0; n];
    let mut vals = Vec::new();
    for i in 0..nvals {
        let (a, x) = random(rng, r.dtype, n);
        for (g, x) in g.iter_mut().zip(x) {
            *g += x;
        }
        vals.push(h.put(&a, i));
    }
    kv.push(key, &vals).unwrap();
    r.step(u, &g);
}

/// Pulls `key` and compares it with the reference elementwise.
fn check(kv: &KvStore, h: Home, key: i32, r: &RefKey, what: &str) {
    let out = h.full_typed([r.w.len()], 1234.0, r.dtype, 0);
    kv.pull(key, &out).unwrap();
    let got = out.to_vec::<f64>().unwrap();
    let tol = tolerance(r.dtype);
    let mut worst = (0.0, 0);
    for (i, (&g, &w)) in got.iter().zip(&r.w).enumerate() {
        let excess = (g - w).abs() / (tol * (w.abs() + 1.0));
        if excess > worst.0 {
            worst = (excess, i);
        }
    }
    let i = worst.1;
    assert!(
        worst.0 <= 1.0,
        "{what}, {}: element {i} of {} is {} but the reference says {} (tolerance {tol})",
        r.dtype,
        got.len(),
        got[i],
        r.w[i]
    );
}

/// Inits a key with random values, sets `u`, runs `steps` pushes of `nvals` values, checks.
fn run(h: Home, u: &Updater, dtype: DType, n: usize, steps: usize, nvals: usize, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let kv = h.store();
    let (w0, exact) = random(&mut rng, dtype, n);
    kv.init(1, &h.put(&w0, 0)).unwrap();
    kv.set_updater(u.clone()).unwrap();
    let mut r = RefKey::new(dtype, exact);
    for s in 0..steps {
        push_random(&kv, h, 1, &mut r, u, &mut rng, nvals);
        check(
            &kv,
            h,
            1,
            &r,
            &format!("{u:?}, n={n}, after step {}", s + 1),
        );
    }
}

fn sgd_plain() -> Updater {
    Updater::Sgd(Sgd {
        lr: 0.1,
        ..Sgd::default()
    })
}

fn sgd_full() -> Updater {
    Updater::Sgd(Sgd {
        lr: 0.05,
        momentum: 0.0,
        wd: 0.01,
        rescale_grad: 0.5,
        clip_gradient: Some(0.3),
    })
}

fn sgd_mom() -> Updater {
    Updater::Sgd(Sgd {
        lr: 0.1,
        momentum: 0.9,
        ..Sgd::default()
    })
}

fn sgd_mom_full() -> Updater {
    Updater::Sgd(Sgd {
        lr: 0.05,
        momentum: 0.8,
        wd: 0.02,
        rescale_grad: 0.7,
        clip_gradient: Some(0.4),
    })
}

fn adam_plain() -> Updater {
    Updater::Adam(Adam {
        lr: 0.05,
        ..Adam::default()
    })
}

fn adam_full() -> Updater {
    Updater::Adam(Adam {
        lr: 0.05,
        beta1: 0.8,
        beta2: 0.99,
        epsilon: 1e-6,
        wd: 0.01,
        rescale_grad: 0.5,
        clip_gradient: Some(0.3),
        epsilon_after_correction: false,
    })
}

/// PyTorch's Adam: epsilon after the bias-corrected root. A large epsilon, so that where it is
/// added shows in every step.
fn adam_torch() -> Updater {
    Updater::Adam(Adam {
        lr: 0.05,
        epsilon: 1e-2,
        wd: 0.01,
        epsilon_after_correction: true,
        ..Adam::default()
    })
}

fn axpby() -> Updater {
    Updater::Axpby { a: 0.9, b: -0.3 }
}

fn all_updaters() -> Vec<Updater> {
    vec![
        Updater::Assign,
        axpby(),
        sgd_plain(),
        sgd_full(),
        sgd_mom(),
        sgd_mom_full(),
        adam_plain(),
        adam_full(),
        adam_torch(),
    ]
}

fn tiny_arrays_every_updater_every_dtype(h: Home) {
    for (i, u) in all_updaters().iter().enumerate() {
        for (j, dtype) in DType::ALL.into_iter().enumerate() {
            for (k, n) in [1, 7, 1025].into_iter().enumerate() {
                run(h, u, dtype, n, 5, 3, (i * 100 + j * 10 + k) as u64);
            }
        }
    }
}

fn large(h: Home, dtype: DType) {
    for (i, u) in [axpby(), sgd_full(), sgd_mom_full(), adam_full()]
        .iter()
        .enumerate()
    {
        // 2^17 + 1 on the stand-in driver's interpreter (still several blocks' worth).
        run(
            h,
            u,
            dtype,
            h.scaled(LARGE, (1 << 17) + 1),
            3,
            2,
            1000 + i as u64,
        );
    }
}

fn large_f32(h: Home) {
    large(h, DType::F32);
}

fn large_f64(h: Home) {
    large(h, DType::F64);
}

fn large_f16(h: Home) {
    large(h, DType::F16);
}

fn large_bf16(h: Home) {
    large(h, DType::BF16);
}

/// The Adam bias correction matters: without it the first step is ~3x smaller. Checks the
/// first step alone, where the reference's `lr_t` is `lr * sqrt(1 - b2) / (1 - b1)`. In f64 (the
/// host path on both homes) and in f32 (the PTX kernel on a GPU home).
fn adam_first_step_is_bias_corrected(h: Home) {
    for dtype in [DType::F64, DType::F32] {
        let typed = |v: Vec<f64>| {
            let a = NDArray::from_vec(v, [4]).unwrap().astype(dtype).unwrap();
            h.put(&a, 0)
        };
        let kv = h.store();
        kv.init(1, &typed(vec![0.5; 4])).unwrap();
        kv.set_updater(adam_plain()).unwrap();
        kv.push(1, &typed(vec![0.2, -0.4, 1.0, -3.0])).unwrap();
        let out = h.full_typed([4], 0.0, dtype, 0);
        kv.pull(1, &out).unwrap();
        // With m = 0.1 g, v = 0.001 g², the step is lr * sign(g) up to epsilon.
        let lr = f64::from(0.05f32);
        for (got, g) in out
            .to_vec::<f64>()
            .unwrap()
            .iter()
            .zip([0.2, -0.4, 1.0, -3.0])
        {
            let want = 0.5 - lr * f64::signum(g);
            assert!((got - want).abs() < 1e-6, "{dtype}: got {got}, want {want}");
        }
    }
}

/// `set_updater` again, even with the same parameters, starts momentum afresh.
fn state_resets_on_set_updater(h: Home) {
    for u in [sgd_mom_full(), adam_full()] {
        for dtype in [DType::F32, DType::F64] {
            let mut rng = StdRng::seed_from_u64(7);
            let kv = h.store();
            let (w0, exact) = random(&mut rng, dtype, 100);
            kv.init(1, &h.put(&w0, 0)).unwrap();
            kv.set_updater(u.clone()).unwrap();
            let mut r = RefKey::new(dtype, exact);
            push_random(&kv, h, 1, &mut r, &u, &mut rng, 2);
            push_random(&kv, h, 1, &mut r, &u, &mut rng, 2);
            check(&kv, h, 1, &r, "before the reset");

            kv.set_updater(u.clone()).unwrap();
            let mut kept = RefKey {
                dtype,
                w: r.w.clone(),
                m: r.m.clone(),
                v: r.v.clone(),
                t: r.t,
            };
            r.reset_state();
            let (x, g) = random(&mut rng, dtype, 100);
            kv.push(1, &h.put(&x, 0)).unwrap();
            r.step(&u, &g);
            check(&kv, h, 1, &r, "after the reset");
            // The same push without a reset would give something measurably different.
            kept.step(&u, &g);
            let diff: f64 = kept.w.iter().zip(&r.w).map(|(a, b)| (a - b).abs()).sum();
            assert!(diff > 1e-3, "{u:?}: a reset should change the result");
        }
    }
}

/// Each key counts its own Adam steps, and keeps its own moments.
fn adam_step_count_is_per_key(h: Home) {
    let u = adam_full();
    let mut rng = StdRng::seed_from_u64(11);
    let kv = h.store();
    let n = 64;
    let (a0, ea) = random(&mut rng, DType::F32, n);
    let (b0, eb) = random(&mut rng, DType::F32, n);
    kv.init_list(&[1, 2], &[h.put(&a0, 0), h.put(&b0, 1)])
        .unwrap();
    kv.set_updater(u.clone()).unwrap();
    let mut ra = RefKey::new(DType::F32, ea);
    let mut rb = RefKey::new(DType::F32, eb);
    for _ in 0..3 {
        push_random(&kv, h, 1, &mut ra, &u, &mut rng, 1);
    }
    push_random(&kv, h, 2, &mut rb, &u, &mut rng, 1);
    check(&kv, h, 1, &ra, "key 1 after 3 steps");
    check(&kv, h, 2, &rb, "key 2 after 1 step");

    // One list push: key 1 takes step 4, key 2 step 2 (on a GPU home, one launch when both
    // keys share a GPU, each record with its own step size).
    let (x1, g1) = random(&mut rng, DType::F32, n);
    let (x2, g2) = random(&mut rng, DType::F32, n);
    kv.push_list(&[Key::Int(2), Key::Int(1)], &[h.put(&x2, 1), h.put(&x1, 0)])
        .unwrap();
    ra.step(&u, &g1);
    rb.step(&u, &g2);
    assert_eq!((ra.t, rb.t), (4, 2));
    check(&kv, h, 1, &ra, "key 1 at step 4");
    check(&kv, h, 2, &rb, "key 2 at step 2");
}

on_every_home!(
    tiny_arrays_every_updater_every_dtype,
    large_f32,
    large_f64,
    large_f16,
    large_bf16,
    adam_first_step_is_bias_corrected,
    state_resets_on_set_updater,
    adam_step_count_is_per_key,
);
