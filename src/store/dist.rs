//! Distributed stores (`dist_sync`, `dist_device_sync`): the store's side of a call across
//! ranks.
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
use std::sync::{Once, RwLockReadGuard, RwLockWriteGuard};

use super::groups::{issue_order, lock_cells, Group};
use super::hook::{call_hook, pushed};
use super::table::place_on_ranks;
use super::{check_new_keys, hyper, insert_slots, kinds_of, read, write, KvStore, StoreKind};
use crate::backend::{probe, HomePull, HomeValue, KeyFacts};
use crate::comm::dist::Round;
use crate::comm::dist::{self, Dist, GpuPiece, Piece, Sum, SumData};
use crate::comm::mpi::Fingerprint;
use crate::comm::{self, KeyPush, Spread};
use crate::host::HostData;
use crate::ndarray::Storage;
use crate::{cpu, Device, Key, NDArray, Result, Shape, Updater};

/// Joins the distributed world for a store of `kind` (named `name`): `dist_device_sync` on a
/// machine with GPUs keeps each rank's values on its GPU and moves them over NCCL.
pub(super) fn connect(kind: StoreKind, name: &str) -> Result<Dist> {
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
    Dist::connect(on_gpu)
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

/// This rank's contribution to a key of a push: its values' sum, or its one value itself.
enum Mine<'a> {
    Summed(NDArray),
    Single(&'a NDArray),
}

impl Mine<'_> {
    /// The contribution as an array of its own, which a collective may overwrite (a single
    /// value is copied: it is the caller's).
    fn into_array(self) -> Result<NDArray> {
        match self {
            Mine::Summed(a) => Ok(a),
            Mine::Single(a) => a.copy(),
        }
    }
}

/// Rank 0's value of a key being initialized: in host memory, or on the GPU of a GPU rank.
enum Rank0 {
    Host(HostData),
    Gpu(NDArray),
}

/// The home rank of a key that lives whole on one rank.
fn root_of(spread: Spread) -> usize {
    match spread {
        Spread::Whole { rank } => rank,
        Spread::Sliced => 0,
    }
}

/// The fingerprint of a call of `op` on `groups`: each key with its shape and dtype.
fn fingerprint(op: &'static str, groups: &[Group<'_>]) -> Fingerprint {
    let mut fp = Fingerprint::new(op);
    for g in groups {
        fp.push(g.slot.key.clone(), g.slot.shape.dims(), g.slot.dtype);
    }
    fp
}

impl KvStore {
    /// A dist store's init of checked `keys`: rank 0's `values` go to every rank, which keeps its
    /// part of each.
    pub(super) fn dist_init(&self, d: &Dist, keys: Vec<Key>, values: &[NDArray]) -> Result<()> {
        // Rank 0's values, read (or copied to its GPU) before the call: that may fail.
        let prepared = (|| {
            check_new_keys(&read(&self.table), &keys)?;
            let mut fp = Fingerprint::new("init");
            let mut mine = Vec::with_capacity(keys.len());
            for (key, v) in keys.iter().zip(values) {
                fp.push(key.clone(), v.shape().dims(), v.dtype());
                mine.push(match (d.rank(), d.gpu()) {
                    (0, Some(_)) => Some(Rank0::Gpu(v.to_device(d.home())?)),
                    (0, None) => Some(Rank0::Host(v.with_host(HostData::clone)?)),
                    _ => None,
                });
            }
            Ok((fp, mine))
        })();
        let (fp, mine) = prepared.map_err(|e| d.reject("init", e))?;
        let mut call = d.begin(&fp)?;
        // Every rank gets rank 0's whole values, then keeps its part of each.
        let whole: Vec<Rank0> = match d.gpu() {
            Some(rc) => {
                let pieces = values
                    .iter()
                    .zip(mine)
                    .map(|(v, m)| GpuPiece {
                        data: match m {
                            Some(Rank0::Gpu(a)) => Some(a),
                            _ => None,
                        },
                        shape: v.shape(),
                        dtype: v.dtype(),
                        root: 0,
                    })
                    .collect();
                let arrays = dist::gather_on_gpus(rc, pieces)?;
                arrays.into_iter().map(Rank0::Gpu).collect()
            }
            None => {
                let pieces = values
                    .iter()
                    .zip(&mine)
                    .map(|(v, m)| Piece {
                        data: match m {
                            Some(Rank0::Host(h)) => Some(h),
                            _ => None,
                        },
                        len: v.size(),
                        dtype: v.dtype(),
                        spread: Spread::Whole { rank: 0 },
                        into: None,
                    })
                    .collect();
                let hosts = dist::gather(&mut call, d.pool(), pieces)?;
                hosts.into_iter().map(Rank0::Host).collect()
            }
        };
        let mut table = write(&self.table);
        // Every rank checked these keys before the call; a key another thread of this process
        // added since is this rank's own race.
        check_new_keys(&table, &keys)?;
        let sizes: Vec<(usize, bool)> = values
            .iter()
            .map(|v| (v.nbytes(), d.is_sliced(v.size())))
            .collect();
        let spreads = place_on_ranks(&mut table.rank_bytes, d.size(), &sizes);
        let data: Vec<HomeValue> = whole
            .into_iter()
            .zip(&spreads)
            .zip(values)
            .map(|((w, s), v)| match w {
                Rank0::Gpu(a) if s.holds(d.rank()) => HomeValue::copy_of(&a, d.home()),
                Rank0::Gpu(_) => Ok(HomeValue::from_host(HostData::filled(v.dtype(), 0, 0.0))),
                Rank0::Host(w) => {
                    let mine = s.piece(w.len(), d.rank(), d.size());
                    let part = if mine.len() == w.len() {
                        w
                    } else {
                        w.slice_of(mine)
                    };
                    keep(d, part)
                }
            })
            .collect::<Result<_>>()?;
        let homes = vec![d.home(); keys.len()];
        insert_slots(&mut table, keys, &kinds_of(values), data, &homes, &spreads);
        Ok(())
    }

    /// A dist store's push of checked `groups` (`op` is `push` or `pushpull`), then, for a
    /// pushpull, the pull of `pulls` (the same keys) in the same call.
    pub(super) fn dist_push(
        &self,
        op: &'static str,
        d: &Dist,
        groups: Vec<Group<'_>>,
        pulls: Option<&[Group<'_>]>,
    ) -> Result<()> {
        let ctx = self.ctx();
        // This process's sums, before the call: reading a value may fail.
        // On host ranks, a key pushed one value in host memory (checked: of its dtype) is read
        // where it is; otherwise this rank's values are summed first.
        let sums = groups
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
                    comm::local_sum(ctx, &facts, &g.arrays, d.home(), scratch).map(Mine::Summed)
                }
            })
            .collect::<Result<Vec<_>>>()
            .map_err(|e| d.reject(op, e))?;
        let active = read(&self.active).clone();
        let hook = read(&self.hook).clone();
        // The ranks must agree on the updater too: it decides which collectives follow.
        let fp = fingerprint(op, &groups).note(&format!("updater {}", active.updater.name()));
        // The totals this rank holds, as arrays of the shape its part has.
        let (mut call, inputs) = match d.gpu() {
            Some(rc) => {
                let roots = groups.iter().map(|g| root_of(g.slot.spread));
                let call = d.begin(&fp)?;
                let sums = sums
                    .into_iter()
                    .map(Mine::into_array)
                    .zip(roots)
                    .map(|(a, r)| Ok((a?, r)))
                    .collect::<Result<Vec<_>>>()?;
                let totals = dist::reduce_on_gpus(rc, sums)?;
                (call, totals)
            }
            None => {
                let mut sums = groups
                    .iter()
                    .zip(sums)
                    .map(|(g, s)| {
                        let data = match s {
                            Mine::Summed(s) => SumData::Owned(s.into_host()?),
                            Mine::Single(a) => SumData::Value(a),
                        };
                        Ok(Sum {
                            data,
                            spread: g.slot.spread,
                        })
                    })
                    .collect::<Result<Vec<_>>>()
                    .map_err(|e| d.reject(op, e))?;
                let mut call = d.begin(&fp)?;
                // A key's one value that travels alone is sent from its own storage, lent under
                // its write lock (taken inside the call, so no other call of this process
                // waits on it) and handed back unchanged.
                let mut lent = lend_arrays(d, &groups);
                for (s, out) in sums.iter_mut().zip(lent.iter_mut()) {
                    if let Some(Storage::Host(h)) = out.as_deref_mut() {
                        let own = std::mem::replace(h, HostData::filled(h.dtype(), 0, 0.0));
                        s.data = SumData::Lent(own);
                    }
                }
                let reduced = dist::reduce(&mut call, d.pool(), sums);
                let totals = match reduced {
                    Ok((totals, back)) => {
                        for (i, h) in back {
                            if let Some(Storage::Host(slot)) = lent[i].as_deref_mut() {
                                *slot = h;
                            }
                        }
                        refill(&groups, &mut lent);
                        totals
                    }
                    Err(e) => {
                        // A lent value may be lost with the failed transfer: zeros keep the
                        // array whole (the distributed world is unusable after this anyway).
                        refill(&groups, &mut lent);
                        return Err(e);
                    }
                };
                drop(lent);
                let inputs = totals
                    .into_iter()
                    .zip(&groups)
                    .map(|(t, g)| {
                        t.map(|t| {
                            let shape = part_shape(g, t.len());
                            NDArray::from_host(t, shape, cpu(0))
                        })
                    })
                    .collect();
                (call, inputs)
            }
        };
        let mut cells = lock_cells(&groups);
        let refs: Vec<Option<[&NDArray; 1]>> =
            inputs.iter().map(|a| a.as_ref().map(|a| [a])).collect();
        // Update counts are kept on every rank, so every rank computes the same rate.
        let generation = active.generation;
        let counts: Vec<u64> = groups.iter().map(|g| g.slot.updates(generation)).collect();
        let hypers = hyper::for_push(&active, &groups, &counts);
        let mut taken: Vec<Option<&mut _>> = cells.iter_mut().map(Some).collect();
        let mut jobs = Vec::new();
        for i in issue_order(&groups) {
            let (Some(value), Some(input)) = (taken[i].take(), refs[i].as_ref()) else {
                continue;
            };
            let g = &groups[i];
            jobs.push(KeyPush {
                facts: KeyFacts {
                    shape: input[0].shape(),
                    ..g.slot.facts()
                },
                value,
                values: &input[..],
                hyper: hypers.of(i),
            });
        }
        let mut agree = |ok: bool| call.agree(op, ok, "in the updater");
        comm::push(&active.updater, generation, ctx, jobs, Some(&mut agree))?;
        hypers.commit(&active);
        for (g, &c) in groups.iter().zip(&counts) {
            g.slot.set_updates(generation, c + 1);
        }
        let steps: Vec<Option<u64>> = counts
            .iter()
            .map(|&c| (!matches!(active.updater, Updater::Custom(_))).then_some(c + 1))
            .collect();
        let done = hook.as_ref().map(|_| pushed(&groups, &steps));
        if let Some(pulls) = pulls {
            pull_parts(&mut call, d, ctx, pulls, &cells)?;
        }
        drop(cells);
        drop(call);
        drop(refs);
        // The totals' host buffers serve the next call.
        for total in inputs.into_iter().flatten() {
            if !total.device().is_gpu() {
                if let Ok(h) = total.into_host() {
                    d.pool().give(h);
                }
            }
        }
        call_hook(hook.as_deref(), &active, done)
    }

    /// A dist store's pull of checked `groups`.
    pub(super) fn dist_pull(&self, d: &Dist, groups: Vec<Group<'_>>) -> Result<()> {
        let mut call = d.begin(&fingerprint("pull", &groups))?;
        let cells: Vec<RwLockReadGuard<'_, HomeValue>> =
            groups.iter().map(|g| read(&g.slot.cell)).collect();
        pull_parts(&mut call, d, self.ctx(), &groups, &cells)
    }
}

/// Brings every group's value from where it lives (this rank's parts are in `cells`) to every
/// rank, and into the group's outs.
fn pull_parts<C: std::ops::Deref<Target = HomeValue>>(
    call: &mut Round<'_>,
    d: &Dist,
    ctx: comm::Ctx,
    groups: &[Group<'_>],
    cells: &[C],
) -> Result<()> {
    if let Some(rc) = d.gpu() {
        let pieces = groups
            .iter()
            .zip(cells)
            .map(|(g, cell)| {
                let root = root_of(g.slot.spread);
                Ok(GpuPiece {
                    data: match root == d.rank() {
                        true => Some(cell.to_array(g.slot.shape)?),
                        false => None,
                    },
                    shape: g.slot.shape,
                    dtype: g.slot.dtype,
                    root,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let values = dist::gather_on_gpus(rc, pieces)?
            .iter()
            .map(|a| HomeValue::copy_of(a, d.home()))
            .collect::<Result<Vec<_>>>()?;
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
    let mut gathered = match dist::gather(call, d.pool(), pieces) {
        Ok(g) => g,
        Err(e) => {
            // A lent out's storage may be lost with the failed transfer: zeros of its length
            // keep the array whole.
            refill(groups, &mut lent);
            return Err(e);
        }
    };
    // The lent outs get their storage back, holding the value.
    let mut in_place = vec![false; groups.len()];
    for (i, out) in lent.iter_mut().enumerate() {
        if let Some(Storage::Host(h)) = out.as_deref_mut() {
            std::mem::swap(h, &mut gathered[i]);
            in_place[i] = true;
        }
    }
    drop(lent);
    let values: Vec<HomeValue> = gathered.into_iter().map(HomeValue::from_host).collect();
    let pulled = fan_out(ctx, groups, &values, &in_place);
    // The whole values' buffers serve the next call.
    for v in values {
        if let Ok(h) = v.into_host() {
            d.pool().give(h);
        }
    }
    pulled
}

/// Write locks on the arrays whose storage a transfer uses in place, per group: a pull's out
/// that receives its key's value, a push's value that is sent as it is. That is the key's only
/// array, in host memory, of its dtype, named by no other key of the call, for a key whose
/// value travels in a buffer of its own.
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
                    d.size(),
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

/// Copies every group's whole value (`values`, in group order) into its outs, in issue order,
/// except the groups `done` marks (their outs hold the value already).
fn fan_out(
    ctx: comm::Ctx,
    groups: &[Group<'_>],
    values: &[HomeValue],
    done: &[bool],
) -> Result<()> {
    let jobs: Vec<HomePull<'_>> = issue_order(groups)
        .into_iter()
        .filter(|&i| !done.get(i).copied().unwrap_or(false))
        .map(|i| HomePull {
            key: &groups[i].slot.key,
            value: &values[i],
            outs: &groups[i].arrays,
        })
        .collect();
    comm::pull(ctx, &jobs)
}

/// The shape of this rank's part of a group's key, of `len` elements: the key's shape when it
/// holds all of it, a flat slice otherwise.
fn part_shape(g: &Group<'_>, len: usize) -> Shape {
    match g.slot.spread {
        Spread::Whole { .. } => g.slot.shape,
        Spread::Sliced => Shape::new(&[len]).unwrap_or(g.slot.shape),
    }
}
