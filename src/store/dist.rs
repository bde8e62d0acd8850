//! The across-ranks steps of every store's one pipeline. A store's [`Dist`] holds its link to
//! the other ranks: one rank alone (the single-process kinds, whose values pass through
//! unchanged), or the ranks of a `dist_*` store.
//!
//! Every rank keeps the whole key table (names, shapes, dtypes, and which ranks hold each key),
//! and, in each slot, only its own part of the value: the whole value of the keys it homes, its
//! slice of each sliced key, nothing of the others. The updater and its state run where the
//! value is, so optimizer state is sharded over the ranks (ZeRO-1).
//!
//! - **init**: rank 0's values go to every rank, which keeps its part. Keys are placed on ranks
//!   largest first, each on the rank holding the fewest bytes; keys of more than
//!   `KVSTORE_BIGARRAY_BOUND` elements are sliced over every rank.
//! - **push**: each rank sums its own values, the sums are summed across ranks onto where the
//!   key lives ([`comm::dist::reduce`]), and the updater runs there, once per key.
//! - **pull**: the value goes from where it lives to every rank ([`comm::dist::gather`]), then
//!   into the outs.
//!
//! Values live in host memory and move over MPI (`dist_sync`, and `dist_device_sync` without a
//! GPU), or on each rank's GPU and move over NCCL (`dist_device_sync` with GPUs; keys are not
//! sliced there). Every rank also counts every key's updates, homed there or not, so a
//! learning-rate schedule gives every rank the same rate.
//!
//! Each call first checks its input on this rank. A rank that rejects its input tells the
//! others in the call's fingerprint check, so every rank fails the same call
//! ([`Error::RankRejected`] on the others) and nothing changes anywhere. An updater that can
//! fail (a closure) computes every key's new value, then the ranks compare notes, and nothing
//! is stored unless every rank's updater succeeded ([`Error::RankFailed`] on the others).
//!
//! Every rank must make the same calls, with the same keys, shapes and dtypes, in the same
//! order: the collectives of MPI (and NCCL) match calls by their order. Set the same updater on
//! every rank; it runs on the ranks that hold each key.

use std::collections::HashMap;
use std::ops::{Deref, Range};
use std::sync::{Once, RwLockWriteGuard};

use super::groups::{issue_order, Group};
use super::StoreKind;
use crate::backend::{probe, HomePull, HomeValue};
use crate::comm::dist::{self, Dist, GpuPiece, Piece, Scattered, Sum, SumData};
use crate::comm::fingerprint::Fingerprint;
use crate::comm::link::Round;
use crate::comm::{self, Spread};
use crate::config::Config;
use crate::host::HostData;
use crate::ndarray::Storage;
use crate::{cpu, Device, Error, Key, NDArray, Result, Shape};

/// The link of a store of `kind` (named `name`): one rank alone for the single-process kinds;
/// the distributed world for the `dist_*` kinds, where `dist_device_sync` on a machine with
/// GPUs keeps each rank's values on its GPU and moves them over NCCL.
pub(super) fn connect(kind: StoreKind, name: &str, config: &Config) -> Result<Dist> {
    if !kind.is_dist() {
        return Ok(Dist::solo());
    }
    let on_gpu = kind == StoreKind::DistDeviceSync && probe::gpu_count() > 0;
    if kind == StoreKind::DistDeviceSync && !on_gpu {
        static ONCE: Once = Once::new();
        ONCE.call_once(|| {
            log::warn!(
                "kvstore: no GPU found; '{name}' keeps its values in host memory and behaves \
                 as 'dist_sync'"
            )
        });
    }
    Dist::connect(on_gpu, config).map_err(|e| match e {
        Error::KindUnavailable { reason, .. } => Error::KindUnavailable {
            kind: name.to_owned(),
            reason,
        },
        e => e,
    })
}

/// This rank's part of a key, `part` (host data), kept where the store keeps its values.
pub(super) fn keep(d: &Dist, part: HostData) -> Result<HomeValue> {
    match d.home() {
        Device::Cpu(_) => Ok(HomeValue::from_host(part)),
        home => {
            let flat = Shape::new(&[part.len()])?;
            HomeValue::copy_of(&NDArray::from_host(part, flat, cpu(0)), home)
        }
    }
}

/// This rank's contribution to a key of a push on ranks: its values' sum, or its one value
/// itself. (One rank alone has none: its values pass through to the backend, which sums and
/// updates in one pass.)
pub(super) enum Mine<'a> {
    /// The sum, on this rank's GPU.
    Summed(NDArray),
    /// The sum, in host memory.
    Owned(HostData),
    /// The one value pushed, in host memory, of the key's dtype.
    Single(&'a NDArray),
}

impl Mine<'_> {
    /// The contribution as an array of its own, which a collective may overwrite (a single
    /// value is copied: it is the caller's).
    fn into_array(self) -> Result<NDArray> {
        match self {
            Mine::Summed(a) => Ok(a),
            Mine::Single(a) => a.copy(),
            Mine::Owned(_) => Err(dist::internal("a host contribution on a link of GPU ranks")),
        }
    }
}

/// What the updater takes for each key of a push on this rank.
pub(super) enum Inputs {
    /// The caller's values, summed by the backend with the update (one rank alone).
    Values,
    /// Per group, the total across ranks of what this rank holds of the key (`None` where it
    /// holds nothing), as an array of the shape of its part.
    Totals(Vec<Option<NDArray>>),
}

/// Rank 0's value of a key being initialized, as this rank receives it.
pub(super) enum Rank0<'a> {
    /// The caller's value itself (one rank alone; keys homed on a GPU are copied there once
    /// placed).
    Caller(&'a NDArray),
    /// In host memory.
    Host(HostData),
    /// On the GPU of a GPU rank.
    Gpu(NDArray),
    /// This rank's slice of a sliced key, in host memory.
    Part(HostData),
    /// This rank's slice of a sliced key, on the GPU of a GPU rank.
    GpuPart(NDArray),
}

/// A GPU call's results for its whole keys and for its sliced keys (each in the keys' order),
/// back in the order of the keys' `spreads`.
fn in_key_order<T>(
    spreads: impl IntoIterator<Item = Spread>,
    whole: impl IntoIterator<Item = T>,
    sliced: impl IntoIterator<Item = T>,
) -> Result<Vec<T>> {
    let (mut whole, mut sliced) = (whole.into_iter(), sliced.into_iter());
    spreads
        .into_iter()
        .map(|s| {
            let got = match s {
                Spread::Whole { .. } => whole.next(),
                Spread::Sliced => sliced.next(),
            };
            got.ok_or_else(|| dist::internal("a GPU call lost a key's result"))
        })
        .collect()
}

/// The fingerprint of a call of `op` on `groups`: each key with its shape and dtype.
pub(super) fn fingerprint(op: &'static str, groups: &[Group<'_>]) -> Fingerprint {
    let mut fp = Fingerprint::new(op);
    fp.reserve(groups.len());
    for g in groups {
        fp.push(g.slot.key.clone(), g.slot.shape.dims(), g.slot.dtype);
    }
    fp
}

/// The fingerprint of an init of `keys` with `values`.
pub(super) fn init_fingerprint(keys: &[Key], values: &[NDArray]) -> Fingerprint {
    let mut fp = Fingerprint::new("init");
    for (key, v) in keys.iter().zip(values) {
        fp.push(key.clone(), v.shape().dims(), v.dtype());
    }
    fp
}

/// Before an init's call: rank 0's values, read (or copied to its GPU), since that may fail.
/// One rank alone copies host homes here, outside the table lock (`to_gpu`: some key is
/// homed on a GPU, and is copied once placed).
pub(super) fn rank0_values<'a>(
    d: &Dist,
    values: &'a [NDArray],
    to_gpu: bool,
) -> Result<Vec<Option<Rank0<'a>>>> {
    values
        .iter()
        .map(|v| {
            Ok(match (d.passes_through(), d.rank(), d.gpu()) {
                (true, _, _) if to_gpu => Some(Rank0::Caller(v)),
                (true, _, _) => Some(Rank0::Host(v.with_host(HostData::clone)?)),
                (false, 0, Some(_)) => Some(Rank0::Gpu(v.to_device(d.home())?)),
                (false, 0, None) => Some(Rank0::Host(v.with_host(HostData::clone)?)),
                _ => None,
            })
        })
        .collect()
}

/// An init's step across ranks: rank 0's values (`mine` on rank 0) to every rank.
pub(super) fn from_rank0<'a>(
    call: &mut dyn Round,
    d: &Dist,
    values: &[NDArray],
    spreads: &[Spread],
    mine: Vec<Option<Rank0<'a>>>,
) -> Result<Vec<Rank0<'a>>> {
    if d.passes_through() {
        return mine
            .into_iter()
            .map(|m| m.ok_or_else(|| dist::internal("one rank without its own value")))
            .collect();
    }
    if let Some(rc) = d.gpu() {
        // Whole keys go to every rank (packed, as a pull does); a sliced key is scattered.
        let (mut whole, mut sliced) = (Vec::new(), Vec::new());
        for ((v, m), s) in values.iter().zip(mine).zip(spreads) {
            let data = match m {
                Some(Rank0::Gpu(a)) => Some(a),
                _ => None,
            };
            match s {
                Spread::Sliced => sliced.push((data, v.size(), v.dtype())),
                Spread::Whole { .. } => whole.push(GpuPiece {
                    data,
                    shape: v.shape(),
                    dtype: v.dtype(),
                    root: 0,
                }),
            }
        }
        let whole = dist::gather_on_gpus(rc, whole)?.into_iter().map(Rank0::Gpu);
        let sliced = dist::scatter_on_gpus(rc, sliced)?
            .into_iter()
            .map(Rank0::GpuPart);
        return in_key_order(spreads.iter().copied(), whole, sliced);
    }
    // Whole keys go to every rank (packed, as a pull does); a sliced key is scattered, each
    // rank receiving its own slice only, so an init never holds a big key whole on every rank.
    fn host<'m>(m: &'m Option<Rank0<'_>>) -> Option<&'m HostData> {
        match m {
            Some(Rank0::Host(h)) => Some(h),
            _ => None,
        }
    }
    let ranks = (d.rank(), d.size());
    let (mut whole, mut sliced) = (Vec::new(), Vec::new());
    for ((v, m), s) in values.iter().zip(&mine).zip(spreads) {
        match s {
            Spread::Whole { .. } => whole.push(Piece {
                data: host(m),
                len: v.size(),
                dtype: v.dtype(),
                spread: Spread::Whole { rank: 0 },
                into: None,
            }),
            Spread::Sliced => sliced.push(Scattered {
                data: host(m),
                len: v.size(),
                dtype: v.dtype(),
            }),
        }
    }
    let mut whole = dist::gather(call, ranks, d.pool(), whole)?.into_iter();
    let mut sliced = dist::scatter(call, ranks, d.pool(), sliced)?.into_iter();
    spreads
        .iter()
        .map(|s| {
            let got = match s {
                Spread::Whole { .. } => whole.next().map(Rank0::Host),
                Spread::Sliced => sliced.next().map(Rank0::Part),
            };
            got.ok_or_else(|| dist::internal("an init key got no value"))
        })
        .collect()
}

/// This rank's part of a key initialized with `whole`, kept on `home` where the key's spread
/// says this rank holds some of it.
pub(super) fn keep_part(
    d: &Dist,
    whole: Rank0<'_>,
    spread: Spread,
    home: Device,
    value: &NDArray,
    key: &Key,
) -> Result<HomeValue> {
    match whole {
        Rank0::Caller(v) => HomeValue::copy_of(v, home).map_err(|e| e.with_key(key)),
        Rank0::GpuPart(p) => HomeValue::from_array(p, home).map_err(|e| e.with_key(key)),
        Rank0::Gpu(a) if spread.holds(d.rank()) => HomeValue::copy_of(&a, home),
        Rank0::Part(p) if p.capacity() == p.len() => keep(d, p),
        Rank0::Part(p) => {
            let part = p.slice_of(0..p.len());
            d.pool().give(p);
            keep(d, part)
        }
        Rank0::Gpu(_) => Ok(HomeValue::from_host(HostData::filled(
            value.dtype(),
            0,
            0.0,
        ))),
        Rank0::Host(w) => {
            // A stored value owns exactly its size: a transfer's buffer (from the pool, with
            // room for bigger keys) is copied out of and goes back to the pool.
            let mine = spread.piece(w.len(), d.rank(), d.size());
            if mine.len() == w.len() && w.capacity() == w.len() {
                return keep(d, w);
            }
            let part = w.slice_of(mine);
            d.pool().give(w);
            keep(d, part)
        }
    }
}

/// Before a push's call: this process's contribution to each key. Reading a value may fail.
/// On host ranks, a key pushed one value in host memory (checked: of its dtype) is read where
/// it is; otherwise this rank's values are summed first. One rank alone sums nothing here, and
/// needs no list: its values pass through ([`sum_across`] gives [`Inputs::Values`]).
///
/// `on_host`: the call works on the sums in host memory (a compressed push makes its words
/// there), so a GPU rank reads its sums back here, before the call, where a failure is a
/// rejection every rank hears of rather than a rank missing from a collective.
pub(super) fn contributions<'g>(
    d: &Dist,
    ctx: comm::Ctx,
    groups: &[Group<'g>],
    on_host: bool,
) -> Result<Vec<Mine<'g>>> {
    if d.passes_through() {
        return Ok(Vec::new());
    }
    groups
        .iter()
        .map(|g| match g.arrays.as_slice() {
            [a] if d.gpu().is_none() && !a.device().is_gpu() => Ok(Mine::Single(a)),
            _ => {
                let len = g.slot.shape.size();
                let scratch = d
                    .gpu()
                    .is_none()
                    .then(|| d.pool().take(g.slot.dtype, len, d.room(len)));
                let facts = g.slot.facts();
                let sum = comm::local_sum(ctx, &facts, &g.arrays, d.home(), scratch)?;
                match d.gpu() {
                    Some(_) if !on_host => Ok(Mine::Summed(sum)),
                    _ => sum.into_host().map(Mine::Owned),
                }
            }
        })
        .collect()
}

/// A push's step across ranks: every rank's contributions (`mine`) summed onto where each key
/// lives. One rank alone passes its values through.
pub(super) fn sum_across(
    call: &mut dyn Round,
    d: &Dist,
    groups: &[Group<'_>],
    mine: Vec<Mine<'_>>,
) -> Result<Inputs> {
    if d.passes_through() {
        return Ok(Inputs::Values);
    }
    if let Some(rc) = d.gpu() {
        // Whole keys are reduced onto their home rank (packed where small); sliced keys are
        // reduce-scattered, each rank left with the total of its slice.
        let (mut whole, mut sliced) = (Vec::new(), Vec::new());
        for (g, m) in groups.iter().zip(mine) {
            match g.slot.spread {
                Spread::Sliced => sliced.push(m.into_array()?),
                Spread::Whole { rank } => whole.push((m.into_array()?, rank)),
            }
        }
        let whole = dist::reduce_on_gpus(rc, whole)?;
        // Flat, of the slice's length: the shape of a sliced key's part.
        let sliced = dist::reduce_scatter_on_gpus(rc, sliced)?
            .into_iter()
            .map(Some);
        let spreads = groups.iter().map(|g| g.slot.spread);
        return Ok(Inputs::Totals(in_key_order(spreads, whole, sliced)?));
    }
    let sums = groups
        .iter()
        .zip(mine)
        .map(|(g, s)| {
            let data = match s {
                Mine::Owned(h) => SumData::Owned(h),
                Mine::Single(a) => SumData::Value(a),
                Mine::Summed(_) => return Err(dist::internal("a contribution not in host memory")),
            };
            Ok(Sum {
                data,
                spread: g.slot.spread,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    // The caller's values are read, never lent: a transfer that fails cannot lose them.
    let totals = dist::reduce(call, (d.rank(), d.size()), d.pool(), sums)?;
    Ok(Inputs::Totals(
        totals
            .into_iter()
            .zip(groups)
            .map(|(t, g)| {
                t.map(|t| {
                    let shape = part_shape(g, t.len());
                    NDArray::from_host(t, shape, cpu(0))
                })
            })
            .collect(),
    ))
}

/// Gives the host buffers of a push's totals back to the pool, for the next call.
pub(super) fn recycle(d: &Dist, inputs: Inputs) {
    let Inputs::Totals(totals) = inputs else {
        return;
    };
    for total in totals.into_iter().flatten() {
        if !total.device().is_gpu() {
            if let Ok(h) = total.into_host() {
                d.pool().give(h);
            }
        }
    }
}

/// A pull's step across ranks, and the copies into the outs: every group's value from where it
/// lives (this rank's parts are in `cells`) to every rank, and into the group's outs. One rank
/// alone copies from its cells straight into the outs.
pub(super) fn pull_parts<C: Deref<Target = HomeValue>>(
    call: &mut dyn Round,
    d: &Dist,
    ctx: comm::Ctx,
    groups: &[Group<'_>],
    cells: &[C],
) -> Result<()> {
    if d.passes_through() {
        let whole: Vec<(&HomeValue, _)> = cells.iter().map(|c| (&**c, None)).collect();
        return fan_out(ctx, groups, &whole, &[]);
    }
    if let Some(rc) = d.gpu() {
        // Whole keys are broadcast from their home (packed where small); sliced keys are
        // all-gathered from every rank's slice.
        let (mut pieces, mut parts) = (Vec::new(), Vec::new());
        for (g, cell) in groups.iter().zip(cells) {
            let len = g.slot.shape.size();
            match g.slot.spread {
                Spread::Sliced => {
                    let mine = g.slot.spread.piece(len, d.rank(), d.size()).len();
                    parts.push((cell.to_array(part_shape(g, mine))?, len));
                }
                Spread::Whole { rank: root } => pieces.push(GpuPiece {
                    data: match root == d.rank() {
                        true => Some(cell.to_array(g.slot.shape)?),
                        false => None,
                    },
                    shape: g.slot.shape,
                    dtype: g.slot.dtype,
                    root,
                }),
            }
        }
        let whole = dist::gather_on_gpus(rc, pieces)?;
        let sliced = dist::all_gather_on_gpus(rc, parts)?;
        let values = in_key_order(groups.iter().map(|g| g.slot.spread), whole, sliced)?
            .into_iter()
            .map(|value| HomeValue::from_array(value, d.home()))
            .collect::<Result<Vec<_>>>()?;
        let values: Vec<(&HomeValue, _)> = values.iter().map(|v| (v, None)).collect();
        return fan_out(ctx, groups, &values, &[]);
    }
    // This rank's parts, read where they are (host values are borrowed, not copied).
    let parts = groups
        .iter()
        .zip(cells)
        .map(|(g, cell)| match g.slot.spread.holds(d.rank()) {
            true => cell.value_to_host().map(Some),
            false => Ok(None),
        })
        .collect::<Result<Vec<_>>>()?;
    // A key's only out, in host memory and of the key's dtype, and no other key's out, receives
    // the value itself, with no copy afterwards: its storage is lent to the transfer under its
    // write lock.
    let mut lent = lend_arrays(d, groups);
    let pieces = groups
        .iter()
        .zip(&parts)
        .zip(lent.iter_mut())
        .map(|((g, part), lent)| Piece {
            data: part.as_deref(),
            len: g.slot.shape.size(),
            dtype: g.slot.dtype,
            spread: g.slot.spread,
            into: lent.as_mut().and_then(|out| match &mut **out {
                Storage::Host(h) => Some(std::mem::replace(h, HostData::filled(h.dtype(), 0, 0.0))),
                Storage::Gpu(_) => None,
            }),
        })
        .collect();
    let gathered = match dist::gather_shared(call, (d.rank(), d.size()), d.pool(), pieces) {
        Ok(g) => g,
        Err(e) => {
            // A lent out's storage may be lost with the failed transfer: zeros of its length
            // keep the array whole.
            refill(groups, &mut lent);
            return Err(e);
        }
    };
    // The lent outs get their storage back, holding the value (each travelled in a buffer of
    // its own).
    let dist::Gathered { mut bufs, at } = gathered;
    let mut in_place = vec![false; groups.len()];
    for (i, out) in lent.iter_mut().enumerate() {
        if let Some(Storage::Host(h)) = out.as_deref_mut() {
            std::mem::swap(h, &mut bufs[at[i].0]);
            in_place[i] = true;
        }
    }
    drop(lent);
    // The other keys are copied into their outs from where they arrived (packed keys from
    // their shared buffer).
    let lens: Vec<usize> = bufs.iter().map(HostData::len).collect();
    let values: Vec<HomeValue> = bufs.into_iter().map(HomeValue::from_host).collect();
    let parts: Vec<(&HomeValue, Option<Range<usize>>)> = at
        .into_iter()
        .map(|(b, range)| {
            let whole = range == (0..lens[b]);
            (&values[b], (!whole).then_some(range))
        })
        .collect();
    let pulled = fan_out(ctx, groups, &parts, &in_place);
    drop(parts);
    // The received buffers serve the next call.
    for v in values {
        if let Ok(h) = v.into_host() {
            d.pool().give(h);
        }
    }
    pulled
}

/// Write locks on the outs that receive their key's value in place, per group of a pull: the
/// key's only out, in host memory, of its dtype, named by no other key of the call, for a key
/// whose value travels in a buffer of its own.
fn lend_arrays<'g>(
    d: &Dist,
    groups: &'g [Group<'_>],
) -> Vec<Option<RwLockWriteGuard<'g, Storage>>> {
    let candidate = |g: &Group<'_>| match g.arrays.as_slice() {
        [a] => {
            a.dtype() == g.slot.dtype
                && !a.device().is_gpu()
                && dist::receives_in_place(
                    g.slot.spread,
                    g.slot.shape.size(),
                    g.slot.dtype,
                    (d.size(), groups.len()),
                )
        }
        _ => false,
    };
    // Most calls of many small keys have no candidate: count array uses only when needed.
    if !groups.iter().any(candidate) {
        return groups.iter().map(|_| None).collect();
    }
    let mut uses: HashMap<usize, usize> = HashMap::new();
    for a in groups.iter().flat_map(|g| &g.arrays) {
        *uses.entry(a.storage_id()).or_default() += 1;
    }
    groups
        .iter()
        .map(|g| match g.arrays.as_slice() {
            [a] if candidate(g) && uses[&a.storage_id()] == 1 => Some(a.write()),
            _ => None,
        })
        .collect()
}

/// Gives every lent array that has no storage back (its transfer failed) zeros of its length.
fn refill(groups: &[Group<'_>], lent: &mut [Option<RwLockWriteGuard<'_, Storage>>]) {
    for (g, out) in groups.iter().zip(lent.iter_mut()) {
        if let Some(Storage::Host(h)) = out.as_deref_mut() {
            if h.len() != g.slot.shape.size() {
                *h = HostData::filled(g.slot.dtype, g.slot.shape.size(), 0.0);
            }
        }
    }
}

/// Copies every group's whole value (`values`, in group order: a value, or the group's
/// elements of a value several groups share) into its outs, in issue order, except the groups
/// `done` marks (their outs hold the value already).
fn fan_out(
    ctx: comm::Ctx,
    groups: &[Group<'_>],
    values: &[(&HomeValue, Option<Range<usize>>)],
    done: &[bool],
) -> Result<()> {
    let jobs: Vec<HomePull<'_>> = issue_order(groups)
        .into_iter()
        .filter(|&i| !done.get(i).copied().unwrap_or(false))
        .map(|i| HomePull {
            key: &groups[i].slot.key,
            value: values[i].0,
            part: values[i].1.clone(),
            outs: &groups[i].arrays,
        })
        .collect();
    comm::pull(ctx, &jobs)
}

/// The shape of this rank's part of a group's key, of `len` elements: the key's shape when it
/// holds all of it, a flat slice otherwise.
pub(super) fn part_shape(g: &Group<'_>, len: usize) -> Shape {
    match g.slot.spread {
        Spread::Whole { .. } => g.slot.shape,
        Spread::Sliced => Shape::new(&[len]).unwrap_or(g.slot.shape),
    }
}
