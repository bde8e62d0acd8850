//! Copies of every rank's parts on a buddy rank (`KVSTORE_REPLICAS=1`, where the store can go
//! on after a lost rank): so that the survivors lose nothing (see [`super::elastic`]).
//!
//! - **init** (and a load): each rank sends its new parts to its buddy, which keeps them.
//! - **push**, one of two ways (`KVSTORE_REPLICA_UPDATE`):
//!   - `replay` (the default): each rank sends its part of the summed push (what its updater
//!     takes) to its buddy, before any rank commits; the buddy runs the same updater on its
//!     copy, so the copy stays equal, bit for bit, to the part (the same code on the same
//!     input). About one more slice on the wire per push.
//!   - `send`: after the push commits, each rank sends its updated part, value and updater
//!     state, to its buddy ([`send_parts`]). The part and its state on the wire per push. A
//!     closure updater (which may keep state of its own, per key, so it must run once per
//!     part) and a PTX updater without a CPU twin always go this way.
//!
//!   While a push's parts are on their way, their copies lag them ([`Slot::copy_behind`]): a
//!   rank lost then, before its part reached its buddy, costs the survivors a reload of the
//!   last checkpoint.
//! - A push of rows updates no copies: their keys' copies lag until a load or a heal makes
//!   them anew.

use std::borrow::Cow;
use std::sync::atomic::Ordering;
use std::sync::RwLockWriteGuard;

use super::groups::Group;
use super::heal::wire::Piece;
use super::save_load::host_copy;
use super::table::Slot;
use super::{write, Active};
use crate::backend::HomeValue;
use crate::comm::dist::{all_to_all_words, to_buddy, Buddies, Dist, KeyPart};
use crate::comm::link::Round;
use crate::host::HostData;
use crate::{cpu, NDArray, Result};

/// Each key's facts for an exchange with the buddy.
pub(super) fn key_parts<'a>(slots: impl IntoIterator<Item = &'a Slot>) -> Vec<KeyPart> {
    slots
        .into_iter()
        .map(|s| KeyPart {
            dtype: s.dtype,
            len: s.shape.size(),
            spread: s.spread,
        })
        .collect()
}

/// The copies of the source's parts of keys `keys` (one per key: `None` where the source holds
/// none), for this rank's `parts` of them, sent to and received from the buddies.
pub(super) fn exchange_values(
    call: &mut dyn Round,
    d: &Dist,
    buddies: Buddies,
    keys: &[KeyPart],
    parts: &[&HomeValue],
) -> Result<Vec<Option<HomeValue>>> {
    let (rank, size) = (d.rank(), d.size());
    let hosts: Vec<Option<Cow<'_, HostData>>> = (parts.iter().zip(keys))
        .map(|(p, k)| match k.spread.holds(rank) {
            true => p.value_to_host().map(Some),
            false => Ok(None),
        })
        .collect::<Result<_>>()?;
    let mine: Vec<Option<&HostData>> = hosts.iter().map(Option::as_deref).collect();
    let got = to_buddy(call, (rank, size), buddies, d.pool(), keys, &mine)?;
    Ok(got
        .into_iter()
        .map(|h| h.map(HomeValue::from_host))
        .collect())
}

/// The source's part of the summed push of each group (what the copy's updater takes), for this
/// rank's `totals` (its own part of each), sent to and received from the buddies.
pub(super) fn exchange_totals(
    call: &mut dyn Round,
    d: &Dist,
    buddies: Buddies,
    groups: &[Group<'_>],
    totals: &[Option<NDArray>],
) -> Result<Vec<Option<NDArray>>> {
    let keys = key_parts(groups.iter().map(|g| &*g.slot));
    // Read where they are (the push's own host buffers), not copied.
    let guards: Vec<_> = totals
        .iter()
        .map(|t| t.as_ref().map(NDArray::read))
        .collect();
    let hosts: Vec<Option<Cow<'_, HostData>>> = (guards.iter())
        .map(|g| g.as_ref().map(|s| s.host()).transpose())
        .collect::<Result<_>>()?;
    let (rank, size) = (d.rank(), d.size());
    let mine: Vec<Option<&HostData>> = hosts.iter().map(Option::as_deref).collect();
    let got = to_buddy(call, (rank, size), buddies, d.pool(), &keys, &mine)?;
    Ok(got
        .into_iter()
        .zip(groups)
        .map(|(h, g)| {
            h.map(|h| {
                let shape = super::across::part_shape(g, h.len());
                NDArray::from_host(h, shape, cpu(0))
            })
        })
        .collect())
}

/// Marks the copies of `groups`' keys as lagging their parts ([`Slot::copy_behind`]).
pub(super) fn mark_behind(groups: &[Group<'_>]) {
    for g in groups {
        g.slot.copy_behind.store(true, Ordering::Release);
    }
}

/// Sends this rank's part of each group as the push left it in `cells`, value and updater
/// state, to its buddy, and keeps what its buddy source sends as the copies
/// (`KVSTORE_REPLICA_UPDATE=send`). Called after the push committed, on every rank: the copies
/// lag their parts ([`mark_behind`]) until each part arrives here. `current`: whether this
/// rank's parts are as the push left them (false: its update failed after the commit, and it
/// sends none).
///
/// Only the link fails it (a lost rank): a part a rank cannot read or a receiver cannot take
/// leaves that copy lagging (logged), and the push, which took effect, stands.
pub(super) fn send_parts(
    call: &mut dyn Round,
    d: &Dist,
    buddies: Buddies,
    groups: &[Group<'_>],
    cells: &[RwLockWriteGuard<'_, HomeValue>],
    active: &Active,
    current: bool,
) -> Result<()> {
    mark_behind(groups);
    let (rank, size) = (d.rank(), d.size());
    let keys = key_parts(groups.iter().map(|g| &*g.slot));
    // The first word says whether the parts follow.
    let read = (|| {
        let mut words = vec![1];
        for (k, cell) in keys.iter().zip(cells) {
            if k.held(rank, size) == 0 {
                continue;
            }
            // The whole part, as read: no cut (which would copy it again).
            let (value, state) = host_copy(cell, active)?;
            let state = state.map(|s| (s.step, s.bufs));
            Piece { value, state }.encode(&mut words);
        }
        Ok::<_, crate::Error>(words)
    })();
    let words = match (current, read) {
        (true, Ok(words)) => words,
        (false, _) => vec![0],
        (true, Err(e)) => {
            log::warn!(
                "kvstore: this rank's parts could not be read for its buddy ({e}): their \
                 copies lag them until the next load"
            );
            vec![0]
        }
    };
    let mut out = vec![Vec::new(); size];
    out[buddies.buddy(rank)] = words;
    let got = all_to_all_words(call, rank, &out)?;
    drop(out);
    let source = buddies.source(rank);
    let taken = match got.get(source).map(Vec::as_slice) {
        Some([1, pieces @ ..]) => take_copies(groups, &keys, pieces, (source, size), active),
        _ => Err(crate::Error::internal("the buddy source sent no parts")),
    };
    match taken {
        Ok(copies) => {
            for (g, copy) in groups.iter().zip(copies) {
                if let Some(copy) = copy {
                    *write(&g.slot.copy) = copy;
                }
                g.slot.copy_behind.store(false, Ordering::Release);
            }
        }
        Err(e) => log::warn!(
            "kvstore: the copies of rank {source}'s parts were not updated ({e}): they lag \
             those parts until the next load"
        ),
    }
    Ok(())
}

/// The copies of the parts of `keys` that rank `source` (of `size`) holds, from its `words`:
/// one per group (`None` where it holds none).
fn take_copies(
    groups: &[Group<'_>],
    keys: &[KeyPart],
    words: &[u64],
    (source, size): (usize, usize),
    active: &Active,
) -> Result<Vec<Option<HomeValue>>> {
    let mut at = 0;
    let mut copies = Vec::with_capacity(groups.len());
    for (g, k) in groups.iter().zip(keys) {
        let len = k.held(source, size);
        if len == 0 {
            copies.push(None);
            continue;
        }
        let piece = Piece::decode(words, &mut at, g.slot.dtype, len)?;
        let mut copy = HomeValue::from_host(piece.value);
        copy.set_state(active.generation, piece.state)?;
        copies.push(Some(copy));
    }
    if at != words.len() {
        return Err(crate::Error::internal(
            "more words arrived than the buddy's parts",
        ));
    }
    Ok(copies)
}
