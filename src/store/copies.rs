//! Copies of every rank's parts on a buddy rank (`KVSTORE_REPLICAS=1`, where the store can go
//! on after a lost rank): so that the survivors lose nothing (see [`super::elastic`]).
//!
//! - **init** (and a load): each rank sends its new parts to its buddy, which keeps them.
//! - **push**: each rank sends its part of the summed push (what its updater takes) to its
//!   buddy, before any rank commits; the buddy runs the same updater on its copy, so the copy
//!   stays equal, bit for bit, to the part (the same code on the same input).
//! - A closure updater (which may keep state of its own, per key) runs once per part only: a
//!   push under one leaves the copies behind, and the store then marks them stale until they are
//!   sent again (a load); a loss meanwhile falls back to the last checkpoint.

use std::borrow::Cow;

use super::groups::Group;
use super::table::Slot;
use crate::backend::HomeValue;
use crate::comm::dist::{to_buddy, Buddies, Dist, KeyPart};
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
