//! `push_list_with_priority` / `pull_list_with_priority`: work is issued in descending priority,
//! ties in ascending key order, and the results are those of the plain list calls.
//!
//! Every test runs on both homes: `cpu::*` with a `local` store and arrays on cpu(i), `gpu::*`
//! (ignored: needs a GPU) with a `device` store and arrays on the GPUs. Custom updaters run on
//! the host on both homes; the built-in one runs the fused kernels on a GPU home.

mod common;

use std::sync::{Arc, Mutex};

use common::Home;
use kvstore::{Error, Key, KvStore, NDArray, Sgd, Updater};
use rand::prelude::*;

/// `len` random f32 values in [-1, 1) on the home's `i`-th device.
fn random(h: Home, rng: &mut StdRng, len: usize, i: usize) -> NDArray {
    let v: Vec<f32> = (0..len).map(|_| rng.gen_range(-1.0..1.0)).collect();
    h.put(&NDArray::from_vec(v, [len]).unwrap(), i)
}

/// A store whose custom updater records the keys it is called on (and adds the input).
fn recording_store(h: Home, keys: &[Key], rng: &mut StdRng) -> (KvStore, Arc<Mutex<Vec<Key>>>) {
    let kv = h.store();
    let values: Vec<NDArray> = (0..keys.len()).map(|i| random(h, rng, 3, i)).collect();
    kv.init_list(keys, &values).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    kv.set_updater(Updater::custom(move |key, input, stored| {
        log.lock().unwrap().push(key.clone());
        *stored += input;
    }))
    .unwrap();
    (kv, seen)
}

/// The reference order: descending priority, then ascending position in `update_order`.
fn expected_order(keys: &[Key], priorities: &[i32], update_order: &[Key]) -> Vec<Key> {
    let mut best: Vec<(Key, i32)> = Vec::new();
    for (k, &p) in keys.iter().zip(priorities) {
        match best.iter_mut().find(|(b, _)| b == k) {
            Some(entry) => entry.1 = entry.1.max(p),
            None => best.push((k.clone(), p)),
        }
    }
    let pos = |k: &Key| update_order.iter().position(|u| u == k).unwrap();
    best.sort_by(|(a, pa), (b, pb)| pb.cmp(pa).then(pos(a).cmp(&pos(b))));
    best.into_iter().map(|(k, _)| k).collect()
}

fn updater_runs_in_descending_priority_then_key_order(h: Home) {
    let mut rng = StdRng::seed_from_u64(1);
    for round in 0..50 {
        let all: Vec<Key> = (0..12).map(|k| Key::Int(k * 3 - 7)).collect();
        let (kv, seen) = recording_store(h, &all, &mut rng);
        // A random subset, shuffled, some keys repeated, priorities with many ties.
        let mut keys: Vec<Key> = all.iter().filter(|_| rng.gen_bool(0.7)).cloned().collect();
        if keys.is_empty() {
            keys.push(all[0].clone());
        }
        let extra = keys[rng.gen_range(0..keys.len())].clone();
        keys.push(extra);
        keys.shuffle(&mut rng);
        let priorities: Vec<i32> = keys.iter().map(|_| rng.gen_range(-2..3)).collect();
        let values: Vec<NDArray> = (0..keys.len()).map(|i| random(h, &mut rng, 3, i)).collect();

        let before: Vec<Vec<f32>> = all.iter().map(|k| pulled(h, &kv, k)).collect();
        kv.push_list_with_priority(&keys, &values, &priorities)
            .unwrap();
        assert_eq!(
            *seen.lock().unwrap(),
            expected_order(&keys, &priorities, &all),
            "round {round}: keys {keys:?}, priorities {priorities:?}"
        );
        // Each key got its own sum, whatever the order.
        for (k, old) in all.iter().zip(before) {
            let mut want = old;
            for (key, v) in keys.iter().zip(&values) {
                if key == k {
                    for (w, x) in want.iter_mut().zip(v.to_vec::<f32>().unwrap()) {
                        *w += x;
                    }
                }
            }
            assert_eq!(pulled(h, &kv, k), want, "round {round}: key {k}");
        }
    }
}

fn pulled(h: Home, kv: &KvStore, key: &Key) -> Vec<f32> {
    let out = h.full(kv.meta(key).unwrap().0, 0.0, 0);
    kv.pull(key, &out).unwrap();
    out.to_vec().unwrap()
}

fn equal_priorities_keep_ascending_key_order_like_push_list(h: Home) {
    let mut rng = StdRng::seed_from_u64(2);
    let all: Vec<Key> = [9, -4, 0, 17, 3].map(Key::Int).to_vec();
    let (kv, seen) = recording_store(h, &all, &mut rng);
    let values: Vec<NDArray> = (0..all.len()).map(|i| random(h, &mut rng, 3, i)).collect();
    kv.push_list_with_priority(&all, &values, &[7; 5]).unwrap();
    let with_priority = std::mem::take(&mut *seen.lock().unwrap());
    kv.push_list(&all, &values).unwrap();
    let plain = seen.lock().unwrap().clone();
    assert_eq!(with_priority, [-4, 0, 3, 9, 17].map(Key::Int).to_vec());
    assert_eq!(with_priority, plain);
}

fn string_keys_tie_in_init_order(h: Home) {
    let mut rng = StdRng::seed_from_u64(3);
    let all: Vec<Key> = ["w", "a", "m", "b"].map(Key::from).to_vec();
    let (kv, seen) = recording_store(h, &all, &mut rng);
    let values: Vec<NDArray> = (0..all.len()).map(|i| random(h, &mut rng, 3, i)).collect();
    kv.push_list_with_priority(&all, &values, &[0, 0, 1, 0])
        .unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        ["m", "w", "a", "b"].map(Key::from).to_vec()
    );
}

fn single_key_calls(h: Home) {
    let mut rng = StdRng::seed_from_u64(4);
    let (kv, seen) = recording_store(h, &[Key::Int(5)], &mut rng);
    let start = pulled(h, &kv, &Key::Int(5));
    let g = random(h, &mut rng, 3, 1);
    kv.push_with_priority(5, &g, 3).unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![Key::Int(5)]);
    let out = h.full([3], 0.0, 0);
    kv.pull_with_priority(5, &out, -3).unwrap();
    let want: Vec<f32> = start
        .iter()
        .zip(g.to_vec::<f32>().unwrap())
        .map(|(a, b)| a + b)
        .collect();
    assert_eq!(out.to_vec::<f32>().unwrap(), want);
}

/// The fused built-in path with priorities gives bit-identical results to `push_list`, and a
/// prioritized pull fills each out from its own key.
fn builtin_updater_and_pull_match_plain_calls(h: Home) {
    let mut rng = StdRng::seed_from_u64(5);
    let keys: Vec<i32> = (0..40).collect();
    let init: Vec<NDArray> = keys
        .iter()
        .map(|&k| random(h, &mut rng, 1 + k as usize, k as usize))
        .collect();
    let sgd = Updater::Sgd(Sgd {
        lr: 0.1,
        momentum: 0.9,
        ..Sgd::default()
    });
    let stores: Vec<KvStore> = (0..2).map(|_| h.store()).collect();
    for kv in &stores {
        kv.init_list(&keys, &init).unwrap();
        kv.set_updater(sgd.clone()).unwrap();
    }
    for _ in 0..3 {
        let grads: Vec<Vec<NDArray>> = init
            .iter()
            .map(|a| (0..2).map(|d| random(h, &mut rng, a.size(), d)).collect())
            .collect();
        let priorities: Vec<i32> = keys.iter().map(|_| rng.gen_range(-100..100)).collect();
        stores[0]
            .push_list_with_priority(&keys, &grads, &priorities)
            .unwrap();
        stores[1].push_list(&keys, &grads).unwrap();
    }
    let priorities: Vec<i32> = keys.iter().map(|_| rng.gen_range(-100..100)).collect();
    let outs: Vec<Vec<NDArray>> = init
        .iter()
        .map(|a| vec![h.full(a.shape(), 0.0, 0), h.full(a.shape(), 0.0, 1)])
        .collect();
    let plain: Vec<NDArray> = init.iter().map(|a| h.full(a.shape(), 0.0, 0)).collect();
    stores[0]
        .pull_list_with_priority(&keys, &outs, &priorities)
        .unwrap();
    stores[1].pull_list(&keys, &plain).unwrap();
    for ((k, o), p) in keys.iter().zip(&outs).zip(&plain) {
        let want = p.to_vec::<f32>().unwrap();
        assert_ne!(want, init[*k as usize].to_vec::<f32>().unwrap());
        for out in o {
            assert_eq!(out.to_vec::<f32>().unwrap(), want, "key {k}");
        }
    }
}

fn priority_length_mismatch_is_an_error_and_changes_nothing(h: Home) {
    let mut rng = StdRng::seed_from_u64(6);
    let all: Vec<Key> = (0..3).map(Key::Int).collect();
    let (kv, seen) = recording_store(h, &all, &mut rng);
    let before: Vec<Vec<f32>> = all.iter().map(|k| pulled(h, &kv, k)).collect();
    let values: Vec<NDArray> = (0..all.len()).map(|i| random(h, &mut rng, 3, i)).collect();
    for priorities in [&[1, 2][..], &[1, 2, 3, 4][..], &[][..]] {
        let err = kv
            .push_list_with_priority(&all, &values, priorities)
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::LengthMismatch { keys: 3, values, what: "priorities", .. }
                    if values == priorities.len()
            ),
            "{err}"
        );
        let outs: Vec<NDArray> = (0..all.len()).map(|i| h.full([3], 0.0, i)).collect();
        let err = kv
            .pull_list_with_priority(&all, &outs, priorities)
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::LengthMismatch {
                    what: "priorities",
                    ..
                }
            ),
            "{err}"
        );
        for o in &outs {
            assert_eq!(o.to_vec::<f32>().unwrap(), vec![0.0; 3]);
        }
    }
    // Keys vs values is still checked first.
    let err = kv
        .push_list_with_priority(&all, &values[..2], &[0, 0, 0])
        .unwrap_err();
    assert!(
        matches!(err, Error::LengthMismatch { what: "values", .. }),
        "{err}"
    );
    assert!(seen.lock().unwrap().is_empty());
    let after: Vec<Vec<f32>> = all.iter().map(|k| pulled(h, &kv, k)).collect();
    assert_eq!(before, after);
}

/// Threads pushing overlapping keys with opposite priorities finish: locks are taken in key
/// order, not priority order.
fn opposite_priorities_do_not_deadlock(h: Home) {
    let kv = h.store();
    let keys: Vec<i32> = (0..16).collect();
    let init: Vec<NDArray> = (0..keys.len()).map(|i| h.full([64], 0.0, i)).collect();
    kv.init_list(&keys, &init).unwrap();
    kv.set_updater(Updater::Axpby { a: 1.0, b: 1.0 }).unwrap();
    let ones: Vec<NDArray> = (0..keys.len()).map(|i| h.full([64], 1.0, i)).collect();
    std::thread::scope(|s| {
        for t in 0..4 {
            let (kv, keys, ones) = (&kv, &keys, &ones);
            s.spawn(move || {
                let priorities: Vec<i32> = keys
                    .iter()
                    .map(|&k| if t % 2 == 0 { k } else { -k })
                    .collect();
                let outs: Vec<NDArray> = (0..keys.len()).map(|i| h.full([64], 0.0, i)).collect();
                for _ in 0..200 {
                    kv.push_list_with_priority(keys, ones, &priorities).unwrap();
                    kv.pull_list_with_priority(keys, &outs, &priorities)
                        .unwrap();
                }
            });
        }
    });
    let out = h.full([64], 0.0, 0);
    for k in keys {
        kv.pull(k, &out).unwrap();
        assert_eq!(out.to_vec::<f32>().unwrap(), vec![800.0; 64]);
    }
}

on_every_home!(
    updater_runs_in_descending_priority_then_key_order,
    equal_priorities_keep_ascending_key_order_like_push_list,
    string_keys_tie_in_init_order,
    single_key_calls,
    builtin_updater_and_pull_match_plain_calls,
    priority_length_mismatch_is_an_error_and_changes_nothing,
    opposite_priorities_do_not_deadlock,
);
