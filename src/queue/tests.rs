//! [`AsyncKvStore`] on a local store and on loopback ranks: the same values as synchronous
//! calls, calls that return before they run, priority order, and errors at the wait.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::prelude::*;

use super::AsyncKvStore;
use crate::store::loopback_tests::stores;
use crate::{Error, Key, KvStore, NDArray, Sgd, Updater};

/// A bound on every wait of these tests for something the worker should do (never reached
/// when the code is right; a test that reaches it fails instead of hanging).
const BOUND: Duration = Duration::from_secs(20);

fn sgd() -> Updater {
    Updater::Sgd(Sgd {
        lr: 0.25,
        momentum: 0.5,
        wd: 0.125,
        ..Sgd::default()
    })
}

/// Random multiples of 1/4 in [-8, 8]: their float32 sums are exact in any order.
fn quarters(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| rng.gen_range(-32..=32) as f32 / 4.0)
        .collect()
}

fn array(v: Vec<f32>) -> NDArray {
    let n = v.len();
    NDArray::from_vec(v, [n]).unwrap()
}

/// One call of a random program: (op, keys, one value per key and device, priority).
#[derive(Clone, Debug)]
struct Call {
    op: &'static str,
    keys: Vec<i32>,
    values: Vec<Vec<Vec<f32>>>,
    priority: i32,
}

const LENS: [usize; 4] = [3, 1, 17, 5];

fn program(rng: &mut StdRng, calls: usize) -> Vec<Call> {
    (0..calls)
        .map(|_| {
            let op = ["push", "pull", "pushpull"][rng.gen_range(0..3)];
            let n = rng.gen_range(1..4);
            // Repeats allowed: a list call sums a repeated key's values.
            let keys: Vec<i32> = (0..n)
                .map(|_| rng.gen_range(0..LENS.len() as i32))
                .collect();
            let values = keys
                .iter()
                .map(|&k| {
                    let devices = rng.gen_range(1..3);
                    (0..devices)
                        .map(|_| quarters(rng, LENS[k as usize]))
                        .collect()
                })
                .collect();
            Call {
                op,
                keys,
                values,
                priority: rng.gen_range(-2..3),
            }
        })
        .collect()
}

fn initialized(kind: &str, rng: &mut StdRng) -> KvStore {
    let kv = KvStore::create(kind).unwrap();
    let keys: Vec<i32> = (0..LENS.len() as i32).collect();
    let values: Vec<NDArray> = LENS.iter().map(|&n| array(quarters(rng, n))).collect();
    kv.init_list(&keys, &values).unwrap();
    kv.set_updater(sgd()).unwrap();
    kv
}

/// The outs a call pulls into: one zeroed array per key (a pushpull also pulls).
fn outs(call: &Call) -> Vec<NDArray> {
    call.keys
        .iter()
        .map(|&k| NDArray::zeros([LENS[k as usize]]))
        .collect()
}

fn values(call: &Call) -> Vec<Vec<NDArray>> {
    (call.values.iter())
        .map(|per_device| per_device.iter().cloned().map(array).collect())
        .collect()
}

/// Every call's pulled values, and the store's final values, run synchronously.
fn run_sync(kv: &KvStore, program: &[Call]) -> (Vec<Vec<Vec<f32>>>, Vec<Vec<f32>>) {
    let mut pulled = Vec::new();
    for c in program {
        let o = outs(c);
        match c.op {
            "push" => kv.push_list(&c.keys, &values(c)).unwrap(),
            "pull" => kv.pull_list(&c.keys, &o).unwrap(),
            _ => kv.pushpull_list(&c.keys, &values(c), &o).unwrap(),
        }
        pulled.push(o.iter().map(|a| a.to_vec().unwrap()).collect());
    }
    (pulled, finals(kv))
}

/// The same, queued: every call issued at once, then one wait.
fn run_async(kv: &AsyncKvStore, program: &[Call]) -> (Vec<Vec<Vec<f32>>>, Vec<Vec<f32>>) {
    run_queued(kv, program, || {})
}

/// The program queued, with `after_each()` after each call is queued, then one wait.
fn run_queued(
    kv: &AsyncKvStore,
    program: &[Call],
    mut after_each: impl FnMut(),
) -> (Vec<Vec<Vec<f32>>>, Vec<Vec<f32>>) {
    let mut all_outs = Vec::new();
    for c in program {
        let o = outs(c);
        match c.op {
            "push" => kv.push_list(&c.keys, &values(c), c.priority),
            "pull" => kv.pull_list(&c.keys, &o, c.priority),
            _ => kv.pushpull_list(&c.keys, &values(c), &o, c.priority),
        }
        all_outs.push(o);
        after_each();
    }
    kv.wait_all().unwrap();
    let pulled = (all_outs.iter())
        .map(|o| o.iter().map(|a| a.to_vec().unwrap()).collect())
        .collect();
    (pulled, finals(kv.store()))
}

fn finals(kv: &KvStore) -> Vec<Vec<f32>> {
    (0..LENS.len() as i32)
        .map(|k| {
            let out = NDArray::zeros([LENS[k as usize]]);
            kv.pull(k, &out).unwrap();
            out.to_vec().unwrap()
        })
        .collect()
}

/// Random programs with random priorities: a local store reorders calls on different keys,
/// but every pull sees what the synchronous calls in issue order give, bit for bit.
#[test]
fn queued_calls_equal_the_same_calls_made_synchronously() {
    let mut rng = StdRng::from_entropy();
    for round in 0..20 {
        let seed = rng.gen();
        let p = program(&mut StdRng::seed_from_u64(seed), 1 + round * 2);
        let want = run_sync(&initialized("local", &mut StdRng::seed_from_u64(seed)), &p);
        let kv = AsyncKvStore::new(initialized("local", &mut StdRng::seed_from_u64(seed)));
        assert_eq!(run_async(&kv, &p), want, "seed {seed}: {p:?}");
    }
}

/// A store whose custom updater, on key 0, says it has started (`entered`) and waits for the
/// test's go (bounded); it records the keys it updates.
fn gated_store(keys: &[i32]) -> (KvStore, Gate, Arc<Mutex<Vec<Key>>>) {
    let kv = KvStore::create("local").unwrap();
    let values: Vec<NDArray> = keys.iter().map(|_| NDArray::zeros([2])).collect();
    kv.init_list(keys, &values).unwrap();
    let (go, gate) = mpsc::channel::<()>();
    let (tell, entered) = mpsc::channel::<()>();
    let gate = Mutex::new((gate, tell));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    kv.set_updater(Updater::custom(move |key, input, stored| {
        if *key == Key::Int(0) {
            let gate = gate.lock().unwrap();
            gate.1.send(()).unwrap();
            gate.0
                .recv_timeout(BOUND)
                .expect("the test's go, sent only after the push returned");
        }
        log.lock().unwrap().push(key.clone());
        *stored += input;
    }))
    .unwrap();
    (kv, Gate { go, entered }, seen)
}

/// The test's side of [`gated_store`]'s gate.
struct Gate {
    go: mpsc::Sender<()>,
    entered: mpsc::Receiver<()>,
}

/// A push returns before it runs: the updater of key 0 waits for a go the test sends only
/// after `push` returned, so a synchronous push would never return (the updater would give up
/// after the bound, and the test fail).
#[test]
fn a_push_returns_before_its_update_runs() {
    let (kv, gate, seen) = gated_store(&[0, 1]);
    let kv = AsyncKvStore::new(kv);
    kv.push(0, &NDArray::ones([2]), 0);
    kv.push(1, &NDArray::full([2], 2.0), 0);
    assert!(
        seen.lock().unwrap().is_empty(),
        "an update ran before the go"
    );
    gate.go.send(()).unwrap();
    kv.wait(1).unwrap();
    let out = NDArray::zeros([2]);
    kv.pull(0, &out, 0);
    kv.wait(0).unwrap();
    assert_eq!(out.to_vec::<f32>().unwrap(), vec![1.0, 1.0]);
    assert_eq!(*seen.lock().unwrap(), vec![Key::Int(0), Key::Int(1)]);
}

/// While the worker is held on key 0, calls queue; then they run by priority, except that no
/// call passes an older call on its key.
#[test]
fn a_local_store_runs_waiting_calls_by_priority_keeping_each_keys_order() {
    let (kv, gate, seen) = gated_store(&[0, 1, 2, 3]);
    let kv = AsyncKvStore::new(kv);
    let g = NDArray::ones([2]);
    kv.push(0, &g, 0); // holds the worker
    gate.entered.recv_timeout(BOUND).unwrap();
    kv.push(1, &g, -5);
    kv.push(2, &g, 1);
    kv.push(1, &g, 9); // high, but after the push of 1 at -5
    kv.push(3, &g, 4);
    gate.go.send(()).unwrap();
    kv.wait_all().unwrap();
    let order: Vec<Key> = [0, 3, 2, 1, 1].into_iter().map(Key::Int).collect();
    assert_eq!(*seen.lock().unwrap(), order);
}

/// An unknown key fails its call at the wait, naming the call; later calls are not run until
/// `wait_all` has returned the failure, and then run again. Keys of no failed call wait fine.
#[test]
fn an_error_surfaces_at_the_wait_and_stops_later_calls_until_wait_all() {
    let kv = AsyncKvStore::new(initialized("local", &mut StdRng::from_entropy()));
    let before = finals(kv.store());
    // Gradients of 2: with weight decay 0.125 the update is 2 + w / 8, never 0 for the initial
    // values in [-8, 8] (a gradient of 1 left a value of -8 unchanged, a test that failed one
    // run in 65).
    let g = NDArray::full([LENS[0]], 2.0);
    kv.push(0, &g, 0);
    kv.wait(0).unwrap();
    let after_first = finals(kv.store());
    kv.pull(99, &g, 0); // unknown
    kv.push(0, &g, 0); // not run
    kv.push(1, &NDArray::full([LENS[1]], 2.0), 0); // not run
    kv.wait(2).unwrap(); // no call on key 2 failed
    let e = kv.wait(0).unwrap_err();
    match &e {
        Error::Async { call, skipped, .. } => {
            assert!(call.contains("pull [99]"), "{e}");
            // The push of key 1 may not have been reached yet.
            assert!((1..=2).contains(skipped), "{e}");
        }
        other => panic!("expected Error::Async, got {other:?}"),
    }
    assert!(matches!(e.root(), Error::UnknownKey { .. }), "{e}");
    let e = kv.wait_all().unwrap_err();
    assert!(matches!(e, Error::Async { skipped: 2, .. }), "{e}");
    assert!(
        e.to_string().contains("2 later call(s) were not run"),
        "{e}"
    );
    assert_eq!(finals(kv.store()), after_first);
    assert_ne!(after_first, before);
    // Returned once: the queue runs again.
    kv.push(1, &NDArray::full([LENS[1]], 2.0), 0);
    kv.wait_all().unwrap();
    assert_ne!(finals(kv.store())[1], after_first[1]);
}

/// A key that does not convert, and a call that panics, fail at the wait too.
#[test]
fn a_bad_key_and_a_panicking_call_are_errors_at_the_wait() {
    let kv = AsyncKvStore::new(KvStore::create("local").unwrap());
    kv.push(1i64 << 40, &NDArray::ones([1]), 0);
    let e = kv.wait_all().unwrap_err();
    assert!(matches!(e, Error::Async { .. }), "{e}");
    kv.submit("call", vec![Key::Int(4)], 0, |_| panic!("boom"));
    let e = kv.wait(4).unwrap_err();
    assert!(matches!(e.root(), Error::Internal { .. }), "{e}");
    assert!(e.to_string().contains("boom"), "{e}");
    kv.wait_all().unwrap_err();
    kv.wait_all().unwrap();
}

/// The timeline records each call once, in the order they finished, with the call's words.
#[test]
fn the_timeline_records_every_call() {
    let kv = AsyncKvStore::new(initialized("local", &mut StdRng::from_entropy()));
    kv.set_timeline(true);
    kv.push_list(
        &[0, 1],
        &[NDArray::ones([LENS[0]]), NDArray::ones([LENS[1]])],
        0,
    );
    kv.pull(9, &NDArray::zeros([1]), 0);
    kv.wait_all().unwrap_err();
    let t = kv.take_timeline();
    assert_eq!(t.len(), 2);
    assert_eq!((t[0].call.as_str(), t[0].ok), ("#1 push [0, 1]", true));
    assert_eq!((t[1].call.as_str(), t[1].ok), ("#2 pull [9]", false));
    assert!(t
        .iter()
        .all(|s| s.queued <= s.started && s.started <= s.finished));
    assert!(kv.take_timeline().is_empty());
}

/// Dropping the store runs what is queued.
#[test]
fn a_dropped_store_runs_its_queued_calls() {
    let inner = Arc::new(initialized("local", &mut StdRng::from_entropy()));
    let before = finals(&inner);
    let kv = AsyncKvStore::new(inner.clone());
    kv.push(2, &NDArray::ones([LENS[2]]), 0);
    drop(kv);
    assert_ne!(finals(&inner)[2], before[2]);
}

/// On loopback ranks, queued calls run in issue order whatever their priorities, so the ranks'
/// calls pair up: every rank pulls what a local store gives the summed pushes.
#[test]
fn queued_calls_on_loopback_ranks_equal_a_local_store() {
    let mut rng = StdRng::from_entropy();
    for n in [2, 3] {
        let seed: u64 = rng.gen();
        let p = program(&mut StdRng::seed_from_u64(seed), 12);
        // Every rank pushes the whole of each value: the local reference pushes n copies.
        let local_p: Vec<Call> = (p.iter().cloned())
            .map(|mut c| {
                for v in &mut c.values {
                    *v = v.iter().cycle().take(v.len() * n).cloned().collect();
                }
                c
            })
            .collect();
        let want = run_sync(
            &initialized("local", &mut StdRng::seed_from_u64(seed)),
            &local_p,
        );
        let ranks = stores(n);
        let got: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (ranks.into_iter().enumerate())
                .map(|(r, kv)| {
                    let p = &p;
                    s.spawn(move || {
                        let mut init = StdRng::seed_from_u64(seed);
                        let keys: Vec<i32> = (0..LENS.len() as i32).collect();
                        let first: Vec<NDArray> = LENS
                            .iter()
                            .map(|&n| array(quarters(&mut init, n)))
                            .collect();
                        kv.init_list(&keys, &first).unwrap();
                        kv.set_updater(sgd()).unwrap();
                        let kv = AsyncKvStore::new(kv);
                        // Rank 0's worker is held until its whole program is queued, while the
                        // others queue one call at a time and wait for it: queues that differ
                        // between the ranks, as they do when ranks compute at different speeds.
                        let (go, gate) = mpsc::channel::<()>();
                        if r == 0 {
                            kv.submit("call", Vec::new(), 0, move |_| {
                                gate.recv_timeout(BOUND).map_err(|e| Error::Internal {
                                    op: "hold",
                                    message: e.to_string(),
                                })
                            });
                        }
                        let mut queued = 0;
                        run_queued(&kv, p, || {
                            queued += 1;
                            if r != 0 {
                                kv.wait_all().unwrap();
                            } else if queued == p.len() {
                                let _ = go.send(());
                            }
                        })
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, g) in got.into_iter().enumerate() {
            assert_eq!(g, want, "rank {r} of {n}, seed {seed}");
        }
    }
}

/// One rank's queued call has bad input: every rank's wait returns an error, no rank stored
/// anything from that call or the calls after it, and after `wait_all` the ranks go on
/// together.
#[test]
fn one_ranks_bad_queued_call_fails_every_rank_and_stops_the_later_calls() {
    let n = 3;
    let ranks = stores(n);
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (ranks.into_iter().enumerate())
            .map(|(r, kv)| {
                s.spawn(move || {
                    kv.init_list(&[0, 1], &[NDArray::zeros([3]), NDArray::zeros([2])])
                        .unwrap();
                    let kv = AsyncKvStore::new(kv);
                    kv.push(0, &NDArray::ones([3]), 0);
                    let bad = if r == 1 { 4 } else { 3 };
                    kv.push(0, &NDArray::ones([bad]), 0);
                    kv.push(1, &NDArray::ones([2]), 0);
                    let failed = kv.wait_all().unwrap_err();
                    let mid = finals2(kv.store());
                    kv.push(1, &NDArray::full([2], 2.0), 0);
                    kv.wait_all().unwrap();
                    (failed, mid, finals2(kv.store()))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, (failed, mid, end)) in results.into_iter().enumerate() {
        match r {
            1 => assert!(
                matches!(failed.root(), Error::ShapeMismatch { .. }),
                "{failed}"
            ),
            _ => assert!(
                matches!(failed.root(), Error::RankRejected { .. }),
                "{failed}"
            ),
        }
        assert!(
            matches!(&failed, Error::Async { skipped: 1, .. }),
            "{failed}"
        );
        let n = n as f32;
        assert_eq!(mid, vec![vec![n; 3], vec![0.0; 2]], "rank {r}");
        assert_eq!(end, vec![vec![n; 3], vec![2.0 * n; 2]], "rank {r}");
    }
}

/// Keys 0 (3 elements) and 1 (2 elements) of the loopback test above.
fn finals2(kv: &KvStore) -> Vec<Vec<f32>> {
    [(0, 3), (1, 2)]
        .into_iter()
        .map(|(k, len)| {
            let out = NDArray::zeros([len]);
            kv.pull(k, &out).unwrap();
            out.to_vec().unwrap()
        })
        .collect()
}

/// A custom updater that waits on the queue running it gets an error, not a hang.
#[test]
fn a_wait_from_inside_a_queued_call_is_an_error_not_a_hang() {
    let kv = KvStore::create("local").unwrap();
    kv.init(0, &NDArray::zeros([2])).unwrap();
    let handle: Arc<Mutex<Option<Arc<AsyncKvStore>>>> = Arc::new(Mutex::new(None));
    let seen = Arc::new(Mutex::new(None));
    let (h, log) = (handle.clone(), seen.clone());
    kv.set_updater(Updater::custom(move |_, input, stored| {
        let q = h.lock().unwrap().clone().expect("the queue");
        *log.lock().unwrap() = Some(q.wait_all().map_err(|e| e.to_string()));
        *stored += input;
    }))
    .unwrap();
    let q = Arc::new(AsyncKvStore::new(kv));
    *handle.lock().unwrap() = Some(q.clone());
    q.push(0, &NDArray::ones([2]), 0);
    q.wait(0).unwrap();
    let got = seen.lock().unwrap().take().expect("the updater ran");
    assert!(got.unwrap_err().contains("wait for itself"));
    *handle.lock().unwrap() = None; // the updater's handle, so the queue is dropped here
}

/// A queued call that drops the last handle of its own queue (an updater holding it) does not
/// panic: the worker finishes the queue on its own.
#[test]
fn a_queue_dropped_by_its_own_call_finishes_its_calls() {
    let kv = KvStore::create("local").unwrap();
    kv.init(0, &NDArray::zeros([2])).unwrap();
    let handle: Arc<Mutex<Option<AsyncKvStore>>> = Arc::new(Mutex::new(None));
    let h = handle.clone();
    kv.set_updater(Updater::custom(move |_, input, stored| {
        // The last handle of the queue, dropped on its own worker (a panic here would fail
        // the push, and the sum below would miss it).
        drop(h.lock().unwrap().take());
        *stored += input;
    }))
    .unwrap();
    let kv = Arc::new(kv);
    let q = AsyncKvStore::new(kv.clone());
    let (go, gate) = mpsc::channel::<()>();
    // Held until the handle is in place, so the updater finds it.
    q.submit("call", Vec::new(), 0, move |_| {
        gate.recv_timeout(BOUND).map_err(|e| Error::Internal {
            op: "hold",
            message: e.to_string(),
        })
    });
    q.push(0, &NDArray::ones([2]), 0);
    q.push(0, &NDArray::ones([2]), 0);
    *handle.lock().unwrap() = Some(q);
    go.send(()).unwrap();
    let out = NDArray::zeros([2]);
    for _ in 0..2000 {
        kv.pull(0, &out).unwrap();
        if out.to_vec::<f32>().unwrap() == vec![2.0, 2.0] {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!(
        "the queued pushes did not both run: {:?}",
        out.to_vec::<f32>().unwrap()
    );
}
