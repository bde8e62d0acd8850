//! One rank alone (the single-process kinds): values pass through unchanged, so the backend
//! sums a push's values and updates the stored value in one pass.

use std::sync::RwLockWriteGuard;

use super::rows::{whole_part, whole_rows};
use super::{fan_out, Across, Arrived, Inputs, Mine, Rank0, Sent, Summed};
use crate::backend::cpu::rows::gather;
use crate::backend::{probe, HomeValue};
use crate::comm::dist::Dist;
use crate::comm::link::Round;
use crate::comm::{self, Spread};
use crate::compress::Compression;
use crate::host::HostData;
use crate::row_sparse::row_width;
use crate::store::groups::Group;
use crate::store::hook::cell_steps;
use crate::store::table::{place_by_size, Slot, Table};
use crate::store::{compress, Active, StoreKind};
use crate::{Device, Error, NDArray, Result};

/// One rank alone.
pub(crate) struct Alone;

impl Across for Alone {
    fn gpu_homes(&self, kind: StoreKind, homes: Option<&[Device]>) -> bool {
        match homes {
            Some(h) => h.iter().any(|d| d.is_gpu()),
            None => kind != StoreKind::Local && probe::gpu_count() > 0,
        }
    }

    /// Keys go where the caller says, or on this process's GPUs by size (`to_gpu`), or in host
    /// memory; they are never sliced.
    fn place(
        &self,
        _d: &Dist,
        table: &mut Table,
        sizes: &[(usize, usize)],
        homes: Option<&[Device]>,
        to_gpu: bool,
    ) -> (Vec<Device>, Vec<Spread>) {
        let gpus = probe::gpu_count();
        let bytes: Vec<usize> = sizes.iter().map(|&(bytes, _)| bytes).collect();
        let placed: Vec<Device> = match homes {
            Some(h) => h.to_vec(),
            None if to_gpu => place_by_size(&mut table.gpu_bytes.clone(), gpus, &bytes),
            None => vec![Device::Cpu(0); sizes.len()],
        };
        table.gpu_bytes.resize(gpus, 0);
        for (&b, home) in bytes.iter().zip(&placed) {
            if let Device::Gpu(i) = *home {
                table.gpu_bytes[i] += b;
            }
        }
        (placed, vec![Spread::Whole { rank: 0 }; sizes.len()])
    }

    /// Host homes are copied here, outside the table lock; keys homed on a GPU (`to_gpu`) are
    /// copied there once placed.
    fn rank0_values<'a>(
        &self,
        _d: &Dist,
        values: &'a [NDArray],
        to_gpu: bool,
    ) -> Result<Vec<Option<Rank0<'a>>>> {
        values
            .iter()
            .map(|v| match to_gpu {
                true => Ok(Some(Rank0::Caller(v))),
                false => Ok(Some(Rank0::Host(v.with_host(HostData::clone)?))),
            })
            .collect()
    }

    fn rank0_to_all<'a>(
        &self,
        _call: &mut dyn Round,
        _d: &Dist,
        _values: &[NDArray],
        _spreads: &[Spread],
        mine: Vec<Option<Rank0<'a>>>,
    ) -> Result<Vec<Rank0<'a>>> {
        mine.into_iter()
            .map(|m| m.ok_or_else(|| Error::internal("one rank without its own value")))
            .collect()
    }

    /// None: the values pass through to the backend.
    fn contributions<'g>(
        &self,
        _d: &Dist,
        _ctx: comm::Ctx,
        _groups: &[Group<'g>],
        _on_host: bool,
    ) -> Result<Vec<Mine<'g>>> {
        Ok(Vec::new())
    }

    /// Nothing to sum: dense values pass through (compressed ones are decoded under the keys'
    /// locks, [`Across::locked_inputs`]); merged rows are rows of the whole value.
    fn sum_across(
        &self,
        _call: &mut dyn Round,
        _d: &Dist,
        groups: &[Group<'_>],
        sent: Sent<'_>,
    ) -> Result<Arrived> {
        match sent {
            Sent::Dense { .. } => Ok(Arrived::Dense((Inputs::Values, None))),
            Sent::Rows(merged) => Ok(Arrived::Rows(
                (groups.iter().zip(merged))
                    .map(|(g, m)| Some(whole_part(g.slot.shape, m)))
                    .collect(),
            )),
        }
    }

    fn sum_dense(
        &self,
        _call: &mut dyn Round,
        _d: &Dist,
        _groups: &[Group<'_>],
        _mine: Vec<Mine<'_>>,
    ) -> Result<Inputs> {
        Ok(Inputs::Values)
    }

    /// A compressed push's values, each quantized with its residual, decoded and summed in
    /// order, as MXNet does: under the keys' locks, since the residuals change.
    fn locked_inputs(
        &self,
        d: &Dist,
        compression: Compression,
        groups: &[Group<'_>],
        summed: Summed,
    ) -> Result<Summed> {
        if !compression.is_on() {
            return Ok(summed);
        }
        let (totals, residuals) = compress::decoded_totals(compression, groups, d.pool())?;
        Ok((Inputs::Totals(totals), Some(residuals)))
    }

    /// The counts kept with each value's updater state.
    fn update_counts(
        &self,
        active: &Active,
        _groups: &[Group<'_>],
        cells: &[RwLockWriteGuard<'_, HomeValue>],
    ) -> Vec<u64> {
        cells
            .iter()
            .map(|c| c.step(active.generation).unwrap_or(0))
            .collect()
    }

    fn hook_steps(
        &self,
        active: &Active,
        _counts: &[u64],
        cells: &[RwLockWriteGuard<'_, HomeValue>],
    ) -> Vec<Option<u64>> {
        cell_steps(active, cells)
    }

    /// Straight from the cells into the outs.
    fn pull_parts(
        &self,
        _call: &mut dyn Round,
        _d: &Dist,
        ctx: comm::Ctx,
        groups: &[Group<'_>],
        cells: &[&HomeValue],
    ) -> Result<()> {
        fan_out(ctx, groups, |i| (cells[i], None), &[])
    }

    fn rows_pulled(
        &self,
        _call: &mut dyn Round,
        _d: &Dist,
        slot: &Slot,
        cell: &HomeValue,
        ids: &[u64],
    ) -> Result<HostData> {
        Ok(gather(
            &*cell.value_to_host()?,
            &whole_rows(ids, row_width(slot.shape)),
        ))
    }
}
