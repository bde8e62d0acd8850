//! Pushes of many values and pulls into many outs, on arrays of every size around the block
//! size of the CPU backend, so that the parallel path runs with few elements and much traffic
//! per element.

use kvstore::{cpu, DType, KvStore, NDArray};
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

#[test]
fn push_many_values() {
    let mut rng = StdRng::seed_from_u64(5);
    for dtype in [DType::F64, DType::F32, DType::F16] {
        for n in SIZES {
            for nvals in [1, 3, 70, 300] {
                let kv = KvStore::create("local").unwrap();
                kv.init(0, &random(&mut rng, n, dtype)).unwrap();
                let vals: Vec<NDArray> = (0..nvals)
                    .map(|d| random(&mut rng, n, dtype).to_device(cpu(d)).unwrap())
                    .collect();
                // Small integers: every sum is exact, in every dtype (|sum| <= 64 * 300).
                let mut want = vec![0.0f64; n];
                for v in &vals {
                    for (w, x) in want.iter_mut().zip(v.to_vec::<f64>().unwrap()) {
                        *w += x;
                    }
                }
                if dtype == DType::F16 {
                    // float16 holds integers exactly only up to 2048.
                    want.iter_mut()
                        .for_each(|w| *w = half::f16::from_f64(*w).to_f64());
                }
                kv.push(0, &vals).unwrap();
                let out = NDArray::full([n], 0.5).astype(DType::F64).unwrap();
                kv.pull(0, &out).unwrap();
                assert_eq!(
                    out.to_vec::<f64>().unwrap(),
                    want,
                    "{dtype}, {n} elements, {nvals} values"
                );
            }
        }
    }
}

#[test]
fn pull_into_many_outs() {
    let mut rng = StdRng::seed_from_u64(6);
    for dtype in [DType::F32, DType::F64] {
        for n in SIZES {
            for nouts in [1, 2, 90, 400] {
                let kv = KvStore::create("local").unwrap();
                let v = random(&mut rng, n, dtype);
                kv.init(0, &v).unwrap();
                let outs: Vec<NDArray> = (0..nouts)
                    .map(|d| NDArray::full_on([n], 0.5, dtype, cpu(d)).unwrap())
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
#[test]
fn zero_size_arrays() {
    let kv = KvStore::create("local").unwrap();
    kv.init_list(&[1, 2], &[NDArray::zeros([0]), NDArray::zeros([3, 0])])
        .unwrap();
    kv.push(1, &[NDArray::zeros([0]), NDArray::zeros([0])])
        .unwrap();
    kv.pull(2, &[NDArray::zeros([3, 0]), NDArray::zeros([3, 0])])
        .unwrap();
    kv.set_updater(kvstore::Updater::custom(|_, x, w| *w += x))
        .unwrap();
    let v = NDArray::zeros([3, 0]);
    kv.pushpull_in_place(2, &v).unwrap();
    assert_eq!(v.to_vec::<f32>().unwrap(), Vec::<f32>::new());
    assert!(
        kv.push(2, &NDArray::zeros([0])).is_err(),
        "(0,) is not (3, 0)"
    );
}
