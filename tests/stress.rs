//! Many threads on one shared store: no update is lost, list operations are atomic, and
//! operations on different keys run at the same time.
//!
//! Values are small integers stored as f32, so every sum is exact and the final value of each
//! key must equal its initial value plus everything pushed to it, to the last bit.
//!
//! Every test runs on both homes: `cpu::*` with a `local` store and arrays on cpu(i), `gpu::*`
//! (ignored: needs a GPU) with a `device` store and arrays on the GPUs, where pushes and pulls
//! are enqueued on the GPUs' streams and return before the work is done.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::Duration;

use common::Home;
use kvstore::{KvStore, NDArray, Shape, Updater};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const THREADS: usize = 8;
const OPS: usize = 300;
/// Two keys that only ever get `x` and `-x` in one list push: their sum never changes.
const PAIR: [i32; 2] = [100, 101];

fn shape_of(key: i32) -> Shape {
    match key {
        0..=4 => [37].into(),
        5..=9 => [5, 7].into(),
        // Big enough for the parallel path of the CPU backend.
        10 => [200_000].into(),
        11 => [].into(),
        _ => [16].into(),
    }
}

fn keys() -> Vec<i32> {
    (0..12).chain(PAIR).collect()
}

fn random_ints(rng: &mut StdRng, n: usize, range: i32) -> Vec<i64> {
    (0..n)
        .map(|_| i64::from(rng.gen_range(-range..=range)))
        .collect()
}

/// `data` as f32 on the home's `dev`-th device.
fn array(h: Home, data: &[i64], shape: Shape, dev: usize) -> NDArray {
    let v: Vec<f32> = data.iter().map(|&x| x as f32).collect();
    h.put(&NDArray::from_vec(v, shape).unwrap(), dev)
}

fn as_ints(a: &NDArray) -> Vec<i64> {
    a.to_vec::<f64>()
        .unwrap()
        .iter()
        .map(|&x| {
            assert_eq!(x, x.trunc(), "a value that is not an integer: {x}");
            x as i64
        })
        .collect()
}

/// What one thread pushed to each key, elementwise.
type Sums = HashMap<i32, Vec<i64>>;

fn add(sums: &mut Sums, key: i32, x: &[i64]) {
    let s = sums
        .entry(key)
        .or_insert_with(|| vec![0; shape_of(key).size()]);
    for (s, x) in s.iter_mut().zip(x) {
        *s += x;
    }
}

fn pair_total(h: Home, kv: &KvStore, order: [i32; 2]) -> Vec<i64> {
    let outs = [h.full([16], 0.0, 0), h.full([16], 0.0, 1)];
    kv.pull_list(&order, &outs).unwrap();
    let (a, b) = (as_ints(&outs[0]), as_ints(&outs[1]));
    a.iter().zip(&b).map(|(a, b)| a + b).collect()
}

/// One thread's random mix of pushes, list pushes, pushpulls and pulls.
fn worker(kv: &KvStore, h: Home, seed: u64, pair_sum: &[i64]) -> Sums {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut sums = Sums::new();
    let plain: Vec<i32> = (0..12).collect();
    for _ in 0..OPS {
        let r: f64 = rng.gen();
        if r < 0.35 {
            let key = *plain.choose(&mut rng).unwrap();
            let shape = shape_of(key);
            let vals: Vec<NDArray> = (0..rng.gen_range(1..=3))
                .map(|d| {
                    let x = random_ints(&mut rng, shape.size(), 8);
                    add(&mut sums, key, &x);
                    array(h, &x, shape, d)
                })
                .collect();
            kv.push(key, &vals).unwrap();
        } else if r < 0.6 {
            // A list push in random order, possibly naming a key twice.
            let n = rng.gen_range(2..=5);
            let list: Vec<i32> = (0..n).map(|_| *plain.choose(&mut rng).unwrap()).collect();
            let vals: Vec<Vec<NDArray>> = list
                .iter()
                .map(|&key| {
                    (0..rng.gen_range(1..=2))
                        .map(|d| {
                            let x = random_ints(&mut rng, shape_of(key).size(), 8);
                            add(&mut sums, key, &x);
                            array(h, &x, shape_of(key), d)
                        })
                        .collect()
                })
                .collect();
            kv.push_list(&list, &vals).unwrap();
        } else if r < 0.75 {
            // Move x from one pair key to the other, atomically.
            let x = random_ints(&mut rng, 16, 8);
            let neg: Vec<i64> = x.iter().map(|v| -v).collect();
            add(&mut sums, PAIR[0], &x);
            add(&mut sums, PAIR[1], &neg);
            let (a, b) = (array(h, &x, [16].into(), 0), array(h, &neg, [16].into(), 1));
            if rng.gen() {
                kv.push_list(&PAIR, &[a, b]).unwrap();
            } else {
                kv.push_list(&[PAIR[1], PAIR[0]], &[b, a]).unwrap();
            }
        } else if r < 0.85 {
            let key = *plain.choose(&mut rng).unwrap();
            let shape = shape_of(key);
            let x = random_ints(&mut rng, shape.size(), 8);
            add(&mut sums, key, &x);
            let v = array(h, &x, shape, 0);
            kv.pushpull_in_place(key, &v).unwrap();
            as_ints(&v);
        } else {
            let order = if rng.gen() { PAIR } else { [PAIR[1], PAIR[0]] };
            assert_eq!(
                pair_total(h, kv, order),
                pair_sum,
                "a pull saw half of a list push"
            );
            let key = *plain.choose(&mut rng).unwrap();
            let out = h.full(shape_of(key), 0.0, 1);
            kv.pull(key, &out).unwrap();
            as_ints(&out);
        }
    }
    sums
}

fn no_update_lost(h: Home, updater: Updater, seed: u64) {
    let kv = Arc::new(h.store());
    let mut rng = StdRng::seed_from_u64(seed);
    let mut expected: HashMap<i32, Vec<i64>> = HashMap::new();
    for key in keys() {
        let init = random_ints(&mut rng, shape_of(key).size(), 100);
        kv.init(key, &array(h, &init, shape_of(key), 0)).unwrap();
        expected.insert(key, init);
    }
    kv.set_updater(updater).unwrap();
    let pair_sum = pair_total(h, &kv, PAIR);

    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let kv = Arc::clone(&kv);
            let pair_sum = pair_sum.clone();
            thread::spawn(move || worker(&kv, h, seed * 1000 + t as u64, &pair_sum))
        })
        .collect();
    for handle in handles {
        for (key, s) in handle.join().expect("a worker panicked") {
            for (e, s) in expected.get_mut(&key).unwrap().iter_mut().zip(s) {
                *e += s;
            }
        }
    }
    for key in keys() {
        let out = h.full(shape_of(key), 0.0, 0);
        kv.pull(key, &out).unwrap();
        assert_eq!(as_ints(&out), expected[&key], "key {key} lost an update");
    }
    assert_eq!(pair_total(h, &kv, PAIR), pair_sum);
}

fn no_update_lost_fused(h: Home) {
    no_update_lost(h, Updater::Axpby { a: 1.0, b: 1.0 }, 1);
}

fn no_update_lost_custom(h: Home) {
    no_update_lost(h, Updater::custom(|_key, x, w| *w += x), 2);
}

/// While the updater of key 1 is running, a push and a pull of key 2 from another thread
/// complete. If the store serialized them, the updater would wait out its timeout and the
/// test would fail (not hang). The order is forced by channels, not by timing: the timeouts
/// only keep a broken store from hanging the test.
///
/// On a GPU home this means the same: a custom updater runs on the host while its key's lock
/// is held (the value is copied down, updated, copied back), so key 2's push and pull, which
/// take only key 2's lock and their own GPU copies, must complete meanwhile.
fn different_keys_overlap(h: Home) {
    let kv = Arc::new(h.store());
    kv.init_list(&[1, 2], &[h.full([8], 1.0, 0), h.full([8], 10.0, 1)])
        .unwrap();
    let (entered_tx, entered_rx) = mpsc::channel::<()>();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let entered_tx = Mutex::new(entered_tx);
    let done_rx = Mutex::new(done_rx);
    let overlapped = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&overlapped);
    kv.set_updater(Updater::custom(move |key, x, w| {
        if *key == kvstore::Key::Int(1) {
            entered_tx.lock().unwrap().send(()).unwrap();
            if done_rx
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(20))
                .is_ok()
            {
                flag.store(true, Ordering::SeqCst);
            }
        }
        *w += x;
    }))
    .unwrap();

    let kv1 = Arc::clone(&kv);
    let slow = thread::spawn(move || kv1.push(1, &h.full([8], 2.0, 0)).unwrap());
    let kv2 = Arc::clone(&kv);
    let fast = thread::spawn(move || {
        entered_rx
            .recv_timeout(Duration::from_secs(20))
            .expect("key 1's updater never started");
        kv2.push(2, &h.full([8], 5.0, 1)).unwrap();
        let out = h.full([8], 0.0, 1);
        kv2.pull(2, &out).unwrap();
        done_tx.send(()).unwrap();
        out
    });
    let out2 = fast.join().unwrap();
    slow.join().unwrap();
    assert!(
        overlapped.load(Ordering::SeqCst),
        "a push to key 2 waited for key 1's updater"
    );
    assert_eq!(out2.to_vec::<f32>().unwrap(), vec![15.0; 8]);
    let out1 = h.full([8], 0.0, 0);
    kv.pull(1, &out1).unwrap();
    assert_eq!(out1.to_vec::<f32>().unwrap(), vec![3.0; 8]);
}

on_every_home!(
    no_update_lost_fused,
    no_update_lost_custom,
    different_keys_overlap
);
