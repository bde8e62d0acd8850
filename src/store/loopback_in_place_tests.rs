//! The GPU ranks' way across ranks (values moved in place, [`Lane::InPlace`]) under the inputs
//! most likely to break it: every dtype in one list call, keys sliced so that a rank keeps
//! nothing, whole keys too big to pack, one array named twice, outs that are also pushed,
//! init values that differ by rank, ranks that disagree and ranks that stall.
//!
//! Values are random multiples of 1/4 of at most 4 in magnitude, so every sum of up to 5 ranks
//! (and twice one array) is exact in every dtype, bfloat16 included: the reference is computed
//! here, in `f64`, element by element.

use std::time::Duration;

use rand::prelude::*;

use super::loopback_tests::{on_links, on_ranks, snapshot, stores_on, Lane, BOUND};
use crate::comm::link::loopback::Loopback;
use crate::comm::link::Op;
use crate::{DType, Error, KvStore, NDArray, Sgd, Updater};

/// The keys: (key, length, dtype). With [`BOUND`] 8, keys 1, 2 and 5 are above the bound: key 1
/// (9 elements) would leave rank 3 of 4 no element, key 5 (12) rank 4 of 5. In host buffers they
/// are sliced so; the GPU ranks' way keeps such a key whole (a GPU keeps no empty arrays).
const KEYS: [(i32, usize, DType); 6] = [
    (0, 3, DType::F16),
    (1, 9, DType::BF16),
    (2, 37, DType::F64),
    (3, 5, DType::F32),
    (4, 6, DType::F64),
    (5, 12, DType::F16),
];

/// `n` random multiples of 1/4 in `[-4, 4]`.
fn quarters(rng: &mut impl Rng, n: usize) -> Vec<f64> {
    (0..n)
        .map(|_| rng.gen_range(-16..=16) as f64 / 4.0)
        .collect()
}

/// `v` as an array of `dtype`.
fn array(v: &[f64], dtype: DType) -> NDArray {
    NDArray::from_vec(v.to_vec(), [v.len()])
        .unwrap()
        .astype(dtype)
        .unwrap()
}

/// Each rank's values for `keys`, fresh and random.
fn per_rank(rng: &mut impl Rng, n: usize, keys: &[(i32, usize, DType)]) -> Vec<Vec<Vec<f64>>> {
    (0..n)
        .map(|_| keys.iter().map(|&(_, len, _)| quarters(rng, len)).collect())
        .collect()
}

/// The element-wise sum of every rank's value of key index `k`.
fn total(values: &[Vec<Vec<f64>>], k: usize) -> Vec<f64> {
    let mut acc = vec![0.0; values[0][k].len()];
    for rank in values {
        for (a, v) in acc.iter_mut().zip(&rank[k]) {
            *a += v;
        }
    }
    acc
}

/// Runs init (values differing by rank: rank 0's must win), pull, a push of a list naming key 1
/// twice with one array, a pushpull whose outs are the pushed arrays, and a pull that casts, on
/// `n` ranks of `lane`, with `keys`; checks every result against sums computed here.
fn check_every_dtype(lane: Lane, n: usize, bound: usize, keys: &[(i32, usize, DType)]) {
    let mut rng = StdRng::from_entropy();
    let links = Loopback::world(n, Duration::from_secs(10));
    let links: Vec<Loopback> = match lane {
        Lane::Host => links,
        Lane::InPlace => links.into_iter().map(Loopback::moving_in_place).collect(),
    };
    let ranks = on_links(&links, |_, l| {
        KvStore::over_loopback(l.clone(), bound).unwrap()
    });
    let ids: Vec<i32> = keys.iter().map(|k| k.0).collect();
    let inits = per_rank(&mut rng, n, keys);
    let pushed = per_rank(&mut rng, n, keys);
    let again = per_rank(&mut rng, n, keys);
    let got = on_ranks(&ranks, |r, kv| {
        let arrays = |vals: &[Vec<f64>]| -> Vec<NDArray> {
            (vals.iter().zip(keys))
                .map(|(v, &(_, _, dtype))| array(v, dtype))
                .collect()
        };
        let pull = |kv: &KvStore, cast: bool| -> Vec<Vec<f64>> {
            let outs: Vec<NDArray> = (keys.iter())
                .map(|&(_, len, dtype)| {
                    let dtype = if cast { DType::F32 } else { dtype };
                    array(&vec![-99.0; len], dtype)
                })
                .collect();
            kv.pull_list(&ids, &outs).unwrap();
            outs.iter().map(|o| o.to_vec::<f64>().unwrap()).collect()
        };
        kv.init_list(&ids, &arrays(&inits[r])).unwrap();
        let after_init = pull(kv, false);
        // Key 1's array is named twice: its values count twice.
        let values = arrays(&pushed[r]);
        let mut twice_ids = ids.clone();
        twice_ids.push(ids[1]);
        let mut twice = values.clone();
        twice.push(values[1].clone());
        kv.push_list(&twice_ids, &twice).unwrap();
        for (k, v) in values.iter().enumerate() {
            assert_eq!(
                v.to_vec::<f64>().unwrap(),
                pushed[r][k],
                "rank {r}'s pushed array"
            );
        }
        let after_push = pull(kv, false);
        let values = arrays(&again[r]);
        kv.pushpull_list(&ids, &values, &values).unwrap();
        let in_outs: Vec<Vec<f64>> = values.iter().map(|o| o.to_vec().unwrap()).collect();
        (after_init, after_push, in_outs, pull(kv, true))
    });
    for (r, (after_init, after_push, in_outs, cast)) in got.into_iter().enumerate() {
        for (k, &(key, _, dtype)) in keys.iter().enumerate() {
            let what = |step: &str| format!("{step}: rank {r} of {n}, key {key} ({dtype:?})");
            assert_eq!(after_init[k], inits[0][k], "{}", what("init"));
            let mut want = total(&pushed, k);
            if k == 1 {
                want = want
                    .iter()
                    .zip(total(&pushed, k))
                    .map(|(a, b)| a + b)
                    .collect();
            }
            assert_eq!(after_push[k], want, "{}", what("push"));
            assert_eq!(in_outs[k], total(&again, k), "{}", what("pushpull"));
            assert_eq!(cast[k], total(&again, k), "{}", what("cast pull"));
        }
    }
}

/// Every dtype in one list call, keys above the bound whose slices would leave a rank nothing,
/// on 1 to 5 ranks, the GPU ranks' way and in host buffers. (The GPU ranks' way keeps such a
/// key whole, [`crate::comm::dist::Dist::is_sliced`]; only host buffers slice it with a rank
/// left empty.)
#[test]
fn every_dtype_and_short_sliced_keys_on_1_to_5_ranks_both_ways() {
    for n in 1..=5 {
        check_every_dtype(Lane::InPlace, n, BOUND, &KEYS);
        check_every_dtype(Lane::Host, n, BOUND, &KEYS);
    }
}

/// Whole keys too big to pack (more than `PACK_MAX_BYTES`: they travel alone, the home's own
/// copy going out) beside packed ones, with a bound that leaves them whole.
#[test]
fn whole_keys_too_big_to_pack_move_in_place_on_1_to_4_ranks() {
    let keys = [
        (0, 70_000, DType::F32),
        (1, 5, DType::F16),
        (2, 40_000, DType::F64),
        (3, 140_000, DType::BF16),
    ];
    for n in 1..=4 {
        check_every_dtype(Lane::InPlace, n, 1 << 20, &keys);
    }
}

/// A push with SGD on the GPU ranks' way, every dtype, gives what one local store gives when
/// pushed every rank's values, and the pushpull into the pushed arrays too.
#[test]
fn sgd_on_ranks_moving_in_place_equals_a_local_store() {
    let mut rng = StdRng::from_entropy();
    let sgd = Updater::Sgd(Sgd {
        lr: 0.25,
        momentum: 0.5,
        ..Sgd::default()
    });
    let ids: Vec<i32> = KEYS.iter().map(|k| k.0).collect();
    for n in [2, 4, 5] {
        let ranks = stores_on(Lane::InPlace, n);
        let local = KvStore::create("local").unwrap();
        let init = per_rank(&mut rng, 1, &KEYS).remove(0);
        let init: Vec<NDArray> = (init.iter().zip(&KEYS))
            .map(|(v, &(_, _, d))| array(v, d))
            .collect();
        local.init_list(&ids, &init).unwrap();
        local.set_updater(sgd.clone()).unwrap();
        on_ranks(&ranks, |_, kv| {
            kv.init_list(&ids, &init).unwrap();
            kv.set_updater(sgd.clone()).unwrap();
        });
        for _ in 0..3 {
            let pushed = per_rank(&mut rng, n, &KEYS);
            let got = on_ranks(&ranks, |r, kv| {
                let values: Vec<NDArray> = (pushed[r].iter().zip(&KEYS))
                    .map(|(v, &(_, _, d))| array(v, d))
                    .collect();
                kv.pushpull_list_in_place(&ids, &values).unwrap();
                values
                    .iter()
                    .map(|v| v.to_vec::<f64>().unwrap())
                    .collect::<Vec<_>>()
            });
            let sums: Vec<NDArray> = (0..KEYS.len())
                .map(|k| array(&total(&pushed, k), KEYS[k].2))
                .collect();
            local.push_list(&ids, &sums).unwrap();
            for (r, got) in got.iter().enumerate() {
                for (k, &(key, len, dtype)) in KEYS.iter().enumerate() {
                    let out = array(&vec![0.0; len], dtype);
                    local.pull(key, &out).unwrap();
                    assert_eq!(
                        got[k],
                        out.to_vec::<f64>().unwrap(),
                        "rank {r} of {n}, key {key} ({dtype:?})"
                    );
                }
            }
        }
    }
}

/// One rank's call differs from the others' on the GPU ranks' way (another key of the same
/// shape, or a value of another dtype): every rank fails and no rank's store changes.
#[test]
fn ranks_that_disagree_moving_in_place_fail_and_change_nothing() {
    let mut rng = StdRng::from_entropy();
    let ids: Vec<i32> = KEYS.iter().map(|k| k.0).collect();
    for (n, odd) in [(2, 1), (3, 0), (5, 4)] {
        for differ in 0..4 {
            let ranks = stores_on(Lane::InPlace, n);
            let init = per_rank(&mut rng, 1, &KEYS).remove(0);
            let pushed = per_rank(&mut rng, n, &KEYS);
            let got = on_ranks(&ranks, |r, kv| {
                let init: Vec<NDArray> = (init.iter().zip(&KEYS))
                    .map(|(v, &(_, _, d))| array(v, d))
                    .collect();
                kv.init_list(&ids, &init).unwrap();
                let before = snapshot(kv);
                let mut values: Vec<NDArray> = (pushed[r].iter().zip(&KEYS))
                    .map(|(v, &(_, _, d))| array(v, d))
                    .collect();
                let mut keys = ids.clone();
                let mut pushpull = false;
                if r == odd {
                    match differ {
                        // A pushpull where the others push (of the same keys and values).
                        0 => pushpull = true,
                        // A value of another dtype.
                        1 => values[1] = values[1].astype(DType::F32).unwrap(),
                        // One key fewer.
                        2 => {
                            keys.pop();
                            values.pop();
                        }
                        // A key never initialized, of the shape and dtype of the one it replaces.
                        _ => keys[0] = 6,
                    }
                }
                let e = match pushpull {
                    true => kv.pushpull_list(&keys, &values, &values).err(),
                    false => kv.push_list(&keys, &values).err(),
                };
                (e, before == snapshot(kv))
            });
            for (r, (e, kept)) in got.into_iter().enumerate() {
                assert!(e.is_some(), "rank {r} of {n} pushed (differ {differ})");
                assert!(
                    kept,
                    "rank {r} of {n} changed after {e:?} (differ {differ})"
                );
            }
        }
    }
}

/// A rank that never joins one collective (each in turn) on the GPU ranks' way: every rank's
/// call fails within the bound, none hangs, and a push that fails before the update leaves
/// every rank's store as it was.
#[test]
fn a_stalled_rank_moving_in_place_fails_every_rank_and_hangs_none() {
    let mut rng = StdRng::from_entropy();
    let ids: Vec<i32> = KEYS.iter().map(|k| k.0).collect();
    let n = 3;
    let stalls = [
        Op::ReduceScatter,
        Op::AllGather,
        Op::Broadcast { root: 0 },
        Op::Reduce { root: 0 },
        Op::Reduce { root: 1 },
        Op::Reduce { root: 2 },
    ];
    for stall in stalls {
        for stalled in 0..n {
            let links = Loopback::world(n, Duration::from_millis(800));
            let links: Vec<Loopback> = (links.into_iter().enumerate())
                .map(|(r, l)| {
                    let l = l.moving_in_place();
                    if r == stalled {
                        l.stalling_at(stall)
                    } else {
                        l
                    }
                })
                .collect();
            let ranks = on_links(&links, |_, l| {
                KvStore::over_loopback(l.clone(), BOUND).unwrap()
            });
            let init = per_rank(&mut rng, 1, &KEYS).remove(0);
            let pushed = per_rank(&mut rng, n, &KEYS);
            let got = on_ranks(&ranks, |r, kv| {
                let arrays = |v: &[Vec<f64>]| -> Vec<NDArray> {
                    (v.iter().zip(&KEYS))
                        .map(|(v, &(_, _, d))| array(v, d))
                        .collect()
                };
                if let Err(e) = kv.init_list(&ids, &arrays(&init)) {
                    return ("init", Some(e), kv.keys().is_empty());
                }
                let before = snapshot(kv);
                if let Err(e) = kv.push_list(&ids, &arrays(&pushed[r])) {
                    return ("push", Some(e), before == snapshot(kv));
                }
                let outs = arrays(&pushed[r]);
                let e = kv.pull_list(&ids, &outs).err();
                ("pull", e, true)
            });
            let what = format!("{stall:?} on rank {stalled}");
            let failed: Vec<_> = got.iter().filter(|g| g.1.is_some()).collect();
            assert!(
                failed.is_empty() || failed.len() == n,
                "{what}: some ranks failed, some not: {got:?}"
            );
            assert!(!failed.is_empty(), "{what}: every call succeeded");
            for (r, (step, e, kept)) in got.iter().enumerate() {
                assert_eq!(
                    *step, got[0].0,
                    "{what}: rank {r} failed elsewhere: {got:?}"
                );
                assert!(
                    kept,
                    "{what}: rank {r}'s failed {step} changed its store: {e:?}"
                );
            }
        }
    }
}

/// An error from a rank's stalled collective is a typed error, never a panic: checked above by
/// the threads joining; this pins the kind the waiting ranks see.
#[test]
fn the_ranks_waiting_on_a_stalled_one_see_a_timeout() {
    let links = Loopback::world(2, Duration::from_millis(500));
    let links = [
        links[0].clone().moving_in_place(),
        links[1]
            .clone()
            .moving_in_place()
            .stalling_at(Op::ReduceScatter),
    ];
    let ranks = on_links(&links, |_, l| {
        KvStore::over_loopback(l.clone(), BOUND).unwrap()
    });
    let got = on_ranks(&ranks, |_, kv| {
        kv.init(0, &NDArray::zeros([20])).unwrap();
        kv.push(0, &NDArray::ones([20])).unwrap_err()
    });
    assert!(matches!(got[0], Error::Timeout { .. }), "{}", got[0]);
}

/// A pushpull whose outs are the pushed arrays of other keys (key `k`'s result lands in the array
/// pushed to key `k + 1`), on the GPU ranks' way: every push reads its array before any pull
/// writes one, so each out holds its key's sum of what was pushed.
#[test]
fn a_pushpull_into_arrays_pushed_to_other_keys_reads_every_value_first() {
    let mut rng = StdRng::from_entropy();
    // Keys of one dtype and length, whole and sliced: any array fits any key.
    let keys = [
        (0, 12, DType::F32),
        (1, 12, DType::F32),
        (2, 12, DType::F32),
    ];
    let ids: Vec<i32> = keys.iter().map(|k| k.0).collect();
    for n in [1, 3, 5] {
        for bound in [BOUND, 64] {
            let links = Loopback::world(n, Duration::from_secs(10));
            let ranks = on_links(&links, |_, l| {
                KvStore::over_loopback(l.clone().moving_in_place(), bound).unwrap()
            });
            let pushed = per_rank(&mut rng, n, &keys);
            let got = on_ranks(&ranks, |r, kv| {
                kv.init_list(&ids, &vec![NDArray::zeros([12]); 3]).unwrap();
                let values: Vec<NDArray> = pushed[r].iter().map(|v| array(v, DType::F32)).collect();
                let outs: Vec<NDArray> = (0..3).map(|k| values[(k + 1) % 3].clone()).collect();
                kv.pushpull_list(&ids, &values, &outs).unwrap();
                outs.iter()
                    .map(|o| o.to_vec::<f64>().unwrap())
                    .collect::<Vec<_>>()
            });
            for (r, got) in got.iter().enumerate() {
                for (k, got) in got.iter().enumerate() {
                    assert_eq!(
                        *got,
                        total(&pushed, k),
                        "rank {r} of {n}, key {k}, bound {bound}"
                    );
                }
            }
        }
    }
}

/// An updater that fails on one rank only (for the one slice, or the one whole key, whose sum
/// holds a marked element), on the GPU ranks' way: every rank fails the push, no rank's store
/// changes, and the next push (unmarked) gives every rank the sums.
#[test]
fn an_updater_failing_on_one_rank_moving_in_place_fails_every_rank_and_keeps_the_store() {
    let mut rng = StdRng::from_entropy();
    let ids: Vec<i32> = KEYS.iter().map(|k| k.0).collect();
    let marked = 1000.0;
    let updater = Updater::try_custom(move |_key, input, stored| {
        if input
            .to_vec::<f64>()?
            .iter()
            .any(|v| v.abs() >= marked / 2.0)
        {
            return Err("a marked element".into());
        }
        stored.add_scaled(input, 1.0)?;
        Ok(())
    });
    for n in 2..=5 {
        // (key index, element): the last element of a sliced key (on the last rank holding
        // some of it), the first of another, and a whole key (on its home).
        for (k, at) in [(2, 36), (5, 0), (3, 4), (1, 8)] {
            let ranks = stores_on(Lane::InPlace, n);
            let init = per_rank(&mut rng, 1, &KEYS).remove(0);
            let mut pushed = per_rank(&mut rng, n, &KEYS);
            pushed[n - 1][k][at] = marked;
            let next = per_rank(&mut rng, n, &KEYS);
            let got = on_ranks(&ranks, |r, kv| {
                let arrays = |v: &[Vec<f64>]| -> Vec<NDArray> {
                    (v.iter().zip(&KEYS))
                        .map(|(v, &(_, _, d))| array(v, d))
                        .collect()
                };
                kv.init_list(&ids, &arrays(&init)).unwrap();
                kv.set_updater(updater.clone()).unwrap();
                let before = snapshot(kv);
                let e = kv.push_list(&ids, &arrays(&pushed[r])).err();
                let kept = before == snapshot(kv);
                let outs = arrays(&next[r]);
                kv.pushpull_list(&ids, &outs, &outs).unwrap();
                let after: Vec<Vec<f64>> = outs.iter().map(|o| o.to_vec().unwrap()).collect();
                (e, kept, after)
            });
            for (r, (e, kept, after)) in got.into_iter().enumerate() {
                let what = format!("rank {r} of {n}, key {} marked at {at}", KEYS[k].0);
                assert!(
                    matches!(
                        e,
                        Some(Error::UpdaterFailed { .. } | Error::RankFailed { .. })
                    ),
                    "{what}: {e:?}"
                );
                assert!(kept, "{what}: the failed push changed the store");
                for (j, got) in after.iter().enumerate() {
                    let want: Vec<f64> = (init[j].iter().zip(total(&next, j)))
                        .map(|(a, b)| a + b)
                        .collect();
                    assert_eq!(*got, want, "{what}: key {} after", KEYS[j].0);
                }
            }
        }
    }
}

/// Bounds so small that keys of a few elements are above them on more ranks than they have
/// elements: in host buffers most ranks keep nothing of them; the GPU ranks' way keeps them
/// whole.
#[test]
fn keys_sliced_over_more_ranks_than_elements_on_1_to_5_ranks() {
    let keys = [
        (0, 1, DType::F32),
        (1, 2, DType::F16),
        (2, 3, DType::BF16),
        (3, 4, DType::F64),
    ];
    for n in 1..=5 {
        for bound in [0, 1] {
            check_every_dtype(Lane::InPlace, n, bound, &keys);
            check_every_dtype(Lane::Host, n, bound, &keys);
        }
    }
}

thread_local! {
    /// Whether the updater fails on this thread (one rank's thread, in the test below).
    static FAIL_HERE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Compressed pushpulls into the pushed arrays on the GPU ranks' way, with one push between them
/// whose updater fails on one rank: every rank fails it, and afterwards every rank pulls, bit
/// for bit, what a world that never made the failed push pulls (so the failed push kept no
/// residual and no value on any rank).
#[test]
fn a_failed_compressed_push_moving_in_place_leaves_no_residual() {
    use crate::Compression;
    let mut rng = StdRng::from_entropy();
    let updater = Updater::try_custom(|_key, input, stored| {
        if FAIL_HERE.with(|f| f.get()) {
            return Err("this rank's updater fails".into());
        }
        stored.add_scaled(input, 1.0)?;
        Ok(())
    });
    let keys = [(0, 5, DType::F32), (1, 37, DType::F32), (2, 12, DType::F32)];
    let ids: Vec<i32> = keys.iter().map(|k| k.0).collect();
    for compression in [
        Compression::two_bit(0.5),
        Compression::fp16(),
        Compression::bf16(),
    ] {
        for n in [2, 3, 5] {
            let steps: Vec<Vec<Vec<Vec<f64>>>> =
                (0..3).map(|_| per_rank(&mut rng, n, &keys)).collect();
            let failed = per_rank(&mut rng, n, &keys);
            let init = per_rank(&mut rng, 1, &keys).remove(0);
            let run = |with_failure: bool| {
                let ranks = stores_on(Lane::InPlace, n);
                on_ranks(&ranks, |r, kv| {
                    let arrays = |v: &[Vec<f64>]| -> Vec<NDArray> {
                        v.iter().map(|v| array(v, DType::F32)).collect()
                    };
                    kv.set_gradient_compression(compression).unwrap();
                    kv.init_list(&ids, &arrays(&init)).unwrap();
                    kv.set_updater(updater.clone()).unwrap();
                    let mut pulled = Vec::new();
                    for (s, step) in steps.iter().enumerate() {
                        if with_failure && s == 1 {
                            FAIL_HERE.with(|f| f.set(r == n - 1));
                            let e = kv.push_list(&ids, &arrays(&failed[r]));
                            FAIL_HERE.with(|f| f.set(false));
                            assert!(
                                matches!(
                                    e,
                                    Err(Error::UpdaterFailed { .. } | Error::RankFailed { .. })
                                ),
                                "rank {r} of {n} ({compression:?}): {e:?}"
                            );
                        }
                        let values = arrays(&step[r]);
                        kv.pushpull_list_in_place(&ids, &values).unwrap();
                        pulled.push(
                            (values.iter())
                                .map(|v| v.to_vec::<f32>().unwrap())
                                .collect::<Vec<_>>(),
                        );
                    }
                    pulled
                })
            };
            let (got, want) = (run(true), run(false));
            assert_eq!(got, want, "{n} ranks ({compression:?})");
            // And the reference moved: the pushes changed the values.
            assert_ne!(
                want[0][0][1],
                init[1].iter().map(|&v| v as f32).collect::<Vec<_>>()
            );
        }
    }
}

/// A rank whose own part of an in-place collective failed (here it never joins a
/// reduce-scatter) is out of step with the others, who still wait in it: its next call must fail
/// at once, never meet their pending collective with one of its own. With the per-call check off
/// nothing else stands between them: rank 1's next call (a pull, whose all-gather would land in
/// rank 0's pending reduce-scatter) once gave rank 0's push a sum of rank 1's pulled slice, with
/// no error.
#[test]
fn a_rank_that_failed_its_part_in_place_fails_its_next_call_at_once() {
    for check in [false, true] {
        let links = Loopback::world(2, Duration::from_millis(1500));
        let links: Vec<Loopback> = (links.into_iter().enumerate())
            .map(|(r, l)| {
                let l = if check { l } else { l.unchecked() };
                let l = l.moving_in_place();
                if r == 1 {
                    l.stalling_at(Op::ReduceScatter)
                } else {
                    l
                }
            })
            .collect();
        let ranks = on_links(&links, |_, l| {
            KvStore::over_loopback(l.clone(), BOUND).unwrap()
        });
        let init: Vec<f32> = (0..20).map(|i| i as f32 / 4.0 + 1.0).collect();
        let got = on_ranks(&ranks, |r, kv| {
            kv.init(0, &NDArray::from_vec(init.clone(), [20]).unwrap())
                .unwrap();
            let pushed = kv.push(0, &NDArray::ones([20]));
            // Rank 1 goes on to its next call; rank 0 is still in its push.
            let next = match r {
                1 => Some(kv.pull(0, &NDArray::zeros([20]))),
                _ => None,
            };
            (pushed, next)
        });
        let what = format!("check {check}");
        assert!(got[0].0.is_err(), "{what}: rank 0's push succeeded");
        assert!(got[1].0.is_err(), "{what}: rank 1's push succeeded");
        match &got[1].1 {
            Some(Err(Error::DistFailed { .. })) => {}
            other => panic!("{what}: rank 1's next call: {other:?}"),
        }
    }
}
