//! Healing a store after a lost rank from what the survivors hold: their own parts, and the
//! copies of the lost ranks' parts that their buddies kept ([`super::copies`]).
//!
//! Every survivor makes the same [`plan`] from the key table: whole keys stay on their homes,
//! a lost rank's keys go where the bytes are fewest (ties to the buddy that kept their
//! copies), sliced keys are cut again for the new world size, and every part's copy goes to its
//! new buddy. Only the pieces a survivor lacks cross the link, with their updater state, in one
//! all-to-all ([`wire`]); a part that stays whole on its rank keeps its cell, unread. Each survivor keeps its compression residuals (a lost rank's are lost
//! with it) and every key its update count. The ranks agree before they commit: a heal that
//! fails (another rank lost) leaves the table as it was, so the survivors can heal again.

mod plan;
#[cfg(test)]
mod plan_tests;
pub(super) mod wire;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use super::save_load::{host_copy, keep_on};
use super::table::Slot;
use super::{read, write, KvStore};
use crate::backend::HomeValue;
use crate::comm::dist::{all_to_all_words, Buddies};
use crate::comm::fingerprint::Fingerprint;
use crate::host::HostData;
use crate::{Device, Error, Result};
use plan::{Held, KeyAt, Move, Plan, Worlds};
use wire::Piece;

/// What a heal moved: the same figures on every survivor, but `received`.
pub(super) struct Healed {
    /// Keys of which some part moved to another rank.
    pub(super) keys_moved: usize,
    /// Keys in all.
    pub(super) keys: usize,
    /// Bytes of values that moved to another rank as parts (their updater state besides).
    pub(super) part_bytes: usize,
    /// Bytes of values sent to another rank as copies.
    pub(super) copy_bytes: usize,
    /// Bytes this rank received, with state and framing.
    pub(super) received: usize,
}

impl KvStore {
    /// Re-places every key for the new world after the loss of `lost` (ranks of the old world,
    /// where this rank was `old.0` of `old.1`, with copies kept by `old_buddies`). Every
    /// survivor calls it; each lost rank's buddy must be a survivor.
    pub(super) fn heal(
        &self,
        (old_rank, old_size): (usize, usize),
        old_buddies: Buddies,
        lost: &[usize],
    ) -> Result<Healed> {
        let d = &self.ranks;
        let active = read(&self.active).clone();
        let slots = self.slots_in_order();
        let mut fp = Fingerprint::new("heal").note(format!(
            "{} keys of a world of {old_size}, lost {lost:?}",
            slots.len()
        ));
        for s in &slots {
            fp.push(s.key.clone(), s.shape.dims(), s.dtype);
        }
        let mut call = d.begin(fp)?;
        let seq = call.seq();
        // The keys as the call began (another thread's init may have come between).
        let now = self.slots_in_order();
        let changed =
            now.len() != slots.len() || now.iter().zip(&slots).any(|(a, b)| a.key != b.key);
        let can_slice = |len: usize, size: usize| d.can_slice(len, size);
        // Where some survivor's copy lags its part, no surviving part is read from a copy.
        let lags_here = slots.iter().any(|s| s.copy_behind.load(Ordering::Acquire));
        let lags = call.all_gather_words(&[u64::from(lags_here)])?;
        let worlds = Worlds {
            old_size,
            old_buddies,
            lost,
            new_buddies: d.buddies(),
            exact_copies: !d.moves_in_place(),
            copies_current: lags.iter().all(|&l| l == 0),
            can_slice: &can_slice,
        };
        let keys: Vec<KeyAt> = (slots.iter())
            .map(|s| KeyAt {
                len: s.shape.size(),
                bytes: s.shape.size() * s.dtype.size(),
                spread: s.spread,
            })
            .collect();
        // Everything that can fail on this rank alone, before any data moves.
        let me = d.rank();
        let ready = (|| {
            if changed {
                return Err(Error::internal(
                    "the store's keys changed as the heal began",
                ));
            }
            let survivors = worlds.survivors();
            if survivors.len() != d.size() || survivors.get(me) != Some(&old_rank) {
                return Err(Error::internal(
                    "the survivors' new ranks are not their old ones in order",
                ));
            }
            let plan = plan::plan(&keys, &worlds)?;
            // A copy that lags its part cannot heal it (only a lost rank's part is read from a
            // copy then): the store goes back to its checkpoint.
            let reads_copy = |m: &&Move| m.from == me && m.read == Held::Copy;
            let lagging = (plan.moves.iter().filter(reads_copy))
                .find(|m| slots[m.key].copy_behind.load(Ordering::Acquire));
            if let Some(m) = lagging {
                return Err(Error::RankFailed {
                    op: "heal",
                    seq,
                    detail: format!(
                        "this rank's copy of a lost rank's part of key {} lags that part (a \
                         push of rows updates no copies, and a push's updated parts were on \
                         their way to the buddies when the rank was lost)",
                        slots[m.key].key
                    ),
                });
            }
            let kept = kept_in_place(&keys, &plan, (old_rank, old_size), (me, d.size()));
            let held = Holdings::read(&slots, &plan, me, &kept, &active)?;
            let mut out = vec![Vec::new(); d.size()];
            for m in plan.moves.iter().filter(|m| m.from == me && m.travels()) {
                held.piece(m, &keys, old_size)?.encode(&mut out[m.to]);
            }
            Ok((plan, kept, held, out))
        })();
        let (plan, kept, held, out) = call.agreed("heal", ready, "reading its parts")?;
        let mut received = 0;
        let made = (|| {
            let got = all_to_all_words(&mut *call, me, &out)?;
            drop(out);
            received = 8 * got.iter().map(Vec::len).sum::<usize>();
            let mut made = Made::new(&slots, &plan, &kept, me, d.size(), worlds.new_buddies)?;
            let mut at = vec![0usize; d.size()];
            let into_here = |m: &&Move| m.to == me && !(m.into == Held::Part && kept[m.key]);
            for m in plan.moves.iter().filter(into_here) {
                let piece = match m.travels() {
                    true => {
                        let dtype = slots[m.key].dtype;
                        Piece::decode(&got[m.from], &mut at[m.from], dtype, m.range.len())?
                    }
                    false => held.piece(m, &keys, old_size)?,
                };
                made.put(m, &piece)?;
            }
            if at.iter().zip(&got).any(|(&at, words)| at != words.len()) {
                return Err(Error::internal("more words arrived than the heal's pieces"));
            }
            drop((held, got));
            made.into_cells(&slots, d.home(), active.generation)
        })();
        // A fault the GPU latched earlier fails every rank here, not this rank after agreeing.
        let made = made.and_then(|m| crate::backend::settle(d.home()).map(|()| m));
        let cells = call.agreed("heal", made, "putting its parts together")?;
        // Every survivor applies the heal, or none (a rank lost before this point).
        call.commit()?;
        // The parts kept in place pass to the healed keys as they are (each cell's lock taken
        // alone, before the table's).
        let cells: Vec<(HomeValue, HomeValue)> = (slots.iter().zip(cells))
            .map(|(slot, (cell, copy))| {
                let cell = cell.unwrap_or_else(|| {
                    let empty = HomeValue::from_host(HostData::filled(slot.dtype, 0, 0.0));
                    std::mem::replace(&mut *write(&slot.cell), empty)
                });
                (cell, copy)
            })
            .collect();
        let mut table = write(&self.table);
        for ((slot, spread), (cell, copy)) in slots.iter().zip(&plan.spreads).zip(cells) {
            let residuals = std::mem::take(&mut *super::compress::lock(&slot.residuals));
            let updates = *slot.updates.lock().unwrap_or_else(|p| p.into_inner());
            let healed = Slot {
                key: slot.key.clone(),
                order: slot.order,
                init_seq: slot.init_seq,
                shape: slot.shape,
                dtype: slot.dtype,
                home: slot.home,
                spread: *spread,
                cell: RwLock::new(cell),
                copy: RwLock::new(copy),
                copy_behind: AtomicBool::new(false),
                updates: Mutex::new(updates),
                residuals: Mutex::new(residuals),
                row_sparse: slot.row_sparse,
            };
            table.slots.insert(slot.key.clone(), Arc::new(healed));
        }
        table.rank_bytes = plan.rank_bytes.clone();
        let value_bytes = |m: &Move| m.range.len() * slots[m.key].dtype.size();
        let travelling =
            |into: Held| (plan.moves.iter()).filter(move |m| m.into == into && m.travels());
        let mut moved: Vec<usize> = (travelling(Held::Part))
            .filter(|m| !m.range.is_empty())
            .map(|m| m.key)
            .collect();
        moved.dedup();
        Ok(Healed {
            keys_moved: moved.len(),
            keys: slots.len(),
            part_bytes: travelling(Held::Part).map(value_bytes).sum(),
            copy_bytes: travelling(Held::Copy).map(value_bytes).sum(),
            received,
        })
    }
}

/// Per key, whether this rank's part stays as it is: the key's one piece into this rank's part
/// (`me` of `size`; `old_rank` of `old_size` before) is all of its old part, read from that
/// part. Its cell then passes to the healed key unchanged, neither read nor written.
fn kept_in_place(
    keys: &[KeyAt],
    plan: &Plan,
    (old_rank, old_size): (usize, usize),
    (me, size): (usize, usize),
) -> Vec<bool> {
    let mut into_part = vec![0usize; keys.len()];
    let mut whole_from_here = vec![false; keys.len()];
    for m in plan
        .moves
        .iter()
        .filter(|m| m.to == me && m.into == Held::Part)
    {
        into_part[m.key] += 1;
        let key = &keys[m.key];
        let old = key.spread.piece(key.len, old_rank, old_size);
        whole_from_here[m.key] =
            m.from == me && m.read == Held::Part && m.of == old_rank && m.range == old;
    }
    (keys.iter().zip(&plan.spreads).enumerate())
        .map(|(k, (key, spread))| {
            let old = key.spread.piece(key.len, old_rank, old_size);
            let new = spread.piece(key.len, me, size);
            into_part[k] == 1 && whole_from_here[k] && !old.is_empty() && old == new
        })
        .collect()
}

/// Host copies of what this rank holds of each key that some move reads here: its part, and
/// the copy it keeps.
struct Holdings {
    parts: Vec<Option<(HostData, Option<crate::backend::HostState>)>>,
    copies: Vec<Option<(HostData, Option<crate::backend::HostState>)>>,
}

impl Holdings {
    /// Reads this rank's (`me`'s) parts and copies that `plan` reads, each under its lock.
    fn read(
        slots: &[Arc<Slot>],
        plan: &Plan,
        me: usize,
        kept: &[bool],
        active: &super::Active,
    ) -> Result<Holdings> {
        let mut h = Holdings {
            parts: slots.iter().map(|_| None).collect(),
            copies: slots.iter().map(|_| None).collect(),
        };
        // A part kept in place is read only where it is also sent, or copied into a copy.
        let reads =
            |m: &&Move| m.from == me && !(m.to == me && m.into == Held::Part && kept[m.key]);
        for m in plan.moves.iter().filter(reads) {
            let (to, lock) = match m.read {
                Held::Part => (&mut h.parts[m.key], &slots[m.key].cell),
                Held::Copy => (&mut h.copies[m.key], &slots[m.key].copy),
            };
            if to.is_none() {
                let (value, state) = host_copy(&read(lock), active)?;
                // State of another length than the value is no state (a push starts it afresh).
                let state = state.filter(|s| s.bufs.iter().all(|b| b.len() == value.len()));
                *to = Some((value, state.map(|s| (s.step, s.bufs))));
            }
        }
        Ok(h)
    }

    /// The piece `m` reads here.
    fn piece(&self, m: &Move, keys: &[KeyAt], old_size: usize) -> Result<Piece> {
        let held = match m.read {
            Held::Part => &self.parts[m.key],
            Held::Copy => &self.copies[m.key],
        };
        let (value, state) = held
            .as_ref()
            .ok_or_else(|| Error::internal("a piece not read"))?;
        let key = &keys[m.key];
        let start = key.spread.piece(key.len, m.of, old_size).start;
        let range = m.range.start - start..m.range.end - start;
        if range.end > value.len() {
            return Err(Error::internal("a part shorter than its range"));
        }
        Ok(Piece::cut(value, state.as_ref(), range))
    }
}

/// This rank's new parts and copies, being put together from pieces.
struct Made {
    parts: Vec<Assembly>,
    copies: Vec<Assembly>,
    /// Per key, whether this rank's part is kept in place ([`kept_in_place`]), not made.
    kept: Vec<bool>,
}

/// One new part or copy: its elements (from element `start` of the key), its state, and how
/// many elements have arrived.
struct Assembly {
    start: usize,
    value: HostData,
    state: Option<crate::backend::HostState>,
    filled: usize,
}

impl Made {
    /// Empty parts and copies of every key, as this rank (`me` of `size`) holds them under
    /// `plan`, with copies of its new buddy source's parts.
    fn new(
        slots: &[Arc<Slot>],
        plan: &Plan,
        kept: &[bool],
        me: usize,
        size: usize,
        buddies: Option<Buddies>,
    ) -> Result<Made> {
        let empty = |slot: &Slot, range: std::ops::Range<usize>| {
            Ok(Assembly {
                start: range.start,
                value: HostData::try_filled(slot.dtype, range.len(), 0.0)?,
                state: None,
                filled: 0,
            })
        };
        let source = buddies.map(|b| b.source(me));
        let mut made = Made {
            parts: Vec::with_capacity(slots.len()),
            copies: Vec::with_capacity(slots.len()),
            kept: kept.to_vec(),
        };
        for ((slot, spread), &kept) in slots.iter().zip(&plan.spreads).zip(kept) {
            let len = slot.shape.size();
            // A part kept in place is not put together again.
            let part = match kept {
                true => 0..0,
                false => spread.piece(len, me, size),
            };
            made.parts.push(empty(slot, part)?);
            let copy = source.map_or(0..0, |s| spread.piece(len, s, size));
            made.copies.push(empty(slot, copy)?);
        }
        Ok(made)
    }

    /// Writes `piece`, the elements of move `m`, where it goes.
    fn put(&mut self, m: &Move, piece: &Piece) -> Result<()> {
        let a = match m.into {
            Held::Part => &mut self.parts[m.key],
            Held::Copy => &mut self.copies[m.key],
        };
        let at = m.range.start.checked_sub(a.start);
        let disagree = || Error::internal("the pieces of a key disagree on its updater state");
        let first = a.filled == 0;
        let fits = at.is_some_and(|at| a.value.write_at(at, &piece.value));
        if !fits {
            return Err(Error::internal("a piece outside its part"));
        }
        let at = m.range.start - a.start;
        match (&mut a.state, &piece.state) {
            (None, None) => {}
            (state @ None, Some((step, bufs))) if first => {
                let mut new = Vec::with_capacity(bufs.len());
                for b in bufs {
                    let mut full = HostData::try_filled(b.dtype(), a.value.len(), 0.0)?;
                    full.write_at(at, b).then_some(()).ok_or_else(disagree)?;
                    new.push(full);
                }
                *state = Some((*step, new));
            }
            (Some((step, have)), Some((s, bufs))) if *step == *s && have.len() == bufs.len() => {
                for (h, b) in have.iter_mut().zip(bufs) {
                    h.write_at(at, b).then_some(()).ok_or_else(disagree)?;
                }
            }
            _ => return Err(disagree()),
        }
        a.filled += piece.value.len();
        Ok(())
    }

    /// The new cells (on `home`; `None` where the part is kept in place) and copies (in host
    /// memory) of every key, checked whole.
    fn into_cells(
        self,
        slots: &[Arc<Slot>],
        home: Device,
        generation: u64,
    ) -> Result<Vec<(Option<HomeValue>, HomeValue)>> {
        let mut cells = Vec::with_capacity(slots.len());
        let parts = self.parts.into_iter().zip(self.kept);
        for ((slot, (part, kept)), copy) in slots.iter().zip(parts).zip(self.copies) {
            if part.filled != part.value.len() || copy.filled != copy.value.len() {
                return Err(Error::internal("a part left with elements missing"));
            }
            let cell = match kept {
                true => None,
                false => {
                    let mut cell = keep_on(home, part.value, &slot.key)?;
                    cell.set_state(generation, part.state)?;
                    Some(cell)
                }
            };
            let mut copied = HomeValue::from_host(copy.value);
            copied.set_state(generation, copy.state)?;
            cells.push((cell, copied));
        }
        Ok(cells)
    }
}
