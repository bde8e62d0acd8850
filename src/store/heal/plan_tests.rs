//! Adversarial tests of the heal's plan ([`super::plan::plan`]) against a brute-force reference
//! written here: element by element, who holds each element (part and copy) before and after,
//! and where the one piece that fills it must come from.

use super::plan::{plan, Held, KeyAt, Worlds};
use crate::comm::dist::Buddies;
use crate::comm::Spread;

fn mix(mut h: u64) -> u64 {
    h = (h ^ (h >> 33)).wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    h = (h ^ (h >> 33)).wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    h ^ (h >> 33)
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// My own slice: blocks of ceil(len / size) in rank order.
fn my_slice(len: usize, size: usize, r: usize) -> std::ops::Range<usize> {
    let block = len.div_ceil(size.max(1));
    let start = (r * block).min(len);
    start..(start + block).min(len)
}

/// Owner of element `i` of a key of `len` under `spread` over `size` ranks.
fn owner(spread: Spread, len: usize, size: usize, i: usize) -> usize {
    match spread {
        Spread::Whole { rank } => rank,
        Spread::Sliced => (0..size)
            .find(|&r| my_slice(len, size, r).contains(&i))
            .expect("an owner"),
    }
}

/// My own buddy shift: the most ranks on another machine than their buddy, ties to the
/// smallest shift; `None` below 2 ranks.
fn my_shift(machines: &[usize]) -> Option<usize> {
    let size = machines.len();
    if size < 2 {
        return None;
    }
    let mut best = (0usize, 1usize);
    for s in 1..size {
        let apart = (0..size)
            .filter(|&r| machines[r] != machines[(r + s) % size])
            .count();
        if apart > best.0 {
            best = (apart, s);
        }
    }
    Some(best.1)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    Local(Held),
    Remote(usize, Held),
}

/// Checks `plan(keys, worlds)` against the brute-force reference; `machines` are the old
/// world's; `new_copies`: whether the new world keeps copies.
#[allow(clippy::too_many_arguments)]
fn check_one(
    keys: &[KeyAt],
    machines: &[usize],
    lost: &[usize],
    (exact, current): (bool, bool),
    in_place_rule: bool,
    new_copies: bool,
    what: &str,
) {
    let old_size = machines.len();
    let survivors: Vec<usize> = (0..old_size).filter(|r| !lost.contains(r)).collect();
    let size = survivors.len();
    let new_machines: Vec<usize> = survivors.iter().map(|&r| machines[r]).collect();
    let old_shift = my_shift(machines).expect("two ranks");
    let old_buddy = |r: usize| (r + old_shift) % old_size;
    let new_shift = match new_copies {
        true => my_shift(&new_machines),
        false => None,
    };
    let new_of = |r: usize| survivors.iter().position(|&s| s == r);
    let can_slice = move |len: usize, size: usize| {
        size > 1 && (!in_place_rule || len.div_ceil(size) * (size - 1) < len)
    };
    let w = Worlds {
        old_size,
        old_buddies: Buddies::of(machines).expect("buddies"),
        lost,
        new_buddies: match new_copies {
            true => Buddies::of(&new_machines),
            false => None,
        },
        exact_copies: exact,
        copies_current: current,
        can_slice: &can_slice,
    };
    // Expect an error where some element's owner and its buddy are both lost.
    let unhealable = keys.iter().any(|k| {
        (0..k.len).any(|i| {
            let o = owner(k.spread, k.len, old_size, i);
            lost.contains(&o) && lost.contains(&old_buddy(o))
        })
    });
    let got = plan(keys, &w);
    if unhealable {
        assert!(got.is_err(), "{what}: a plan for a piece no survivor holds");
        return;
    }
    let p = got.unwrap_or_else(|e| panic!("{what}: {e}"));
    // The new spreads, by the rules.
    let mut loads = vec![0usize; size];
    let mut want: Vec<Option<Spread>> = vec![None; keys.len()];
    let mut homeless = Vec::new();
    for (k, key) in keys.iter().enumerate() {
        match key.spread {
            Spread::Whole { rank } if !lost.contains(&rank) => {
                let home = new_of(rank).unwrap();
                loads[home] += key.bytes;
                want[k] = Some(Spread::Whole { rank: home });
            }
            Spread::Whole { rank } => homeless.push((k, new_of(old_buddy(rank)))),
            Spread::Sliced if can_slice(key.len, size) => {
                for l in loads.iter_mut() {
                    *l += key.bytes.div_ceil(size);
                }
                want[k] = Some(Spread::Sliced);
            }
            Spread::Sliced => homeless.push((k, None)),
        }
    }
    // Largest first, table order among equals.
    let mut order: Vec<(usize, Option<usize>)> = Vec::new();
    for item in homeless {
        let at = order
            .iter()
            .position(|&(o, _)| keys[o].bytes < keys[item.0].bytes)
            .unwrap_or(order.len());
        order.insert(at, item);
    }
    for (k, buddy) in order {
        let min = *loads.iter().min().unwrap();
        let home = match buddy {
            Some(b) if loads[b] == min => b,
            _ => loads.iter().position(|&l| l == min).unwrap(),
        };
        loads[home] += keys[k].bytes;
        want[k] = Some(Spread::Whole { rank: home });
    }
    let want: Vec<Spread> = want.into_iter().map(Option::unwrap).collect();
    assert_eq!(p.spreads, want, "{what}: the spreads");
    assert_eq!(p.rank_bytes, loads, "{what}: the bytes per rank");
    // Every element of every new part and copy: filled exactly once, from the right place.
    for (k, key) in keys.iter().enumerate() {
        // filled[(to, held)][i]: the move that filled element i.
        let mut filled: std::collections::HashMap<(usize, bool), Vec<Option<usize>>> =
            std::collections::HashMap::new();
        // (to, into a part): the empty parts and copies given their state by an empty move.
        let mut empties = std::collections::HashSet::new();
        for (mi, m) in p.moves.iter().enumerate().filter(|(_, m)| m.key == k) {
            assert!(m.to < size && m.from < size, "{what}: {m:?}");
            if m.range.is_empty() {
                // Only the state of an empty part travels so, from the last element's part.
                assert_eq!(m.range, key.len..key.len, "{what}: an empty move {m:?}");
                assert!(
                    empties.insert((m.to, m.into == Held::Part)),
                    "{what}: two empty moves into {m:?}"
                );
                continue;
            }
            let slot = filled
                .entry((m.to, m.into == Held::Part))
                .or_insert_with(|| vec![None; key.len]);
            for i in m.range.clone() {
                assert!(
                    slot[i].is_none(),
                    "{what}: key {k} element {i} into {:?} at {} twice",
                    m.into,
                    m.to
                );
                slot[i] = Some(mi);
            }
        }
        for i in 0..key.len {
            let o = owner(key.spread, key.len, old_size, i);
            let n_owner = owner(want[k], key.len, size, i);
            let mut targets = vec![(n_owner, Held::Part)];
            if let Some(s) = new_shift {
                targets.push(((n_owner + s) % size, Held::Copy));
            }
            for &(to, into) in &targets {
                let mi = filled
                    .get(&(to, into == Held::Part))
                    .and_then(|v| v[i])
                    .unwrap_or_else(|| {
                        panic!(
                            "{what}: key {k} ({key:?}) element {i} never reaches {into:?} at {to}"
                        )
                    });
                let m = &p.moves[mi];
                assert_eq!(m.of, o, "{what}: key {k} element {i}: {m:?}");
                let t_old = survivors[to];
                let here_part = o == t_old;
                let here_copy = old_buddy(o) == t_old;
                let expect = match into {
                    Held::Part if here_part => Expect::Local(Held::Part),
                    Held::Part if exact && current && here_copy => Expect::Local(Held::Copy),
                    Held::Copy if current && here_copy => Expect::Local(Held::Copy),
                    Held::Copy if here_part => Expect::Local(Held::Part),
                    _ if !lost.contains(&o) => Expect::Remote(new_of(o).unwrap(), Held::Part),
                    _ => Expect::Remote(new_of(old_buddy(o)).unwrap(), Held::Copy),
                };
                let expect = match expect {
                    Expect::Remote(from, read) if from == to => Expect::Local(read),
                    e => e,
                };
                let got = match m.from == m.to {
                    true => Expect::Local(m.read),
                    false => Expect::Remote(m.from, m.read),
                };
                assert_eq!(
                    got, expect,
                    "{what}: key {k} element {i} into {into:?} at {to}: {m:?}"
                );
            }
            // Nothing else holds element i.
            for (&(to, part), v) in &filled {
                if v[i].is_some() {
                    let into = if part { Held::Part } else { Held::Copy };
                    assert!(
                        targets.contains(&(to, into)),
                        "{what}: key {k} element {i} also into {into:?} at {to}"
                    );
                }
            }
        }
        // Every rank that holds an empty part of the key (and the buddy of its copy) gets the
        // key's state by one empty move; no other does.
        // The state comes from the part holding the last element (a key of no elements: its
        // home, or the old world's last rank), or its buddy's copy; with both lost, no state.
        let state_at = match (key.spread, key.len) {
            (Spread::Whole { rank }, _) => rank,
            (Spread::Sliced, 0) => old_size - 1,
            (Spread::Sliced, len) => owner(key.spread, len, old_size, len - 1),
        };
        let state_kept = !lost.contains(&state_at) || !lost.contains(&old_buddy(state_at));
        let mut want_empty = std::collections::HashSet::new();
        for j in (0..size).filter(|_| state_kept) {
            let (holds, empty) = match want[k] {
                Spread::Whole { rank } => (rank == j, key.len == 0),
                Spread::Sliced => (true, key.len.div_ceil(size) * j >= key.len),
            };
            if holds && empty {
                want_empty.insert((j, true));
                if let Some(s) = new_shift {
                    want_empty.insert(((j + s) % size, false));
                }
            }
        }
        assert_eq!(
            empties, want_empty,
            "{what}: key {k}: the empty parts given state"
        );
    }
}

fn machines_of(kind: usize, size: usize, rng: &mut Rng) -> Vec<usize> {
    match kind {
        0 => vec![0; size],
        1 => (0..size).map(|r| r % 2).collect(),
        2 => (0..size).map(|r| r / 2).collect(),
        3 => (0..size).map(|r| r / 3).collect(),
        _ => (0..size).map(|_| rng.below(3)).collect(),
    }
}

fn random_keys(rng: &mut Rng, old_size: usize, in_place_rule: bool, count: usize) -> Vec<KeyAt> {
    (0..count)
        .map(|_| {
            let len = match rng.below(6) {
                0 => 0,
                1 => 1 + rng.below(4),
                2 => old_size + rng.below(3),
                3 => 5 + rng.below(30),
                4 => 9,
                _ => 50 + rng.below(300),
            };
            let elem = [2usize, 4, 8][rng.below(3)];
            let sliceable =
                old_size > 1 && (!in_place_rule || len.div_ceil(old_size) * (old_size - 1) < len);
            let spread = match rng.below(3) == 0 && sliceable {
                true => Spread::Sliced,
                false => Spread::Whole {
                    rank: rng.below(old_size),
                },
            };
            KeyAt {
                len,
                bytes: len * elem,
                spread,
            }
        })
        .collect()
}

#[test]
fn the_plan_matches_a_brute_force_reference_on_odd_worlds() {
    let mut rng = Rng(0xDEC0DE);
    let mut checked = 0;
    for old_size in 2..=8usize {
        for lost_mask in 1u32..(1 << old_size) {
            let lost: Vec<usize> = (0..old_size).filter(|r| lost_mask >> r & 1 == 1).collect();
            if 2 * lost.len() >= old_size {
                continue;
            }
            for kind in 0..5 {
                let machines = machines_of(kind, old_size, &mut rng);
                for variant in 0..4 {
                    let (exact, in_place_rule) =
                        [(true, false), (false, true), (false, false), (true, true)][variant];
                    let count = 1 + rng.below(25);
                    let keys = random_keys(&mut rng, old_size, in_place_rule, count);
                    let new_copies = rng.below(5) != 0;
                    // Some copy lags somewhere: only lost ranks' parts are read from copies.
                    let current = rng.below(3) != 0;
                    let what = format!(
                        "old {old_size}, machines {machines:?}, lost {lost:?}, exact {exact}, \
                         current {current}, in-place rule {in_place_rule}, copies \
                         {new_copies}, keys {keys:?}"
                    );
                    check_one(
                        &keys,
                        &machines,
                        &lost,
                        (exact, current),
                        in_place_rule,
                        new_copies,
                        &what,
                    );
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 1000, "{checked}");
}

#[test]
fn ties_go_to_the_lost_ranks_buddy_even_where_it_is_not_the_lowest_rank() {
    // 6 ranks on 2 machines round robin... one machine (shift 1): rank 4's buddy is 5 (now 4).
    // Every survivor holds 40 bytes; rank 4's 3 keys of 40 bytes: the first to its buddy (new 4),
    // then the lowest ones.
    let mut keys: Vec<KeyAt> = (0..6)
        .map(|r| KeyAt {
            len: 10,
            bytes: 40,
            spread: Spread::Whole { rank: r },
        })
        .collect();
    keys.extend((0..3).map(|_| KeyAt {
        len: 10,
        bytes: 40,
        spread: Spread::Whole { rank: 4 },
    }));
    check_one(&keys, &[0; 6], &[4], (true, true), false, true, "ties");
}

#[test]
fn a_part_that_stays_put_is_kept_in_place_and_no_other() {
    // 4 ranks on one machine, rank 3 lost (its buddy is rank 0): rank 0's whole key stays
    // where it is, the sliced key is cut again, and rank 3's key lands on rank 1 (fewest bytes).
    let keys = [
        KeyAt {
            len: 10,
            bytes: 40,
            spread: Spread::Whole { rank: 0 },
        },
        KeyAt {
            len: 100,
            bytes: 400,
            spread: Spread::Sliced,
        },
        KeyAt {
            len: 5,
            bytes: 20,
            spread: Spread::Whole { rank: 3 },
        },
    ];
    let w = Worlds {
        old_size: 4,
        old_buddies: Buddies::of(&[0; 4]).unwrap(),
        lost: &[3],
        new_buddies: Buddies::of(&[0; 3]),
        exact_copies: true,
        copies_current: true,
        can_slice: &|_, size| size > 1,
    };
    let p = plan(&keys, &w).unwrap();
    assert_eq!(p.spreads[2], Spread::Whole { rank: 1 });
    let kept = |rank: usize| super::kept_in_place(&keys, &p, (rank, 4), (rank, 3));
    assert_eq!(kept(0), [true, false, false]);
    assert_eq!(kept(1), [false, false, false]);
    assert_eq!(kept(2), [false, false, false]);
}
