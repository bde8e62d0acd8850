//! The distributed rules on the loopback link: N ranks as N threads, in `cargo test`.
//!
//! - `a_random_program_on_n_ranks_equals_one_local_store`: random sequences of calls (init,
//!   push, pull, pushpull, broadcast, lists with repeated keys, updaters, learning rates,
//!   save and load) with random per-rank splits of the pushed values, on 1 to 5 ranks, must
//!   give every rank what a single `local` store gives at every pull.
//! - `one_rank_differing_in_one_field_fails_every_rank`: one rank's call differs in one field;
//!   every rank must get an error, and no rank may store anything.
//!
//! Pushed values are multiples of 1/4 of at most 8 in magnitude, so their float32 sums are
//! exact in any order: the ranks sum in another order than the local store does, and the
//! results must still be equal bit for bit.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use crate::comm::link::loopback::Loopback;
use crate::{Adam, Error, KvStore, NDArray, Sgd, Updater};

/// Keys of more elements than this are sliced over every rank in these tests.
pub(super) const BOUND: usize = 8;

/// The loopback stores of `n` ranks, one per rank (created together: creating one is a call
/// of every rank).
pub(crate) fn stores(n: usize) -> Vec<KvStore> {
    stores_on(Lane::Host, n)
}

/// How the values of a loopback world's stores cross its ranks.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Lane {
    /// In host buffers, as ranks that keep their values in host memory move them.
    Host,
    /// In place in the arrays that hold them, as GPU ranks move theirs (here in host memory).
    InPlace,
}

/// [`stores`], crossing ranks as `lane` says.
pub(crate) fn stores_on(lane: Lane, n: usize) -> Vec<KvStore> {
    let links = Loopback::world(n, Duration::from_secs(10));
    let links: Vec<Loopback> = match lane {
        Lane::Host => links,
        Lane::InPlace => links.into_iter().map(Loopback::moving_in_place).collect(),
    };
    on_links(&links, |_, l| {
        KvStore::over_loopback(l.clone(), BOUND).expect("a store")
    })
}

/// Runs `f` on every rank's link, each in its own thread; the results in rank order.
pub(super) fn on_links<R: Send>(
    links: &[Loopback],
    f: impl Fn(usize, &Loopback) -> R + Sync,
) -> Vec<R> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (links.iter().enumerate())
            .map(|(r, l)| {
                let f = &f;
                s.spawn(move || f(r, l))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    })
}

/// Runs `f` on every rank's store, each in its own thread; the results in rank order.
pub(super) fn on_ranks<R: Send>(
    stores: &[KvStore],
    f: impl Fn(usize, &KvStore) -> R + Sync,
) -> Vec<R> {
    std::thread::scope(|s| {
        let handles: Vec<_> = stores
            .iter()
            .enumerate()
            .map(|(r, kv)| {
                let f = &f;
                s.spawn(move || f(r, kv))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    })
}

/// A fresh directory under the system's temporary directory.
fn temp_dir(what: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "kvstore-loopback-{what}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    dir
}

/// One call of a random program.
#[derive(Clone, Debug)]
enum Call {
    /// A push of each key's values: `(key, values, the rank each value is pushed from)`.
    Push(Vec<(i32, Vec<Vec<f32>>, Vec<usize>)>),
    /// A pull of the keys.
    Pull(Vec<i32>),
    /// A pushpull of each key's values into a fresh out.
    PushPull(Vec<(i32, Vec<Vec<f32>>, Vec<usize>)>),
    /// A new updater.
    SetUpdater(Updater),
    /// A new learning rate, keeping the state.
    SetLr(f64),
    /// A save of every key, then a load of it.
    SaveLoad,
}

/// Key sizes: whole keys, and keys above [`BOUND`] that are sliced (one not a multiple of any
/// rank count above 1).
const SIZES: [usize; 5] = [3, 1, 8, 20, 37];

fn grad(len: usize) -> impl Strategy<Value = Vec<f32>> {
    proptest::collection::vec((-32i32..=32).prop_map(|q| q as f32 / 4.0), len)
}

fn key_values(ranks: usize) -> impl Strategy<Value = (i32, Vec<Vec<f32>>, Vec<usize>)> {
    (0..SIZES.len() as i32).prop_flat_map(move |k| {
        let len = SIZES[k as usize];
        (1..4usize).prop_flat_map(move |n| {
            (
                Just(k),
                proptest::collection::vec(grad(len), n),
                proptest::collection::vec(0..ranks, n),
            )
        })
    })
}

fn updater() -> impl Strategy<Value = Updater> {
    prop_oneof![
        Just(Updater::Assign),
        (1u32..8, 0u32..3).prop_map(|(lr, m)| Updater::Sgd(Sgd {
            lr: f64::from(lr) / 16.0,
            momentum: f64::from(m) / 4.0,
            ..Sgd::default()
        })),
        (1u32..8).prop_map(|lr| Updater::Adam(Adam {
            lr: f64::from(lr) / 64.0,
            ..Adam::default()
        })),
    ]
}

fn call(ranks: usize) -> impl Strategy<Value = Call> {
    let keys = proptest::collection::vec(0..SIZES.len() as i32, 1..4);
    prop_oneof![
        4 => proptest::collection::vec(key_values(ranks), 1..4).prop_map(Call::Push),
        2 => keys.prop_map(Call::Pull),
        2 => proptest::collection::vec(key_values(ranks), 1..3).prop_map(Call::PushPull),
        1 => updater().prop_map(Call::SetUpdater),
        1 => (1u32..8).prop_map(|lr| Call::SetLr(f64::from(lr) / 32.0)),
        1 => Just(Call::SaveLoad),
    ]
}

/// The keys' initial values.
fn initial() -> Vec<NDArray> {
    SIZES
        .iter()
        .enumerate()
        .map(|(k, &n)| {
            let v: Vec<f32> = (0..n).map(|i| (i as f32 - k as f32) / 8.0).collect();
            NDArray::from_vec(v, [n]).expect("an array")
        })
        .collect()
}

/// The values of a pull of `keys`, or the error.
fn pull(kv: &KvStore, keys: &[i32]) -> Result<Vec<Vec<f32>>, Error> {
    let outs: Vec<NDArray> = keys
        .iter()
        .map(|&k| NDArray::full([SIZES[k as usize]], f32::NAN as f64))
        .collect();
    kv.pull_list(keys, &outs)?;
    outs.iter().map(|o| o.to_vec::<f32>()).collect()
}

/// Runs `call` on one store: rank `rank` of a store whose ranks split pushed values as the
/// call says, or the local reference (`rank` None: every value). Returns what it pulled.
fn run(kv: &KvStore, rank: Option<usize>, call: &Call, dir: &Path) -> Result<Vec<Vec<f32>>, Error> {
    let mine = |(k, vals, from): &(i32, Vec<Vec<f32>>, Vec<usize>)| {
        let vals: Vec<NDArray> = vals
            .iter()
            .zip(from)
            .filter(|(_, &r)| rank.is_none_or(|me| me == r))
            .map(|(v, _)| NDArray::from_vec(v.clone(), [v.len()]).expect("an array"))
            .collect();
        (*k, vals)
    };
    match call {
        Call::Push(kvs) | Call::PushPull(kvs) => {
            // A rank with no value of a key pushes zeros: its sum adds nothing.
            let (keys, vals): (Vec<i32>, Vec<Vec<NDArray>>) = kvs
                .iter()
                .map(mine)
                .map(|(k, mut v)| {
                    if v.is_empty() {
                        v.push(NDArray::zeros([SIZES[k as usize]]));
                    }
                    (k, v)
                })
                .unzip();
            if let Call::Push(_) = call {
                kv.push_list(&keys, &vals)?;
                return Ok(Vec::new());
            }
            let outs: Vec<NDArray> = keys
                .iter()
                .map(|&k| NDArray::full([SIZES[k as usize]], f32::NAN as f64))
                .collect();
            kv.pushpull_list(&keys, &vals, &outs)?;
            outs.iter().map(|o| o.to_vec::<f32>()).collect()
        }
        Call::Pull(keys) => pull(kv, keys),
        Call::SetUpdater(u) => kv.set_updater(u.clone()).map(|()| Vec::new()),
        Call::SetLr(lr) => match kv.set_learning_rate(*lr) {
            // Not an SGD or Adam updater: nothing to set, on every store alike.
            Err(Error::InvalidUpdater(_)) => Ok(Vec::new()),
            r => r.map(|()| Vec::new()),
        },
        Call::SaveLoad => {
            let path = match rank {
                Some(_) => dir.join("sharded"),
                None => dir.join("local.kvckpt"),
            };
            kv.save(&path)?;
            kv.load(&path)?;
            Ok(Vec::new())
        }
    }
}

/// Runs `program` on `n` loopback ranks and on a local store; checks every pull.
fn check_program(n: usize, program: &[Call]) -> Result<(), TestCaseError> {
    check_program_on(Lane::Host, n, program)
}

/// [`check_program`], with the ranks' values crossing as `lane` says.
fn check_program_on(lane: Lane, n: usize, program: &[Call]) -> Result<(), TestCaseError> {
    let dir = temp_dir("program");
    let keys: Vec<i32> = (0..SIZES.len() as i32).collect();
    let local = KvStore::create("local").expect("a local store");
    local.init_list(&keys, &initial()).expect("init");
    let ranks = stores_on(lane, n);
    let results = on_ranks(&ranks, |r, kv| {
        kv.init_list(&keys, &initial())?;
        let mut pulled = Vec::new();
        for c in program {
            pulled.push(run(kv, Some(r), c, &dir)?);
        }
        pulled.push(pull(kv, &keys)?);
        Ok::<_, Error>(pulled)
    });
    let mut want = Vec::new();
    for c in program {
        want.push(run(&local, None, c, &dir).expect("the local store"));
    }
    want.push(pull(&local, &keys).expect("pull"));
    let _ = std::fs::remove_dir_all(&dir);
    for (r, got) in results.into_iter().enumerate() {
        let got = got.map_err(|e| TestCaseError::fail(format!("rank {r} of {n}: {e}")))?;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // Compare bits: NaN outs that were never written must not pass as equal.
            let bits = |v: &Vec<Vec<f32>>| -> Vec<Vec<u32>> {
                v.iter()
                    .map(|a| a.iter().map(|x| x.to_bits()).collect())
                    .collect()
            };
            prop_assert_eq!(
                bits(g),
                bits(w),
                "rank {} of {} ({:?}), after call {} ({:?})",
                r,
                n,
                lane,
                i,
                program.get(i)
            );
        }
    }
    Ok(())
}

#[test]
fn a_random_program_on_n_ranks_equals_one_local_store() {
    let mut runner = TestRunner::new(Config {
        cases: 48,
        ..Config::default()
    });
    let strategy =
        (1usize..=5).prop_flat_map(|n| (Just(n), proptest::collection::vec(call(n), 1..12)));
    runner
        .run(&strategy, |(n, program)| check_program(n, &program))
        .unwrap();
}

/// The random programs of [`a_random_program_on_n_ranks_equals_one_local_store`], on ranks
/// that move their values in place, as GPU ranks do (the GPU ranks' way of crossing ranks:
/// packing by home and dtype, reduce-scatter and all-gather of sliced keys, the init's scatter
/// by broadcasts), here on arrays in host memory.
#[test]
fn a_random_program_on_n_ranks_moving_values_in_place_equals_one_local_store() {
    let mut runner = TestRunner::new(Config {
        cases: 32,
        ..Config::default()
    });
    let strategy =
        (1usize..=5).prop_flat_map(|n| (Just(n), proptest::collection::vec(call(n), 1..12)));
    runner
        .run(&strategy, |(n, program)| {
            check_program_on(Lane::InPlace, n, &program)
        })
        .unwrap();
}

/// A whole key and a sliced key, on 3 ranks: the sums and updates of every rank land where
/// the keys live, and every rank pulls the same values as a local store, in host buffers and
/// in place.
#[test]
fn sliced_and_whole_keys_on_3_ranks_equal_a_local_store() {
    let program = vec![
        Call::SetUpdater(Updater::Sgd(Sgd {
            lr: 0.25,
            momentum: 0.5,
            ..Sgd::default()
        })),
        Call::Push(vec![
            (3, vec![vec![1.0; 20], vec![0.5; 20]], vec![0, 2]),
            (0, vec![vec![2.0; 3], vec![-1.0; 3]], vec![1, 1]),
        ]),
        Call::Pull(vec![3, 0]),
        Call::PushPull(vec![(4, vec![vec![0.25; 37]; 3], vec![0, 1, 2])]),
    ];
    check_program_on(Lane::Host, 3, &program).unwrap();
    check_program_on(Lane::InPlace, 3, &program).unwrap();
}

/// Bad input on one rank: that rank gets its own error, the others `RankRejected`, and
/// nothing changes on any rank; the store stays usable.
#[test]
fn one_ranks_bad_input_fails_every_rank_and_changes_nothing() {
    let ranks = stores(3);
    let keys: Vec<i32> = (0..SIZES.len() as i32).collect();
    let errors = on_ranks(&ranks, |r, kv| {
        kv.init_list(&keys, &initial()).unwrap();
        let g = NDArray::ones([if r == 1 { 4 } else { 3 }]);
        let err = kv.push(0, &g).unwrap_err();
        let after = pull(kv, &keys).unwrap();
        kv.push(0, &NDArray::ones([3])).unwrap();
        (err, after)
    });
    let untouched: Vec<Vec<f32>> = initial().iter().map(|a| a.to_vec().unwrap()).collect();
    for (r, (err, after)) in errors.into_iter().enumerate() {
        match r {
            1 => assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}"),
            _ => assert!(matches!(err, Error::RankRejected { .. }), "{err}"),
        }
        assert_eq!(after, untouched, "rank {r} changed");
    }
}

/// A layer above the store that rejects its own input on one rank (a binding that could not
/// convert an argument) tells the others through `reject`: they fail that call with
/// `RankRejected`, nothing changes, and the next call of every rank pairs up as it should.
#[test]
fn a_rejection_from_above_the_store_fails_the_other_ranks_call() {
    let ranks = stores(3);
    let keys: Vec<i32> = (0..SIZES.len() as i32).collect();
    let results = on_ranks(&ranks, |r, kv| {
        kv.init_list(&keys, &initial()).unwrap();
        let first = match r {
            2 => kv.reject("push", "TypeError: a float key"),
            _ => kv.push(0, &NDArray::ones([3])),
        };
        let after = pull(kv, &keys).unwrap();
        kv.push(0, &NDArray::ones([3])).unwrap();
        (first, after, pull(kv, &[0]).unwrap())
    });
    let untouched: Vec<Vec<f32>> = initial().iter().map(|a| a.to_vec().unwrap()).collect();
    for (r, (first, after, last)) in results.into_iter().enumerate() {
        if r != 2 {
            let err = first.unwrap_err();
            assert!(matches!(err, Error::RankRejected { .. }), "{err}");
            assert!(err.to_string().contains("a float key"), "{err}");
        }
        assert_eq!(after, untouched, "rank {r} changed");
        assert_eq!(last, vec![vec![3.0; 3]], "rank {r}: the next push");
    }
}

/// A function pointer or a boxed closure has one type for every function: a dist store refuses
/// it unlabeled (its ranks could not tell two apart), and takes it labeled; a closure passed
/// as itself is named by its own type.
#[test]
fn an_unnamed_function_is_refused_on_more_than_one_rank() {
    fn add(_: &crate::Key, input: &NDArray, stored: &mut NDArray) {
        *stored += input
    }
    type Boxed = Box<dyn Fn(&crate::Key, &NDArray, &mut NDArray) + Send + Sync>;
    let pointer: fn(&crate::Key, &NDArray, &mut NDArray) = add;
    let ranks = stores(2);
    let results = on_ranks(&ranks, |_, kv| {
        let boxed: Boxed = Box::new(|_, input, stored| *stored += input);
        [
            kv.set_updater(Updater::custom(pointer)),
            kv.set_updater(Updater::custom(boxed)),
            kv.set_updater(Updater::custom_labeled("add", pointer)),
            kv.set_updater(Updater::custom(add)),
        ]
    });
    for (r, got) in results.iter().enumerate() {
        for e in [&got[0], &got[1]] {
            let e = e.as_ref().unwrap_err();
            assert!(matches!(e, Error::InvalidUpdater(_)), "rank {r}: {e}");
            assert!(e.to_string().contains("custom_labeled"), "{e}");
        }
        assert!(got[2].is_ok() && got[3].is_ok(), "rank {r}: {got:?}");
    }
    // One rank alone takes any closure.
    let local = KvStore::create("local").unwrap();
    local.set_updater(Updater::custom(pointer)).unwrap();
}

/// After the world failed (here a desync), every later call is `DistFailed`, even one whose
/// input this rank would reject (an unknown key): the first failure is what the user must see.
#[test]
fn after_a_desync_bad_input_is_dist_failed_too() {
    let ranks = stores(2);
    let results = on_ranks(&ranks, |r, kv| {
        kv.init_list(&[0, 1], &[NDArray::zeros([2]), NDArray::zeros([2])])
            .unwrap();
        let desync = kv.push(r as i32, &NDArray::ones([2])).unwrap_err();
        let unknown = kv.pull(7, &NDArray::zeros([2])).unwrap_err();
        let bad_shape = kv.push(0, &NDArray::ones([5])).unwrap_err();
        let from_above = kv.reject("push", "TypeError: not an array").unwrap_err();
        (desync, unknown, bad_shape, from_above)
    });
    for (r, (desync, unknown, bad_shape, from_above)) in results.into_iter().enumerate() {
        assert!(matches!(desync, Error::Desync { .. }), "rank {r}: {desync}");
        for e in [unknown, bad_shape, from_above] {
            assert!(matches!(e, Error::DistFailed { .. }), "rank {r}: {e}");
        }
    }
}

// ---- Ranks that disagree fail, every one of them, and store nothing -----------------------

/// One key's part on one rank: the key, its value, and its step and state buffers.
type Part = (String, Vec<f64>, Option<(u64, Vec<Vec<f64>>)>);

/// This rank's parts of every key (values and state), read where they are: what a call that
/// failed must have left alone.
pub(super) fn snapshot(kv: &KvStore) -> Vec<Part> {
    let (_, _, entries) = kv.export_entries().expect("this rank's parts");
    entries
        .into_iter()
        .map(|e| {
            let state = e
                .state
                .map(|s| (s.step, s.bufs.iter().map(|b| b.to_vec::<f64>()).collect()));
            (e.key.to_string(), e.value.to_vec::<f64>(), state)
        })
        .collect()
}

/// One field in which one rank's call differs from the others'.
#[derive(Clone, Copy, Debug)]
enum Differ {
    /// It pushes to another key of the same shape.
    Key,
    /// It pushes a value of another shape.
    Shape,
    /// It pushes a value of another dtype.
    DType,
    /// It pulls where the others push.
    Op,
    /// Its SGD learning rate differs (changed keeping the state).
    LearningRate,
    /// It set the learning rate (keeping the state) where the others did not.
    SetLearningRate,
    /// It pushes to its second store where the others push to their first.
    Store,
    /// It loads another checkpoint, of the same keys.
    CheckpointPath,
    /// Its custom updater is another closure.
    CustomClosure,
    /// Its custom updater is the same closure, capturing another value it names in its label.
    CustomLabel,
    /// Its PTX updater has the same entry and twin but another module text.
    PtxModule,
    /// Its PTX updater's twin is the same closure, capturing another value it names.
    PtxTwinLabel,
    /// It set another updater before a load (the others set theirs after it, say): the load
    /// would restore state on some ranks and not on others.
    UpdaterAtLoad,
    /// It passes something else to `agree`.
    Agree,
    /// It passes to `agree` the same words with a line break where the others have a space.
    AgreeLineBreak,
}

/// SGD with momentum at learning rate `lr`.
fn sgd(lr: f64) -> Updater {
    Updater::Sgd(Sgd {
        lr,
        momentum: 0.5,
        ..Sgd::default()
    })
}

/// One of two closures, each adding the input to the stored value: the same computation, but
/// the ranks cannot know that, so two closures must fail.
fn custom_closure(other: bool) -> Updater {
    match other {
        true => Updater::custom(|_, input, stored| *stored += input),
        false => Updater::custom(|_, input, stored| *stored += input),
    }
}

/// One closure capturing `scale`, named in its label.
fn scaled_by(scale: f64) -> Updater {
    Updater::custom_labeled(&format!("scale {scale}"), move |_, input, stored| {
        *stored += input * scale
    })
}

/// The example PTX updater, or the same with `sub.rn` for `add.rn` somewhere: another module
/// of the same length.
fn ptx_updater(other: bool) -> Updater {
    let mut ptx = crate::PtxUpdater::EXAMPLE_SGD_F32.to_owned();
    if other {
        ptx = ptx.replacen("add.rn", "sub.rn", 1);
    }
    let p = crate::PtxUpdater::new(ptx, "sgd_f32", crate::DType::F32)
        .expect("the example module")
        .with_scalars([0.1, 0.0, 0.0, 0.0])
        .with_cpu_twin(|_, input, stored| *stored += input * -0.1);
    Updater::Ptx(p)
}

/// The example PTX updater whose CPU twin captures `scale`, named in its label.
fn ptx_twin_scaled(scale: f64) -> Updater {
    let p = crate::PtxUpdater::new(
        crate::PtxUpdater::EXAMPLE_SGD_F32,
        "sgd_f32",
        crate::DType::F32,
    )
    .expect("the example module")
    .with_scalars([0.1, 0.0, 0.0, 0.0])
    .with_cpu_twin_labeled(&format!("scale {scale}"), move |_, input, stored| {
        *stored += input * scale
    });
    Updater::Ptx(p)
}

/// Runs one call on `n` ranks where rank `odd` differs in `differ`; every rank must fail it,
/// and no rank's parts may change.
fn check_differing_call(n: usize, odd: usize, differ: Differ, seed: &[f32]) -> Result<(), String> {
    let dir = temp_dir("differ");
    let worlds = Loopback::world(n, Duration::from_secs(10));
    // Two stores per rank, created in the same order on every rank.
    let both = on_links(&worlds, |_, l| {
        let first = KvStore::over_loopback(l.clone(), BOUND).expect("a store");
        (
            first,
            KvStore::over_loopback(l.clone(), BOUND).expect("a store"),
        )
    });
    let pairs: Vec<(&KvStore, &KvStore)> = both.iter().map(|(a, b)| (a, b)).collect();
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = pairs
            .iter()
            .enumerate()
            .map(|(r, (kv, other))| {
                let dir = &dir;
                s.spawn(move || {
                    let me = r == odd;
                    // Keys 0 and 1 whole, key 2 sliced; values from the seed.
                    let values: Vec<NDArray> = [3usize, 3, 20]
                        .iter()
                        .map(|&len| {
                            let v: Vec<f32> = (0..len).map(|i| seed[i % seed.len()]).collect();
                            NDArray::from_vec(v, [len]).unwrap()
                        })
                        .collect();
                    for store in [kv, other] {
                        store.init_list(&[0, 1, 2], &values).unwrap();
                        store.set_updater(sgd(0.1)).unwrap();
                    }
                    // A push that every rank makes alike, so that there is state to keep.
                    let g = |len: usize| NDArray::full([len], 0.5);
                    kv.push_list(&[0, 2], &[g(3), g(20)]).unwrap();
                    // Two checkpoints of the same keys, with different values.
                    kv.save(dir.join("a")).unwrap();
                    kv.push(2, &g(20)).unwrap();
                    kv.save(dir.join("b")).unwrap();
                    match differ {
                        Differ::SetLearningRate if me => kv.set_learning_rate(0.05).unwrap(),
                        Differ::LearningRate if me => kv.update_hyperparameters(sgd(0.2)).unwrap(),
                        Differ::CustomClosure => kv.set_updater(custom_closure(me)).unwrap(),
                        Differ::CustomLabel => kv
                            .set_updater(scaled_by(if me { 3.0 } else { 2.0 }))
                            .unwrap(),
                        Differ::PtxModule => kv.set_updater(ptx_updater(me)).unwrap(),
                        Differ::PtxTwinLabel => kv
                            .set_updater(ptx_twin_scaled(if me { -0.2 } else { -0.1 }))
                            .unwrap(),
                        Differ::UpdaterAtLoad if me => kv.set_updater(Updater::Assign).unwrap(),
                        _ => {}
                    }
                    let before = snapshot(kv);
                    let got = match differ {
                        Differ::Key if me => kv.push(1, &g(3)),
                        Differ::Shape if me => kv.push(2, &g(21)),
                        Differ::DType if me => {
                            kv.push(2, &g(20).astype(crate::DType::F64).unwrap())
                        }
                        Differ::Op if me => kv.pull(2, &g(20)),
                        Differ::Store if me => other.push(2, &g(20)),
                        Differ::CheckpointPath if me => kv.load(dir.join("b")),
                        Differ::CheckpointPath | Differ::UpdaterAtLoad => kv.load(dir.join("a")),
                        Differ::Agree => kv.agree(if me { "lr 0.2" } else { "lr 0.1" }),
                        Differ::AgreeLineBreak => {
                            kv.agree(if me { "lr 0.1\nwd 0" } else { "lr 0.1 wd 0" })
                        }
                        Differ::Key => kv.push(0, &g(3)),
                        _ => kv.push(2, &g(20)),
                    };
                    let after = snapshot(kv);
                    (got, before == after)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect::<Vec<_>>()
    });
    let _ = std::fs::remove_dir_all(&dir);
    for (r, (got, unchanged)) in results.into_iter().enumerate() {
        if got.is_ok() || !unchanged {
            return Err(format!(
                "{differ:?} on rank {odd} of {n}: rank {r} got {got:?} and {}",
                match unchanged {
                    true => "stored nothing",
                    false => "stored something",
                }
            ));
        }
    }
    Ok(())
}

#[test]
fn one_rank_differing_in_one_field_fails_every_rank() {
    let differs = [
        Differ::Key,
        Differ::Shape,
        Differ::DType,
        Differ::Op,
        Differ::LearningRate,
        Differ::SetLearningRate,
        Differ::Store,
        Differ::CheckpointPath,
        Differ::CustomClosure,
        Differ::CustomLabel,
        Differ::PtxModule,
        Differ::PtxTwinLabel,
        Differ::UpdaterAtLoad,
        Differ::Agree,
        Differ::AgreeLineBreak,
    ];
    let mut runner = TestRunner::new(Config {
        cases: 24,
        ..Config::default()
    });
    let strategy = (2usize..=4).prop_flat_map(move |n| {
        (
            Just(n),
            0..n,
            0..differs.len(),
            proptest::collection::vec((-16i32..16).prop_map(|q| q as f32 / 4.0), 1..5),
        )
    });
    // Every field on 2 ranks first, whatever the random cases pick: every failing field is
    // named at once.
    let failed: Vec<String> = differs
        .iter()
        .filter_map(|&d| check_differing_call(2, 1, d, &[0.25, -1.5]).err())
        .collect();
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    runner
        .run(&strategy, |(n, odd, d, seed)| {
            check_differing_call(n, odd, differs[d], &seed).map_err(TestCaseError::fail)
        })
        .unwrap();
}

/// Int key 3 and string key "3" hash apart, and the desync names both keys with their types.
#[test]
fn an_int_and_a_string_key_of_the_same_digits_are_named_apart() {
    let ranks = stores(2);
    let errors = on_ranks(&ranks, |r, kv| {
        let v = NDArray::ones([2]);
        match r {
            0 => kv.init(3, &v).unwrap_err(),
            _ => kv.init("3", &v).unwrap_err(),
        }
    });
    for e in errors {
        let text = e.to_string();
        assert!(matches!(e, Error::Desync { .. }), "{text}");
        assert!(!text.contains("collision"), "{text}");
        assert!(
            text.contains("key 3 on rank 0") && text.contains("key \"3\" on rank 1"),
            "{text}"
        );
    }
}

/// With the check off (`KVSTORE_DIST_CHECK=0`), a rank that rejects its input cannot tell
/// the others. Its next call must not be matched with the collectives they started for the
/// rejected one: rank 1 rejects a push of key 0 and goes on to push key 1 while rank 0 still
/// waits in its push of key 0. Nothing may succeed with key 0's and key 1's values mixed.
#[test]
fn with_the_check_off_a_rejected_call_never_lets_a_later_call_compute() {
    let links: Vec<Loopback> = Loopback::world(2, Duration::from_millis(1500))
        .into_iter()
        .map(Loopback::unchecked)
        .collect();
    let ranks = on_links(&links, |_, l| {
        KvStore::over_loopback(l.clone(), BOUND).unwrap()
    });
    let results = on_ranks(&ranks, |r, kv| {
        kv.init_list(&[0, 1], &[NDArray::zeros([2]), NDArray::zeros([2])])
            .unwrap();
        let first = match r {
            0 => kv.push(0, &NDArray::full([2], 1.0)),
            _ => kv.push(0, &NDArray::full([3], 1.0)),
        };
        let second = kv.push(1, &NDArray::full([2], 100.0));
        (first, second)
    });
    let (r0, r1) = (&results[0], &results[1]);
    assert!(
        matches!(r1.0, Err(Error::ShapeMismatch { .. })),
        "{:?}",
        r1.0
    );
    assert!(r1.1.is_err(), "rank 1's next push computed: {:?}", r1.1);
    assert!(
        r0.0.is_err(),
        "rank 0's push of key 0 succeeded: {:?}",
        r0.0
    );
}

/// Ranks whose stores are set up differently (here `KVSTORE_BIGARRAY_BOUND`) fail at
/// creation on every rank, naming the setting, instead of slicing keys differently.
#[test]
fn ranks_with_different_settings_fail_at_creation() {
    let links = Loopback::world(3, Duration::from_secs(10));
    let made = on_links(&links, |r, l| {
        KvStore::over_loopback(l.clone(), if r == 2 { BOUND + 1 } else { BOUND })
    });
    for (r, m) in made.into_iter().enumerate() {
        let e = m
            .err()
            .unwrap_or_else(|| panic!("rank {r} created its store"));
        let text = e.to_string();
        assert!(matches!(e, Error::Desync { .. }), "{text}");
        assert!(text.contains("KVSTORE_BIGARRAY_BOUND"), "{text}");
    }
}

/// Ranks that keep their copies current differently (`KVSTORE_REPLICA_UPDATE`), or where one
/// keeps none (`KVSTORE_REPLICAS=0`), fail at creation on every rank: their pushes would run
/// different collectives.
#[test]
fn ranks_that_keep_copies_differently_fail_at_creation() {
    use crate::config::ReplicaUpdate;
    for odd in [Some(ReplicaUpdate::Send), None] {
        let links: Vec<Loopback> = Loopback::world(3, Duration::from_secs(10))
            .into_iter()
            .map(Loopback::elastic)
            .collect();
        let made = on_links(&links, |r, l| {
            let keeping = if r == 1 {
                odd
            } else {
                Some(ReplicaUpdate::Replay)
            };
            KvStore::over_loopback_keeping(l.clone(), BOUND, keeping)
        });
        for (r, m) in made.into_iter().enumerate() {
            let e = m
                .err()
                .unwrap_or_else(|| panic!("{odd:?}: rank {r} created its store"));
            let text = e.to_string();
            assert!(matches!(e, Error::Desync { .. }), "{text}");
            assert!(text.contains("KVSTORE_REPLICA"), "{text}");
        }
    }
}

/// A push whose transfer fails (here rank 1 never joins the reduce-scatter of a sliced key, so
/// rank 0 times out) leaves the caller's pushed array exactly as it was, on every path.
#[test]
fn a_failed_push_never_changes_the_pushed_array() {
    use crate::comm::link::Op;
    let links = Loopback::world(2, Duration::from_millis(1500));
    let links = [
        links[0].clone(),
        links[1].clone().stalling_at(Op::ReduceScatter),
    ];
    let ranks = on_links(&links, |_, l| {
        KvStore::over_loopback(l.clone(), BOUND).unwrap()
    });
    let results = on_ranks(&ranks, |r, kv| {
        kv.init(0, &NDArray::zeros([20])).unwrap();
        let v: Vec<f32> = (0..20).map(|i| i as f32 / 4.0 + r as f32).collect();
        let pushed = NDArray::from_vec(v.clone(), [20]).unwrap();
        let got = kv.push(0, &pushed);
        (got, pushed.to_vec::<f32>().unwrap() == v)
    });
    for (r, (got, kept)) in results.into_iter().enumerate() {
        assert!(got.is_err(), "rank {r}'s push succeeded");
        assert!(kept, "rank {r}'s pushed array changed after {got:?}");
    }
}

/// A stored value owns exactly its size: an init after big pushes, whose transfers use the
/// pool's big buffers, keeps no spare room in any rank's part (ten inits of a small key once
/// kept a big buffer each, and a rank grew far beyond the pool's bound).
#[test]
fn an_init_after_big_pushes_keeps_no_spare_room() {
    let ranks = stores(2);
    let spare = on_ranks(&ranks, |_, kv| {
        let big = 1 << 17;
        kv.init(100, &NDArray::zeros([big])).unwrap();
        for _ in 0..3 {
            kv.push(100, &NDArray::ones([big])).unwrap();
            kv.pull(100, &NDArray::zeros([big])).unwrap();
        }
        for k in 0..10 {
            let len = if k % 2 == 0 { 5 } else { 20 };
            kv.init(k, &NDArray::full([len], k as f64)).unwrap();
        }
        let table = super::read(&kv.table);
        table
            .slots
            .values()
            .filter_map(|s| {
                let cell = super::read(&s.cell);
                let h = cell.value_to_host().unwrap();
                (h.capacity() != h.len()).then(|| (s.key.clone(), h.len(), h.capacity()))
            })
            .collect::<Vec<_>>()
    });
    for (r, s) in spare.into_iter().enumerate() {
        assert!(
            s.is_empty(),
            "rank {r} keeps spare room (key, len, capacity): {s:?}"
        );
    }
}

/// An init moves only the slices of a sliced key: on 4 ranks each rank other than rank 0
/// receives its quarter of a big key, not the whole value (which once went to every rank
/// before each kept its slice, and a rank with 2 GiB of keys peaked at 1.5 times its steady
/// memory). A small whole key still goes to every rank.
#[test]
fn an_init_moves_only_the_slices_of_a_sliced_key() {
    let links = Loopback::world(4, Duration::from_secs(10));
    let ranks = on_links(&links, |_, l| {
        KvStore::over_loopback(l.clone(), BOUND).unwrap()
    });
    let len = 4000;
    let value: Vec<f32> = (0..len).map(|i| i as f32 / 8.0).collect();
    let before: Vec<usize> = links.iter().map(Loopback::received).collect();
    on_ranks(&ranks, |_, kv| {
        let v = NDArray::from_vec(value.clone(), [len]).unwrap();
        kv.init_list(&[0, 1], &[v, NDArray::ones([3])]).unwrap();
    });
    for (r, l) in links.iter().enumerate().skip(1) {
        let got = l.received() - before[r];
        // Its slice (1000) and the small key (3), plus the call's check words.
        assert!(
            got < len / 4 + 64,
            "rank {r} received {got} elements for its 1000"
        );
    }
    // And every rank pulls the value rank 0 gave.
    let pulled = on_ranks(&ranks, |_, kv| {
        let out = NDArray::zeros([len]);
        kv.pull(0, &out).unwrap();
        out.to_vec::<f32>().unwrap()
    });
    for p in pulled {
        assert_eq!(p, value);
    }
}

/// A random multiple of 1/64 in `(-bound, bound)`: sums of a few are exact in float32 in any
/// order (a rank sums its values in the backend's order, the reference in list order).
fn sixty_fourths(rng: &mut impl rand::Rng, bound: f32) -> f32 {
    (rng.gen_range(-bound..bound) * 64.0).round() / 64.0
}

/// Compression on ranks (2-bit, and the bfloat16 and float16 wires), against a reference
/// written here element by element (not the crate's codec): each rank sums its own values, adds
/// the sum to its residual, sends `+t`, `-t` or 0 per element (2-bit) or the nearest 16-bit
/// float, and keeps the rest; the stored value is the sum of what every rank sent, in rank
/// order. Keys whole and sliced, random values from 1 to 4 per rank, on 1 to 4 ranks, over
/// several pushes (the residuals carry over), on both ways of crossing ranks; each key pushed
/// alone on even steps, all in one list call on odd ones. A push of more than a few dozen
/// elements travels in several waves here (tests' `WAVE_BYTES`), so one of 300 (up to 16
/// waves of its parts, 2-bit words shared at their edges) is decoded wave by wave.
#[test]
fn compressed_pushes_on_n_ranks_equal_a_reference() {
    use crate::Compression;
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    for n in 1..=4 {
        let t: f32 = [0.5, 0.25, 0.3][rng.gen_range(0..3)];
        for compression in [
            Compression::two_bit(t),
            Compression::bf16(),
            Compression::fp16(),
        ] {
            // What one element sends, by the rules written out (docs/compression.md), and
            // what stays.
            let send = |acc: f32| -> (f32, f32) {
                let sent = match compression {
                    Compression::TwoBit { .. } if acc >= t => t,
                    Compression::TwoBit { .. } if acc <= -t => -t,
                    Compression::TwoBit { .. } => 0.0,
                    Compression::Half {
                        dtype: crate::DType::F16,
                    } => half::f16::from_f32(acc).to_f32(),
                    _ => half::bf16::from_f32(acc).to_f32(),
                };
                (sent, if sent.is_finite() { acc - sent } else { 0.0 })
            };
            let lens = [5usize, 37, 300];
            let steps: Vec<Vec<Vec<Vec<Vec<f32>>>>> = (0..4)
                .map(|_| {
                    lens.iter()
                        .map(|&len| {
                            (0..n)
                                .map(|_| {
                                    (0..rng.gen_range(1..=4))
                                        .map(|_| match compression {
                                            Compression::TwoBit { .. } => (0..len)
                                                .map(|_| sixty_fourths(&mut rng, 2.0 * t))
                                                .collect(),
                                            // Multiples of 1/1024: a rank's sum is exact
                                            // in any order, and needs more bits than a
                                            // bfloat16 or float16 keeps.
                                            _ => (0..len)
                                                .map(|_| {
                                                    (rng.gen_range(-3.0f32..3.0) * 1024.0).round()
                                                        / 1024.0
                                                })
                                                .collect(),
                                        })
                                        .collect()
                                })
                                .collect()
                        })
                        .collect()
                })
                .collect();
            // The reference: per key and rank, a residual; per step, the rank's sum in order.
            let mut residual: Vec<Vec<Vec<f32>>> =
                lens.iter().map(|&l| vec![vec![0.0; l]; n]).collect();
            let mut want: Vec<Vec<Vec<f32>>> = Vec::new();
            for step in &steps {
                let mut stored = Vec::new();
                for (k, per_rank) in step.iter().enumerate() {
                    let mut total = vec![0f32; lens[k]];
                    for (r, values) in per_rank.iter().enumerate() {
                        let mut sum = values[0].clone();
                        for v in &values[1..] {
                            sum.iter_mut().zip(v).for_each(|(s, x)| *s += x);
                        }
                        for i in 0..lens[k] {
                            let (sent, kept) = send(residual[k][r][i] + sum[i]);
                            residual[k][r][i] = kept;
                            total[i] = if r == 0 { sent } else { total[i] + sent };
                        }
                    }
                    stored.push(total);
                }
                want.push(stored);
            }
            // Host buffers and the GPU ranks' in-place way, in turn.
            let lane = [Lane::Host, Lane::InPlace][n % 2];
            let ranks = stores_on(lane, n);
            let got = on_ranks(&ranks, |r, kv| {
                kv.set_gradient_compression(compression).unwrap();
                let keys = [0, 1, 2];
                let zeros = |_| {
                    lens.iter()
                        .map(|&l| NDArray::zeros([l]))
                        .collect::<Vec<_>>()
                };
                kv.init_list(&keys, &zeros(())).unwrap();
                let mut pulled = Vec::new();
                for (s, step) in steps.iter().enumerate() {
                    let values: Vec<Vec<NDArray>> = step
                        .iter()
                        .map(|per_rank| {
                            per_rank[r]
                                .iter()
                                .map(|v| NDArray::from_vec(v.clone(), [v.len()]).unwrap())
                                .collect()
                        })
                        .collect();
                    match s % 2 {
                        0 => (0..keys.len()).for_each(|k| kv.push(k as i32, &values[k]).unwrap()),
                        _ => kv.push_list(&keys, &values).unwrap(),
                    }
                    let outs = zeros(());
                    kv.pull_list(&keys, &outs).unwrap();
                    pulled.push(
                        outs.iter()
                            .map(|o| o.to_vec::<f32>().unwrap())
                            .collect::<Vec<_>>(),
                    );
                }
                pulled
            });
            for (r, pulled) in got.iter().enumerate() {
                for (s, (p, w)) in pulled.iter().zip(&want).enumerate() {
                    assert_eq!(
                        p, w,
                        "{n} ranks, rank {r}, step {s} ({compression:?}, t = {t})"
                    );
                }
            }
        }
    }
}

/// Ranks that disagree on the compression (one rank without it, another threshold, another
/// wire: 2-bit, bfloat16, float16) fail their first push on every rank, and no rank stores
/// anything.
#[test]
fn ranks_that_compress_differently_fail_every_rank() {
    use crate::Compression;
    for (same, other) in [
        (Compression::two_bit(0.5), Compression::None),
        (Compression::two_bit(0.5), Compression::two_bit(0.25)),
        (Compression::two_bit(0.5), Compression::bf16()),
        (Compression::bf16(), Compression::fp16()),
        (Compression::fp16(), Compression::None),
    ] {
        let ranks = stores(3);
        let outcome = on_ranks(&ranks, |r, kv| {
            let mine = if r == 1 { other } else { same };
            if mine.is_on() {
                kv.set_gradient_compression(mine).unwrap();
            }
            kv.init(0, &NDArray::zeros([20])).unwrap();
            let err = kv.push(0, &NDArray::ones([20])).unwrap_err();
            let out = NDArray::zeros([20]);
            (err, kv.pull(0, &out).map(|()| out.to_vec::<f32>().unwrap()))
        });
        for (r, (err, after)) in outcome.into_iter().enumerate() {
            assert!(
                matches!(err, Error::Desync { .. }),
                "rank {r}, {same:?} against {other:?}: {err}"
            );
            // After a desync the world is failed: a pull is refused too, nothing computed.
            assert!(
                after.is_err() || after.unwrap() == vec![0.0; 20],
                "rank {r} changed"
            );
        }
    }
}

/// What a compressed push moves: on 4 ranks, a key of 16,000 float32 elements sliced in four
/// travels as 1,000 words from each rank, 250 to each holder of a slice, and every rank
/// receives the 250 words of its slice from each rank: 1,000 words, a sixteenth of the key's
/// elements (docs/compression.md). The same push uncompressed receives each rank's
/// slice of the sum, 4,000 elements, as the result of a reduce-scatter whose ring moves about
/// three times that per rank.
#[test]
fn a_compressed_push_moves_a_sixteenth_of_the_key_from_each_rank() {
    use crate::Compression;
    let len = 16_000;
    let received = |compress: bool| -> Vec<usize> {
        let links = Loopback::world(4, Duration::from_secs(10));
        let ranks = on_links(&links, |_, l| {
            KvStore::over_loopback(l.clone(), BOUND).unwrap()
        });
        on_ranks(&ranks, |_, kv| {
            if compress {
                kv.set_gradient_compression(Compression::two_bit(0.5))
                    .unwrap();
            }
            kv.init(0, &NDArray::zeros([len])).unwrap();
        });
        let before: Vec<usize> = links.iter().map(Loopback::received).collect();
        on_ranks(&ranks, |r, kv| {
            let g: Vec<f32> = (0..len)
                .map(|i| ((i + r) % 7) as f32 / 4.0 - 0.75)
                .collect();
            kv.push(0, &NDArray::from_vec(g, [len]).unwrap()).unwrap();
        });
        links
            .iter()
            .zip(before)
            .map(|(l, b)| l.received() - b)
            .collect()
    };
    let compressed = received(true);
    let plain = received(false);
    for (r, (&c, &p)) in compressed.iter().zip(&plain).enumerate() {
        // 4 ranks x 250 words, plus the call's check words.
        assert!(
            (len / 16..len / 16 + 64).contains(&c),
            "rank {r} received {c} elements in a compressed push (uncompressed: {p})"
        );
        assert!(
            p >= len / 4,
            "rank {r}: an uncompressed push receives its slice, got {p}"
        );
    }
}

/// A compressed push of a whole key moves its words to the key's home and nothing else: the
/// all-to-all's blocks are of unequal lengths, so the ranks that hold no part of the key
/// receive no padding (a 2-bit key of 16,000 elements: 4 × 1,000 words to the home, none
/// elsewhere, where equal blocks would have sent every rank 4,000).
#[test]
fn a_compressed_push_of_a_whole_key_sends_no_padding() {
    use crate::Compression;
    let len = 16_000;
    let links = Loopback::world(4, Duration::from_secs(10));
    let ranks = on_links(&links, |_, l| {
        KvStore::over_loopback(l.clone(), 1_000_000).unwrap()
    });
    on_ranks(&ranks, |_, kv| {
        kv.set_gradient_compression(Compression::two_bit(0.5))
            .unwrap();
        kv.init(0, &NDArray::zeros([len])).unwrap();
    });
    let before: Vec<usize> = links.iter().map(Loopback::received).collect();
    on_ranks(&ranks, |r, kv| {
        let g: Vec<f32> = (0..len)
            .map(|i| ((i * 3 + r) % 11) as f32 / 4.0 - 1.25)
            .collect();
        kv.push(0, &NDArray::from_vec(g, [len]).unwrap()).unwrap();
    });
    let got: Vec<usize> = (links.iter().zip(before))
        .map(|(l, b)| l.received() - b)
        .collect();
    // The call's check words aside (under 64 elements per rank).
    let home: Vec<usize> = (0..4).filter(|&r| got[r] >= 64).collect();
    assert_eq!(home.len(), 1, "one rank is the key's home: {got:?}");
    let h = home[0];
    assert!(
        (4 * len / 16..4 * len / 16 + 64).contains(&got[h]),
        "the home received {} elements: {got:?}",
        got[h]
    );
}

/// Where MPI's `int` counts could not hold the unequal blocks' displacements, the compressed
/// all-to-all pads every block to the longest instead: the same values arrive, bit for bit,
/// with more elements on the wire. The limit is lowered for the test (3 ranks, a whole key and
/// a sliced one, 2-bit and bfloat16, random values).
#[test]
fn the_padded_all_to_all_gives_the_same_values_as_the_unequal_one() {
    use crate::Compression;
    use rand::{Rng, SeedableRng};
    let seed: u64 = rand::random();
    let lens = [300usize, 5000];
    for compression in [Compression::two_bit(0.5), Compression::bf16()] {
        let run = |limit: usize| -> (Vec<Vec<f32>>, Vec<usize>) {
            let links = Loopback::world(3, Duration::from_secs(10));
            let ranks = on_links(&links, |_, l| {
                KvStore::over_loopback(l.clone(), 1000).unwrap()
            });
            let before: Vec<usize> = links.iter().map(Loopback::received).collect();
            let pulled = on_ranks(&ranks, |r, kv| {
                crate::comm::dist::blocks_tests::COUNT_MAX.with(|m| m.set(limit));
                kv.set_gradient_compression(compression).unwrap();
                let keys = [0, 1];
                let zeros: Vec<NDArray> = lens.iter().map(|&n| NDArray::zeros([n])).collect();
                kv.init_list(&keys, &zeros).unwrap();
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ r as u64);
                for _ in 0..3 {
                    let grads: Vec<NDArray> = lens
                        .iter()
                        .map(|&n| {
                            let g: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
                            NDArray::from_vec(g, [n]).unwrap()
                        })
                        .collect();
                    kv.push_list(&keys, &grads).unwrap();
                }
                let outs: Vec<NDArray> = lens.iter().map(|&n| NDArray::zeros([n])).collect();
                kv.pull_list(&keys, &outs).unwrap();
                outs.iter()
                    .flat_map(|o| o.to_vec::<f32>().unwrap())
                    .collect::<Vec<f32>>()
            });
            let moved = (links.iter().zip(before))
                .map(|(l, b)| l.received() - b)
                .collect();
            (pulled, moved)
        };
        let (unequal, unequal_moved) = run(i32::MAX as usize);
        let (padded, padded_moved) = run(10);
        assert!(
            unequal.iter().flatten().any(|&v| v != 0.0),
            "the pushes stored something"
        );
        for (a, b) in unequal.iter().zip(&padded) {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(a),
                bits(b),
                "seed {seed}, {compression:?}: padded blocks changed the values"
            );
        }
        assert!(
            padded_moved.iter().sum::<usize>() > unequal_moved.iter().sum::<usize>(),
            "padding moves more: {padded_moved:?} against {unequal_moved:?}"
        );
    }
}

/// A compressed dist run saved to a sharded checkpoint and resumed by as many ranks continues
/// bit for bit: each rank's residuals come back from its own shard. Resumed by another number
/// of ranks, the values load and the residuals start at zero. Random values, a whole key and a
/// sliced one, or two whole keys (then on 3 ranks one rank holds no key, only residuals), 2-bit
/// and bfloat16, on 2 and 3 ranks.
#[test]
fn a_sharded_checkpoint_carries_each_ranks_residuals() {
    use crate::Compression;
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    for (lens, n) in [([5usize, 37], 2usize), ([5, 37], 3), ([5, 6], 3)] {
        for compression in [Compression::two_bit(0.5), Compression::bf16()] {
            // steps[s][k][r]: rank r's value of key k at step s.
            let steps: Vec<Vec<Vec<Vec<f32>>>> = (0..4)
                .map(|_| {
                    lens.iter()
                        .map(|&len| {
                            (0..n)
                                .map(|_| {
                                    (0..len)
                                        .map(|_| {
                                            (rng.gen_range(-1.3f32..1.3) * 1024.0).round() / 1024.0
                                        })
                                        .collect()
                                })
                                .collect()
                        })
                        .collect()
                })
                .collect();
            // Rank r's pushes of `steps`.
            let push = |kv: &KvStore, r: usize, steps: &[Vec<Vec<Vec<f32>>>]| {
                for step in steps {
                    for (k, per_rank) in step.iter().enumerate() {
                        let v = &per_rank[r];
                        kv.push(k as i32, &NDArray::from_vec(v.clone(), [v.len()]).unwrap())
                            .unwrap();
                    }
                }
            };
            let pull = |kv: &KvStore| {
                let outs = [NDArray::zeros([lens[0]]), NDArray::zeros([lens[1]])];
                kv.pull_list(&[0, 1], &outs).unwrap();
                outs.map(|o| o.to_vec::<f32>().unwrap())
            };
            let dir = temp_dir("residuals");
            // The uninterrupted run, saved after two steps.
            let ranks = stores(n);
            let whole = on_ranks(&ranks, |r, kv| {
                kv.set_gradient_compression(compression).unwrap();
                kv.init_list(
                    &[0, 1],
                    &[NDArray::zeros([lens[0]]), NDArray::zeros([lens[1]])],
                )
                .unwrap();
                push(kv, r, &steps[..2]);
                kv.save(&dir).unwrap();
                push(kv, r, &steps[2..]);
                pull(kv)
            });
            // Resumed from the checkpoint by as many ranks.
            let resumed = on_ranks(&stores(n), |r, kv| {
                kv.set_gradient_compression(compression).unwrap();
                kv.load(&dir).unwrap();
                push(kv, r, &steps[2..]);
                pull(kv)
            });
            assert_eq!(resumed, whole, "{n} ranks, {compression:?}");
            // By one rank more: the values load, the residuals start at zero.
            let more = on_ranks(&stores(n + 1), |_, kv| {
                kv.set_gradient_compression(compression).unwrap();
                kv.load(&dir).unwrap();
                let values = pull(kv);
                let residuals: Vec<usize> = [0, 1]
                    .iter()
                    .map(|&k| {
                        let table = super::read(&kv.table);
                        let slot = &table.slots[&crate::Key::Int(k)];
                        let r = slot.residuals.lock().unwrap();
                        r.len()
                    })
                    .collect();
                (values, residuals)
            });
            let saved = on_ranks(&stores(n), |_, kv| {
                kv.load(&dir).unwrap();
                pull(kv)
            });
            for (values, residuals) in more {
                assert_eq!(values, saved[0], "{} ranks load what {n} saved", n + 1);
                assert_eq!(
                    residuals,
                    [0, 0],
                    "no residuals carry over to another world"
                );
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

#[test]
fn any_of_is_each_flag_ored_over_the_ranks() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    for n in 1..=4 {
        let len = rng.gen_range(0..200);
        let flags: Vec<Vec<bool>> = (0..n)
            .map(|_| (0..len).map(|_| rng.gen_bool(0.2)).collect())
            .collect();
        let want: Vec<bool> = (0..len).map(|i| flags.iter().any(|f| f[i])).collect();
        let kvs = stores(n);
        let got = on_ranks(&kvs, |r, kv| kv.any_of("used", &flags[r]));
        for g in got {
            assert_eq!(g.unwrap(), want, "{n} ranks, {len} flags");
        }
    }
}

#[test]
fn ranks_whose_any_of_differs_fail_every_rank() {
    let kvs = stores(3);
    // One rank passes one flag more, another a different `what`.
    let got = on_ranks(&kvs, |r, kv| match r {
        1 => kv.any_of("used", &[true, false, true]),
        _ => kv.any_of("used", &[true, false]),
    });
    assert!(
        got.iter().all(|g| matches!(g, Err(Error::Desync { .. }))),
        "{got:?}"
    );
    let kvs = stores(2);
    let got = on_ranks(&kvs, |r, kv| {
        kv.any_of(if r == 0 { "a" } else { "b" }, &[true])
    });
    assert!(
        got.iter().all(|g| matches!(g, Err(Error::Desync { .. }))),
        "{got:?}"
    );
}

#[test]
fn ranks_with_different_tags_fail_every_rank_and_store_nothing() {
    let kvs = stores(3);
    let init = NDArray::from_vec(vec![0.25f32, -1.5, 2.0], [3]).unwrap();
    on_ranks(&kvs, |_, kv| kv.init(7, &init).unwrap());
    // Equal tags: the push goes through.
    on_ranks(&kvs, |_, kv| {
        kv.set_tag(Some("step 1"));
        kv.push(7, &NDArray::from_vec(vec![0.5f32, 0.5, 0.5], [3]).unwrap())
            .unwrap();
    });
    // Rank 2 a step behind: every rank fails, the message shows both tags, nothing stored.
    let before: Vec<_> = kvs.iter().map(snapshot).collect();
    let got = on_ranks(&kvs, |r, kv| {
        kv.set_tag(Some(if r == 2 { "step 1" } else { "step 2" }));
        kv.push(7, &NDArray::from_vec(vec![1.0f32, 1.0, 1.0], [3]).unwrap())
    });
    for g in &got {
        match g {
            Err(Error::Desync { detail, .. }) => {
                assert!(
                    detail.contains("[step 1]") && detail.contains("[step 2]"),
                    "{detail}"
                )
            }
            other => panic!("expected Desync, got {other:?}"),
        }
    }
    let after: Vec<_> = kvs.iter().map(snapshot).collect();
    assert_eq!(before, after);
    // The value is the first push's: three ranks' halves (the push assigns the sum).
    let home = before
        .iter()
        .flatten()
        .find(|p| p.0 == "7")
        .expect("key 7's home");
    assert_eq!(home.1, vec![1.5f64, 1.5, 1.5]);
}
