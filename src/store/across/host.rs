//! Ranks that keep their values in host memory: values move over the link's collectives on
//! host buffers ([`comm::dist`] plans them: packed where small, sliced where big).

use std::ops::Range;
use std::sync::RwLockWriteGuard;

use super::{fan_out, in_key_order, on_rank0, part_shape, Across, Inputs, Mine, Rank0};
use crate::backend::cpu::Few;
use crate::backend::HomeValue;
use crate::comm::dist::{self, Dist, GatherPiece, Scattered, Sum, SumData, Uses};
use crate::comm::link::Round;
use crate::comm::{self, Spread};
use crate::host::HostData;
use crate::ndarray::Storage;
use crate::store::groups::Group;
use crate::{cpu, Error, NDArray, Result};

/// Ranks with their values in host memory (`dist_sync`; `dist_device_sync` without a GPU).
pub(crate) struct HostRanks;

impl Across for HostRanks {
    fn rank0_values<'a>(
        &self,
        d: &Dist,
        values: &'a [NDArray],
        _to_gpu: bool,
    ) -> Result<Vec<Option<Rank0<'a>>>> {
        on_rank0(d, values, |v| {
            Ok(Rank0::Host(v.with_host(HostData::clone)?))
        })
    }

    fn rank0_to_all<'a>(
        &self,
        call: &mut dyn Round,
        d: &Dist,
        values: &[NDArray],
        spreads: &[Spread],
        mine: Vec<Option<Rank0<'a>>>,
    ) -> Result<Vec<Rank0<'a>>> {
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
                Spread::Whole { .. } => whole.push(GatherPiece {
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
        let whole = dist::gather(call, ranks, d.pool(), whole)?;
        let sliced = dist::scatter(call, ranks, d.pool(), sliced)?;
        let (whole, sliced) = (whole.into_iter(), sliced.into_iter());
        in_key_order(
            spreads.iter().copied(),
            whole.map(Rank0::Host),
            sliced.map(Rank0::Part),
        )
    }

    fn contributions<'g>(
        &self,
        d: &Dist,
        ctx: comm::Ctx,
        groups: &[Group<'g>],
        _on_host: bool,
    ) -> Result<Vec<Mine<'g>>> {
        // A key pushed one value in host memory (checked: of its dtype) is read where it is;
        // otherwise this rank's values are summed first.
        groups
            .iter()
            .map(|g| match g.arrays.as_slice() {
                [a] if !a.device().is_gpu() => Ok(Mine::Single(a)),
                _ => {
                    let len = g.slot.shape.size();
                    let scratch = Some(d.pool().take(g.slot.dtype, len, d.room(len)));
                    let facts = g.slot.facts();
                    let sum = comm::local_sum(ctx, &facts, &g.arrays, d.home(), scratch)?;
                    sum.into_host().map(Mine::Owned)
                }
            })
            .collect()
    }

    fn sum_dense(
        &self,
        call: &mut dyn Round,
        d: &Dist,
        groups: &[Group<'_>],
        mine: Vec<Mine<'_>>,
    ) -> Result<Inputs> {
        let sums = groups
            .iter()
            .zip(mine)
            .map(|(g, s)| {
                let data = match s {
                    Mine::Owned(h) => SumData::Owned(h),
                    Mine::Single(a) => SumData::Value(a),
                    Mine::Summed(_) => {
                        return Err(Error::internal("a contribution not in host memory"))
                    }
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

    fn pull_parts(
        &self,
        call: &mut dyn Round,
        d: &Dist,
        ctx: comm::Ctx,
        groups: &[Group<'_>],
        cells: &[&HomeValue],
    ) -> Result<()> {
        // This rank's parts, read where they are (host values are borrowed, not copied).
        let parts = groups
            .iter()
            .zip(cells)
            .map(|(g, cell)| match g.slot.spread.holds(d.rank()) {
                true => cell.value_to_host().map(Some),
                false => Ok(None),
            })
            .collect::<Result<Few<_>>>()?;
        // Outs that receive their value in place lend their storage to the transfer, under
        // their write locks (see `lend_arrays`).
        let mut lent = lend_arrays(d, groups);
        let mut pieces: Few<GatherPiece<'_>> = groups
            .iter()
            .zip(&parts)
            .zip(lent.iter_mut())
            .map(|((g, part), lent)| GatherPiece {
                data: part.as_deref(),
                len: g.slot.shape.size(),
                dtype: g.slot.dtype,
                spread: g.slot.spread,
                into: lent.as_mut().and_then(|out| match &mut **out {
                    Storage::Host(h) => {
                        Some(std::mem::replace(h, HostData::filled(h.dtype(), 0, 0.0)))
                    }
                    Storage::Gpu(_) => None,
                }),
            })
            .collect();
        let gathered = match dist::gather_shared(call, (d.rank(), d.size()), d.pool(), &mut pieces)
        {
            Ok(g) => g,
            Err(e) => {
                // A lent out's storage may be lost with the failed transfer: zeros of its length
                // keep the array whole.
                for (g, out) in groups.iter().zip(lent.iter_mut()) {
                    if let Some(Storage::Host(h)) = out.as_deref_mut() {
                        if h.len() != g.slot.shape.size() {
                            *h = HostData::filled(g.slot.dtype, g.slot.shape.size(), 0.0);
                        }
                    }
                }
                return Err(e);
            }
        };
        // The lent outs get their storage back, holding the value.
        let dist::Gathered { mut bufs, at } = gathered;
        let mut in_place: Few<bool> = smallvec::smallvec![false; groups.len()];
        for (i, out) in lent.iter_mut().enumerate() {
            if let Some(Storage::Host(h)) = out.as_deref_mut() {
                std::mem::swap(h, &mut bufs[at[i].0]);
                in_place[i] = true;
            }
        }
        drop(lent);
        // The other keys are copied into their outs from where they arrived.
        let lens: Few<usize> = bufs.iter().map(HostData::len).collect();
        let values: Few<HomeValue> = bufs.into_iter().map(HomeValue::from_host).collect();
        let parts: Few<(&HomeValue, Option<Range<usize>>)> = at
            .into_iter()
            .map(|(b, range)| {
                let whole = range == (0..lens[b]);
                (&values[b], (!whole).then_some(range))
            })
            .collect();
        let pulled = fan_out(ctx, groups, |i| parts[i].clone(), &in_place);
        drop(parts);
        // The received buffers serve the next call.
        for v in values {
            if let Ok(h) = v.into_host() {
                d.pool().give(h);
            }
        }
        pulled
    }
}

/// Write locks on the outs that receive their key's value in place, per group of a pull: the
/// key's only out, in host memory, of its dtype, named by no other key of the call, for a key
/// whose value travels in a buffer of its own.
fn lend_arrays<'g>(
    d: &Dist,
    groups: &'g [Group<'_>],
) -> Few<Option<RwLockWriteGuard<'g, Storage>>> {
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
    let uses = Uses::of(
        groups
            .iter()
            .flat_map(|g| &g.arrays)
            .map(|a| a.storage_id()),
    );
    groups
        .iter()
        .map(|g| match g.arrays.as_slice() {
            [a] if candidate(g) && uses.once(a.storage_id()) => Some(a.write()),
            _ => None,
        })
        .collect()
}
