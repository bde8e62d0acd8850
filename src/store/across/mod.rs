//! How a store's values cross ranks: one trait, [`Across`], chosen once when the store is
//! created ([`connect`]), with one file per way.
//!
//! - [`alone`]: one rank alone (the single-process kinds). Values pass through unchanged, so
//!   the backend fuses the sum with the update.
//! - [`host`]: ranks that keep their values in host memory (`dist_sync`, and
//!   `dist_device_sync` without a GPU), moved by the collectives [`comm::dist`] plans.
//! - [`gpu`]: ranks that keep their values on their GPUs, moved over NCCL between the GPUs.
//!
//! Row-sparse rows and compressed values travel in host memory on every kind of ranks.
//!
//! Every rank keeps the whole key table and, in each slot, only its own part of the value: the
//! whole value of the keys it homes, its slice of each sliced key, nothing of the others. The
//! updater and its state run where the value is, so optimizer state is sharded (ZeRO-1).
//!
//! - **init**: rank 0's values go to every rank, which keeps its part. Keys are placed largest
//!   first, each on the rank holding the fewest bytes; keys of more than
//!   `KVSTORE_BIGARRAY_BOUND` elements are sliced over every rank.
//! - **push**: each rank sums its own values, the sums are summed onto where the key lives
//!   ([`comm::dist::reduce`]), and the updater runs there.
//! - **pull**: the value goes from where it lives to every rank ([`comm::dist::gather`]).
//!
//! Every rank counts every key's updates, homed there or not, so a schedule gives every rank
//! the same rate. A rank that rejects its input tells the others in the call's fingerprint
//! check, so every rank fails the same call ([`Error::RankRejected`]). An updater that can fail
//! (a closure) stores nothing unless it succeeded on every rank ([`Error::RankFailed`]).
//!
//! Every rank must make the same calls, with the same keys, shapes and dtypes, in the same
//! order: MPI and NCCL match collectives by their order.

mod alone;
mod compressed;
mod gpu;
mod host;
mod rows;

use std::ops::Range;
use std::sync::{Once, RwLockWriteGuard};

use super::compress::Residuals;
use super::groups::{issue_order, Group};
use super::table::{place_on_ranks, Slot, Table};
use super::{Active, StoreKind};
use crate::backend::cpu::rows::Merged;
use crate::backend::cpu::Few;
use crate::backend::{probe, HomePull, HomeValue};
use crate::comm::dist::Dist;
use crate::comm::fingerprint::Fingerprint;
use crate::comm::link::Round;
use crate::comm::{self, Spread};
use crate::compress::Compression;
use crate::config::Config;
use crate::host::HostData;
use crate::{cpu, Device, Error, Key, NDArray, Result, Shape, Updater};
pub(super) use rows::Part;

/// How a store's values cross ranks (see the module doc). Every method is one step of a store
/// call; the defaults are those of ranks (host and GPU alike).
pub(super) trait Across: Send + Sync {
    /// Whether an init with `homes` (`None`: placed by the store) puts some key on a GPU of
    /// this process (one rank alone only: ranks keep values where [`Dist::home`] says).
    fn gpu_homes(&self, _kind: StoreKind, _homes: Option<&[Device]>) -> bool {
        false
    }

    /// Where new keys of `sizes` (bytes, elements) live: each one's home device and spread
    /// (whole on the least loaded rank, largest first; sliced when big). Updates the loads.
    fn place(
        &self,
        d: &Dist,
        table: &mut Table,
        sizes: &[(usize, usize)],
        _homes: Option<&[Device]>,
        _to_gpu: bool,
    ) -> (Vec<Device>, Vec<Spread>) {
        let sizes: Vec<(usize, bool)> = (sizes.iter())
            .map(|&(bytes, len)| (bytes, d.is_sliced(len)))
            .collect();
        let spreads = place_on_ranks(&mut table.rank_bytes, d.size(), &sizes);
        (vec![d.home(); sizes.len()], spreads)
    }

    /// Before an init's call: rank 0's values, read or copied (that may fail). `to_gpu`:
    /// [`Across::gpu_homes`].
    fn rank0_values<'a>(
        &self,
        d: &Dist,
        values: &'a [NDArray],
        to_gpu: bool,
    ) -> Result<Vec<Option<Rank0<'a>>>>;

    /// An init's step across ranks: rank 0's values (`mine` on rank 0) to every rank.
    fn rank0_to_all<'a>(
        &self,
        call: &mut dyn Round,
        d: &Dist,
        values: &[NDArray],
        spreads: &[Spread],
        mine: Vec<Option<Rank0<'a>>>,
    ) -> Result<Vec<Rank0<'a>>>;

    /// Before a push's call: this process's contribution to each key. `on_host`: the call
    /// works on the sums in host memory (a compressed push), so they are read back before the
    /// call, where a failure is a rejection every rank hears of, not a rank missing from a
    /// collective.
    fn contributions<'g>(
        &self,
        d: &Dist,
        ctx: comm::Ctx,
        groups: &[Group<'g>],
        on_host: bool,
    ) -> Result<Vec<Mine<'g>>>;

    /// A push's step across ranks, before the keys are locked: every rank's `sent` summed onto
    /// where each key lives. Compressed values and rows travel in host memory; the rest as
    /// [`Across::sum_dense`] says.
    fn sum_across(
        &self,
        call: &mut dyn Round,
        d: &Dist,
        groups: &[Group<'_>],
        sent: Sent<'_>,
    ) -> Result<Arrived> {
        match sent {
            Sent::Dense { mine, compression } if compression.is_on() => {
                let (inputs, residuals) =
                    compressed::sum_encoded(call, d, compression, groups, mine)?;
                Ok(Arrived::Dense((inputs, Some(residuals))))
            }
            Sent::Dense { mine, .. } => {
                let inputs = self.sum_dense(call, d, groups, mine)?;
                Ok(Arrived::Dense((inputs, None)))
            }
            Sent::Rows(merged) => rows::push_across(call, d, groups, merged).map(Arrived::Rows),
        }
    }

    /// [`Across::sum_across`] for uncompressed values.
    fn sum_dense(
        &self,
        call: &mut dyn Round,
        d: &Dist,
        groups: &[Group<'_>],
        mine: Vec<Mine<'_>>,
    ) -> Result<Inputs>;

    /// What the updater takes, once the keys are locked (`summed`, unless there is more to do).
    fn locked_inputs(
        &self,
        _d: &Dist,
        _compression: Compression,
        _groups: &[Group<'_>],
        summed: Summed,
    ) -> Result<Summed> {
        Ok(summed)
    }

    /// Each key's update count before this push, for the schedule and the step.
    fn update_counts(
        &self,
        active: &Active,
        groups: &[Group<'_>],
        _cells: &[RwLockWriteGuard<'_, HomeValue>],
    ) -> Vec<u64> {
        groups
            .iter()
            .map(|g| g.slot.updates(active.generation))
            .collect()
    }

    /// Each key's step after this push, for the push hook (`None`: a closure, which keeps no
    /// step).
    fn hook_steps(
        &self,
        active: &Active,
        counts: &[u64],
        _cells: &[RwLockWriteGuard<'_, HomeValue>],
    ) -> Vec<Option<u64>> {
        counts
            .iter()
            .map(|&c| (!matches!(active.updater, Updater::Custom(_))).then_some(c + 1))
            .collect()
    }

    /// A pull's step across ranks: every group's value from where it lives (this rank's parts
    /// are in `cells`) into the group's outs on every rank.
    fn pull_parts(
        &self,
        call: &mut dyn Round,
        d: &Dist,
        ctx: comm::Ctx,
        groups: &[Group<'_>],
        cells: &[&HomeValue],
    ) -> Result<()>;

    /// After a push: gives the host buffers of its totals back to the pool.
    fn recycle(&self, d: &Dist, inputs: Inputs) {
        let Inputs::Totals(totals) = inputs else {
            return;
        };
        for total in totals.into_iter().flatten() {
            if let Ok(h) = total.into_host() {
                d.pool().give(h);
            }
        }
    }

    /// A `row_sparse_pull`'s step across ranks: the rows `ids` of a key (this rank's part is
    /// `cell`), put together on this rank.
    fn rows_pulled(
        &self,
        call: &mut dyn Round,
        d: &Dist,
        slot: &Slot,
        cell: &HomeValue,
        ids: &[u64],
    ) -> Result<HostData> {
        rows::pull_across(call, d, slot, cell, ids)
    }
}

/// A push's totals across ranks, and the residuals a compressed push keeps once it succeeds.
pub(super) type Summed = (Inputs, Option<Vec<Residuals>>);

/// What a push sends across ranks.
pub(super) enum Sent<'g> {
    /// This process's contribution to each key, and the compression it travels with.
    Dense {
        mine: Vec<Mine<'g>>,
        compression: Compression,
    },
    /// Each row-sparse key's rows, summed by row on this process.
    Rows(Vec<Merged>),
}

/// What a push's step across ranks leaves on this rank, for the updater.
pub(super) enum Arrived {
    /// Dense totals (and a compressed push's residuals).
    Dense(Summed),
    /// Per row-sparse key, the rows this rank updates.
    Rows(Vec<Option<Part>>),
}

/// The link of a store of `kind` (named `name`), and how its values cross it.
pub(super) fn connect(
    kind: StoreKind,
    name: &str,
    config: &Config,
) -> Result<(Dist, Box<dyn Across>)> {
    let d = link(kind, name, config)?;
    let across = match d.is_alone() {
        true => Box::new(alone::Alone),
        false => over(&d),
    };
    Ok((d, across))
}

/// How the values of a store cross the ranks of `d`: in place (GPU ranks) or in host buffers.
pub(super) fn over(d: &Dist) -> Box<dyn Across> {
    match d.moves_in_place() {
        true => Box::new(gpu::GpuRanks),
        false => Box::new(host::HostRanks),
    }
}

/// The link of a store of `kind` (see [`connect`]).
fn link(kind: StoreKind, name: &str, config: &Config) -> Result<Dist> {
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

/// This rank's part of a key, `part`, kept where the store keeps its values.
pub(super) fn keep(d: &Dist, part: HostData) -> Result<HomeValue> {
    let flat = Shape::new(&[part.len()])?;
    HomeValue::from_array(NDArray::from_host(part, flat, cpu(0)), d.home())
}

/// This rank's contribution to a key of a push on ranks: its values' sum, or its one value.
pub(super) enum Mine<'a> {
    /// The sum, on this rank's GPU.
    Summed(NDArray),
    /// The sum, in host memory.
    Owned(HostData),
    /// The one value pushed, in host memory, of the key's dtype.
    Single(&'a NDArray),
}

impl Mine<'_> {
    /// The contribution as an array a collective may overwrite (a caller's value is copied).
    fn into_array(self) -> Result<NDArray> {
        match self {
            Mine::Summed(a) => Ok(a),
            Mine::Single(a) => a.copy(),
            Mine::Owned(_) => Err(Error::internal(
                "a host contribution on a link of GPU ranks",
            )),
        }
    }
}

/// What the updater takes for each key of a push on this rank.
pub(super) enum Inputs {
    /// The caller's values, summed by the backend with the update (one rank alone).
    Values,
    /// Per group, the total across ranks of this rank's part of the key (`None`: no part).
    Totals(Vec<Option<NDArray>>),
}

/// Rank 0's values (`read` of each) on rank 0, `None` on the others.
fn on_rank0<'a>(
    d: &Dist,
    values: &'a [NDArray],
    read: impl Fn(&'a NDArray) -> Result<Rank0<'a>>,
) -> Result<Vec<Option<Rank0<'a>>>> {
    let rank0 = d.rank() == 0;
    values
        .iter()
        .map(|v| rank0.then(|| read(v)).transpose())
        .collect()
}

/// A call's results for its whole and its sliced keys, back in the order of the keys' `spreads`.
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
            got.ok_or_else(|| Error::internal("a call lost a key's result"))
        })
        .collect()
}

/// Rank 0's value of a key being initialized, as this rank receives it.
pub(super) enum Rank0<'a> {
    /// The caller's value (one rank alone; GPU homes are copied there once placed).
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

/// Copies every group's whole value (`value(i)` for group `i`: a value, or the group's
/// elements of a shared one) into its outs, in issue order, except where `done`.
fn fan_out<'v>(
    ctx: comm::Ctx,
    groups: &[Group<'_>],
    value: impl Fn(usize) -> (&'v HomeValue, Option<Range<usize>>),
    done: &[bool],
) -> Result<()> {
    let jobs: Few<HomePull<'_>> = issue_order(groups)
        .into_iter()
        .filter(|&i| !done.get(i).copied().unwrap_or(false))
        .map(|i| {
            let (value, part) = value(i);
            HomePull {
                key: &groups[i].slot.key,
                value,
                part,
                outs: &groups[i].arrays,
            }
        })
        .collect();
    comm::pull(ctx, &jobs)
}

/// The shape of this rank's part (`len` elements) of a group's key: flat when it is a slice.
pub(super) fn part_shape(g: &Group<'_>, len: usize) -> Shape {
    match g.slot.spread {
        Spread::Whole { .. } => g.slot.shape,
        Spread::Sliced => Shape::new(&[len]).unwrap_or(g.slot.shape),
    }
}
