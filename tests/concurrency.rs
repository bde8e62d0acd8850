//! Deadlock freedom under concurrency: store calls made from rayon tasks (the store must never
//! let a rayon worker steal user work while it holds key locks), and array arithmetic on two
//! arrays from two threads in opposite orders.
//!
//! Every test body runs on a spawned thread and the test fails, instead of hanging, when it does
//! not finish within [`BOUND`]. CI also runs this file with `RAYON_NUM_THREADS=8`, so the global
//! pool has 8 workers whatever the core count.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use kvstore::{cpu, KvStore, NDArray, Updater};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

/// Far longer than any of these tests takes on a loaded 2-core machine.
const BOUND: Duration = Duration::from_secs(120);

/// Runs `body` on its own thread; panics if it panics or does not finish within [`BOUND`].
fn bounded(what: &str, body: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        body();
        let _ = tx.send(());
    });
    match rx.recv_timeout(BOUND) {
        Ok(()) => worker.join().expect("the test body panicked"),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            // The body panicked before sending: report its panic.
            if let Err(panic) = worker.join() {
                std::panic::resume_unwind(panic);
            }
        }
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what}: did not finish within {BOUND:?}: deadlock")
        }
    }
}

/// Small random integers as f32, so every sum is exact in any order.
fn random_ints(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-8..=8) as f32).collect()
}

/// Keys, and elements per key: 512 Ki f32 = 2 MiB per value, far above the 1 MiB of traffic
/// from which a push or pull splits its work across threads.
const KEYS: usize = 6;
const ELEMS: usize = 512 << 10;

/// One task's work: push two values to `key`, then pull it. Returns what it pushed (summed).
struct Task {
    key: usize,
    values: [NDArray; 2],
    sum: Vec<f32>,
}

fn tasks(rng: &mut StdRng, n: usize) -> Vec<Task> {
    (0..n)
        .map(|t| {
            let a = random_ints(rng, ELEMS);
            let b = random_ints(rng, ELEMS);
            let sum = a.iter().zip(&b).map(|(x, y)| x + y).collect();
            Task {
                key: t % KEYS,
                values: [
                    NDArray::from_vec(a, [ELEMS]).unwrap(),
                    NDArray::from_vec(b, [ELEMS])
                        .unwrap()
                        .to_device(cpu(1))
                        .unwrap(),
                ],
                sum,
            }
        })
        .collect()
}

/// A store whose updater adds every push into the stored value, and the initial values.
fn store(rng: &mut StdRng) -> (KvStore, Vec<Vec<f32>>) {
    let kv = KvStore::create("local").unwrap();
    kv.set_updater(Updater::Axpby { a: 1.0, b: 1.0 }).unwrap();
    let init: Vec<Vec<f32>> = (0..KEYS).map(|_| random_ints(rng, ELEMS)).collect();
    for (k, v) in init.iter().enumerate() {
        kv.init(k as i32, &NDArray::from_vec(v.clone(), [ELEMS]).unwrap())
            .unwrap();
    }
    (kv, init)
}

/// One task on the store: a push, a pull, and a list push of the same key twice.
fn run(kv: &KvStore, t: &Task) {
    let key = t.key as i32;
    kv.push(key, &t.values[..]).unwrap();
    let out = NDArray::zeros([ELEMS]);
    kv.pull(key, &out).unwrap();
    // The same key from two entries of one list call: both values are summed into it.
    kv.push_list(&[key, key], &[&t.values[0], &t.values[1]])
        .unwrap();
}

/// Every key must hold its initial value plus twice the sum of every task's values for it.
fn check<'a>(kv: &KvStore, init: &[Vec<f32>], tasks: impl IntoIterator<Item = &'a Task>) {
    let mut expected = init.to_vec();
    for t in tasks {
        for (e, s) in expected[t.key].iter_mut().zip(&t.sum) {
            *e += 2.0 * s;
        }
    }
    for (k, want) in expected.iter().enumerate() {
        let out = NDArray::full([ELEMS], f64::NAN);
        kv.pull(k as i32, &out).unwrap();
        assert!(
            out.to_vec::<f32>().unwrap() == *want,
            "key {k} lost or doubled a push"
        );
    }
}

/// Pushes and pulls from `par_iter()` inside an explicitly built 8-thread pool, with several
/// tasks per key.
#[test]
fn store_calls_from_an_8_thread_rayon_pool_finish() {
    bounded("store calls from an 8-thread pool", || {
        let mut rng = StdRng::from_entropy();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(8)
            .build()
            .unwrap();
        for _round in 0..3 {
            let (kv, init) = store(&mut rng);
            let tasks = tasks(&mut rng, 4 * KEYS);
            pool.install(|| tasks.par_iter().for_each(|t| run(&kv, t)));
            check(&kv, &init, &tasks);
        }
    });
}

/// The same from the global pool (its size honours `RAYON_NUM_THREADS`), while two plain
/// threads push the same keys at the same time.
#[test]
fn store_calls_from_the_global_pool_and_plain_threads_finish() {
    bounded("store calls from the global pool", || {
        let mut rng = StdRng::from_entropy();
        for _round in 0..3 {
            let (kv, init) = store(&mut rng);
            let kv = Arc::new(kv);
            let pool_tasks = Arc::new(tasks(&mut rng, 4 * KEYS));
            let plain: Vec<Arc<Vec<Task>>> =
                (0..2).map(|_| Arc::new(tasks(&mut rng, KEYS))).collect();
            let threads: Vec<_> = plain
                .iter()
                .map(|ts| {
                    let (kv, ts) = (kv.clone(), ts.clone());
                    std::thread::spawn(move || ts.iter().for_each(|t| run(&kv, t)))
                })
                .collect();
            pool_tasks.par_iter().for_each(|t| run(&kv, t));
            for t in threads {
                t.join().unwrap();
            }
            let all = pool_tasks.iter().chain(plain.iter().flat_map(|p| p.iter()));
            check(&kv, &init, all);
        }
    });
}

/// `a.add_scaled(&b)` on two threads and `b.add_scaled(&a)` on two others (and the same
/// through `+=` and `-=`), many times. Before the fix, each call locked its operand, then
/// itself, and this hung within seconds.
#[test]
fn add_scaled_in_opposite_orders_from_two_threads_finishes() {
    bounded("add_scaled in opposite orders", || {
        let mut rng = StdRng::from_entropy();
        let a = NDArray::from_vec(random_ints(&mut rng, 16), [16]).unwrap();
        let b = NDArray::from_vec(random_ints(&mut rng, 16), [16]).unwrap();
        let iters = 200_000;
        let spawn = |x: NDArray, y: NDArray| {
            std::thread::spawn(move || {
                let mut x2 = x.clone();
                for i in 0..iters {
                    if i % 2 == 0 {
                        x.add_scaled(&y, 0.5).unwrap();
                        x.add_scaled(&y, -0.5).unwrap();
                    } else {
                        x2 += &y;
                        x2 -= &y;
                    }
                }
            })
        };
        let threads = [
            spawn(a.clone(), b.clone()),
            spawn(b.clone(), a.clone()),
            spawn(a.clone(), b.clone()),
            spawn(b.clone(), a.clone()),
        ];
        // What matters is that every call returns; the values themselves depend on the
        // interleaving (and may overflow to infinity), so they are not checked.
        for t in threads {
            t.join().unwrap();
        }
    });
}
