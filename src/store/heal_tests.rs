//! Adversarial tests of the heal after a lost rank (`heal/`): many keys of mixed sizes and
//! dtypes, Adam and SGD with momentum, 3 to 7 ranks, every lost rank, in place or not, two
//! losses in a row, string keys, keys inited after a loss, saves and loads across a heal, 2-bit
//! compression across a heal. Every store's values are compared, bit for bit, with an
//! independent reference: one local store fed the committed pushes (each the sum over the ranks
//! alive then), or, for compression, the 2-bit rule written out here.
//!
//! Pushed values are multiples of 1/4 of at most 2 in magnitude and the rates are 1/2, as in
//! `elastic_tests`, so every sum is exact whatever the order.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::loopback_tests::{on_links, BOUND};
use crate::comm::link::loopback::Loopback;
use crate::{Adam, Compression, DType, Error, Key, KvStore, NDArray, Sgd, Updater};

#[derive(Clone, Debug)]
struct KeySpec {
    key: Key,
    len: usize,
    dtype: DType,
}

/// A call of a test program (every rank makes the same).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    Push,
    PushPull,
    Pull,
    /// Inits late key `i`.
    Init(usize),
    Save,
    Load,
}

/// A loss: rank `orig` (numbered as at the start) dies at its `after`-th exchange counted from
/// the start of step `arm`, before (or, `sent`, after) its deposit.
#[derive(Clone, Copy, Debug)]
struct Loss {
    orig: usize,
    arm: usize,
    after: u64,
    sent: bool,
}

struct Case<'a> {
    n: usize,
    seed: u64,
    keys: &'a [KeySpec],
    late: &'a [KeySpec],
    program: &'a [Call],
    losses: &'a [Loss],
    in_place: bool,
    updater: Updater,
    dir: Option<&'a Path>,
    /// Applied to every store, the reference too, after the updater is set.
    setup: Option<fn(&KvStore)>,
}

struct Seen {
    log: Vec<(usize, Vec<usize>)>,
    events: Vec<String>,
    values: Vec<(Key, Vec<f64>)>,
}

fn hash(seed: u64, a: u64, b: u64, c: u64, i: u64) -> u64 {
    let mut h =
        seed ^ a.wrapping_mul(0xA24B_AED4_963E_E407) ^ b.wrapping_mul(0x9FB2_1C65_1E98_DF25);
    h ^= c.wrapping_mul(0xC2B2_AE3D_27D4_EB4F) ^ i.wrapping_mul(0x1656_67B1_9E37_79F9);
    h = (h ^ (h >> 33)).wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    h = (h ^ (h >> 33)).wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    h ^ (h >> 33)
}

/// A multiple of 1/4 in [-2, 2).
fn quarter(h: u64) -> f32 {
    ((h >> 60) as f32 - 8.0) / 4.0
}

fn array(v: Vec<f32>, dtype: DType) -> NDArray {
    let n = v.len();
    NDArray::from_vec(v, [n])
        .expect("an array")
        .astype(dtype)
        .expect("a cast")
}

/// Key number `idx`'s value at its init.
fn init_value(seed: u64, idx: usize, spec: &KeySpec) -> NDArray {
    let v = (0..spec.len)
        .map(|i| quarter(hash(seed, 7, idx as u64, 0, i as u64)))
        .collect();
    array(v, spec.dtype)
}

/// What rank `orig` pushes to key number `idx` at `step`.
fn grad(seed: u64, orig: usize, step: usize, idx: usize, spec: &KeySpec) -> NDArray {
    let v = (0..spec.len)
        .map(|i| {
            quarter(hash(
                seed,
                100 + orig as u64,
                step as u64,
                idx as u64,
                i as u64,
            ))
        })
        .collect();
    array(v, spec.dtype)
}

impl Case<'_> {
    /// The keys (number, spec) a store holds after the calls `log` committed.
    fn keys_after(&self, log: &[(usize, Vec<usize>)]) -> Vec<(usize, KeySpec)> {
        let mut out: Vec<(usize, KeySpec)> = self.keys.iter().cloned().enumerate().collect();
        for (s, _) in log {
            if let Call::Init(j) = self.program[*s] {
                out.push((self.keys.len() + j, self.late[j].clone()));
            }
        }
        out
    }
}

fn out_for(spec: &KeySpec) -> NDArray {
    NDArray::zeros([spec.len])
        .astype(spec.dtype)
        .expect("an out")
}

fn values_of(a: &NDArray) -> Vec<f64> {
    a.to_vec::<f64>().expect("values")
}

fn run(c: &Case<'_>) -> Vec<Result<Seen, String>> {
    let links: Vec<Loopback> = Loopback::world(c.n, Duration::from_secs(30))
        .into_iter()
        .map(Loopback::elastic)
        .map(|l| match c.in_place {
            true => l.moving_in_place(),
            false => l,
        })
        .collect();
    on_links(&links, |orig, link| {
        let kv = KvStore::over_loopback(link.clone(), BOUND).expect("a store");
        kv.set_updater(c.updater.clone()).expect("the updater");
        let base: Vec<Key> = c.keys.iter().map(|k| k.key.clone()).collect();
        let vals: Vec<NDArray> = (c.keys.iter().enumerate())
            .map(|(i, k)| init_value(c.seed, i, k))
            .collect();
        kv.init_list(&base, &vals).expect("the init");
        if let Some(setup) = c.setup {
            setup(&kv);
        }
        let mut alive: Vec<usize> = (0..c.n).collect();
        let mut armed = vec![false; c.losses.len()];
        let (mut log, mut events) = (Vec::new(), Vec::new());
        let mut step = 0;
        while step < c.program.len() {
            for (i, loss) in c.losses.iter().enumerate() {
                if step == loss.arm && !armed[i] {
                    armed[i] = true;
                    if loss.orig == orig {
                        link.die_after(loss.after, loss.sent);
                    }
                }
            }
            let keys = c.keys_after(&log);
            let ids: Vec<Key> = keys.iter().map(|(_, s)| s.key.clone()).collect();
            let call = c.program[step];
            let got = match call {
                Call::Push | Call::PushPull => {
                    let grads: Vec<NDArray> = (keys.iter())
                        .map(|(idx, s)| grad(c.seed, orig, step, *idx, s))
                        .collect();
                    match call {
                        Call::Push => kv.push_list(&ids, &grads),
                        _ => {
                            let outs: Vec<NDArray> = keys.iter().map(|(_, s)| out_for(s)).collect();
                            kv.pushpull_list(&ids, &grads, &outs)
                        }
                    }
                }
                Call::Pull => {
                    let outs: Vec<NDArray> = keys.iter().map(|(_, s)| out_for(s)).collect();
                    kv.pull_list(&ids, &outs)
                }
                Call::Init(j) => {
                    let idx = c.keys.len() + j;
                    kv.init(c.late[j].key.clone(), &init_value(c.seed, idx, &c.late[j]))
                }
                Call::Save => kv.save(c.dir.expect("a dir").join("dist")),
                Call::Load => kv.load(c.dir.expect("a dir").join("dist")),
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
                    detail,
                    ..
                }) => {
                    events.push(format!(
                        "{step} {call:?}: lost {lost:?} committed {committed} healed {healed} \
                         restored {:?}",
                        restored.is_some()
                    ));
                    if !healed {
                        return Err(format!(
                            "rank {orig}: not healed at step {step} ({call:?}): {detail}"
                        ));
                    }
                    if committed {
                        log.push((step, alive.clone()));
                        step += 1;
                    }
                    alive = (alive.iter().enumerate())
                        .filter(|(r, _)| !lost.contains(r))
                        .map(|(_, &o)| o)
                        .collect();
                }
                Err(e) => return Err(format!("rank {orig}, step {step} ({call:?}): {e}")),
            }
        }
        let mut values = Vec::new();
        for (_, spec) in c.keys_after(&log) {
            let out = out_for(&spec);
            match kv.pull(spec.key.clone(), &out) {
                Ok(()) => {}
                Err(_) if link.is_gone() => return Err("died".to_owned()),
                Err(e) => return Err(format!("rank {orig}: the last pull of {:?}: {e}", spec.key)),
            }
            values.push((spec.key.clone(), values_of(&out)));
        }
        Ok(Seen {
            log,
            events,
            values,
        })
    })
}

/// One local store fed the calls `log` committed.
fn reference(c: &Case<'_>, log: &[(usize, Vec<usize>)]) -> Vec<(Key, Vec<f64>)> {
    let kv = KvStore::create("local").expect("a local store");
    kv.set_updater(c.updater.clone()).expect("the updater");
    let base: Vec<Key> = c.keys.iter().map(|k| k.key.clone()).collect();
    let vals: Vec<NDArray> = (c.keys.iter().enumerate())
        .map(|(i, k)| init_value(c.seed, i, k))
        .collect();
    kv.init_list(&base, &vals).expect("the init");
    if let Some(setup) = c.setup {
        setup(&kv);
    }
    for (i, (step, alive)) in log.iter().enumerate() {
        match c.program[*step] {
            Call::Push | Call::PushPull => {
                for (idx, spec) in c.keys_after(&log[..i]) {
                    let grads: Vec<NDArray> = (alive.iter())
                        .map(|&o| grad(c.seed, o, *step, idx, &spec))
                        .collect();
                    kv.push(spec.key.clone(), &grads).expect("a push");
                }
            }
            Call::Init(j) => {
                let idx = c.keys.len() + j;
                kv.init(c.late[j].key.clone(), &init_value(c.seed, idx, &c.late[j]))
                    .expect("an init");
            }
            Call::Save => kv
                .save(c.dir.expect("a dir").join("local"))
                .expect("a save"),
            Call::Load => kv
                .load(c.dir.expect("a dir").join("local"))
                .expect("a load"),
            Call::Pull => {}
        }
    }
    c.keys_after(log)
        .into_iter()
        .map(|(_, spec)| {
            let out = out_for(&spec);
            kv.pull(spec.key.clone(), &out).expect("a pull");
            (spec.key.clone(), values_of(&out))
        })
        .collect()
}

/// Checks every survivor against the reference; returns the survivors' count. Panics naming
/// the first key that differs.
fn check(c: &Case<'_>, seen: &[Result<Seen, String>], what: &str) -> usize {
    for (r, s) in seen.iter().enumerate() {
        if let Err(e) = s {
            let victim = c.losses.iter().any(|l| l.orig == r);
            assert!(victim && e == "died", "{what}: rank {r} stopped: {e}");
        }
    }
    let survivors: Vec<&Seen> = seen.iter().filter_map(|s| s.as_ref().ok()).collect();
    let first = survivors.first().expect("survivors");
    let want = reference(c, &first.log);
    for (r, s) in seen.iter().enumerate() {
        let Ok(s) = s else { continue };
        assert_eq!(
            s.events, first.events,
            "{what}: survivors saw different outcomes"
        );
        assert_eq!(s.values.len(), want.len(), "{what}: rank {r}: keys");
        for ((k, got), (wk, w)) in s.values.iter().zip(&want) {
            assert_eq!(k, wk);
            if got != w {
                let bad: Vec<(usize, f64, f64)> = (got.iter().zip(w).enumerate())
                    .filter(|(_, (g, w))| g != w)
                    .map(|(i, (g, w))| (i, *g, *w))
                    .take(6)
                    .collect();
                panic!(
                    "{what}: rank {r}: key {k:?} of {} elements differs at (element, got, \
                     want) {bad:?}; events {:?}",
                    got.len(),
                    s.events
                );
            }
        }
    }
    survivors.len()
}

fn sgd() -> Updater {
    Updater::Sgd(Sgd {
        lr: 0.5,
        momentum: 0.5,
        ..Sgd::default()
    })
}

fn adam() -> Updater {
    Updater::Adam(Adam {
        lr: 0.5,
        beta1: 0.5,
        beta2: 0.5,
        ..Adam::default()
    })
}

const DTYPES: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::F64];

/// `count` keys of mixed lengths (some above [`BOUND`], sliced; some not) and dtypes; int keys
/// numbered out of order, or string keys.
fn mixed_keys(count: usize, seed: u64, strings: bool, first: usize) -> Vec<KeySpec> {
    (0..count)
        .map(|i| {
            let h = hash(seed, 3, (first + i) as u64, 0, 0);
            let len = match h % 7 {
                0 => 1,
                1 => 2 + (h >> 8) as usize % 7,
                2 => 9 + (h >> 8) as usize % 5,
                3 => 13 + (h >> 8) as usize % 40,
                4 => 3 + (h >> 8) as usize % 4,
                5 => 8,
                _ => 50 + (h >> 8) as usize % 90,
            };
            let dtype = DTYPES[(h >> 20) as usize % 4];
            let key = match strings {
                true => Key::Str(format!("w{}", (first + i) * 7919 % 1009)),
                false => Key::Int(((first + i) * 7919 % 100_003) as i32),
            };
            KeySpec { key, len, dtype }
        })
        .collect()
}

fn fresh_dir(what: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "kvstore-heal-test-{what}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a directory");
    dir
}

/// The harness itself: with no loss, the stores equal the reference (else the reference, not
/// the heal, is wrong).
#[test]
fn control_without_a_loss_equals_the_reference() {
    let keys = mixed_keys(40, 1, false, 0);
    let late = mixed_keys(3, 1, false, 40);
    let program = [
        Call::Push,
        Call::PushPull,
        Call::Init(0),
        Call::Push,
        Call::Init(1),
        Call::PushPull,
    ];
    for (n, updater, in_place) in [(3, sgd(), false), (4, adam(), true), (5, adam(), false)] {
        let c = Case {
            n,
            seed: 9,
            keys: &keys,
            late: &late,
            program: &program,
            losses: &[],
            in_place,
            updater,
            dir: None,
            setup: None,
        };
        assert_eq!(check(&c, &run(&c), "control"), n);
    }
}

/// Every lost rank of 3 to 7, in place and not, SGD and Adam, ~60 to ~120 mixed keys: the
/// loss in the third push, before the deposit; then pushes, a key inited after the loss.
#[test]
fn every_lost_rank_of_3_to_7_with_mixed_keys_and_dtypes() {
    let program = [
        Call::Push,
        Call::PushPull,
        Call::Push,
        Call::Push,
        Call::Init(0),
        Call::PushPull,
        Call::Init(1),
        Call::Push,
    ];
    for n in 3..=7 {
        for victim in 0..n {
            for (u, in_place) in [(0, false), (1, true), (1, false), (0, true)] {
                if (n + victim + u) % 2 == 1 && n > 4 {
                    continue; // keep the run short: half the cases on the bigger worlds
                }
                let seed = (n * 100 + victim * 10 + u) as u64;
                let keys = mixed_keys(60 + 10 * n, seed, false, 0);
                let late = mixed_keys(2, seed, false, 500);
                let losses = [Loss {
                    orig: victim,
                    arm: 2,
                    after: 1 + (seed % 4),
                    sent: seed % 3 == 0,
                }];
                let c = Case {
                    n,
                    seed,
                    keys: &keys,
                    late: &late,
                    program: &program,
                    losses: &losses,
                    in_place,
                    updater: [sgd(), adam()][u].clone(),
                    dir: None,
                    setup: None,
                };
                let what = format!("n {n} victim {victim} updater {u} in place {in_place}");
                let seen = run(&c);
                assert!(seen[victim].is_err(), "{what}: the victim lived");
                assert_eq!(check(&c, &seen, &what), n - 1, "{what}");
            }
        }
    }
}

/// 250 keys on 6 ranks (many whole keys per rank, so the lost rank's keys spread over
/// several survivors), Adam, string keys.
#[test]
fn many_string_keys_under_adam_survive_a_loss() {
    for (victim, in_place) in [(0, false), (5, true), (2, false), (3, true)] {
        let keys = mixed_keys(250, 77 + victim as u64, true, 0);
        let late = mixed_keys(2, 77, true, 900);
        let program = [
            Call::Push,
            Call::Push,
            Call::PushPull,
            Call::Init(0),
            Call::Push,
            Call::Init(1),
            Call::Push,
        ];
        let losses = [Loss {
            orig: victim,
            arm: 1,
            after: 2,
            sent: victim % 2 == 0,
        }];
        let c = Case {
            n: 6,
            seed: 77,
            keys: &keys,
            late: &late,
            program: &program,
            losses: &losses,
            in_place,
            updater: adam(),
            dir: None,
            setup: None,
        };
        let what = format!("strings victim {victim} in place {in_place}");
        assert_eq!(check(&c, &run(&c), &what), 5);
    }
}

/// Two losses one after the other: the first heal, more pushes, then another rank (each
/// survivor in turn, the one that took the first victim's keys among them) is lost.
#[test]
fn two_losses_one_after_the_other() {
    let program = [
        Call::Push,
        Call::PushPull,
        Call::Push,
        Call::Init(0),
        Call::Push,
        Call::PushPull,
        Call::Push,
        Call::Init(1),
        Call::Push,
    ];
    for n in [5, 6, 7] {
        for first in [0, n / 2, n - 1] {
            for second in (0..n).filter(|&r| r != first) {
                for (u, in_place) in [(0, false), (1, true)] {
                    let seed = (n * 1000 + first * 100 + second * 10 + u) as u64;
                    let keys = mixed_keys(80, seed, false, 0);
                    let late = mixed_keys(2, seed, false, 300);
                    let losses = [
                        Loss {
                            orig: first,
                            arm: 1,
                            after: 1,
                            sent: false,
                        },
                        Loss {
                            orig: second,
                            arm: 4,
                            after: 1 + seed % 3,
                            sent: seed % 2 == 0,
                        },
                    ];
                    let c = Case {
                        n,
                        seed,
                        keys: &keys,
                        late: &late,
                        program: &program,
                        losses: &losses,
                        in_place,
                        updater: [sgd(), adam()][u].clone(),
                        dir: None,
                        setup: None,
                    };
                    let what =
                        format!("n {n}: {first} then {second}, updater {u}, in place {in_place}");
                    let seen = run(&c);
                    assert!(seen[first].is_err() && seen[second].is_err(), "{what}");
                    assert_eq!(check(&c, &seen, &what), n - 2, "{what}");
                }
            }
        }
    }
}

/// A save after the heal (at the new world size), more pushes, then a load: the values and
/// the state go back to the save's.
#[test]
fn a_save_then_a_load_after_a_heal() {
    let program = [
        Call::Push,
        Call::Push,
        Call::PushPull,
        Call::Save,
        Call::Push,
        Call::PushPull,
        Call::Load,
        Call::Push,
        Call::Push,
    ];
    // Worlds where no sliced key is left with an empty slice (in place, or 3 survivors or
    // fewer); see `a_save_after_a_heal_that_left_an_empty_slice` for the others.
    for (n, victim, u, in_place) in [
        (4, 3, 1, true),
        (3, 0, 1, false),
        (6, 2, 0, true),
        (4, 1, 0, false),
        (5, 1, 1, true),
        (7, 6, 1, true),
    ] {
        let dir = fresh_dir("save");
        let seed = 40 + victim as u64;
        let keys = mixed_keys(50, seed, false, 0);
        let losses = [Loss {
            orig: victim,
            arm: 1,
            after: 1,
            sent: false,
        }];
        let c = Case {
            n,
            seed,
            keys: &keys,
            late: &[],
            program: &program,
            losses: &losses,
            in_place,
            updater: [sgd(), adam()][u].clone(),
            dir: Some(&dir),
            setup: None,
        };
        let what = format!("save/load n {n} victim {victim} updater {u}");
        assert_eq!(check(&c, &run(&c), &what), n - 1, "{what}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A save before the loss (at the old world size), the heal, then a load of that save at the
/// new world size.
#[test]
fn a_save_before_the_loss_loads_after_the_heal() {
    let program = [
        Call::Push,
        Call::Save,
        Call::Push,
        Call::PushPull,
        Call::Push,
        Call::Load,
        Call::Push,
    ];
    for (n, victim, u, in_place) in [(5, 4, 1, false), (4, 0, 0, true), (7, 3, 1, true)] {
        let dir = fresh_dir("save-before");
        let seed = 60 + victim as u64;
        let keys = mixed_keys(50, seed, false, 0);
        let losses = [Loss {
            orig: victim,
            arm: 2,
            after: 2,
            sent: true,
        }];
        let c = Case {
            n,
            seed,
            keys: &keys,
            late: &[],
            program: &program,
            losses: &losses,
            in_place,
            updater: [sgd(), adam()][u].clone(),
            dir: Some(&dir),
            setup: None,
        };
        let what = format!("save before n {n} victim {victim} updater {u}");
        assert_eq!(check(&c, &run(&c), &what), n - 1, "{what}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Losses at every exchange of a push on a store of many keys, after and before the deposit:
/// the heal must give the committed pushes' values whatever the point.
#[test]
fn a_loss_at_every_exchange_point() {
    let program = [
        Call::Push,
        Call::PushPull,
        Call::Push,
        Call::PushPull,
        Call::Push,
    ];
    for after in 1..=12u64 {
        for sent in [false, true] {
            let (n, victim) = (4 + after as usize % 3, after as usize % 4);
            let seed = 500 + after * 2 + u64::from(sent);
            let keys = mixed_keys(30, seed, false, 0);
            let losses = [Loss {
                orig: victim,
                arm: 1,
                after,
                sent,
            }];
            let c = Case {
                n,
                seed,
                keys: &keys,
                late: &[],
                program: &program,
                losses: &losses,
                in_place: after % 2 == 0,
                updater: [sgd(), adam()][after as usize % 2].clone(),
                dir: None,
                setup: None,
            };
            let what = format!("n {n} victim {victim} after {after} sent {sent}");
            let seen = run(&c);
            check(&c, &seen, &what);
        }
    }
}

/// 2-bit compression across a heal, against the rule written out: each rank adds its push to
/// its residual, sends +t, -t or 0 and keeps the rest; the survivors keep theirs through the
/// heal, the lost rank's is lost with it. Then SGD with momentum on the sum.
#[test]
fn two_bit_compression_across_a_heal() {
    let t = 0.5f32;
    for (n, victim, in_place) in [(4, 1, false), (5, 4, true), (3, 0, false), (6, 3, true)] {
        let keys: Vec<KeySpec> = [3usize, 20, 9, 1, 33, 8, 17]
            .iter()
            .enumerate()
            .map(|(i, &len)| KeySpec {
                key: Key::Int(i as i32 * 5 % 7),
                len,
                dtype: DType::F32,
            })
            .collect();
        let steps = 7usize;
        let seed = 900 + victim as u64;
        let links: Vec<Loopback> = Loopback::world(n, Duration::from_secs(30))
            .into_iter()
            .map(Loopback::elastic)
            .map(|l| match in_place {
                true => l.moving_in_place(),
                false => l,
            })
            .collect();
        let ids: Vec<Key> = keys.iter().map(|k| k.key.clone()).collect();
        let seen = on_links(&links, |orig, link| {
            let kv = KvStore::over_loopback(link.clone(), BOUND).expect("a store");
            kv.set_updater(sgd()).expect("the updater");
            kv.set_gradient_compression(Compression::two_bit(t))
                .expect("compression");
            let vals: Vec<NDArray> = (keys.iter().enumerate())
                .map(|(i, k)| init_value(seed, i, k))
                .collect();
            kv.init_list(&ids, &vals).expect("init");
            let mut alive: Vec<usize> = (0..n).collect();
            let mut log = Vec::new();
            let mut step = 0;
            while step < steps {
                if step == 2 && orig == victim && !log.iter().any(|(s, _)| *s == 2) {
                    link.die_after(1, false);
                }
                let grads: Vec<NDArray> = (keys.iter().enumerate())
                    .map(|(i, k)| grad(seed, orig, step, i, k))
                    .collect();
                match kv.push_list(&ids, &grads) {
                    Ok(()) => {
                        log.push((step, alive.clone()));
                        step += 1;
                    }
                    Err(_) if link.is_gone() => return None,
                    Err(Error::WorldChanged {
                        lost,
                        committed,
                        healed,
                        ..
                    }) => {
                        assert!(healed, "not healed");
                        if committed {
                            log.push((step, alive.clone()));
                            step += 1;
                        }
                        alive = (alive.iter().enumerate())
                            .filter(|(r, _)| !lost.contains(r))
                            .map(|(_, &o)| o)
                            .collect();
                    }
                    Err(e) => panic!("rank {orig}: {e}"),
                }
            }
            let values: Vec<Vec<f64>> = (keys.iter())
                .map(|k| {
                    let out = out_for(k);
                    kv.pull(k.key.clone(), &out).expect("a pull");
                    values_of(&out)
                })
                .collect();
            Some((log, values))
        });
        let (log, _) = seen.iter().flatten().next().expect("a survivor");
        // The reference: residuals per (key, original rank); a local store fed the sums.
        let local = KvStore::create("local").expect("local");
        local.set_updater(sgd()).expect("the updater");
        let vals: Vec<NDArray> = (keys.iter().enumerate())
            .map(|(i, k)| init_value(seed, i, k))
            .collect();
        local.init_list(&ids, &vals).expect("init");
        let mut residual: Vec<Vec<Vec<f32>>> =
            keys.iter().map(|k| vec![vec![0.0; k.len]; n]).collect();
        for (step, alive) in log {
            for (i, k) in keys.iter().enumerate() {
                let mut total = vec![0f32; k.len];
                for &o in alive {
                    let g = grad(seed, o, *step, i, k).to_vec::<f32>().unwrap();
                    for e in 0..k.len {
                        let acc = residual[i][o][e] + g[e];
                        let sent = if acc >= t {
                            t
                        } else if acc <= -t {
                            -t
                        } else {
                            0.0
                        };
                        residual[i][o][e] = acc - sent;
                        total[e] += sent;
                    }
                }
                local
                    .push(k.key.clone(), &array(total, DType::F32))
                    .unwrap();
            }
        }
        let want: Vec<Vec<f64>> = (keys.iter())
            .map(|k| {
                let out = out_for(k);
                local.pull(k.key.clone(), &out).unwrap();
                values_of(&out)
            })
            .collect();
        let mut survivors = 0;
        for (r, s) in seen.iter().enumerate() {
            let Some((l, values)) = s else { continue };
            survivors += 1;
            assert_eq!(l, log, "n {n}: the survivors committed differently");
            for (i, (g, w)) in values.iter().zip(&want).enumerate() {
                assert_eq!(
                    g, w,
                    "n {n} victim {victim}: rank {r}, key {i} ({:?})",
                    keys[i]
                );
            }
        }
        assert_eq!(survivors, n - 1);
    }
}

/// Row-sparse keys (inited, pulled by rows, pushed dense keys beside them) survive a heal;
/// after it, rows pushed to them land as a local store's.
#[test]
fn row_sparse_keys_beside_dense_ones_survive_a_heal() {
    use crate::RowSparse;
    let (rows, cols) = (11usize, 3usize);
    for (n, victim, in_place) in [(4, 2, false), (5, 0, true), (3, 1, false)] {
        let links: Vec<Loopback> = Loopback::world(n, Duration::from_secs(30))
            .into_iter()
            .map(Loopback::elastic)
            .map(|l| match in_place {
                true => l.moving_in_place(),
                false => l,
            })
            .collect();
        let dense: Vec<KeySpec> = mixed_keys(20, 5, false, 0);
        let sparse_keys: Vec<i32> = vec![200_001, 200_002, 200_003];
        let sparse_init = |j: usize| {
            let v: Vec<f32> = (0..rows * cols)
                .map(|i| quarter(hash(5, 11, j as u64, 0, i as u64)))
                .collect();
            NDArray::from_vec(v, [rows, cols]).unwrap()
        };
        let rs_push = |orig: usize, j: usize| {
            let ids: Vec<u64> = vec![(orig % rows) as u64, ((orig + 3 + j) % rows) as u64];
            let mut ids = ids;
            ids.sort_unstable();
            ids.dedup();
            let v: Vec<f32> = (0..ids.len() * cols)
                .map(|i| quarter(hash(5, 12, orig as u64, j as u64, i as u64)))
                .collect();
            let n_ids = ids.len();
            RowSparse::new(ids, NDArray::from_vec(v, [n_ids, cols]).unwrap()).unwrap()
        };
        let seen = on_links(&links, |orig, link| {
            let kv = KvStore::over_loopback(link.clone(), BOUND).expect("a store");
            kv.set_updater(sgd()).unwrap();
            let ids: Vec<Key> = dense.iter().map(|k| k.key.clone()).collect();
            let vals: Vec<NDArray> = (dense.iter().enumerate())
                .map(|(i, k)| init_value(5, i, k))
                .collect();
            kv.init_list(&ids, &vals).unwrap();
            for (j, &k) in sparse_keys.iter().enumerate() {
                kv.init_row_sparse(k, &sparse_init(j)).unwrap();
            }
            let mut pushed = 0;
            let mut alive: Vec<usize> = (0..n).collect();
            let mut log = Vec::new();
            while pushed < 4 {
                if pushed == 1 && orig == victim && log.len() == 1 {
                    link.die_after(1, false);
                }
                let grads: Vec<NDArray> = (dense.iter().enumerate())
                    .map(|(i, k)| grad(5, orig, pushed, i, k))
                    .collect();
                match kv.push_list(&ids, &grads) {
                    Ok(()) => {
                        log.push(alive.clone());
                        pushed += 1;
                    }
                    Err(_) if link.is_gone() => return None,
                    Err(Error::WorldChanged {
                        lost,
                        committed,
                        healed,
                        ..
                    }) => {
                        assert!(healed);
                        if committed {
                            log.push(alive.clone());
                            pushed += 1;
                        }
                        alive = (alive.iter().enumerate())
                            .filter(|(r, _)| !lost.contains(r))
                            .map(|(_, &o)| o)
                            .collect();
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            // After the heal: a row-sparse push of each sparse key, by the survivors.
            for (j, &k) in sparse_keys.iter().enumerate() {
                kv.push_row_sparse(k, &[rs_push(orig, j)])
                    .expect("a row-sparse push");
            }
            let mut values = Vec::new();
            for (j, &k) in sparse_keys.iter().enumerate() {
                let out = NDArray::zeros([rows, cols]);
                kv.pull(k, &out).expect("a pull");
                values.push(values_of(&out));
                let all: Vec<u64> = (0..rows as u64).collect();
                let got = kv.row_sparse_pull(k, &all).expect("a row-sparse pull");
                let _ = (j, got);
            }
            for k in &dense {
                let out = out_for(k);
                kv.pull(k.key.clone(), &out).unwrap();
                values.push(values_of(&out));
            }
            Some((log, alive, values))
        });
        let (log, alive, _) = seen.iter().flatten().next().expect("a survivor");
        let local = KvStore::create("local").unwrap();
        local.set_updater(sgd()).unwrap();
        let ids: Vec<Key> = dense.iter().map(|k| k.key.clone()).collect();
        let vals: Vec<NDArray> = (dense.iter().enumerate())
            .map(|(i, k)| init_value(5, i, k))
            .collect();
        local.init_list(&ids, &vals).unwrap();
        for (j, &k) in sparse_keys.iter().enumerate() {
            local.init_row_sparse(k, &sparse_init(j)).unwrap();
        }
        for (step, al) in log.iter().enumerate() {
            for (i, k) in dense.iter().enumerate() {
                let g: Vec<NDArray> = al.iter().map(|&o| grad(5, o, step, i, k)).collect();
                local.push(k.key.clone(), &g).unwrap();
            }
        }
        for (j, &k) in sparse_keys.iter().enumerate() {
            let pushes: Vec<RowSparse> = alive.iter().map(|&o| rs_push(o, j)).collect();
            local.push_row_sparse(k, &pushes).unwrap();
        }
        let mut want = Vec::new();
        for &k in &sparse_keys {
            let out = NDArray::zeros([rows, cols]);
            local.pull(k, &out).unwrap();
            want.push(values_of(&out));
        }
        for k in &dense {
            let out = out_for(k);
            local.pull(k.key.clone(), &out).unwrap();
            want.push(values_of(&out));
        }
        for (r, s) in seen.iter().enumerate() {
            let Some((_, _, values)) = s else { continue };
            for (i, (g, w)) in values.iter().zip(&want).enumerate() {
                assert_eq!(
                    g, w,
                    "row sparse n {n} victim {victim}: rank {r}, value {i}"
                );
            }
        }
        assert_eq!(seen.iter().flatten().count(), n - 1);
    }
}

/// The smallest case of a save failing after a heal: 5 ranks, one sliced key of 9 elements,
/// SGD with momentum; one push, rank 1 lost in the second, the redo, a save. On 4 ranks the key
/// is cut [0,3) [3,6) [6,9) [9,9): rank 3's part is empty, and must count the updates too.
#[test]
fn a_save_after_a_heal_that_left_an_empty_slice() {
    let keys = [KeySpec {
        key: Key::Int(0),
        len: 9,
        dtype: DType::F32,
    }];
    // A save right after the heal, or after a push.
    for program in [
        &[
            Call::Push,
            Call::Pull,
            Call::Save,
            Call::Push,
            Call::Load,
            Call::Push,
        ][..],
        &[
            Call::Push,
            Call::Push,
            Call::Save,
            Call::Push,
            Call::Load,
            Call::Push,
        ][..],
    ] {
        let dir = fresh_dir("empty-slice");
        let losses = [Loss {
            orig: 1,
            arm: 1,
            after: 1,
            sent: false,
        }];
        let c = Case {
            n: 5,
            seed: 1,
            keys: &keys,
            late: &[],
            program,
            losses: &losses,
            in_place: false,
            updater: sgd(),
            dir: Some(&dir),
            setup: None,
        };
        let seen = run(&c);
        let survivors = check(&c, &seen, &format!("empty slice {program:?}"));
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(survivors, 4);
    }
}

/// The same program with no loss on 4 ranks (the key has an empty slice from the init): the
/// save works, so the failure above is the heal's.
#[test]
fn control_an_empty_slice_from_the_init_saves() {
    let keys = [KeySpec {
        key: Key::Int(0),
        len: 9,
        dtype: DType::F32,
    }];
    let program = [
        Call::Push,
        Call::Push,
        Call::Save,
        Call::Push,
        Call::Load,
        Call::Push,
    ];
    let dir = fresh_dir("empty-slice-control");
    let c = Case {
        n: 4,
        seed: 1,
        keys: &keys,
        late: &[],
        program: &program,
        losses: &[],
        in_place: false,
        updater: sgd(),
        dir: Some(&dir),
        setup: None,
    };
    let seen = run(&c);
    let survivors = check(&c, &seen, "empty slice control");
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(survivors, 4);
}

/// A learning-rate schedule (halved at every update) and per-key rate and decay multipliers,
/// across a heal and a second loss: the heal keeps every key's update count.
#[test]
fn a_schedule_and_per_key_multipliers_across_two_heals() {
    fn setup(kv: &KvStore) {
        kv.set_lr_scheduler(Some(crate::LrScheduler::factor(1, 0.5)))
            .expect("the schedule");
        for k in [0, 7919, 15838, 23757] {
            kv.set_lr_mult(k, 0.5).expect("a multiplier");
        }
    }
    let program = [
        Call::Push,
        Call::PushPull,
        Call::Push,
        Call::Push,
        Call::PushPull,
        Call::Push,
        Call::Push,
    ];
    for (n, first, second, u, in_place) in
        [(5, 1, 3, 0, false), (6, 0, 5, 1, true), (5, 4, 0, 1, false)]
    {
        let seed = 3000 + first as u64;
        let keys = mixed_keys(40, seed, false, 0);
        let losses = [
            Loss {
                orig: first,
                arm: 1,
                after: 2,
                sent: true,
            },
            Loss {
                orig: second,
                arm: 4,
                after: 1,
                sent: false,
            },
        ];
        let c = Case {
            n,
            seed,
            keys: &keys,
            late: &[],
            program: &program,
            losses: &losses,
            in_place,
            updater: [sgd(), adam()][u].clone(),
            dir: None,
            setup: Some(setup),
        };
        let what = format!("schedule n {n}: {first} then {second}");
        assert_eq!(check(&c, &run(&c), &what), n - 2, "{what}");
    }
}

/// [`a_schedule_and_per_key_multipliers_across_two_heals`] with no loss, and with a loss but
/// the schedule alone, and the multipliers alone: which one the heal breaks.
#[test]
fn control_schedule_and_multipliers_without_a_loss() {
    fn both(kv: &KvStore) {
        kv.set_lr_scheduler(Some(crate::LrScheduler::factor(1, 0.5)))
            .expect("the schedule");
        for k in [0, 7919, 15838, 23757] {
            kv.set_lr_mult(k, 0.5).expect("a multiplier");
        }
    }
    fn schedule(kv: &KvStore) {
        kv.set_lr_scheduler(Some(crate::LrScheduler::factor(1, 0.5)))
            .expect("the schedule");
    }
    fn mults(kv: &KvStore) {
        for k in [0, 7919, 15838, 23757] {
            kv.set_lr_mult(k, 0.5).expect("a multiplier");
        }
    }
    let program = [Call::Push, Call::PushPull, Call::Push, Call::Push];
    let keys = mixed_keys(40, 3001, false, 0);
    let mut failures = Vec::new();
    for (name, setup, loss) in [
        ("both, no loss", both as fn(&KvStore), false),
        ("schedule, no loss", schedule as fn(&KvStore), false),
        ("multipliers, no loss", mults as fn(&KvStore), false),
        ("schedule, loss", schedule as fn(&KvStore), true),
        ("multipliers, loss", mults as fn(&KvStore), true),
    ] {
        let losses = [Loss {
            orig: 1,
            arm: 1,
            after: 2,
            sent: true,
        }];
        let c = Case {
            n: 5,
            seed: 3001,
            keys: &keys,
            late: &[],
            program: &program,
            losses: if loss { &losses } else { &[] },
            in_place: false,
            updater: sgd(),
            dir: None,
            setup: Some(setup),
        };
        let seen = run(&c);
        if let Err(e) =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(&c, &seen, name)))
        {
            let msg = e.downcast_ref::<String>().cloned().unwrap_or_default();
            failures.push(msg.chars().take(300).collect::<String>());
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A loss in an init (of a sliced or whole key, after an earlier heal or not) or in a load:
/// the survivors agree whether it took effect, and the values follow.
#[test]
fn a_loss_in_an_init_or_a_load() {
    let keys = mixed_keys(30, 4000, false, 0);
    // A sliced key (len 40) and a whole one (len 3), inited in the program.
    let late = [
        KeySpec {
            key: Key::Int(-5),
            len: 40,
            dtype: DType::F16,
        },
        KeySpec {
            key: Key::Int(-6),
            len: 3,
            dtype: DType::F64,
        },
    ];
    let programs: [&[Call]; 2] = [
        &[
            Call::Push,
            Call::Init(0),
            Call::Init(1),
            Call::Push,
            Call::Push,
        ],
        &[
            Call::Push,
            Call::Save,
            Call::Push,
            Call::Load,
            Call::Push,
            Call::Push,
        ],
    ];
    let mut failures = Vec::new();
    for (p, program) in programs.iter().enumerate() {
        for after in 1..=6u64 {
            for sent in [false, true] {
                let (n, victim) = (4 + after as usize % 2, after as usize % 4);
                let dir = fresh_dir("init-load");
                let arm = if p == 0 { 1 } else { 3 };
                let losses = [Loss {
                    orig: victim,
                    arm,
                    after,
                    sent,
                }];
                let c = Case {
                    n,
                    seed: 4000 + after,
                    keys: &keys,
                    late: &late,
                    program,
                    losses: &losses,
                    in_place: sent,
                    updater: adam(),
                    dir: Some(&dir),
                    setup: None,
                };
                let what = format!("program {p} n {n} victim {victim} after {after} sent {sent}");
                let seen = run(&c);
                let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    check(&c, &seen, &what)
                }));
                if let Err(e) = got {
                    let msg = e.downcast_ref::<String>().cloned().unwrap_or_default();
                    failures.push(msg.chars().take(400).collect::<String>());
                }
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} failed: {failures:#?}",
        failures.len()
    );
}
