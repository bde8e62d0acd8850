//! Elastic dist stores on the loopback link (N ranks as N threads), in `cargo test`: a rank lost
//! at a random point of a random program.
//!
//! - `a_rank_lost_anywhere_costs_nothing`: on 2 to 5 ranks, one rank dies at a random exchange
//!   of a random program of pushes, pushpulls, pulls, barriers, saves and inits (SGD with
//!   momentum, a sliced key among whole ones), before or after its part of that exchange went
//!   out (after: the exchange completes on some survivors and fails on others). Every survivor
//!   must see the same calls succeed and the same one fail with [`Error::WorldChanged`], healed
//!   from the copies, and redo it unless it committed. At the end every survivor's values equal,
//!   bit for bit, one local store fed exactly the calls that committed, each push summed over
//!   the ranks alive then. Skipping the buddies' update, committing on some ranks only, or
//!   ending a call on some survivors only makes them differ. On 2 ranks the survivor stops.
//!   Half the cases move the values in place, as GPU ranks do. A third of the cases send the
//!   updated parts to the buddies (`KVSTORE_REPLICA_UPDATE=send`), and a third run a closure
//!   updater (whose parts are always sent); there a loss while the parts travel may go back to
//!   the checkpoint (a save made first).
//! - `sent_copies_heal_a_loss_but_while_they_travel`: with sent copies, a rank dies at every
//!   exchange of a program in turn: the survivors heal from the copies, but while a push's
//!   parts are on their way, when they go back to the checkpoint.
//! - `calls_queued_in_the_async_mode_commit_or_fail_everywhere`: the same through an
//!   [`AsyncKvStore`](crate::AsyncKvStore) queue: every survivor fails the same queued call.
//! - `a_second_loss_during_the_heal_heals_again_from_the_copies`: a heal that another loss
//!   ends puts the old table back, and the survivors heal again.
//! - `two_losses_at_once_fall_back_to_the_checkpoint`: a rank and its buddy die together, so a
//!   part has no copy left: the survivors reload the last checkpoint.
//! - `a_loss_after_a_heal_heals_from_the_copies_the_heal_made`: a second loss, some calls
//!   after the first heal, heals from the copies that heal made for the new buddies.
//! - `a_heal_moves_only_the_lost_ranks_keys_and_the_slices_that_change`: whole keys stay on
//!   their homes, and the error counts the keys that moved.
//! - `a_side_without_a_majority_stops`: 1 survivor of 2 stops, and never computes on.
//!
//! `heal_tests` tries to break the heal itself (many keys and dtypes, Adam, 3 to 7 ranks, two
//! losses, saves and loads, compression, row-sparse keys).
//!
//! Pushed values are multiples of 1/4 of at most 2 in magnitude and the updater's rates are
//! 1/2, so every sum and update is exact in float32, whatever the order.

use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use super::loopback_tests::{on_links, BOUND};
use crate::comm::link::loopback::Loopback;
use crate::config::ReplicaUpdate;
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

/// The updater of a test: [`sgd`], or a closure (`closure`) that no copy can replay.
fn updater(closure: bool) -> Updater {
    match closure {
        true => Updater::custom(|_key, input, stored| *stored += input * -0.5),
        false => sgd(),
    }
}

/// A call of a test program (every rank makes the same).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    Push,
    PushPull,
    Pull,
    Barrier,
    Save,
    /// A new key, numbered 100 + the step.
    Init,
    /// A new key as [`Call::Init`] makes, pulled in the same call.
    Broadcast,
}

const CALLS: [Call; 7] = [
    Call::Push,
    Call::PushPull,
    Call::Pull,
    Call::Barrier,
    Call::Save,
    Call::Init,
    Call::Broadcast,
];

/// The elements of `key` (the base keys 0..3, or 100 + the step that added it).
fn len_of(key: i32) -> usize {
    LENS[(key % 100) as usize % LENS.len()]
}

/// What rank `orig` (numbered as at the start) pushes to `key` at `step`.
fn grad(seed: u64, orig: usize, step: usize, key: i32) -> NDArray {
    let n = len_of(key);
    let v: Vec<f32> = (0..n)
        .map(|i| {
            let h =
                (seed ^ (orig as u64) << 40 ^ (step as u64) << 20 ^ (key as u64) << 10 ^ i as u64)
                    .wrapping_mul(0x9E37_79B9_7F4A_7C15);
            ((h >> 59) as f32 - 8.0) / 4.0
        })
        .collect();
    NDArray::from_vec(v, [n]).expect("a gradient")
}

/// The base keys' values at the start (rank 0's).
fn init(seed: u64) -> Vec<NDArray> {
    (0..LENS.len() as i32)
        .map(|k| grad(seed, 99, 0, k))
        .collect()
}

/// The keys a store holds after the calls `log` committed: the base keys, then those added.
fn keys_after(program: &[Call], log: &[(usize, Vec<usize>)]) -> Vec<i32> {
    let added = (log.iter()).filter(|(s, _)| matches!(program[*s], Call::Init | Call::Broadcast));
    (0..LENS.len() as i32)
        .chain(added.map(|(s, _)| 100 + *s as i32))
        .collect()
}

/// What one survivor saw: the steps that took effect, in order, each with the ranks (numbered
/// as at the start) alive then; every call's outcome in words; every key's value at the end.
struct Seen {
    log: Vec<(usize, Vec<usize>)>,
    events: Vec<String>,
    values: Vec<(i32, Vec<f32>)>,
}

/// A test run: `program` on `n` ranks; each of `victims` dies at its `die_after`-th exchange
/// counted from the start of step `arm` (`sent`: after its part of it went out); saves go to
/// `dir`; `scheduled`: under a learning-rate schedule.
struct Plan<'a> {
    n: usize,
    seed: u64,
    program: &'a [Call],
    victims: &'a [usize],
    die_after: u64,
    sent: bool,
    arm: usize,
    dir: &'a std::path::Path,
    scheduled: bool,
    /// The ranks move their values in place, as GPU ranks do.
    in_place: bool,
    /// A rank that dies at its n-th exchange of the world the survivors make (during the
    /// recovery from the victims' loss).
    second: Option<(usize, u64)>,
    /// How the pushes keep the copies current (`KVSTORE_REPLICA_UPDATE`).
    update: ReplicaUpdate,
    /// The updater is a closure (no state), not SGD with momentum: its copies are sent.
    closure: bool,
}

/// Whether `plan`'s pushes send their updated parts to the buddies (not the sums to replay).
fn sends(plan: &Plan<'_>) -> bool {
    plan.update == ReplicaUpdate::Send || plan.closure
}

/// Runs `plan`: each rank's [`Seen`], or why it stopped (`died`, or its error).
fn run(plan: &Plan<'_>) -> Vec<Result<Seen, String>> {
    let links: Vec<Loopback> = Loopback::world(plan.n, Duration::from_secs(20))
        .into_iter()
        .map(Loopback::elastic)
        .map(|l| match plan.in_place {
            true => l.moving_in_place(),
            false => l,
        })
        .collect();
    let (seed, program) = (plan.seed, plan.program);
    on_links(&links, |orig, link| {
        let kv = KvStore::over_loopback_keeping(link.clone(), BOUND, Some(plan.update))
            .expect("a store");
        kv.set_updater(updater(plan.closure)).expect("the updater");
        schedule(&kv, plan.scheduled);
        let base: Vec<i32> = (0..LENS.len() as i32).collect();
        kv.init_list(&base, &init(seed)).expect("the init");
        if sends(plan) {
            // A loss while a push's parts are on their way goes back to a checkpoint.
            kv.save(plan.dir).expect("the first save");
        }
        let mut alive: Vec<usize> = (0..plan.n).collect();
        let (mut log, mut events) = (Vec::new(), Vec::new());
        let (mut step, mut armed) = (0, false);
        while step < program.len() {
            if step == plan.arm && !armed {
                if plan.victims.contains(&orig) {
                    link.die_after(plan.die_after, plan.sent);
                }
                if let Some((_, n)) = plan.second.filter(|&(r, _)| r == orig) {
                    link.die_in_next_world(n);
                }
                armed = true;
            }
            let keys = keys_after(program, &log);
            let grads: Vec<NDArray> = keys.iter().map(|&k| grad(seed, orig, step, k)).collect();
            let outs: Vec<NDArray> = keys.iter().map(|&k| NDArray::zeros([len_of(k)])).collect();
            let call = program[step];
            let got = match call {
                Call::Push => kv.push_list(&keys, &grads),
                Call::PushPull => kv.pushpull_list(&keys, &grads, &outs),
                Call::Pull => kv.pull_list(&keys, &outs),
                Call::Barrier => kv.barrier(),
                Call::Save => kv.save(plan.dir),
                Call::Init => kv.init(100 + step as i32, &grad(seed, 98, step, 100 + step as i32)),
                Call::Broadcast => {
                    let key = 100 + step as i32;
                    let out = NDArray::zeros([len_of(key)]);
                    kv.broadcast(key, &grad(seed, 98, step, key), &out)
                }
            };
            match got {
                Ok(()) => {
                    events.push(format!("{step} {call:?}: ok"));
                    log.push((step, alive.clone()));
                    step += 1;
                }
                Err(_) if link.is_gone() => return Err("died".to_owned()),
                Err(Error::WorldChanged {
                    lost,
                    committed,
                    healed,
                    restored,
                    ..
                }) => {
                    let back = restored.is_some();
                    events.push(format!(
                        "{step} {call:?}: lost {lost:?} committed {committed} healed {healed} \
                         restored {back}"
                    ));
                    if committed {
                        log.push((step, alive.clone()));
                        step += 1;
                    }
                    if back {
                        // Back at the last save: the calls after it are redone.
                        match (log.iter()).rposition(|(s, _)| program[*s] == Call::Save) {
                            Some(saved) => {
                                step = log[saved].0 + 1;
                                log.truncate(saved + 1);
                            }
                            None => {
                                assert!(sends(plan), "no save to go back to");
                                step = 0;
                                log.clear();
                            }
                        }
                    }
                    alive = (alive.iter().enumerate())
                        .filter(|(r, _)| !lost.contains(r))
                        .map(|(_, &o)| o)
                        .collect();
                }
                Err(e @ Error::DistFailed { .. }) => return Err(e.to_string()),
                Err(e) => panic!("rank {orig}, step {step} ({call:?}): {e}"),
            }
        }
        let mut values = Vec::new();
        for k in keys_after(program, &log) {
            let out = NDArray::zeros([len_of(k)]);
            loop {
                match kv.pull(k, &out) {
                    Ok(()) => break,
                    Err(_) if link.is_gone() => return Err("died".to_owned()),
                    // A loss during the pull: the keys are as they were (healed); pull again.
                    Err(Error::WorldChanged { healed, .. }) => {
                        events.push(format!("the last pull of {k}: healed {healed}"));
                        assert!(
                            healed,
                            "rank {orig}: a loss in the last pull was not healed"
                        );
                    }
                    Err(e @ Error::DistFailed { .. }) => return Err(e.to_string()),
                    Err(e) => panic!("rank {orig}: the pull: {e}"),
                }
            }
            values.push((k, out.to_vec::<f32>().expect("values")));
        }
        Ok(Seen {
            log,
            events,
            values,
        })
    })
}

/// One local store fed the calls `log` committed (each push the sum over the ranks alive then).
fn reference(plan: &Plan<'_>, log: &[(usize, Vec<usize>)]) -> Vec<(i32, Vec<f32>)> {
    let (seed, program) = (plan.seed, plan.program);
    let kv = KvStore::create("local").expect("a local store");
    kv.set_updater(updater(plan.closure)).expect("the updater");
    schedule(&kv, plan.scheduled);
    let base: Vec<i32> = (0..LENS.len() as i32).collect();
    kv.init_list(&base, &init(seed)).expect("the init");
    for (i, (step, alive)) in log.iter().enumerate() {
        let step = *step;
        match program[step] {
            Call::Push | Call::PushPull => {
                for key in keys_after(program, &log[..i]) {
                    let grads: Vec<NDArray> =
                        alive.iter().map(|&o| grad(seed, o, step, key)).collect();
                    kv.push(key, &grads).expect("a push");
                }
            }
            Call::Init | Call::Broadcast => {
                let key = 100 + step as i32;
                kv.init(key, &grad(seed, 98, step, key)).expect("an init");
            }
            Call::Pull | Call::Barrier | Call::Save => {}
        }
    }
    keys_after(program, log)
        .into_iter()
        .map(|k| {
            let out = NDArray::zeros([len_of(k)]);
            kv.pull(k, &out).expect("a pull");
            (k, out.to_vec::<f32>().expect("values"))
        })
        .collect()
}

/// Checks that every survivor saw the same calls succeed and fail, and holds the values one
/// local store fed the committed ones holds; returns the survivors' count.
fn check_survivors(plan: &Plan<'_>, seen: &[Result<Seen, String>]) -> usize {
    let survivors: Vec<&Seen> = seen.iter().filter_map(|s| s.as_ref().ok()).collect();
    let Some(first) = survivors.first() else {
        return 0;
    };
    let want = reference(plan, &first.log);
    for s in &survivors {
        assert_eq!(
            s.events, first.events,
            "the survivors saw different calls succeed or fail"
        );
        assert_eq!(s.log, first.log, "the survivors saw different calls commit");
        assert_eq!(
            s.values, want,
            "a survivor's values differ from the committed calls' (events {:?})",
            s.events
        );
    }
    survivors.len()
}

/// A fresh directory for a test's checkpoints.
fn fresh_dir(what: &str, case: u64) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "kvstore-elastic-{what}-{}-{case}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a directory");
    dir
}

#[test]
fn a_rank_lost_anywhere_costs_nothing() {
    let mut runner = TestRunner::new(Config {
        cases: 48,
        ..Config::default()
    });
    let program = proptest::collection::vec(0..CALLS.len(), 3..9);
    let cases = (2usize..=5, 0usize..5, 1u64..30, any::<bool>(), program);
    let case = std::sync::atomic::AtomicU64::new(0);
    // How the copies keep up: SGD's sums replayed, SGD's parts sent, a closure's parts sent.
    let copies = [
        (ReplicaUpdate::Replay, false),
        (ReplicaUpdate::Send, false),
        (ReplicaUpdate::Replay, true),
    ];
    runner
        .run(
            &(cases, any::<u64>(), any::<bool>(), 0..copies.len()),
            |((n, victim, die_after, sent, calls), seed, in_place, how)| {
                let (update, closure) = copies[how];
                let victim = victim % n;
                let program: Vec<Call> = calls.iter().map(|&c| CALLS[c]).collect();
                let dir = fresh_dir(
                    "any",
                    case.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                );
                let plan = Plan {
                    n,
                    seed,
                    program: &program,
                    victims: &[victim],
                    die_after,
                    sent,
                    arm: 0,
                    dir: &dir,
                    scheduled: false,
                    in_place,
                    second: None,
                    update,
                    closure,
                };
                let seen = run(&plan);
                let _ = std::fs::remove_dir_all(&dir);
                let died = seen[victim].is_err();
                let survivors = check_survivors(&plan, &seen);
                match (died, n) {
                    // The victim's clock ran out after its last call: nobody was lost.
                    (false, _) => prop_assert_eq!(survivors, n),
                    // 1 of 2 is no majority: the survivor stops.
                    (true, 2) => {
                        let other = &seen[1 - victim];
                        prop_assert!(
                            matches!(other, Err(e) if e.contains("no majority")),
                            "the survivor of 2 went on, or stopped for another reason"
                        );
                    }
                    (true, _) => prop_assert_eq!(survivors, n - 1),
                }
                for s in seen.iter().flatten() {
                    let changes = s.events.iter().filter(|e| e.contains("lost")).count();
                    prop_assert!(changes <= 1, "{:?}", s.events);
                    // Replayed copies never lag; sent ones may, while a push's parts travel.
                    if !sends(&plan) {
                        prop_assert!(!s.events.iter().any(|e| e.contains("restored true")));
                    }
                }
                Ok(())
            },
        )
        .unwrap();
}

#[test]
fn calls_queued_in_the_async_mode_commit_or_fail_everywhere() {
    // Each rank queues 5 pushes and a pull, then waits: a rank lost among them fails the same
    // queued call on every survivor (the later ones are skipped), and the keys hold exactly the
    // pushes before it, and it too where it committed.
    let steps = 5;
    for case in 0..12u64 {
        let (n, seed) = (3 + case as usize % 3, 1000 + case);
        let (victim, die_after, sent) = (case as usize % n, 1 + case * 3 % 14, case % 2 == 0);
        let links: Vec<Loopback> = Loopback::world(n, Duration::from_secs(20))
            .into_iter()
            .map(Loopback::elastic)
            .collect();
        let keys: Vec<i32> = (0..LENS.len() as i32).collect();
        let seen = on_links(&links, |orig, link| {
            let kv = KvStore::over_loopback(link.clone(), BOUND).expect("a store");
            kv.set_updater(sgd()).expect("the updater");
            kv.init_list(&keys, &init(seed)).expect("the init");
            let queue = crate::AsyncKvStore::new(kv);
            if orig == victim {
                link.die_after(die_after, sent);
            }
            for step in 0..steps {
                let grads: Vec<NDArray> = keys.iter().map(|&k| grad(seed, orig, step, k)).collect();
                queue.push_list(&keys, &grads, 0);
            }
            let outs: Vec<NDArray> = keys.iter().map(|&k| NDArray::zeros([len_of(k)])).collect();
            queue.pull_list(&keys, &outs, 0);
            let waited = queue.wait_all();
            if link.is_gone() {
                return None;
            }
            let failed = match waited {
                Ok(()) => None,
                Err(Error::Async {
                    call,
                    skipped,
                    source,
                }) => match &*source {
                    Error::WorldChanged {
                        committed, lost, ..
                    } => Some((call, skipped, *committed, lost.clone())),
                    e => panic!("rank {orig}: {call} failed: {e}"),
                },
                Err(e) => panic!("rank {orig}: {e}"),
            };
            let values: Vec<Vec<f32>> = (keys.iter())
                .map(|&k| {
                    let out = NDArray::zeros([len_of(k)]);
                    queue
                        .store()
                        .pull(k, &out)
                        .expect("a pull after the change");
                    out.to_vec::<f32>().expect("values")
                })
                .collect();
            Some((failed, values))
        });
        let survivors: Vec<_> = seen.iter().flatten().collect();
        let first = survivors.first().expect("survivors");
        // The pushes that took effect: those before the failed call, and it where committed.
        let done = match &first.0 {
            None => steps,
            Some((call, _, committed, _)) => {
                let number: usize = call[1..call.find(' ').expect("a number")]
                    .parse()
                    .expect("the call's number");
                (number - 1).min(steps) + usize::from(*committed && number <= steps)
            }
        };
        let program = vec![Call::Push; steps];
        // Every push that took effect, the failed one too, summed every rank's values.
        let log: Vec<(usize, Vec<usize>)> = (0..done).map(|s| (s, (0..n).collect())).collect();
        let plan = Plan {
            n,
            seed,
            program: &program,
            victims: &[victim],
            die_after,
            sent,
            arm: 0,
            dir: std::path::Path::new("."),
            scheduled: false,
            in_place: false,
            second: None,
            update: ReplicaUpdate::Replay,
            closure: false,
        };
        let want: Vec<Vec<f32>> = reference(&plan, &log).into_iter().map(|(_, v)| v).collect();
        for s in &survivors {
            assert_eq!(
                s.0, first.0,
                "case {case}: the survivors failed different calls"
            );
            assert_eq!(
                s.1, want,
                "case {case}: the values differ from the committed pushes'"
            );
        }
    }
}

#[test]
fn two_losses_at_once_fall_back_to_the_checkpoint() {
    // Ranks 1 and 2 of 5 on one machine: 2 keeps 1's copy, so 1's parts have no copy left.
    let program = [
        Call::Push,
        Call::PushPull,
        Call::Save,
        Call::Push,
        Call::PushPull,
        Call::Push,
        Call::PushPull,
    ];
    for die_after in [1, 4, 9] {
        let dir = fresh_dir("two", die_after);
        let plan = Plan {
            n: 5,
            seed: 7 + die_after,
            program: &program,
            victims: &[1, 2],
            die_after,
            sent: false,
            arm: 3,
            dir: &dir,
            scheduled: false,
            in_place: false,
            second: None,
            update: ReplicaUpdate::Replay,
            closure: false,
        };
        let seen = run(&plan);
        assert_eq!(check_survivors(&plan, &seen), 3);
        for s in seen.iter().flatten() {
            let changes: Vec<&String> = s.events.iter().filter(|e| e.contains("lost")).collect();
            assert_eq!(changes.len(), 1, "{:?}", s.events);
            assert!(changes[0].contains("restored true"), "{:?}", s.events);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_second_loss_during_the_heal_heals_again_from_the_copies() {
    // Rank 1 of 5 dies; rank 3 (not 1's buddy, 2, nor its source, 0) dies at an exchange of the
    // survivors' heal. The heal fails, puts the old table back, and the 3 survivors heal again
    // from the copies: nothing goes back to a checkpoint (there is none).
    let program = [
        Call::Push,
        Call::PushPull,
        Call::Push,
        Call::PushPull,
        Call::Push,
    ];
    for (die_after, during) in [(2, 1), (3, 2), (5, 3), (7, 4), (4, 5)] {
        let plan = Plan {
            n: 5,
            seed: 11 + die_after,
            program: &program,
            victims: &[1],
            die_after,
            sent: false,
            arm: 0,
            dir: std::path::Path::new("."),
            scheduled: false,
            in_place: false,
            second: Some((3, during)),
            update: ReplicaUpdate::Replay,
            closure: false,
        };
        let seen = run(&plan);
        assert!(seen[1].is_err() && seen[3].is_err(), "a victim lived on");
        assert_eq!(check_survivors(&plan, &seen), 3);
        for s in seen.iter().flatten() {
            let changes: Vec<&String> = s.events.iter().filter(|e| e.contains("lost")).collect();
            assert_eq!(changes.len(), 1, "{:?}", s.events);
            assert!(
                changes[0].contains("lost [1, 3]") && changes[0].contains("healed true"),
                "{:?}",
                s.events
            );
        }
    }
}

#[test]
fn a_loss_after_a_heal_heals_from_the_copies_the_heal_made() {
    // Rank 1 of 5 dies after two pushes (so the keys have momentum); some calls later, in the world of 4, another rank dies: its parts
    // (some placed by the first heal, some of them 1's) come back from the copies that the
    // first heal made for the new buddies. Copies made without their state, or not at all,
    // make the values differ.
    let program = [Call::Push, Call::PushPull].repeat(5);
    let mut seen_twice = 0;
    for (second, during, in_place) in [
        (2, 14, false),
        (0, 20, true),
        (3, 26, false),
        (4, 14, true),
        (2, 30, true),
        (0, 40, false),
    ] {
        let plan = Plan {
            n: 5,
            seed: 5 + during,
            program: &program,
            victims: &[1],
            die_after: 3,
            sent: false,
            arm: 2,
            dir: std::path::Path::new("."),
            scheduled: false,
            in_place,
            second: Some((second, during)),
            update: ReplicaUpdate::Replay,
            closure: false,
        };
        let seen = run(&plan);
        assert!(
            seen[1].is_err() && seen[second].is_err(),
            "a victim lived on"
        );
        assert_eq!(check_survivors(&plan, &seen), 3);
        for s in seen.iter().flatten() {
            let changes: Vec<&String> = s.events.iter().filter(|e| e.contains("lost")).collect();
            assert!(
                changes.iter().all(|c| c.contains("healed true")),
                "{:?}",
                s.events
            );
            if changes.len() == 2 {
                seen_twice += 1;
            }
        }
    }
    // The second loss came after the first heal (two changes), not during it, in most runs.
    assert!(
        seen_twice >= 3 * 4,
        "{seen_twice} survivors saw two changes"
    );
}

#[test]
fn a_heal_moves_only_the_lost_ranks_keys_and_the_slices_that_change() {
    // 5 ranks, 17 whole keys of 1 to 8 elements and a sliced one of 40; rank 3 dies in a
    // push. Whole keys on the survivors stay where they are; rank 3's go where the bytes are
    // fewest, ties to its buddy (rank 4), which kept their copies; the sliced key is cut again.
    let lens: Vec<usize> = (0..17).map(|k| 1 + (k * 5) % 8).chain([40]).collect();
    let keys: Vec<i32> = (0..lens.len() as i32).collect();
    let links: Vec<Loopback> = Loopback::world(5, Duration::from_secs(20))
        .into_iter()
        .map(Loopback::elastic)
        .collect();
    let seen = on_links(&links, |rank, link| {
        let kv = KvStore::over_loopback(link.clone(), BOUND).expect("a store");
        kv.set_updater(sgd()).expect("the updater");
        let values: Vec<NDArray> = (keys.iter().zip(&lens))
            .map(|(&k, &n)| NDArray::from_vec(vec![k as f32 / 4.0; n], [n]).expect("a value"))
            .collect();
        kv.init_list(&keys, &values).expect("the init");
        let spreads = || -> Vec<crate::comm::Spread> {
            let table = super::read(&kv.table);
            keys.iter()
                .map(|k| table.slots[&crate::Key::Int(*k)].spread)
                .collect()
        };
        let grads: Vec<NDArray> = (lens.iter())
            .map(|&n| NDArray::from_vec(vec![0.25 * (rank + 1) as f32; n], [n]).expect("a grad"))
            .collect();
        kv.push_list(&keys, &grads).expect("a push");
        let before = spreads();
        if rank == 3 {
            link.die_after(2, false);
        }
        match kv.push_list(&keys, &grads) {
            Err(Error::WorldChanged { detail, healed, .. }) => {
                assert!(healed, "{detail}");
                Some((before, spreads(), detail))
            }
            Err(_) if link.is_gone() => None,
            other => panic!("rank {rank}: {other:?}"),
        }
    });
    let (before, after, detail) = seen[0].clone().expect("rank 0 lived");
    let new_of = |r: usize| r - usize::from(r > 3);
    let mut must_move = 1; // the sliced key
    for (k, (b, a)) in before.iter().zip(&after).enumerate() {
        match *b {
            crate::comm::Spread::Whole { rank: 3 } => {
                must_move += usize::from(*a != crate::comm::Spread::Whole { rank: 3 });
            }
            crate::comm::Spread::Whole { rank } => {
                assert_eq!(
                    *a,
                    crate::comm::Spread::Whole { rank: new_of(rank) },
                    "key {k}"
                );
            }
            crate::comm::Spread::Sliced => assert_eq!(*a, crate::comm::Spread::Sliced),
        }
    }
    let lost_keys = (before.iter())
        .filter(|s| **s == crate::comm::Spread::Whole { rank: 3 })
        .count();
    assert!(lost_keys >= 2, "rank 3 held {lost_keys} keys");
    assert!(
        detail.contains(&format!(" {must_move} of 18 keys moved")),
        "{must_move} keys should have moved: {detail}"
    );
    for s in seen.iter().flatten() {
        assert_eq!(
            (&s.0, &s.1),
            (&before, &after),
            "the survivors placed keys differently"
        );
    }
}

#[test]
fn a_side_without_a_majority_stops() {
    let program = [Call::Push; 6];
    let plan = Plan {
        n: 2,
        seed: 3,
        program: &program,
        victims: &[1],
        die_after: 5,
        sent: false,
        arm: 0,
        dir: std::path::Path::new("."),
        scheduled: false,
        in_place: false,
        second: None,
        update: ReplicaUpdate::Replay,
        closure: false,
    };
    match &run(&plan)[0] {
        Err(e) => assert!(e.contains("no majority"), "{e}"),
        Ok(s) => panic!("the survivor of 2 went on: {:?}", s.events),
    }
}

#[test]
fn back_at_the_checkpoint_a_schedule_gives_the_redone_pushes_their_rates() {
    // A rank and its buddy die some pushes after the checkpoint: the survivors reload it and
    // redo those pushes, which a schedule must rate as it did the first time (MXNet's
    // num_update goes back with the keys' counts).
    let mut program = vec![Call::Push, Call::Save];
    program.extend([Call::Push, Call::PushPull].repeat(4));
    for die_after in [12, 18, 24, 30] {
        let dir = fresh_dir("schedule", die_after);
        let plan = Plan {
            n: 5,
            seed: 7 + die_after,
            program: &program,
            victims: &[1, 2],
            die_after,
            sent: false,
            arm: 2,
            dir: &dir,
            scheduled: true,
            in_place: false,
            second: None,
            update: ReplicaUpdate::Replay,
            closure: false,
        };
        let seen = run(&plan);
        assert_eq!(check_survivors(&plan, &seen), 3);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn sent_copies_heal_a_loss_but_while_they_travel() {
    // `KVSTORE_REPLICA_UPDATE=send`, and a closure updater (whose copies are always sent): a
    // rank dies at every exchange of a program in turn. Every survivor must end equal to the
    // committed calls; a loss heals from the copies, but one while a push's parts are on their
    // way to the buddies, which goes back to the checkpoint (the first save) instead. Copies
    // never sent, or not marked as lagging while they travel, make the values differ.
    let program = [Call::Push, Call::PushPull, Call::Pull, Call::Push];
    for (update, closure) in [(ReplicaUpdate::Send, false), (ReplicaUpdate::Replay, true)] {
        let (mut healed, mut back) = (0, 0);
        for (n, victim) in [(4, 1), (5, 4)] {
            for die_after in 1..36u64 {
                for sent in [false, true] {
                    let dir = fresh_dir("sent", die_after * 2 + u64::from(sent));
                    let plan = Plan {
                        n,
                        seed: 3 + die_after,
                        program: &program,
                        victims: &[victim],
                        die_after,
                        sent,
                        arm: 0,
                        dir: &dir,
                        scheduled: false,
                        in_place: die_after % 3 == 0,
                        second: None,
                        update,
                        closure,
                    };
                    let seen = run(&plan);
                    let _ = std::fs::remove_dir_all(&dir);
                    check_survivors(&plan, &seen);
                    let Some(change) = (seen.iter().flatten())
                        .flat_map(|s| s.events.iter().find(|e| e.contains("lost")))
                        .next()
                    else {
                        continue;
                    };
                    match change.contains("restored true") {
                        true => {
                            assert!(change.contains("Push"), "{change}");
                            back += 1;
                        }
                        false => {
                            assert!(change.contains("healed true"), "{change}");
                            healed += 1;
                        }
                    }
                }
            }
        }
        println!("{update:?}, closure {closure}: {healed} losses healed, {back} went back");
        // Only a loss while the parts travel goes back: 21 to 23 of about 100 kill points
        // here. Copies marked as lagging before the commit point (a loss there leaves them
        // current) sent 36 of 112 back.
        assert!(
            back > 0 && back * 3 < healed,
            "{update:?}, closure {closure}: {healed} healed, {back} went back"
        );
    }
}
