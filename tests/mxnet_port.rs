//! MXNet's own KVStore tests, ported: `tests/python/unittest/test_kvstore.py`,
//! `test_kvstore_custom.py`, `tests/python/gpu/test_device.py` (with cpu(i) devices) and the
//! nightly updater loop, plus the numbers of the seed tutorials (001 and 003).
//!
//! Each MXNet test runs with int keys and with string keys, as upstream does, and on both
//! homes: `cpu::*` with a `local` store and values on cpu(i); `gpu::*` (ignored: needs a GPU)
//! with a `device` store and values on the GPUs.

mod common;

use std::sync::{Arc, Mutex};

use common::Home;
use kvstore::{DType, Key, KvStore, NDArray, Shape, StoreKind, Updater};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const SHAPE: [usize; 2] = [4, 4];

/// MXNet's `keys` and `str_keys`, with the single key used beside them.
fn int_keys() -> (Key, [Key; 3]) {
    (Key::Int(3), [5, 7, 11].map(Key::Int))
}

fn str_keys() -> (Key, [Key; 3]) {
    (Key::from("a"), ["b", "c", "d"].map(Key::from))
}

fn both_key_kinds() -> [(Key, [Key; 3]); 2] {
    [int_keys(), str_keys()]
}

/// A key made by doubling another (`key + key` in Python): 3 -> 6, "a" -> "aa".
fn doubled(k: &Key) -> Key {
    match k {
        Key::Int(i) => Key::Int(i + i),
        Key::Str(s) => Key::Str(format!("{s}{s}")),
    }
}

/// `[full(v)]` on the home's first `n` devices.
fn on_devs(h: Home, n: usize, v: f64) -> Vec<NDArray> {
    (0..n).map(|i| h.full(SHAPE, v, i)).collect()
}

/// An out that is surely overwritten by a pull: filled with a value no test expects.
fn empty_out(h: Home) -> NDArray {
    h.full(SHAPE, -123.0, 0)
}

fn assert_all(a: &NDArray, v: f64) {
    let got = a.to_vec::<f64>().unwrap();
    assert!(
        got.iter().all(|&x| x == v),
        "expected every element {v}, got {:?}",
        &got[..got.len().min(8)]
    );
}

fn assert_all_approx(a: &NDArray, v: f64, tol: f64) {
    let got = a.to_vec::<f64>().unwrap();
    assert!(
        got.iter().all(|&x| (x - v).abs() <= tol),
        "expected every element {v} (±{tol}), got {:?}",
        &got[..got.len().min(8)]
    );
}

/// MXNet's `init_kv`: key `k0` and the three `keys`, all zeros, on the home's store.
fn init_kv(h: Home, k0: &Key, keys: &[Key; 3]) -> KvStore {
    let kv = h.store();
    kv.init(k0, &h.full(SHAPE, 0.0, 0)).unwrap();
    kv.init_list(keys, &vec![h.full(SHAPE, 0.0, 0); 3]).unwrap();
    kv
}

/// MXNet's updater `stored += recv`.
fn add_updater() -> Updater {
    Updater::custom(|_key, recv, stored| *stored += recv)
}

fn test_single_kv_pair(h: Home) {
    for (k0, keys) in both_key_kinds() {
        let kv = init_kv(h, &k0, &keys);
        kv.push(&k0, &h.full(SHAPE, 1.0, 0)).unwrap();
        let out = empty_out(h);
        kv.pull(&k0, &out).unwrap();
        assert_all(&out, 1.0);
    }
}

fn test_init(h: Home) {
    for key in [Key::Int(3), Key::from("a")] {
        let kv = h.store();
        kv.init(&key, &(h.full(SHAPE, 1.0, 0) * 4.0)).unwrap();
        let out = empty_out(h);
        kv.pull(&key, &out).unwrap();
        assert_all(&out, 4.0);
    }
}

fn test_pull(h: Home) {
    for kind in h.kinds() {
        let kv = h.store_of(kind);
        kv.init("1", &h.full(SHAPE, 0.0, 0)).unwrap();
        // The same array four times: summed four times.
        let a = h.full(SHAPE, 1.0, 0);
        kv.push("1", &[a.clone(), a.clone(), a.clone(), a]).unwrap();
        let out = empty_out(h);
        kv.pull("1", &out).unwrap();
        assert_all(&out, 4.0);

        kv.init("2", &h.full(SHAPE, 0.0, 0)).unwrap();
        kv.pull("2", &out).unwrap();
        assert_all(&out, 0.0);
    }
}

fn test_list_kv_pair(h: Home) {
    for (k0, keys) in both_key_kinds() {
        let kv = init_kv(h, &k0, &keys);
        let v = h.full(SHAPE, 1.0, 0) * 4.0;
        kv.push_list(&keys, &vec![v; 3]).unwrap();
        // The same out for all three keys (`[e] * 3`).
        let e = empty_out(h);
        kv.pull_list(&keys, &vec![e.clone(); 3]).unwrap();
        assert_all(&e, 4.0);
        // And each key on its own.
        for k in &keys {
            let out = empty_out(h);
            kv.pull(k, &out).unwrap();
            assert_all(&out, 4.0);
        }
    }
}

fn test_aggregator(h: Home) {
    for (k0, keys) in both_key_kinds() {
        let kv = init_kv(h, &k0, &keys);
        kv.push(&k0, &on_devs(h, 4, 1.0)).unwrap();
        let outs = on_devs(h, 4, -1.0);
        kv.pull(&k0, &outs).unwrap();
        for o in &outs {
            assert_all(o, 4.0);
        }

        // `[[ones*2 on 4 devs]] * 3`: one inner list shared by the three keys.
        let vals = vec![on_devs(h, 4, 2.0); 3];
        kv.push_list(&keys, &vals).unwrap();
        let outs: Vec<Vec<NDArray>> = (0..3).map(|_| on_devs(h, 4, -1.0)).collect();
        kv.pull_list(&keys, &outs).unwrap();
        for o in outs.iter().flatten() {
            assert_all(o, 8.0);
        }
    }
}

fn test_updater(h: Home) {
    let updaters = [add_updater(), Updater::Axpby { a: 1.0, b: 1.0 }];
    for updater in updaters {
        for (k0, keys) in both_key_kinds() {
            let kv = init_kv(h, &k0, &keys);
            kv.set_updater(updater.clone()).unwrap();
            kv.push(&k0, &on_devs(h, 4, 1.0)).unwrap();
            let outs = on_devs(h, 4, -1.0);
            kv.pull(&k0, &outs).unwrap();
            for o in &outs {
                assert_all(o, 4.0);
            }

            for _ in 0..4 {
                kv.push_list(&keys, &vec![on_devs(h, 4, 1.0); 3]).unwrap();
            }
            let outs: Vec<Vec<NDArray>> = (0..3).map(|_| on_devs(h, 4, -1.0)).collect();
            kv.pull_list(&keys, &outs).unwrap();
            for o in outs.iter().flatten() {
                assert_all(o, 16.0);
            }
        }
    }
}

#[test]
fn test_get_type() {
    let kv = KvStore::create("local_allreduce_cpu").unwrap();
    assert_eq!(kv.type_name(), "local_allreduce_cpu");
    assert_eq!(kv.kind(), StoreKind::Local);
    for name in [
        "local",
        "local_update_cpu",
        "device",
        "local_allreduce_device",
        "nccl",
    ] {
        let kv = KvStore::create(name).unwrap();
        assert_eq!(kv.type_name(), name);
        assert_eq!(kv.kind(), name.parse::<StoreKind>().unwrap());
        // The kind itself is accepted too, and reports its canonical name.
        let again = KvStore::create(kv.kind()).unwrap();
        assert_eq!(again.kind(), kv.kind());
        assert_eq!(again.type_name(), kv.kind().name());
    }
    assert_eq!(
        KvStore::create(String::from("NCCL")).unwrap().kind(),
        StoreKind::Nccl
    );
    assert_eq!(StoreKind::Device.to_string(), "device");
}

fn test_broadcast_single_kv_pair(h: Home) {
    for kind in h.kinds() {
        for key in [Key::Int(3), Key::from("a")] {
            let kv = h.store_of(kind);
            let out = empty_out(h);
            kv.broadcast(&key, &h.full(SHAPE, 1.0, 0), &out).unwrap();
            assert_all(&out, 1.0);

            let e = empty_out(h);
            let outs = vec![e.clone(); 3];
            kv.broadcast(doubled(&key), &h.full(SHAPE, 1.0, 0), &outs)
                .unwrap();
            assert_all(&e, 1.0);
        }
    }
}

fn test_broadcast_list_kv_pair(h: Home) {
    for (_, keys) in both_key_kinds() {
        let kv = h.store();
        let e = empty_out(h);
        kv.broadcast_list(&keys, &vec![h.full(SHAPE, 1.0, 0); 3], &vec![e.clone(); 3])
            .unwrap();
        assert_all(&e, 1.0);

        let keys2: Vec<Key> = keys.iter().map(doubled).collect();
        let e = empty_out(h);
        kv.broadcast_list(
            &keys2,
            &vec![h.full(SHAPE, 1.0, 0); 3],
            &vec![vec![e.clone(); 2]; 3],
        )
        .unwrap();
        assert_all(&e, 1.0);
    }
}

/// `test_pushpull_single_kv_pair` and, without `in_place`, `test_pushpull_list_kv_pair`.
fn pushpull_case(h: Home, in_place: bool) {
    for kind in h.kinds() {
        for (k0, keys) in both_key_kinds() {
            let kv = h.store_of(kind);
            let e = empty_out(h);
            kv.broadcast(&k0, &h.full(SHAPE, 0.0, 0), &e).unwrap();
            assert_all(&e, 0.0);

            let outs = on_devs(h, 4, -1.0);
            kv.pushpull(&k0, &on_devs(h, 4, 1.0), &outs).unwrap();
            for o in &outs {
                assert_all(o, 4.0);
            }
            if in_place {
                let vals = on_devs(h, 4, 1.0);
                kv.pushpull_in_place(&k0, &vals).unwrap();
                for v in &vals {
                    assert_all(v, 4.0);
                }
            }

            let e = empty_out(h);
            kv.broadcast_list(&keys, &vec![h.full(SHAPE, 0.0, 0); 3], &vec![e.clone(); 3])
                .unwrap();
            assert_all(&e, 0.0);
            let outs: Vec<Vec<NDArray>> = (0..3).map(|_| on_devs(h, 4, -1.0)).collect();
            kv.pushpull_list(&keys, &vec![on_devs(h, 4, 2.0); 3], &outs)
                .unwrap();
            for o in outs.iter().flatten() {
                assert_all(o, 8.0);
            }
            if in_place {
                // One inner list shared by all three keys: every push reads the 2s before any
                // pull writes the 8s back.
                let vals = vec![on_devs(h, 4, 2.0); 3];
                kv.pushpull_list(&keys, &vals, &vals).unwrap();
                for v in &vals[0] {
                    assert_all(v, 8.0);
                }
                for k in &keys {
                    let out = empty_out(h);
                    kv.pull(k, &out).unwrap();
                    assert_all(&out, 8.0);
                }
            }
        }
    }
}

fn test_pushpull_single_kv_pair(h: Home) {
    pushpull_case(h, true);
}

fn test_pushpull_list_kv_pair(h: Home) {
    pushpull_case(h, false);
}

/// `test_device.py`: a fresh store per (shape, n); n ones from n devices sum to n everywhere.
fn test_device_loop(h: Home) {
    let shapes: [&[usize]; 7] = [
        &[10],
        &[100],
        &[1000],
        &[10000],
        &[100000],
        &[2, 2],
        &[2, 3, 4, 5, 6, 7, 8],
    ];
    for kind in h.kinds() {
        for (i, dims) in shapes.iter().enumerate() {
            let shape = Shape::new(dims).unwrap();
            for n in 1..=4 {
                let kv = h.store_of(kind);
                let key = format!("{}", (i + 1) * 4 + n);
                kv.init(key.as_str(), &h.full(shape, 1.0, 0)).unwrap();
                let vals: Vec<NDArray> = (0..n).map(|d| h.full(shape, 1.0, d)).collect();
                kv.push(key.as_str(), &vals).unwrap();
                let outs: Vec<NDArray> = (0..n).map(|d| h.full(shape, 0.0, d)).collect();
                kv.pull(key.as_str(), &outs).unwrap();
                for o in &outs {
                    assert_eq!(o.shape(), shape);
                    assert_all(o, n as f64);
                }
            }
        }
    }
}

/// Relative L1 error `Σ|got - want| / Σ|want|`.
fn rel_l1(got: &[f32], want: &[f64]) -> f64 {
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (f64::from(g) - w).abs())
        .sum();
    let den: f64 = want.iter().map(|w| w.abs()).sum();
    num / den
}

/// The nightly `test_kvstore` / `test_group_kvstore` loop: `stored += 0.1 * merged`, 10 rounds
/// of uniform[-1, 1) data from 4 devices, keys 3, 5, 7 with shapes up to 2000x2000.
///
/// The reference is computed in f64 from the same f32 data. The store sums the 4 values in f32
/// and applies `0.1 * sum` in f32; its error against the exact result stays far below the
/// 1e-6 relative L1 bound MXNet uses.
fn nightly_loop(h: Home, kinds: &[&str], updater: Updater, grouped: bool, seed: u64) {
    let keys = [3, 5, 7];
    // 400 x 400 on the stand-in driver's interpreter.
    let big = h.scaled(2000, 400);
    let shapes: [Shape; 3] = [[4, 4].into(), [100, 100].into(), [big, big].into()];
    let mut rng = StdRng::seed_from_u64(seed);
    for &kind in kinds {
        let kv = h.store_of(kind);
        kv.set_updater(updater.clone()).unwrap();
        let zeros: Vec<NDArray> = shapes.iter().map(|&s| h.full(s, 0.0, 0)).collect();
        kv.init_list(&keys, &zeros).unwrap();
        let mut expected: Vec<Vec<f64>> = shapes.iter().map(|s| vec![0.0; s.size()]).collect();
        for _round in 0..10 {
            let mut all_vals = Vec::new();
            for (k, s) in shapes.iter().enumerate() {
                let vals: Vec<NDArray> = (0..4)
                    .map(|d| {
                        let data: Vec<f32> =
                            (0..s.size()).map(|_| rng.gen_range(-1.0..1.0)).collect();
                        NDArray::from_vec(data, *s)
                            .unwrap()
                            .to_device(h.dev(d))
                            .unwrap()
                    })
                    .collect();
                for v in &vals {
                    let data = v.to_vec::<f32>().unwrap();
                    for (e, x) in expected[k].iter_mut().zip(data) {
                        *e += 0.1 * f64::from(x);
                    }
                }
                all_vals.push(vals);
            }
            let outs: Vec<Vec<NDArray>> = shapes
                .iter()
                .map(|&s| (0..4).map(|d| h.full(s, 7.0, d)).collect())
                .collect();
            if grouped {
                kv.push_list(&keys, &all_vals).unwrap();
                kv.pull_list(&keys, &outs).unwrap();
            } else {
                for (k, vals) in keys.iter().zip(&all_vals) {
                    kv.push(*k, vals).unwrap();
                }
                for (k, o) in keys.iter().zip(&outs) {
                    kv.pull(*k, o).unwrap();
                }
            }
            for (k, os) in outs.iter().enumerate() {
                for o in os {
                    let err = rel_l1(&o.to_vec::<f32>().unwrap(), &expected[k]);
                    assert!(
                        err < 1e-6,
                        "{kind}: key {} relative L1 error {err}",
                        keys[k]
                    );
                }
            }
        }
    }
}

fn test_nightly_kvstore_axpby(h: Home) {
    nightly_loop(h, &h.kinds(), Updater::Axpby { a: 1.0, b: 0.1 }, false, 1);
}

fn test_nightly_group_kvstore_axpby(h: Home) {
    nightly_loop(h, &[h.kind()], Updater::Axpby { a: 1.0, b: 0.1 }, true, 2);
}

fn test_nightly_kvstore_custom(h: Home) {
    let u = Updater::custom(|_k, merged, stored| *stored += merged * 0.1);
    nightly_loop(h, &[h.kind()], u.clone(), false, 3);
    nightly_loop(h, &[h.kind()], u, true, 4);
}

/// Seed 001 (the KVStore tutorial) and seed 003 (the notebook), with every number they print,
/// and the order of "update on key" lines.
fn seed_walkthroughs(h: Home) {
    let shape = [2, 3];
    let log: Arc<Mutex<Vec<Key>>> = Arc::default();

    // Seed 001, on a `local` store.
    let kv = h.store();
    kv.init(3, &(h.full(shape, 1.0, 0) * 2.0)).unwrap();
    let a = h.full(shape, 0.0, 0);
    kv.pull(3, &a).unwrap();
    assert_all(&a, 2.0);
    kv.push(3, &(h.full(shape, 1.0, 0) * 8.0)).unwrap();
    kv.pull(3, &a).unwrap();
    assert_all(&a, 8.0);
    let b: Vec<NDArray> = (0..4).map(|d| h.full(shape, 1.0, d)).collect();
    kv.push(3, &b).unwrap();
    kv.pull(3, &a).unwrap();
    assert_all(&a, 4.0);

    let seen = log.clone();
    kv.set_updater(Updater::custom(move |key, input, stored| {
        seen.lock().unwrap().push(key.clone());
        *stored += input * 2.0;
    }))
    .unwrap();
    kv.pull(3, &a).unwrap();
    assert_all(&a, 4.0);
    assert!(log.lock().unwrap().is_empty(), "set_updater runs nothing");
    kv.push(3, &h.full(shape, 1.0, 0)).unwrap();
    kv.pull(3, &a).unwrap();
    assert_all(&a, 6.0);
    assert_eq!(*log.lock().unwrap(), vec![Key::Int(3)]);

    let b: Vec<NDArray> = (0..4).map(|d| h.full(shape, 1.0, d)).collect();
    kv.pull(3, &b).unwrap();
    assert_all(&b[1], 6.0);

    let keys = [5, 7, 9];
    kv.init_list(&keys, &vec![h.full(shape, 1.0, 0); 3])
        .unwrap();
    // Pushed in descending order: the updater still runs in ascending key order.
    kv.push_list(&[9, 7, 5], &vec![h.full(shape, 1.0, 0); 3])
        .unwrap();
    let b = vec![h.full(shape, 0.0, 0); 3];
    kv.pull_list(&keys, &b).unwrap();
    assert_all(&b[1], 3.0);

    let inner: Vec<NDArray> = (0..4).map(|d| h.full(shape, 1.0, d)).collect();
    let b = vec![inner; 3];
    kv.push_list(&keys, &b).unwrap();
    kv.pull_list(&keys, &b).unwrap();
    assert_all(&b[1][1], 11.0);
    let ints = |v: &[i32]| v.iter().map(|&k| Key::Int(k)).collect::<Vec<_>>();
    let want: Vec<Key> = ints(&[3, 5, 7, 9, 5, 7, 9]);
    assert_eq!(*log.lock().unwrap(), want);

    // Seed 003, on a `device` store.
    let kv = h.store();
    kv.init(3, &(h.full(shape, 1.0, 0) * -2.0)).unwrap();
    let a = h.full(shape, 0.0, 0);
    kv.pull(3, &a).unwrap();
    assert_all(&a, -2.0);
    kv.push(3, &(h.full(shape, 1.0, 0) * -7.0)).unwrap();
    kv.pull(3, &a).unwrap();
    assert_all(&a, -7.0);
    let b: Vec<NDArray> = (0..3).map(|d| h.full(shape, 1.0, d)).collect();
    kv.push(3, &b).unwrap();
    kv.pull(3, &a).unwrap();
    assert_all(&a, 3.0);

    let keys = [7, 11, 13, 17];
    kv.init_list(&keys, &vec![h.full(shape, 1.0, 0) * -3.0; 4])
        .unwrap();
    let c = vec![h.full(shape, 0.0, 0); 4];
    kv.pull_list(&keys, &c).unwrap();
    assert_all(&c[0], -3.0);
    let d: Vec<NDArray> = (0..3).map(|i| h.full(shape, -0.1, i)).collect();
    kv.push_list(&keys, &vec![d; 4]).unwrap();
    kv.pull_list(&keys, &c).unwrap();
    assert_all_approx(&c[0], -0.3, 1e-6);

    kv.set_updater(Updater::custom(|_key, input, stored| {
        *stored += input * 0.01
    }))
    .unwrap();
    kv.pull(3, &a).unwrap();
    assert_all(&a, 3.0);
    kv.push(3, &(h.full(shape, 1.0, 0) * 5.0)).unwrap();
    kv.pull(3, &a).unwrap();
    assert_all_approx(&a, 3.05, 1e-6);
}

/// The keys an updater saw, each with the first element of its merged input.
type Log = Arc<Mutex<Vec<(Key, f32)>>>;

/// Records every key the updater sees, and the first element of each merged input.
fn recording_updater() -> (Updater, Log) {
    let log: Log = Arc::default();
    let seen = log.clone();
    let u = Updater::custom(move |key, input, stored| {
        let first = input.to_vec::<f32>().unwrap()[0];
        seen.lock().unwrap().push((key.clone(), first));
        *stored += input;
    });
    (u, log)
}

/// mxnet.md §1, verified on MXNet: keys [9, 2, 5, 2] give updater calls for 2 (with the sum
/// of both of its values), then 5, then 9: once per distinct key, in ascending order.
fn updater_order_int_keys(h: Home) {
    let kv = h.store();
    kv.init_list(&[2, 5, 9], &vec![h.full([3], 0.0, 0); 3])
        .unwrap();
    let (u, log) = recording_updater();
    kv.set_updater(u).unwrap();
    let vals: Vec<NDArray> = [1.0, 2.0, 3.0, 4.0]
        .iter()
        .enumerate()
        .map(|(i, &v)| h.full([3], v, i))
        .collect();
    kv.push_list(&[9, 2, 5, 2], &vals).unwrap();
    let want = vec![(Key::Int(2), 6.0), (Key::Int(5), 3.0), (Key::Int(9), 1.0)];
    assert_eq!(*log.lock().unwrap(), want);
    let out = h.full([3], 0.0, 0);
    kv.pull(2, &out).unwrap();
    assert_all(&out, 6.0);
}

/// String keys are updated in the order they were first initialized, not alphabetically.
fn updater_order_str_keys(h: Home) {
    let kv = h.store();
    kv.init("c", &h.full([2], 0.0, 0)).unwrap();
    kv.init_list(&["a", "b"], &vec![h.full([2], 0.0, 0); 2])
        .unwrap();
    assert_eq!(
        kv.keys(),
        vec![Key::from("c"), Key::from("a"), Key::from("b")]
    );
    let (u, log) = recording_updater();
    kv.set_updater(u).unwrap();
    let vals: Vec<NDArray> = [1.0, 2.0, 3.0]
        .iter()
        .enumerate()
        .map(|(i, &v)| h.full([2], v, i))
        .collect();
    kv.push_list(&["a", "b", "c"], &vals).unwrap();
    let order: Vec<Key> = log.lock().unwrap().iter().map(|(k, _)| k.clone()).collect();
    assert_eq!(order, vec![Key::from("c"), Key::from("a"), Key::from("b")]);
}

/// Pull converts to the out's dtype, as MXNet does.
fn pull_casts_to_out_dtype(h: Home) {
    let kv = h.store();
    kv.init(3, &h.full([2, 3], 3.0, 0)).unwrap();
    let outs: Vec<NDArray> = DType::ALL
        .iter()
        .map(|&d| h.full_typed([2, 3], -1.0, d, 0))
        .collect();
    kv.pull(3, &outs).unwrap();
    for o in &outs {
        assert_all(o, 3.0);
    }
}

on_every_home!(
    test_single_kv_pair,
    test_init,
    test_pull,
    test_list_kv_pair,
    test_aggregator,
    test_updater,
    test_broadcast_single_kv_pair,
    test_broadcast_list_kv_pair,
    test_pushpull_single_kv_pair,
    test_pushpull_list_kv_pair,
    test_device_loop,
    test_nightly_kvstore_axpby,
    test_nightly_group_kvstore_axpby,
    test_nightly_kvstore_custom,
    seed_walkthroughs,
    updater_order_int_keys,
    updater_order_str_keys,
    pull_casts_to_out_dtype,
);
