//! candle tensors in the store (cargo feature `candle`): zero-copy lends (pointer identity),
//! views, dtypes, errors, ownership under kept clones, and data-parallel training that equals
//! single-device training.

use std::sync::{Arc, Mutex};

use half::{bf16, f16};
use kvstore::candle::candle_core::{self, CpuStorage, DType, Device, Storage, Tensor, Var};
use kvstore::candle::{__host_addr, with_arrays, Access, CandleError, CandleExt};
use kvstore::{Adam, KvStore, Updater};
use rand::Rng;

fn rand_vec(n: usize) -> Vec<f64> {
    let mut rng = rand::thread_rng();
    (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect()
}

fn tensor(dims: &[usize], dtype: DType) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_vec(rand_vec(n), dims, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// The address of a CPU tensor's storage.
fn addr(t: &Tensor) -> usize {
    let (s, _) = t.storage_and_layout();
    match &*s {
        Storage::Cpu(CpuStorage::F32(v)) => v.as_ptr().addr(),
        Storage::Cpu(CpuStorage::F64(v)) => v.as_ptr().addr(),
        Storage::Cpu(CpuStorage::F16(v)) => v.as_ptr().addr(),
        Storage::Cpu(CpuStorage::BF16(v)) => v.as_ptr().addr(),
        other => panic!("not a float CPU storage: {other:?}"),
    }
}

fn f64s(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn assert_close(a: &[f64], b: &[f64], tol: f64) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol, "element {i}: {x} vs {y} (tol {tol})");
    }
}

#[test]
fn lent_arrays_are_the_tensors_own_storage() {
    let a = tensor(&[3, 4], DType::F32);
    let b = tensor(&[5], DType::F64);
    let (pa, pb) = (addr(&a), addr(&b));
    let before = (f64s(&a), f64s(&b));
    for access in [Access::Read, Access::Write] {
        let seen = with_arrays(&[&a, &b], access, |arrays| {
            Ok((__host_addr(&arrays[0]), __host_addr(&arrays[1])))
        })
        .unwrap();
        assert_eq!(
            seen,
            (Some(pa), Some(pb)),
            "{access:?}: the arrays are the tensors' Vecs"
        );
        // Moved back: the same allocation, the same elements.
        assert_eq!((addr(&a), addr(&b)), (pa, pb));
        assert_eq!((f64s(&a), f64s(&b)), before);
    }
}

#[test]
fn push_and_pull_go_through_the_tensors_storage() {
    let kv = KvStore::create("local").unwrap();
    let init = tensor(&[2, 3], DType::F32);
    kv.init_candle("w", &init).unwrap();
    let grads: Vec<Tensor> = (0..4).map(|_| tensor(&[2, 3], DType::F32)).collect();
    let addrs: Vec<usize> = grads.iter().map(addr).collect();
    kv.push_candle("w", &grads).unwrap();
    assert_eq!(grads.iter().map(addr).collect::<Vec<_>>(), addrs);

    let outs = [tensor(&[2, 3], DType::F32), tensor(&[2, 3], DType::F32)];
    let out_addrs: Vec<usize> = outs.iter().map(addr).collect();
    kv.pull_candle("w", &outs).unwrap();
    assert_eq!(outs.iter().map(addr).collect::<Vec<_>>(), out_addrs);

    let mut want = vec![0.0; 6];
    for g in &grads {
        for (w, x) in want.iter_mut().zip(f64s(g)) {
            *w += x;
        }
    }
    for o in &outs {
        assert_close(&f64s(o), &want, 1e-5);
    }
}

#[test]
fn pull_writes_a_var_in_place() {
    let kv = KvStore::create("local").unwrap();
    let value = tensor(&[4, 2], DType::F64);
    kv.init_candle(1, &value).unwrap();
    let var = Var::zeros((4, 2), DType::F64, &Device::Cpu).unwrap();
    let p = addr(var.as_tensor());
    kv.pull_candle(1, &[var.as_tensor().clone()]).unwrap();
    assert_eq!(addr(var.as_tensor()), p);
    assert_eq!(f64s(var.as_tensor()), f64s(&value));
}

#[test]
fn views_are_copied_through_their_layout() {
    let kv = KvStore::create("local").unwrap();
    kv.init_candle(0, &Tensor::zeros((3, 2), DType::F32, &Device::Cpu).unwrap())
        .unwrap();
    // A transposed view and a narrowed view (contiguous, offset 4) as push values.
    let base = tensor(&[2, 3], DType::F32);
    let t = base.t().unwrap();
    assert!(!t.is_contiguous());
    let big = tensor(&[5, 2], DType::F32);
    let narrow = big.narrow(0, 2, 3).unwrap();
    kv.push_candle(0, &[t.clone(), narrow.clone()]).unwrap();
    let want: Vec<f64> = f64s(&t)
        .iter()
        .zip(f64s(&narrow))
        .map(|(a, b)| a + b)
        .collect();
    let out = Tensor::zeros((3, 2), DType::F32, &Device::Cpu).unwrap();
    kv.pull_candle(0, std::slice::from_ref(&out)).unwrap();
    assert_close(&f64s(&out), &want, 1e-6);

    // Pull into a transposed view: the elements land where the view says.
    let under = tensor(&[2, 3], DType::F32);
    let view = under.t().unwrap();
    kv.pull_candle(0, std::slice::from_ref(&view)).unwrap();
    assert_close(&f64s(&view), &want, 1e-6);
    assert_close(&f64s(&under.t().unwrap()), &want, 1e-6);

    // Pull into rows 1..4 of a 5x2 tensor: the other rows are untouched.
    let host = tensor(&[5, 2], DType::F32);
    let keep = f64s(&host);
    kv.pull_candle(0, &[host.narrow(0, 1, 3).unwrap()]).unwrap();
    let got = f64s(&host);
    assert_eq!(got[..2], keep[..2]);
    assert_close(&got[2..8], &want, 1e-6);
    assert_eq!(got[8..], keep[8..]);
}

#[test]
fn every_float_dtype_round_trips_and_pull_converts() {
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let kv = KvStore::create("local").unwrap();
        let v = tensor(&[7], dtype);
        kv.init_candle(0, &v).unwrap();
        let same = Tensor::zeros(7, dtype, &Device::Cpu).unwrap();
        let wide = Tensor::zeros(7, DType::F64, &Device::Cpu).unwrap();
        kv.pull_candle(0, &[same.clone(), wide.clone()]).unwrap();
        assert_eq!(f64s(&same), f64s(&v), "{dtype:?}");
        assert_eq!(f64s(&wide), f64s(&v), "{dtype:?} pulled into f64");
    }
    // The element types on the candle side are the ones kvstore names.
    let h = Tensor::from_vec(vec![f16::from_f32(0.5); 2], 2, &Device::Cpu).unwrap();
    let b = Tensor::from_vec(vec![bf16::from_f32(0.25); 2], 2, &Device::Cpu).unwrap();
    let kv = KvStore::create("local").unwrap();
    kv.init_list_candle(&[0, 1], &[h, b]).unwrap();
    assert_eq!(kv.meta(0).unwrap().1, kvstore::DType::F16);
    assert_eq!(kv.meta(1).unwrap().1, kvstore::DType::BF16);
}

#[test]
fn other_dtypes_are_a_typed_error_and_change_nothing() {
    let kv = KvStore::create("local").unwrap();
    let ints = Tensor::from_vec(vec![1u32, 2, 3], 3, &Device::Cpu).unwrap();
    let err = kv.init_candle(0, &ints).unwrap_err();
    assert!(
        matches!(
            err,
            CandleError::UnsupportedDType {
                dtype: DType::U32,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("to_dtype"), "{err}");
    assert!(kv.keys().is_empty());

    let v = tensor(&[3], DType::F32);
    kv.init_candle(0, &v).unwrap();
    let i64s = Tensor::from_vec(vec![1i64, 2, 3], 3, &Device::Cpu).unwrap();
    let good = tensor(&[3], DType::F32);
    let err = kv.push_candle(0, &[good, i64s.clone()]).unwrap_err();
    assert!(matches!(err, CandleError::UnsupportedDType { .. }), "{err}");
    assert!(err.to_string().contains("value 1"), "{err}");
    let err = kv.pull_candle(0, &[i64s]).unwrap_err();
    assert!(err.to_string().contains("out 0"), "{err}");
    let out = Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap();
    kv.pull_candle(0, std::slice::from_ref(&out)).unwrap();
    assert_eq!(f64s(&out), f64s(&v), "the store is unchanged");
}

#[test]
fn store_errors_leave_tensors_and_store_as_they_were() {
    let kv = KvStore::create("local").unwrap();
    let v = tensor(&[2, 2], DType::F32);
    kv.init_candle(0, &v).unwrap();
    let good = tensor(&[2, 2], DType::F32);
    let wrong = tensor(&[4], DType::F32);
    let (pg, pw) = (addr(&good), addr(&wrong));
    let (kg, kw) = (f64s(&good), f64s(&wrong));
    let err = kv
        .push_candle(0, &[good.clone(), wrong.clone()])
        .unwrap_err();
    assert!(
        matches!(
            err,
            CandleError::Store(kvstore::Error::ShapeMismatch { .. })
        ),
        "{err}"
    );
    let err = kv
        .pull_candle(0, &[good.clone(), wrong.clone()])
        .unwrap_err();
    assert!(matches!(err, CandleError::Store(_)), "{err}");
    let err = kv.push_candle(9, std::slice::from_ref(&good)).unwrap_err();
    assert!(
        matches!(err, CandleError::Store(kvstore::Error::UnknownKey { .. })),
        "{err}"
    );
    assert_eq!((addr(&good), addr(&wrong)), (pg, pw));
    assert_eq!((f64s(&good), f64s(&wrong)), (kg, kw));
    let out = Tensor::zeros((2, 2), DType::F32, &Device::Cpu).unwrap();
    kv.pull_candle(0, std::slice::from_ref(&out)).unwrap();
    assert_eq!(f64s(&out), f64s(&v));
}

#[test]
fn shared_storage_is_copied_for_push_and_refused_for_pull() {
    let kv = KvStore::create("local").unwrap();
    kv.init_candle(0, &Tensor::zeros(5, DType::F64, &Device::Cpu).unwrap())
        .unwrap();
    let g = tensor(&[5], DType::F64);
    // The same storage twice (a clone of the handle): summed twice, no deadlock.
    kv.push_candle(0, &[g.clone(), g.clone()]).unwrap();
    let out = Tensor::zeros(5, DType::F64, &Device::Cpu).unwrap();
    kv.pull_candle(0, std::slice::from_ref(&out)).unwrap();
    let twice: Vec<f64> = f64s(&g).iter().map(|x| 2.0 * x).collect();
    assert_close(&f64s(&out), &twice, 1e-12);
    // A broadcast view repeats elements: fine to read.
    let one = tensor(&[1], DType::F64);
    kv.push_candle(0, &[one.broadcast_as(5).unwrap()]).unwrap();

    let keep = f64s(&out);
    let err = kv.pull_candle(0, &[out.clone(), out.clone()]).unwrap_err();
    assert!(
        matches!(err, CandleError::AliasedOuts { index: 1 }),
        "{err}"
    );
    let err = kv
        .pull_candle(0, &[one.broadcast_as(5).unwrap()])
        .unwrap_err();
    assert!(
        matches!(err, CandleError::AliasedOuts { index: 0 }),
        "{err}"
    );
    assert_eq!(f64s(&out), keep);
}

#[test]
fn a_kept_clone_costs_a_copy_not_the_tensors_data() {
    // A custom updater that keeps a clone of what it was given: with one value, the lent
    // array itself may reach the updater. The tensor must still get its elements back.
    let kv = KvStore::create("local").unwrap();
    kv.init_candle(0, &Tensor::zeros(6, DType::F32, &Device::Cpu).unwrap())
        .unwrap();
    let kept = Arc::new(Mutex::new(Vec::new()));
    let k = kept.clone();
    kv.set_updater(Updater::custom(move |_key, input, stored| {
        k.lock().unwrap().push(input.clone());
        *stored += input;
    }))
    .unwrap();
    let g = tensor(&[6], DType::F32);
    let before = f64s(&g);
    kv.push_candle(0, std::slice::from_ref(&g)).unwrap();
    assert_eq!(f64s(&g), before);
    assert_eq!(kept.lock().unwrap().len(), 1);
    let out = Tensor::zeros(6, DType::F32, &Device::Cpu).unwrap();
    kv.pull_candle(0, std::slice::from_ref(&out)).unwrap();
    assert_eq!(f64s(&out), before);
}

#[test]
fn empty_and_scalar_tensors() {
    let kv = KvStore::create("local").unwrap();
    let e = Tensor::zeros((0, 3), DType::F32, &Device::Cpu).unwrap();
    let s = Tensor::new(2.5f32, &Device::Cpu).unwrap();
    kv.init_list_candle(&[0, 1], &[e.clone(), s]).unwrap();
    kv.push_list_candle(
        &[0, 1],
        &[
            vec![e.clone()],
            vec![Tensor::new(4.0f32, &Device::Cpu).unwrap()],
        ],
    )
    .unwrap();
    let out = Tensor::new(0f32, &Device::Cpu).unwrap();
    kv.pull_list_candle(&[0, 1], &[vec![e], vec![out.clone()]])
        .unwrap();
    assert_eq!(out.to_scalar::<f32>().unwrap(), 4.0);
}

// ---- Training equivalence ------------------------------------------------------------------

const D: usize = 6;
const H: usize = 8;
const BATCH: usize = 32;
const WORKERS: usize = 4;
const STEPS: usize = 25;

struct Mlp {
    params: Vec<Var>, // w1 [D,H], b1 [H], w2 [H,1], b2 [1]
}

impl Mlp {
    fn from(values: &[Vec<f64>]) -> Mlp {
        let shapes: [&[usize]; 4] = [&[D, H], &[H], &[H, 1], &[1]];
        let params = values
            .iter()
            .zip(shapes)
            .map(|(v, s)| {
                Var::from_tensor(&Tensor::from_vec(v.clone(), s, &Device::Cpu).unwrap()).unwrap()
            })
            .collect();
        Mlp { params }
    }

    /// Mean squared error of the batch.
    fn loss(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        let p = &self.params;
        let h = x
            .matmul(p[0].as_tensor())?
            .broadcast_add(p[1].as_tensor())?
            .tanh()?;
        let out = h
            .matmul(p[2].as_tensor())?
            .broadcast_add(p[3].as_tensor())?;
        (out - y)?.sqr()?.mean_all()
    }

    /// The gradient of every parameter, in parameter order.
    fn grads(&self, x: &Tensor, y: &Tensor) -> (f64, Vec<Tensor>) {
        let loss = self.loss(x, y).unwrap();
        let g = loss.backward().unwrap();
        let grads = self
            .params
            .iter()
            .map(|p| g.get(p).unwrap().clone())
            .collect();
        (loss.to_scalar::<f64>().unwrap(), grads)
    }

    fn values(&self) -> Vec<Vec<f64>> {
        self.params.iter().map(|p| f64s(p.as_tensor())).collect()
    }
}

/// MXNet's Adam (kvstore's documented formula), written out in f64.
struct RefAdam {
    lr: f64,
    m: Vec<Vec<f64>>,
    v: Vec<Vec<f64>>,
    t: i32,
}

impl RefAdam {
    fn step(&mut self, w: &mut [Vec<f64>], g: &[Vec<f64>]) {
        let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8);
        self.t += 1;
        let size = self.lr * (1.0 - b2.powi(self.t)).sqrt() / (1.0 - b1.powi(self.t));
        for k in 0..w.len() {
            for i in 0..w[k].len() {
                let gi = g[k][i];
                self.m[k][i] = b1 * self.m[k][i] + (1.0 - b1) * gi;
                self.v[k][i] = b2 * self.v[k][i] + (1.0 - b2) * gi * gi;
                w[k][i] -= size * self.m[k][i] / (self.v[k][i].sqrt() + eps);
            }
        }
    }
}

#[test]
fn data_parallel_training_equals_single_device_training() {
    let init: Vec<Vec<f64>> = [D * H, H, H, 1].iter().map(|&n| rand_vec(n)).collect();
    let lr = 0.01;

    // Reference: one candle model on the whole batch, hand-written Adam.
    let single = Mlp::from(&init);
    let mut w = init.clone();
    let mut adam = RefAdam {
        lr,
        m: init.iter().map(|v| vec![0.0; v.len()]).collect(),
        v: init.iter().map(|v| vec![0.0; v.len()]).collect(),
        t: 0,
    };

    // Data parallel: WORKERS replicas, one list push of all gradients, Adam in the store
    // (rescale_grad 1/WORKERS: each replica's loss is the mean of its shard), one list pull
    // into the replicas' own parameters.
    let kv = KvStore::create("local").unwrap();
    let replicas: Vec<Mlp> = (0..WORKERS).map(|_| Mlp::from(&init)).collect();
    let keys = [0, 1, 2, 3];
    let first: Vec<Tensor> = replicas[0]
        .params
        .iter()
        .map(|p| p.as_tensor().clone())
        .collect();
    kv.init_list_candle(&keys, &first).unwrap();
    kv.set_updater(Updater::Adam(Adam {
        lr,
        rescale_grad: 1.0 / WORKERS as f64,
        ..Adam::default()
    }))
    .unwrap();

    let mut first_loss = None;
    let mut last_loss = 0.0;
    for _ in 0..STEPS {
        let x = Tensor::from_vec(rand_vec(BATCH * D), (BATCH, D), &Device::Cpu).unwrap();
        let y = Tensor::from_vec(rand_vec(BATCH), (BATCH, 1), &Device::Cpu).unwrap();

        let (loss, g) = single.grads(&x, &y);
        first_loss.get_or_insert(loss);
        last_loss = loss;
        let g: Vec<Vec<f64>> = g.iter().map(f64s).collect();
        adam.step(&mut w, &g);
        for (p, v) in single.params.iter().zip(&w) {
            p.set(&Tensor::from_vec(v.clone(), p.shape(), &Device::Cpu).unwrap())
                .unwrap();
        }

        let shard = BATCH / WORKERS;
        let per_key: Vec<Vec<Tensor>> = {
            let per_worker: Vec<Vec<Tensor>> = replicas
                .iter()
                .enumerate()
                .map(|(r, m)| {
                    let xs = x.narrow(0, r * shard, shard).unwrap();
                    let ys = y.narrow(0, r * shard, shard).unwrap();
                    m.grads(&xs, &ys).1
                })
                .collect();
            (0..keys.len())
                .map(|k| per_worker.iter().map(|g| g[k].clone()).collect())
                .collect()
        };
        kv.push_list_candle(&keys, &per_key).unwrap();
        let outs: Vec<Vec<Tensor>> = (0..keys.len())
            .map(|k| {
                replicas
                    .iter()
                    .map(|m| m.params[k].as_tensor().clone())
                    .collect()
            })
            .collect();
        kv.pull_list_candle(&keys, &outs).unwrap();
    }

    let moved = w
        .iter()
        .zip(&init)
        .flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs()))
        .fold(0.0, f64::max);
    assert!(moved > 1e-2, "training moved the weights by {moved} only");
    for m in &replicas {
        for (got, want) in m.values().iter().zip(&w) {
            assert_close(got, want, 1e-5);
        }
    }
    assert!(
        first_loss.unwrap().is_finite() && last_loss.is_finite(),
        "losses {first_loss:?} .. {last_loss}"
    );
}
