//! Elastic dist stores on the loopback link (N ranks as N threads), in `cargo test`: a rank lost
//! at a random point of a random program.
//!
//! - `a_rank_lost_anywhere_costs_nothing`: on 3 to 5 ranks, one rank dies at a random exchange
//!   of a program of pushes and pushpulls (SGD with momentum, a sliced key among whole ones).
//!   Every survivor gets [`Error::WorldChanged`] once, healed from the copies, and redoes the
//!   push unless it committed (a loss in a pushpull's pull comes after its commit). At the end every survivor's values equal, bit for bit, one local store fed
//!   exactly the pushes that committed, each summed over the ranks alive then. Skipping the
//!   buddies' update, or committing on some ranks only, makes the values differ.
//! - `two_losses_at_once_fall_back_to_the_checkpoint`: a rank and its buddy die together, so a
//!   part has no copy left: the survivors reload the last checkpoint.
//! - `a_side_without_a_majority_stops`: 1 survivor of 2 stops, and never computes on.
//!
//! Pushed values are multiples of 1/4 of at most 2 in magnitude and the updater's rates are
//! 1/2, so every sum and update is exact in float32, whatever the order.

use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use super::loopback_tests::{on_links, BOUND};
use crate::comm::link::loopback::Loopback;
use crate::{Error, KvStore, NDArray, Sgd, Updater};

/// Each key's elements: one sliced (more than [`BOUND`]), the others whole.
const LENS: [usize; 3] = [3, 20, 7];

/// A learning-rate schedule (halved at every update) on a store, where `on`.
fn schedule(kv: &KvStore, on: bool) {
    if on {
        let s = crate::LrScheduler::factor(1, 0.5);
        kv.set_lr_scheduler(Some(s)).expect("the schedule");
    }
}

/// The updater every store runs: state (momentum) that the copies must carry.
fn sgd() -> Updater {
    Updater::Sgd(Sgd {
        lr: 0.5,
        momentum: 0.5,
        ..Sgd::default()
    })
}

/// What rank `orig` (numbered as at the start) pushes to key `k` at `step`.
fn grad(seed: u64, orig: usize, step: usize, k: usize) -> NDArray {
    let v: Vec<f32> = (0..LENS[k])
        .map(|i| {
            let h =
                (seed ^ (orig as u64) << 40 ^ (step as u64) << 20 ^ (k as u64) << 10 ^ i as u64)
                    .wrapping_mul(0x9E37_79B9_7F4A_7C15);
            ((h >> 59) as f32 - 8.0) / 4.0
        })
        .collect();
    NDArray::from_vec(v, [LENS[k]]).expect("a gradient")
}

/// Every key's value at the start (rank 0's).
fn init(seed: u64) -> Vec<NDArray> {
    (0..LENS.len()).map(|k| grad(seed, 99, 0, k)).collect()
}

/// What one survivor saw: the ranks (numbered as at the start) alive at each push that
/// committed, in order, the error it got, and every key's value at the end.
type Seen = (Vec<Vec<usize>>, Vec<String>, Vec<Vec<f32>>);

/// Runs `steps` pushes on `n` ranks, where each of `victims` dies at its `die_after`-th
/// exchange after the setup; `save_at`: a checkpoint before that step. `None` for a rank that
/// died (or stopped without a majority: then its error). `scheduled`: under a schedule.
fn run(
    (n, steps, seed): (usize, usize, u64),
    victims: &[usize],
    die_after: u64,
    save_at: Option<(usize, &std::path::Path)>,
    scheduled: bool,
) -> Vec<Result<Seen, String>> {
    let links: Vec<Loopback> = Loopback::world(n, Duration::from_secs(20))
        .into_iter()
        .map(Loopback::elastic)
        .collect();
    let keys: Vec<i32> = (0..LENS.len() as i32).collect();
    on_links(&links, |orig, link| {
        let kv = KvStore::over_loopback(link.clone(), BOUND).expect("a store");
        kv.set_updater(sgd()).expect("the updater");
        schedule(&kv, scheduled);
        kv.init_list(&keys, &init(seed)).expect("the init");
        // The victims' clocks start after the setup, or after the checkpoint where one is saved.
        if victims.contains(&orig) && save_at.is_none() {
            link.die_after(die_after);
        }
        let mut alive: Vec<usize> = (0..n).collect();
        let (mut log, mut errors) = (Vec::new(), Vec::new());
        let mut step = 0;
        while step < steps {
            if save_at.is_some_and(|(s, _)| s == step) && !log.is_empty() {
                if let Some((_, dir)) = save_at {
                    if let Err(e) = kv.save(dir) {
                        panic!("rank {orig}: the save failed: {e}");
                    }
                    if victims.contains(&orig) && errors.is_empty() {
                        link.die_after(die_after);
                    }
                }
            }
            let grads: Vec<NDArray> = (0..LENS.len()).map(|k| grad(seed, orig, step, k)).collect();
            // Odd steps push and pull in one call: a loss in its pull comes after its commit.
            let outs: Vec<NDArray> = LENS.iter().map(|&n| NDArray::zeros([n])).collect();
            let pushed = match step % 2 {
                0 => kv.push_list(&keys, &grads),
                _ => kv.pushpull_list(&keys, &grads, &outs),
            };
            match pushed {
                Ok(()) => {
                    log.push(alive.clone());
                    step += 1;
                }
                Err(_) if link.is_gone() => return Err("died".to_owned()),
                Err(Error::WorldChanged {
                    lost,
                    committed,
                    restored,
                    ..
                }) => {
                    let back = restored.is_some();
                    errors.push(format!(
                        "lost {lost:?} committed {committed} restored {back}"
                    ));
                    if committed {
                        log.push(alive.clone());
                        step += 1;
                    }
                    if restored.is_some() {
                        // Back at the checkpoint: the pushes before it.
                        let saved = save_at.map_or(0, |(s, _)| s);
                        log.truncate(saved);
                        step = saved;
                    }
                    alive = (alive.iter().enumerate())
                        .filter(|(r, _)| !lost.contains(r))
                        .map(|(_, &o)| o)
                        .collect();
                }
                Err(e @ Error::DistFailed { .. }) => return Err(e.to_string()),
                Err(e) => panic!("rank {orig}: {e}"),
            }
        }
        let mut values = Vec::new();
        for &k in &keys {
            let out = NDArray::zeros([LENS[k as usize]]);
            loop {
                match kv.pull(k, &out) {
                    Ok(()) => break,
                    Err(_) if link.is_gone() => return Err("died".to_owned()),
                    // A loss during the pull: the keys are as they were (healed); pull again.
                    Err(Error::WorldChanged { healed, .. }) => {
                        errors.push(format!("pull: healed {healed}"));
                        assert!(
                            healed,
                            "rank {orig}: a loss in the last pull was not healed"
                        );
                        continue;
                    }
                    Err(e) => panic!("rank {orig}: the pull: {e}"),
                }
            }
            values.push(out.to_vec::<f32>().expect("values"));
        }
        Ok((log, errors, values))
    })
}

/// One local store fed the pushes `log` committed (each the sum over the ranks alive then).
fn reference(seed: u64, log: &[Vec<usize>], scheduled: bool) -> Vec<Vec<f32>> {
    let kv = KvStore::create("local").expect("a local store");
    kv.set_updater(sgd()).expect("the updater");
    schedule(&kv, scheduled);
    let keys: Vec<i32> = (0..LENS.len() as i32).collect();
    kv.init_list(&keys, &init(seed)).expect("the init");
    for (step, alive) in log.iter().enumerate() {
        for (k, &key) in keys.iter().enumerate() {
            let grads: Vec<NDArray> = alive.iter().map(|&o| grad(seed, o, step, k)).collect();
            kv.push(key, &grads).expect("a push");
        }
    }
    keys.iter()
        .map(|&k| {
            let out = NDArray::zeros([LENS[k as usize]]);
            kv.pull(k, &out).expect("a pull");
            out.to_vec::<f32>().expect("values")
        })
        .collect()
}

/// Checks that every survivor saw the same pushes commit, and holds the values one local store
/// fed them holds; returns the survivors' count.
fn check_survivors(seed: u64, seen: &[Result<Seen, String>], scheduled: bool) -> usize {
    let survivors: Vec<&Seen> = seen.iter().filter_map(|s| s.as_ref().ok()).collect();
    let Some(first) = survivors.first() else {
        return 0;
    };
    let want = reference(seed, &first.0, scheduled);
    for s in &survivors {
        assert_eq!(s.0, first.0, "the survivors saw different pushes commit");
        assert_eq!(
            s.2, want,
            "a survivor's values differ from the committed pushes' (log {:?}, errors {:?})",
            s.0, s.1
        );
    }
    survivors.len()
}

#[test]
fn a_rank_lost_anywhere_costs_nothing() {
    let mut runner = TestRunner::new(Config {
        cases: 24,
        ..Config::default()
    });
    let cases = (3usize..=5, 0usize..5, 1u64..25, any::<u64>());
    runner
        .run(&cases, |(n, victim, die_after, seed)| {
            let victim = victim % n;
            let seen = run((n, 6, seed), &[victim], die_after, None, false);
            prop_assert!(seen[victim].is_err(), "the victim lived on");
            let survivors = check_survivors(seed, &seen, false);
            prop_assert_eq!(survivors, n - 1);
            for s in seen.iter().flatten() {
                // Once at most: a loss after the last push costs no error.
                prop_assert!(s.1.len() <= 1, "{:?}", s.1);
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn two_losses_at_once_fall_back_to_the_checkpoint() {
    // Ranks 1 and 2 of 5 on one machine: 2 keeps 1's copy, so 1's parts have no copy left.
    for die_after in [1, 4, 9] {
        let dir = std::env::temp_dir().join(format!(
            "kvstore-elastic-two-{}-{die_after}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a directory");
        let seen = run(
            (5, 6, 7 + die_after),
            &[1, 2],
            die_after,
            Some((2, &dir)),
            false,
        );
        assert_eq!(check_survivors(7 + die_after, &seen, false), 3);
        for s in seen.iter().flatten() {
            assert_eq!(s.1.len(), 1, "{:?}", s.1);
            assert!(s.1[0].contains("restored true"), "{:?}", s.1);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_side_without_a_majority_stops() {
    let seen = run((2, 6, 3), &[1], 5, None, false);
    match &seen[0] {
        Err(e) => assert!(e.contains("no majority"), "{e}"),
        Ok(s) => panic!("the survivor of 2 went on: {:?}", s.1),
    }
}

#[test]
fn back_at_the_checkpoint_a_schedule_gives_the_redone_pushes_their_rates() {
    // A rank and its buddy die some pushes after the checkpoint: the survivors reload it and
    // redo those pushes, which a schedule must rate as it did the first time (MXNet's
    // num_update goes back with the keys' counts).
    for die_after in [12, 18, 24, 30] {
        let dir = std::env::temp_dir().join(format!(
            "kvstore-elastic-schedule-{}-{die_after}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a directory");
        let seen = run(
            (5, 8, 7 + die_after),
            &[1, 2],
            die_after,
            Some((1, &dir)),
            true,
        );
        assert_eq!(check_survivors(7 + die_after, &seen, true), 3);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
