//! Where each piece of each key goes when the survivors of a lost rank re-place the store: the
//! same plan on every survivor, made from the key table and the two worlds alone.
//!
//! - A whole key stays on its home where that rank survived: nothing moves.
//! - A lost rank's whole keys are placed again, largest first, each on the survivor holding
//!   the fewest bytes, ties to the lost rank's buddy, which kept their copies (so such a key
//!   moves nothing). The survivors stay balanced, and only keys that had to find a new home
//!   move.
//! - A sliced key is cut again for the new world size ([`Spread::Sliced`]); each new slice is
//!   put together from the old slices it overlaps.
//! - Every new part's copy goes to its new buddy.
//!
//! Each piece is read where its receiver already holds it when it can (its own part, or the
//! copy it kept), else from the old part's owner, else from that owner's buddy (its copy).
//! A part is read from a copy only where copies are bit for bit their parts, or where its owner
//! was lost.

use std::ops::Range;

use crate::comm::dist::Buddies;
use crate::comm::Spread;
use crate::{Error, Result};

/// Where a rank keeps a piece of a key: in its own part, or in the copy it keeps of its
/// buddy source's part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Held {
    Part,
    Copy,
}

/// One piece of one key in a heal: elements `range` of key `key`, which lie in old rank `of`'s
/// part, read from new rank `from`'s `read` and written into new rank `to`'s `into`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Move {
    pub key: usize,
    pub range: Range<usize>,
    pub of: usize,
    pub from: usize,
    pub read: Held,
    pub to: usize,
    pub into: Held,
}

impl Move {
    /// Whether the piece crosses between ranks (else its rank copies it in its own memory).
    pub(super) fn travels(&self) -> bool {
        self.from != self.to
    }
}

/// One key, as the plan sees it.
#[derive(Clone, Copy, Debug)]
pub(super) struct KeyAt {
    /// Elements.
    pub len: usize,
    /// Bytes of its value.
    pub bytes: usize,
    /// Where it lives in the old world.
    pub spread: Spread,
}

/// The world before the loss, and what is known of the one after.
pub(super) struct Worlds<'a> {
    /// The old world's size.
    pub old_size: usize,
    /// Who kept whose copy in the old world.
    pub old_buddies: Buddies,
    /// The ranks lost, in the old world's numbers.
    pub lost: &'a [usize],
    /// Who keeps whose copy in the new world (`None`: no copies).
    pub new_buddies: Option<Buddies>,
    /// Whether a copy is bit for bit its part (copies updated by the same code as their parts:
    /// host ranks), so that a part may be read from a copy.
    pub exact_copies: bool,
    /// Whether every survivor's copies are current ([`crate::store::table::Slot::copy_behind`]
    /// nowhere): else a copy is read only for a lost rank's part, never in place of a
    /// surviving one.
    pub copies_current: bool,
    /// Whether a key of `len` elements can be sliced over `size` ranks.
    pub can_slice: &'a dyn Fn(usize, usize) -> bool,
}

impl Worlds<'_> {
    /// The survivors, in the old world's numbers; survivor `i` is rank `i` of the new world.
    pub(super) fn survivors(&self) -> Vec<usize> {
        (0..self.old_size)
            .filter(|r| !self.lost.contains(r))
            .collect()
    }
}

/// What the survivors do: each key's new spread, every piece's move (by key, then by the rank
/// it goes to), and the bytes each new rank holds (for the placement of later keys).
#[derive(Debug)]
pub(super) struct Plan {
    pub spreads: Vec<Spread>,
    pub moves: Vec<Move>,
    pub rank_bytes: Vec<usize>,
}

/// The plan for `keys` (in the table's order) from old world to new.
pub(super) fn plan(keys: &[KeyAt], w: &Worlds<'_>) -> Result<Plan> {
    let survivors = w.survivors();
    let size = survivors.len();
    if size == 0 || w.lost.iter().any(|&l| l >= w.old_size) {
        return Err(Error::internal(
            "a heal with no survivor, or of a rank that never was",
        ));
    }
    let new_of = |old: usize| survivors.binary_search(&old).ok();
    let (spreads, rank_bytes) = spreads(keys, w, &new_of, size)?;
    let mut moves = Vec::new();
    for (k, (key, new)) in keys.iter().zip(&spreads).enumerate() {
        // The old part that holds the key's last element (where its value ends).
        let last = (0..w.old_size).rev().find(|&o| {
            let p = key.spread.piece(key.len, o, w.old_size);
            key.spread.holds(o) && p.end == key.len && (p.start < p.end || key.len == 0)
        });
        for j in (0..size).filter(|&j| new.holds(j)) {
            let range = new.piece(key.len, j, size);
            // The old pieces that make it up: those it overlaps, or, for an empty part (a
            // sliced key's last slices, when the key has fewer elements than the ranks' blocks
            // cover), none of the elements but the key's updater state all the same (its step),
            // from the part holding the last element, so every part's step stays the key's.
            let pieces: Vec<(usize, Range<usize>)> = match range.is_empty() {
                true => last.map(|o| (o, key.len..key.len)).into_iter().collect(),
                false => (0..w.old_size)
                    .map(|of| {
                        let held = key.spread.piece(key.len, of, w.old_size);
                        (of, held.start.max(range.start)..held.end.min(range.end))
                    })
                    .filter(|(_, piece)| !piece.is_empty())
                    .collect(),
            };
            let copy_at = w.new_buddies.map(|b| (b.buddy(j), Held::Copy));
            for (to, into) in std::iter::once((j, Held::Part)).chain(copy_at) {
                for (of, piece) in pieces.iter().cloned() {
                    let part_at = new_of(of);
                    let copy_at = new_of(w.old_buddies.buddy(of));
                    let copies = (w.exact_copies, w.copies_current);
                    let (from, read) = match source(part_at, copy_at, to, into, copies) {
                        Some(from) => from,
                        // A key of no elements, its rank and that rank's buddy both lost:
                        // nothing of it is lost but its step.
                        None if piece.is_empty() => continue,
                        None => {
                            return Err(Error::internal(
                                "a piece of a key that no survivor holds (its rank and that \
                                 rank's buddy both lost)",
                            ))
                        }
                    };
                    moves.push(Move {
                        key: k,
                        range: piece,
                        of,
                        from,
                        read,
                        to,
                        into,
                    });
                }
            }
        }
    }
    Ok(Plan {
        spreads,
        moves,
        rank_bytes,
    })
}

/// Where a piece for new rank `to`'s `into` is read, given where it lies: in the part of new
/// rank `part_at` and the copy of new rank `copy_at` (`None`: lost). The receiver's own memory
/// first, then the part, then the copy; `(exact, current)`: whether copies are bit for bit
/// their parts, and current everywhere (else a surviving part is never read from a copy).
fn source(
    part_at: Option<usize>,
    copy_at: Option<usize>,
    to: usize,
    into: Held,
    (exact, current): (bool, bool),
) -> Option<(usize, Held)> {
    let here_part = (part_at == Some(to)).then_some((to, Held::Part));
    let here_copy = (copy_at == Some(to)).then_some((to, Held::Copy));
    let here = match into {
        Held::Part if exact && current => here_part.or(here_copy),
        Held::Part => here_part,
        Held::Copy if current => here_copy.or(here_part),
        Held::Copy => here_part,
    };
    here.or(part_at.map(|r| (r, Held::Part)))
        .or(copy_at.map(|r| (r, Held::Copy)))
}

/// Each key's spread in the new world of `size` ranks, and the bytes each rank then holds.
fn spreads(
    keys: &[KeyAt],
    w: &Worlds<'_>,
    new_of: &dyn Fn(usize) -> Option<usize>,
    size: usize,
) -> Result<(Vec<Spread>, Vec<usize>)> {
    let mut loads = vec![0usize; size];
    let mut spreads: Vec<Option<Spread>> = vec![None; keys.len()];
    // Keys to place again: (key, the rank that holds their copy, where one survived).
    let mut homeless: Vec<(usize, Option<usize>)> = Vec::new();
    for (k, key) in keys.iter().enumerate() {
        match key.spread {
            Spread::Whole { rank } => match new_of(rank) {
                Some(home) => {
                    loads[home] += key.bytes;
                    spreads[k] = Some(Spread::Whole { rank: home });
                }
                None => homeless.push((k, new_of(w.old_buddies.buddy(rank)))),
            },
            Spread::Sliced if (w.can_slice)(key.len, size) => {
                let share = key.bytes.div_ceil(size);
                loads.iter_mut().for_each(|l| *l += share);
                spreads[k] = Some(Spread::Sliced);
            }
            Spread::Sliced => homeless.push((k, None)),
        }
    }
    // Largest first; a stable sort keeps the table's order among equals.
    homeless.sort_by_key(|&(k, _)| std::cmp::Reverse(keys[k].bytes));
    for (k, buddy) in homeless {
        let home = (0..size)
            .min_by_key(|&r| (loads[r], Some(r) != buddy, r))
            .unwrap_or(0);
        loads[home] += keys[k].bytes;
        spreads[k] = Some(Spread::Whole { rank: home });
    }
    let spreads = spreads
        .into_iter()
        .map(|s| s.ok_or_else(|| Error::internal("a key left without a place")))
        .collect::<Result<Vec<_>>>()?;
    Ok((spreads, loads))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(rank: usize, len: usize) -> KeyAt {
        KeyAt {
            len,
            bytes: 4 * len,
            spread: Spread::Whole { rank },
        }
    }

    fn sliced(len: usize) -> KeyAt {
        KeyAt {
            len,
            bytes: 4 * len,
            spread: Spread::Sliced,
        }
    }

    fn worlds<'a>(old_size: usize, lost: &'a [usize], exact: bool) -> Worlds<'a> {
        let machines = vec![0; old_size];
        let left = vec![0; old_size - lost.len()];
        Worlds {
            old_size,
            old_buddies: Buddies::of(&machines).unwrap(),
            lost,
            new_buddies: Buddies::of(&left),
            exact_copies: exact,
            copies_current: true,
            can_slice: &|_, size| size > 1,
        }
    }

    /// Replays `plan` on every old rank's part and copy of each key (element `i` of a key
    /// worth `1000 * key + i`), and checks every new part and copy, element by element.
    fn replay(keys: &[KeyAt], w: &Worlds<'_>, plan: &Plan) {
        let survivors = w.survivors();
        let size = survivors.len();
        let value = |k: usize, i: usize| 1000 * k + i;
        for (k, key) in keys.iter().enumerate() {
            for j in 0..size {
                let want = plan.spreads[k].piece(key.len, j, size);
                let mut targets = vec![(j, Held::Part)];
                if let Some(b) = w.new_buddies {
                    targets.push((b.buddy(j), Held::Copy));
                }
                for (to, into) in targets {
                    let mut got = vec![None; want.len()];
                    // Rank `to` holds one part and one copy (its source's, `j`'s) of key `k`.
                    let into_it = |m: &&Move| m.key == k && m.to == to && m.into == into;
                    for m in plan.moves.iter().filter(into_it) {
                        let old = survivors[m.from];
                        // What the source holds there: its own part, or its source's.
                        let owner = match m.read {
                            Held::Part => old,
                            Held::Copy => w.old_buddies.source(old),
                        };
                        assert_eq!(owner, m.of, "{m:?} read from a part that does not hold it");
                        let held = key.spread.piece(key.len, owner, w.old_size);
                        assert!(held.start <= m.range.start && m.range.end <= held.end);
                        assert!(!w.lost.contains(&owner) || m.read == Held::Copy);
                        for i in m.range.clone() {
                            let at = i - want.start;
                            assert!(got[at].is_none(), "element {i} of key {k} written twice");
                            got[at] = Some(value(k, i));
                        }
                    }
                    let want: Vec<_> = want.clone().map(|i| Some(value(k, i))).collect();
                    assert_eq!(got, want, "key {k}, rank {j}'s {into:?} at {to}");
                }
            }
        }
    }

    #[test]
    fn a_whole_key_stays_home_and_a_lost_ranks_keys_balance_onto_the_survivors() {
        // Four ranks, one key each of 100 elements, and rank 1 lost: its key goes to its buddy
        // (rank 2, now 1), where the tie between the three survivors falls.
        let keys: Vec<KeyAt> = (0..4).map(|r| whole(r, 100)).collect();
        let w = worlds(4, &[1], true);
        let p = plan(&keys, &w).unwrap();
        let homes: Vec<_> = p.spreads.iter().map(|s| s.piece(100, 0, 3).len()).collect();
        assert_eq!(homes, [100, 0, 0, 0]);
        assert_eq!(
            p.spreads,
            [0, 1, 1, 2].map(|rank| Spread::Whole { rank }).to_vec()
        );
        // No part travels: every home holds its part, the lost one's buddy its copy.
        assert!(p
            .moves
            .iter()
            .filter(|m| m.into == Held::Part)
            .all(|m| !m.travels()));
        assert_eq!(p.rank_bytes, [400, 800, 400]);
        replay(&keys, &w, &p);
    }

    #[test]
    fn lost_keys_go_where_the_bytes_are_fewest() {
        // Rank 0 held three keys; its buddy, rank 1, already holds the most.
        let keys = [
            whole(0, 10),
            whole(0, 30),
            whole(0, 20),
            whole(1, 50),
            whole(2, 5),
        ];
        let w = worlds(3, &[0], true);
        let p = plan(&keys, &w).unwrap();
        // The survivors (now 0 and 1) hold 200 and 20 bytes. Largest first: 120 bytes to 1
        // (20), 80 to 1 (140 < 200), 40 to 0 (200 < 220).
        assert_eq!(
            p.spreads,
            [0, 1, 1, 0, 1].map(|rank| Spread::Whole { rank }).to_vec()
        );
        assert_eq!(p.rank_bytes, [240, 220]);
        replay(&keys, &w, &p);
    }

    #[test]
    fn a_sliced_key_moves_only_where_its_slices_change() {
        // 4 ranks to 3: new slice 0 is [0, 334), of which [0, 250) rank 0 already holds.
        let keys = [sliced(1000)];
        let w = worlds(4, &[3], false);
        let p = plan(&keys, &w).unwrap();
        let parts: Vec<&Move> = p.moves.iter().filter(|m| m.into == Held::Part).collect();
        let kept: usize = parts
            .iter()
            .filter(|m| !m.travels())
            .map(|m| m.range.len())
            .sum();
        let moved: usize = parts
            .iter()
            .filter(|m| m.travels())
            .map(|m| m.range.len())
            .sum();
        assert_eq!(kept + moved, 1000);
        // Rank 0 keeps 250, rank 1 keeps [334, 500), rank 2 [668, 750).
        assert_eq!(kept, 250 + 166 + 82);
        replay(&keys, &w, &p);
    }

    #[test]
    fn no_survivor_holding_a_piece_is_an_error_not_a_gap() {
        // Ranks 0 and 1 of 5 lost: rank 0's buddy is 1, so rank 0's key is gone.
        let keys = [whole(0, 4)];
        let w = worlds(5, &[0, 1], true);
        assert!(plan(&keys, &w).is_err());
    }
}
