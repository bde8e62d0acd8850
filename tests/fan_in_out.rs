//! Pushes of many values and pulls into many outs, on arrays of every size around the block
//! size of the CPU backend, so that the parallel path runs with few elements and much traffic
//! per element.
//!
//! Every test runs on both homes: `cpu::*` with a `local` store and arrays on cpu(i), `gpu::*`
//! (ignored: needs a GPU) with a `device` store and arrays on the GPUs (all on one GPU when
//! there is one: a fused kernel with up to 300 inputs).

mod common;

use common::Home;
use kvstore::gpu_count;
use kvstore::{DType, NDArray};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Sizes around 1024 and 2048 elements (the CPU backend's block is 1024).
const SIZES: [usize; 8] = [1, 1023, 1025, 1500, 2047, 2048, 2049, 5000];

fn random(rng: &mut StdRng, n: usize, dtype: DType) -> NDArray {
    let data: Vec<f64> = (0..n)
        .map(|_| f64::from(rng.gen_range(-64i32..64)))
        .collect();
    NDArray::from_vec(data, [n]).unwrap().astype(dtype).unwrap()
}

fn push_many_values(h: Home) {
    let mut rng = StdRng::seed_from_u64(5);
    for dtype in [DType::F64, DType::F32, DType::F16] {
        for n in SIZES {
            for nvals in [1, 3, 70, 300] {
                let kv = h.store();
                kv.init(0, &h.put(&random(&mut rng, n, dtype), 0)).unwrap();
                let vals: Vec<NDArray> = (0..nvals)
                    .map(|d| h.put(&random(&mut rng, n, dtype), d))
                    .collect();
                // Small integers: every sum is exact, in every dtype (|sum| <= 64 * 300).
                let mut exact = vec![0.0f64; n];
                let mut magnitude = vec![0.0f64; n];
                for v in &vals {
                    for ((e, m), x) in exact
                        .iter_mut()
                        .zip(&mut magnitude)
                        .zip(v.to_vec::<f64>().unwrap())
                    {
                        *e += x;
                        *m += x.abs();
                    }
                }
                let mut want = exact.clone();
                if dtype == DType::F16 {
                    // float16 holds integers exactly only up to 2048.
                    want.iter_mut()
                        .for_each(|w| *w = half::f16::from_f64(*w).to_f64());
                }
                kv.push(0, &vals).unwrap();
                let out = h.full_typed([n], 0.5, DType::F64, 0);
                kv.pull(0, &out).unwrap();
                let got = out.to_vec::<f64>().unwrap();
                let what = format!("{dtype}, {n} elements, {nvals} values");
                if dtype == DType::F16 && h == Home::Gpu && gpu_count() > 1 {
                    assert_partial_sums_bound(&got, &exact, &magnitude, gpu_count(), &what);
                } else {
                    assert_eq!(got, want, "{what}");
                }
            }
        }
    }
}

/// float16 on a GPU home with several GPUs: the values on each GPU other than the key's home
/// are first summed there into a float16 buffer, so each such partial sum is rounded to
/// float16 before the home adds it (and an `nccl` store's reduce rounds once per rank it adds).
/// Once a partial sum passes 2048 that is not the single rounding of the exact sum the CPU
/// home and a single GPU give. Each rounding errs by at most 2^-11 of a partial sum, and every
/// partial sum is at most the sum of magnitudes, so with `gpus` GPUs (at most `gpus - 1`
/// partial sums, `gpus - 1` reduce steps and the final rounding) the result is within
/// `2 * gpus * 2^-11 * sum|x|` of the exact sum.
fn assert_partial_sums_bound(
    got: &[f64],
    exact: &[f64],
    magnitude: &[f64],
    gpus: usize,
    what: &str,
) {
    let u = 2f64.powi(-11);
    for (i, ((g, e), m)) in got.iter().zip(exact).zip(magnitude).enumerate() {
        let bound = 2.0 * gpus as f64 * u * m;
        assert!(
            (g - e).abs() <= bound,
            "{what}: element {i} is {g}, the exact sum {e} (bound {bound})"
        );
    }
}

fn pull_into_many_outs(h: Home) {
    let mut rng = StdRng::seed_from_u64(6);
    for dtype in [DType::F32, DType::F64] {
        for n in SIZES {
            for nouts in [1, 2, 90, 400] {
                let kv = h.store();
                let v = h.put(&random(&mut rng, n, dtype), 0);
                kv.init(0, &v).unwrap();
                let outs: Vec<NDArray> = (0..nouts)
                    .map(|d| h.full_typed([n], 0.5, dtype, d))
                    .collect();
                kv.pull(0, &outs).unwrap();
                let want = v.to_vec::<f64>().unwrap();
                for o in &outs {
                    assert_eq!(
                        o.to_vec::<f64>().unwrap(),
                        want,
                        "{dtype}, {n}, {nouts} outs"
                    );
                }
            }
        }
    }
}

/// Arrays with no elements go through every operation.
fn zero_size_arrays(h: Home) {
    let kv = h.store();
    kv.init_list(&[1, 2], &[h.full([0], 0.0, 0), h.full([3, 0], 0.0, 1)])
        .unwrap();
    kv.push(1, &[h.full([0], 0.0, 0), h.full([0], 0.0, 1)])
        .unwrap();
    kv.pull(2, &[h.full([3, 0], 0.0, 0), h.full([3, 0], 0.0, 1)])
        .unwrap();
    kv.set_updater(kvstore::Updater::custom(|_, x, w| *w += x))
        .unwrap();
    let v = h.full([3, 0], 0.0, 0);
    kv.pushpull_in_place(2, &v).unwrap();
    assert_eq!(v.to_vec::<f32>().unwrap(), Vec::<f32>::new());
    assert!(
        kv.push(2, &h.full([0], 0.0, 0)).is_err(),
        "(0,) is not (3, 0)"
    );
}

on_every_home!(push_many_values, pull_into_many_outs, zero_size_arrays);
