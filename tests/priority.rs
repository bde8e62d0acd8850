//! `push_list_with_priority` / `pull_list_with_priority`: work is issued in descending priority,
//! ties in ascending key order, and the results are those of the plain list calls.

use std::sync::{Arc, Mutex};

use kvstore::{Error, Key, KvStore, NDArray, Sgd, Updater};
use rand::prelude::*;

fn random(rng: &mut StdRng, len: usize) -> NDArray {
    let v: Vec<f32> = (0..len).map(|_| rng.gen_range(-1.0..1.0)).collect();
    NDArray::from_vec(v, [len]).unwrap()
}

/// A store whose custom updater records the keys it is called on (and adds the input).
fn recording_store(keys: &[Key], rng: &mut StdRng) -> (KvStore, Arc<Mutex<Vec<Key>>>) {
    let kv = KvStore::create("local").unwrap();
    let values: Vec<NDArray> = keys.iter().map(|_| random(rng, 3)).collect();
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

#[test]
fn updater_runs_in_descending_priority_then_key_order() {
    let mut rng = StdRng::seed_from_u64(1);
    for round in 0..50 {
        let all: Vec<Key> = (0..12).map(|k| Key::Int(k * 3 - 7)).collect();
        let (kv, seen) = recording_store(&all, &mut rng);
        // A random subset, shuffled, some keys repeated, priorities with many ties.
        let mut keys: Vec<Key> = all.iter().filter(|_| rng.gen_bool(0.7)).cloned().collect();
        if keys.is_empty() {
            keys.push(all[0].clone());
        }
        let extra = keys[rng.gen_range(0..keys.len())].clone();
        keys.push(extra);
        keys.shuffle(&mut rng);
        let priorities: Vec<i32> = keys.iter().map(|_| rng.gen_range(-2..3)).collect();
        let values: Vec<NDArray> = keys.iter().map(|_| random(&mut rng, 3)).collect();

        let before: Vec<Vec<f32>> = all.iter().map(|k| pulled(&kv, k)).collect();
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
            assert_eq!(pulled(&kv, k), want, "round {round}: key {k}");
        }
    }
}

fn pulled(kv: &KvStore, key: &Key) -> Vec<f32> {
    let out = NDArray::zeros(kv.meta(key).unwrap().0);
    kv.pull(key, &out).unwrap();
    out.to_vec().unwrap()
}

#[test]
fn equal_priorities_keep_ascending_key_order_like_push_list() {
    let mut rng = StdRng::seed_from_u64(2);
    let all: Vec<Key> = [9, -4, 0, 17, 3].map(Key::Int).to_vec();
    let (kv, seen) = recording_store(&all, &mut rng);
    let values: Vec<NDArray> = all.iter().map(|_| random(&mut rng, 3)).collect();
    kv.push_list_with_priority(&all, &values, &[7; 5]).unwrap();
    let with_priority = std::mem::take(&mut *seen.lock().unwrap());
    kv.push_list(&all, &values).unwrap();
    let plain = seen.lock().unwrap().clone();
    assert_eq!(with_priority, [-4, 0, 3, 9, 17].map(Key::Int).to_vec());
    assert_eq!(with_priority, plain);
}

#[test]
fn string_keys_tie_in_init_order() {
    let mut rng = StdRng::seed_from_u64(3);
    let all: Vec<Key> = ["w", "a", "m", "b"].map(Key::from).to_vec();
    let (kv, seen) = recording_store(&all, &mut rng);
    let values: Vec<NDArray> = all.iter().map(|_| random(&mut rng, 3)).collect();
    kv.push_list_with_priority(&all, &values, &[0, 0, 1, 0])
        .unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        ["m", "w", "a", "b"].map(Key::from).to_vec()
    );
}

#[test]
fn single_key_calls() {
    let mut rng = StdRng::seed_from_u64(4);
    let (kv, seen) = recording_store(&[Key::Int(5)], &mut rng);
    let start = pulled(&kv, &Key::Int(5));
    let g = random(&mut rng, 3);
    kv.push_with_priority(5, &g, 3).unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![Key::Int(5)]);
    let out = NDArray::zeros([3]);
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
#[test]
fn builtin_updater_and_pull_match_plain_calls() {
    let mut rng = StdRng::seed_from_u64(5);
    let keys: Vec<i32> = (0..40).collect();
    let init: Vec<NDArray> = keys
        .iter()
        .map(|k| random(&mut rng, 1 + *k as usize))
        .collect();
    let sgd = Updater::Sgd(Sgd {
        lr: 0.1,
        momentum: 0.9,
        ..Sgd::default()
    });
    let stores: Vec<KvStore> = (0..2).map(|_| KvStore::create("device").unwrap()).collect();
    for kv in &stores {
        kv.init_list(&keys, &init).unwrap();
        kv.set_updater(sgd.clone()).unwrap();
    }
    for _ in 0..3 {
        let grads: Vec<Vec<NDArray>> = init
            .iter()
            .map(|a| (0..2).map(|_| random(&mut rng, a.size())).collect())
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
        .map(|a| vec![NDArray::zeros(a.shape()), NDArray::zeros(a.shape())])
        .collect();
    let plain: Vec<NDArray> = init.iter().map(|a| NDArray::zeros(a.shape())).collect();
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

#[test]
fn priority_length_mismatch_is_an_error_and_changes_nothing() {
    let mut rng = StdRng::seed_from_u64(6);
    let all: Vec<Key> = (0..3).map(Key::Int).collect();
    let (kv, seen) = recording_store(&all, &mut rng);
    let before: Vec<Vec<f32>> = all.iter().map(|k| pulled(&kv, k)).collect();
    let values: Vec<NDArray> = all.iter().map(|_| random(&mut rng, 3)).collect();
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
        let outs: Vec<NDArray> = all.iter().map(|_| NDArray::zeros([3])).collect();
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
    let after: Vec<Vec<f32>> = all.iter().map(|k| pulled(&kv, k)).collect();
    assert_eq!(before, after);
}

/// Threads pushing overlapping keys with opposite priorities finish: locks are taken in key
/// order, not priority order.
#[test]
fn opposite_priorities_do_not_deadlock() {
    let kv = KvStore::create("local").unwrap();
    let keys: Vec<i32> = (0..16).collect();
    let init: Vec<NDArray> = keys.iter().map(|_| NDArray::zeros([64])).collect();
    kv.init_list(&keys, &init).unwrap();
    kv.set_updater(Updater::Axpby { a: 1.0, b: 1.0 }).unwrap();
    let ones: Vec<NDArray> = keys.iter().map(|_| NDArray::ones([64])).collect();
    std::thread::scope(|s| {
        for t in 0..4 {
            let (kv, keys, ones) = (&kv, &keys, &ones);
            s.spawn(move || {
                let priorities: Vec<i32> = keys
                    .iter()
                    .map(|&k| if t % 2 == 0 { k } else { -k })
                    .collect();
                let outs: Vec<NDArray> = keys.iter().map(|_| NDArray::zeros([64])).collect();
                for _ in 0..200 {
                    kv.push_list_with_priority(keys, ones, &priorities).unwrap();
                    kv.pull_list_with_priority(keys, &outs, &priorities)
                        .unwrap();
                }
            });
        }
    });
    let out = NDArray::zeros([64]);
    for k in keys {
        kv.pull(k, &out).unwrap();
        assert_eq!(out.to_vec::<f32>().unwrap(), vec![800.0; 64]);
    }
}
