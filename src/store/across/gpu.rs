//! Ranks that keep their values on their GPUs: the link moves values in place there (NCCL; in
//! tests, the loopback link on host memory), packed where small; big keys are reduce-scattered
//! and all-gathered.
//!
//! A rank that fails its part of these collectives, or a step between two, shuts its link
//! (`out_of_step_on_error`): the others may still wait in a collective it never joined, which
//! NCCL would match with the next one it starts.

use super::{fan_out, in_key_order, on_rank0, part_shape, Across, Inputs, Mine, Rank0};
use crate::backend::HomeValue;
use crate::comm::dist::in_place::{self, Piece};
use crate::comm::dist::Dist;
use crate::comm::link::Round;
use crate::comm::{self, Spread};
use crate::store::groups::Group;
use crate::{NDArray, Result};

/// Ranks with their values on their GPUs (`dist_device_sync` with GPUs), where the link moves
/// them in place.
pub(crate) struct GpuRanks;

impl Across for GpuRanks {
    fn rank0_values<'a>(
        &self,
        d: &Dist,
        values: &'a [NDArray],
        _to_gpu: bool,
    ) -> Result<Vec<Option<Rank0<'a>>>> {
        on_rank0(d, values, |v| Ok(Rank0::Gpu(v.to_device(d.home())?)))
    }

    fn rank0_to_all<'a>(
        &self,
        call: &mut dyn Round,
        d: &Dist,
        values: &[NDArray],
        spreads: &[Spread],
        mine: Vec<Option<Rank0<'a>>>,
    ) -> Result<Vec<Rank0<'a>>> {
        let got = whole_to_every_rank(call, d, values, spreads, mine);
        call.out_of_step_on_error(got)
    }

    fn contributions<'g>(
        &self,
        d: &Dist,
        ctx: comm::Ctx,
        groups: &[Group<'g>],
        on_host: bool,
    ) -> Result<Vec<Mine<'g>>> {
        // This rank's values are summed on its GPU (a single value too: a collective may
        // overwrite its buffer).
        groups
            .iter()
            .map(|g| {
                let facts = g.slot.facts();
                let sum = comm::local_sum(ctx, &facts, &g.arrays, d.home(), None)?;
                match on_host {
                    false => Ok(Mine::Summed(sum)),
                    true => sum.into_host().map(Mine::Owned),
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
        let got = sum_in_place(call, d, groups, mine);
        call.out_of_step_on_error(got)
    }

    /// The totals are on the GPUs: dropped.
    fn recycle(&self, _d: &Dist, _inputs: Inputs) {}

    fn pull_parts(
        &self,
        call: &mut dyn Round,
        d: &Dist,
        ctx: comm::Ctx,
        groups: &[Group<'_>],
        cells: &[&HomeValue],
    ) -> Result<()> {
        let got = pull_in_place(call, d, groups, cells);
        let values = call.out_of_step_on_error(got)?;
        fan_out(ctx, groups, |i| (&values[i], None), &[])
    }
}

/// [`Across::rank0_to_all`] of GPU ranks: whole keys go to every rank (packed, as a pull does);
/// a sliced key is scattered.
fn whole_to_every_rank<'a>(
    call: &mut dyn Round,
    d: &Dist,
    values: &[NDArray],
    spreads: &[Spread],
    mine: Vec<Option<Rank0<'a>>>,
) -> Result<Vec<Rank0<'a>>> {
    let (mut whole, mut sliced) = (Vec::new(), Vec::new());
    for ((v, m), s) in values.iter().zip(mine).zip(spreads) {
        let data = match m {
            Some(Rank0::Gpu(a)) => Some(a),
            _ => None,
        };
        match s {
            Spread::Sliced => sliced.push((data, v.size(), v.dtype())),
            Spread::Whole { .. } => whole.push(Piece {
                data,
                shape: v.shape(),
                dtype: v.dtype(),
                root: 0,
            }),
        }
    }
    let whole = in_place::gather(call, d, whole)?
        .into_iter()
        .map(Rank0::Gpu);
    let sliced = in_place::scatter(call, d, sliced)?
        .into_iter()
        .map(Rank0::GpuPart);
    in_key_order(spreads.iter().copied(), whole, sliced)
}

/// [`Across::sum_dense`] of GPU ranks: whole keys are reduced onto their home rank (packed where
/// small); sliced keys are reduce-scattered, each rank left with the total of its slice.
fn sum_in_place(
    call: &mut dyn Round,
    d: &Dist,
    groups: &[Group<'_>],
    mine: Vec<Mine<'_>>,
) -> Result<Inputs> {
    let (mut whole, mut sliced) = (Vec::new(), Vec::new());
    for (g, m) in groups.iter().zip(mine) {
        match g.slot.spread {
            Spread::Sliced => sliced.push(m.into_array()?),
            Spread::Whole { rank } => whole.push((m.into_array()?, rank)),
        }
    }
    let whole = in_place::reduce(call, d, whole)?;
    // Flat, of the slice's length: the shape of a sliced key's part.
    let sliced = in_place::reduce_scatter(call, d, sliced)?
        .into_iter()
        .map(Some);
    let spreads = groups.iter().map(|g| g.slot.spread);
    Ok(Inputs::Totals(in_key_order(spreads, whole, sliced)?))
}

/// The collectives of [`Across::pull_parts`] of GPU ranks: whole keys are broadcast from their
/// home (packed where small); sliced keys are all-gathered from every rank's slice. Every key's
/// value, where this rank keeps its values.
fn pull_in_place(
    call: &mut dyn Round,
    d: &Dist,
    groups: &[Group<'_>],
    cells: &[&HomeValue],
) -> Result<Vec<HomeValue>> {
    let (mut pieces, mut parts) = (Vec::new(), Vec::new());
    for (g, cell) in groups.iter().zip(cells) {
        let len = g.slot.shape.size();
        match g.slot.spread {
            Spread::Sliced => {
                let mine = g.slot.spread.piece(len, d.rank(), d.size()).len();
                parts.push((cell.to_array(part_shape(g, mine))?, len));
            }
            Spread::Whole { rank: root } => pieces.push(Piece {
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
    let whole = in_place::gather(call, d, pieces)?;
    let sliced = in_place::all_gather(call, d, parts)?;
    in_key_order(groups.iter().map(|g| g.slot.spread), whole, sliced)?
        .into_iter()
        .map(|value| HomeValue::from_array(value, d.home()))
        .collect()
}
