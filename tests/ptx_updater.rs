//! User PTX updaters: the example kernel `kernels/user/sgd_f32.ptx` (SGD with momentum) on GPU
//! homes, its CPU twin on the CPU home, both against a reference written here; the errors a
//! PTX updater can give, each leaving the store unchanged.
//!
//! `gpu::*` tests need a GPU (`--include-ignored` on a GPU machine).

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use common::Home;
use kvstore::{cpu, DType, Error, Key, KvStore, NDArray, PtxUpdater, Shape, Updater};
use rand::Rng;

const LR: f32 = 0.05;
const MOMENTUM: f32 = 0.9;

fn random(n: usize) -> Vec<f32> {
    let mut rng = rand::thread_rng();
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

/// The example kernel as an updater: lr `LR`, momentum `MOMENTUM`, one state buffer, and a
/// CPU twin doing the kernel's f32 operations in the kernel's order.
fn sgd_momentum() -> PtxUpdater {
    let momenta: Arc<Mutex<HashMap<Key, Vec<f32>>>> = Arc::default();
    PtxUpdater::new(PtxUpdater::EXAMPLE_SGD_F32, "sgd_f32", DType::F32)
        .unwrap()
        .with_scalars([LR, MOMENTUM, 0.0, 0.0])
        .with_state(1)
        .with_cpu_twin(move |key, merged, stored| {
            let g = merged.to_vec::<f32>().unwrap();
            let mut w = stored.to_vec::<f32>().unwrap();
            let mut all = momenta.lock().unwrap();
            let m = all.entry(key.clone()).or_insert_with(|| vec![0.0; g.len()]);
            for i in 0..g.len() {
                m[i] = MOMENTUM * m[i] + g[i];
                w[i] -= LR * m[i];
            }
            *stored = NDArray::from_vec(w, stored.shape()).unwrap();
        })
}

/// Pushes of several random values per key (two keys, one list call each time), then one of a
/// single value (which the GPU home hands the kernel as is), against a reference in f64 that
/// follows the same steps.
fn matches_the_reference(h: Home) {
    let kv = h.store();
    let shapes: [Shape; 2] = [[3, 1000].into(), [7].into()];
    let keys = [10, 11];
    let mut w: Vec<Vec<f64>> = Vec::new();
    for (k, s) in keys.iter().zip(&shapes) {
        let init = random(s.size());
        kv.init(*k, &h.put(&NDArray::from_vec(init.clone(), *s).unwrap(), 0))
            .unwrap();
        w.push(init.iter().map(|&x| f64::from(x)).collect());
    }
    let p = sgd_momentum();
    kv.set_updater(Updater::Ptx(p.clone())).unwrap();
    let mut m: Vec<Vec<f64>> = shapes.iter().map(|s| vec![0.0; s.size()]).collect();
    for step in 0..4 {
        let mut values = Vec::new();
        for (k, s) in shapes.iter().enumerate() {
            // Three values: two on the first device (several on one GPU) and one on the second;
            // at the last step, one value.
            let count = if step == 3 { 1 } else { 3 };
            let data: Vec<Vec<f32>> = (0..count).map(|_| random(s.size())).collect();
            for i in 0..s.size() {
                let g: f64 = data.iter().map(|d| f64::from(d[i])).sum();
                m[k][i] = f64::from(MOMENTUM) * m[k][i] + g;
                w[k][i] -= f64::from(LR) * m[k][i];
            }
            let on: Vec<NDArray> = data
                .into_iter()
                .zip([0, 0, 1])
                .map(|(d, dev)| h.put(&NDArray::from_vec(d, *s).unwrap(), dev))
                .collect();
            values.push(on);
        }
        kv.push_list(&keys, &values).unwrap();
    }
    for (k, want) in keys.iter().zip(&w) {
        let out = h.full(kv.meta(*k).unwrap().0, f64::NAN, 1);
        kv.pull(*k, &out).unwrap();
        let got = out.to_vec::<f64>().unwrap();
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let err = (g - w).abs() / w.abs().max(1.0);
            assert!(
                err <= 1e-5,
                "key {k} element {i}: got {g}, want {w} ({err:e})"
            );
        }
    }
    if h == Home::Gpu {
        let homes: std::collections::BTreeSet<_> =
            keys.iter().map(|k| kv.meta(*k).unwrap().2).collect();
        assert_eq!(
            p.modules_loaded(),
            homes.len(),
            "the module is loaded once per home GPU, however many pushes"
        );
    }
}

/// A snapshot of every key's value, read through the store.
fn snapshot(kv: &KvStore) -> Vec<Vec<f64>> {
    kv.keys()
        .iter()
        .map(|k| {
            let (shape, _, _) = kv.meta(k.clone()).unwrap();
            let out = NDArray::full_on(shape, f64::NAN, DType::F64, cpu(0)).unwrap();
            kv.pull(k.clone(), &out).unwrap();
            out.to_vec::<f64>().unwrap()
        })
        .collect()
}

/// A key homed in host memory needs the CPU twin: without one the push fails and nothing
/// changes, also for the GPU-homed keys of the same call.
fn host_key_without_twin_is_refused(h: Home) {
    let kv = h.store();
    kv.init(1, &h.put(&NDArray::from_vec(random(8), [8]).unwrap(), 0))
        .unwrap();
    kv.init_on(2, &NDArray::from_vec(random(8), [8]).unwrap(), cpu(0))
        .unwrap();
    let p = PtxUpdater::new(PtxUpdater::EXAMPLE_SGD_F32, "sgd_f32", DType::F32)
        .unwrap()
        .with_scalars([0.5, 0.0, 0.0, 0.0]);
    kv.set_updater(Updater::Ptx(p)).unwrap();
    let before = snapshot(&kv);
    let values = vec![
        h.put(&NDArray::from_vec(random(8), [8]).unwrap(), 0),
        NDArray::from_vec(random(8), [8]).unwrap(),
    ];
    let err = kv.push_list(&[1, 2], &values).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidUpdater(m) if m.contains("with_cpu_twin")
            && m.contains(if h == Home::Gpu { "key 2" } else { "key 1" })),
        "{err}"
    );
    assert_eq!(snapshot(&kv), before, "the failed push changed nothing");
}

/// A key of another dtype than the kernel's is refused, and nothing changes. On a GPU home the
/// store refuses it before the launch; on the CPU home the twin (written for f32) returns an
/// f32 result for the f16 key, which the store refuses as it does any closure's.
fn other_dtype_is_refused(h: Home) {
    let kv = h.store();
    let v = NDArray::from_vec(random(16), [16])
        .unwrap()
        .astype(DType::F16)
        .unwrap();
    kv.init(5, &h.put(&v, 0)).unwrap();
    kv.set_updater(Updater::Ptx(sgd_momentum())).unwrap();
    let before = snapshot(&kv);
    let err = kv.push(5, &h.put(&v, 0)).unwrap_err();
    match h {
        Home::Gpu => assert!(
            matches!(&err, Error::InvalidUpdater(m) if m.contains("works on float32 keys")),
            "{err}"
        ),
        Home::Cpu => assert!(matches!(err, Error::DTypeMismatch { .. }), "{err}"),
    }
    assert_eq!(snapshot(&kv), before, "the failed push changed nothing");
}

on_every_home!(
    matches_the_reference,
    host_key_without_twin_is_refused,
    other_dtype_is_refused
);

#[test]
fn more_than_two_state_buffers_is_refused() {
    let kv = KvStore::create("local").unwrap();
    let p = PtxUpdater::new(PtxUpdater::EXAMPLE_SGD_F32, "sgd_f32", DType::F32)
        .unwrap()
        .with_state(3);
    let err = kv.set_updater(Updater::Ptx(p)).unwrap_err();
    assert!(err.to_string().contains("at most 2 state buffers"), "{err}");
    assert_eq!(kv.updater().name(), "assign", "the updater is unchanged");
}

#[test]
fn state_names_follow_the_state_count() {
    let p = PtxUpdater::new(PtxUpdater::EXAMPLE_SGD_F32, "sgd_f32", DType::F32).unwrap();
    assert_eq!(Updater::Ptx(p.clone()).state_names(), &[] as &[&str]);
    assert_eq!(Updater::Ptx(p.clone().with_state(1)).state_names(), &["m"]);
    assert_eq!(Updater::Ptx(p.with_state(2)).state_names(), &["m", "v"]);
}

/// PTX that declares the right entry but does not compile fails the push on the GPU with the
/// driver's message, and changes nothing.
#[test]
#[ignore = "needs a GPU"]
fn broken_ptx_fails_the_push_and_changes_nothing() {
    let h = Home::Gpu;
    let kv = h.store();
    kv.init(1, &h.put(&NDArray::from_vec(random(8), [8]).unwrap(), 0))
        .unwrap();
    let broken = PtxUpdater::EXAMPLE_SGD_F32.replace("ld.param.u64        %rd4, [n];", "bogus.op;");
    let p = PtxUpdater::new(broken, "sgd_f32", DType::F32).unwrap();
    kv.set_updater(Updater::Ptx(p)).unwrap();
    let before = snapshot(&kv);
    let err = kv
        .push(1, &h.put(&NDArray::from_vec(random(8), [8]).unwrap(), 0))
        .unwrap_err();
    assert!(
        matches!(&err, Error::Cuda { op, .. } if *op == "load PTX updater"),
        "{err}"
    );
    assert_eq!(snapshot(&kv), before, "the failed push changed nothing");
}

/// A user updater that stores its first scalar at address 0 from every thread: outside every
/// allocation on any GPU (the null page is never mapped), so the launch faults with
/// CUDA_ERROR_ILLEGAL_ADDRESS on real hardware as on the stand-in's interpreter.
const STORES_TO_NULL: &str = "
.version 7.0
.target sm_70
.address_size 64
.visible .entry to_null(
    .param .u64 stored,
    .param .u64 merged,
    .param .u64 m,
    .param .u64 v,
    .param .u64 n,
    .param .u64 step,
    .param .f32 s0,
    .param .f32 s1,
    .param .f32 s2,
    .param .f32 s3
)
{
    .reg .b64 %rd<2>;
    .reg .f32 %f<2>;
    ld.param.f32 %f1, [s0];
    mov.u64 %rd1, 0;
    st.global.f32 [%rd1], %f1;
    ret;
}
";

/// A PTX updater that writes out of bounds poisons its GPU's context, as CUDA does: the store
/// reports it as a typed `Error::Cuda` (CUDA_ERROR_ILLEGAL_ADDRESS, marked sticky, with a
/// message that says to restart), never panics or hangs, and every later call on that GPU,
/// from this store or a new one, fails with the same error. Runs in a process of its own,
/// since the fault leaves the process's context on gpu(0) unusable.
#[test]
#[ignore = "needs a GPU"]
fn an_illegal_address_in_a_ptx_updater_is_a_sticky_typed_error() {
    let name = "an_illegal_address_in_a_ptx_updater_is_a_sticky_typed_error";
    if !common::in_own_process(name, &[], std::time::Duration::from_secs(600)) {
        return;
    }
    use cudarc::driver::sys::cudaError_enum::CUDA_ERROR_ILLEGAL_ADDRESS;
    assert!(kvstore::gpu_count() > 0, "this test needs a GPU");
    let is_fault = |r: kvstore::Result<()>, what: &str| match r {
        Err(
            e @ Error::Cuda {
                source: Some(d), ..
            },
        ) if d.0 == CUDA_ERROR_ILLEGAL_ADDRESS => {
            assert!(e.is_sticky_gpu_fault(), "{what}: {e}");
            let text = e.to_string();
            assert!(
                text.contains("CUDA_ERROR_ILLEGAL_ADDRESS") && text.contains("Restart"),
                "{what}: the message says what happened and what to do: {text}"
            );
        }
        other => panic!("{what}: expected the sticky illegal-address error, got {other:?}"),
    };
    let kv = KvStore::create("device").unwrap();
    let n = 1000;
    let data = random(n);
    for key in [1, 2] {
        kv.init_on(
            key,
            &NDArray::from_vec(data.clone(), [n]).unwrap(),
            kvstore::gpu(0),
        )
        .unwrap();
    }
    // Before the fault, the GPU works.
    let out = NDArray::full_on([n], f64::NAN, DType::F32, cpu(0)).unwrap();
    kv.pull(2, &out).unwrap();
    assert_eq!(out.to_vec::<f32>().unwrap(), data);
    let p = PtxUpdater::new(STORES_TO_NULL, "to_null", DType::F32)
        .unwrap()
        .with_scalars([1.5, 0.0, 0.0, 0.0]);
    kv.set_updater(Updater::Ptx(p)).unwrap();
    let value = NDArray::from_vec(random(n), [n])
        .unwrap()
        .to_device(kvstore::gpu(0))
        .unwrap();
    // The launch is asynchronous on a GPU: the push may return before the kernel faults.
    match kv.push(1, &value) {
        Ok(()) => println!("the push returned before the fault; the next call reports it"),
        r => is_fault(r, "the push"),
    }
    // Every later call that reaches gpu(0) fails with the sticky error.
    is_fault(kv.pull(2, &out), "a pull of another key");
    is_fault(kv.pull(2, &out), "the same pull again");
    kv.set_updater(Updater::Assign).unwrap();
    is_fault(kv.push(2, &value), "a push with the assign updater");
    let fresh = KvStore::create("device").unwrap();
    is_fault(
        fresh.init_on(3, &NDArray::from_vec(data, [n]).unwrap(), kvstore::gpu(0)),
        "init in a new store",
    );
}
