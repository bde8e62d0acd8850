//! Row-sparse keys (MXNet's `row_sparse` storage): their init, their push by rows with lazy
//! updates (MXNet's `lazy_update=True`), and `row_sparse_pull`. A row-sparse key keeps a dense
//! value on its home; on ranks, rows travel in compact form, only to and from the ranks that
//! hold them, in one all-to-all.

use std::sync::{Arc, RwLockWriteGuard};

use super::across::{self, Part};
use super::groups::{issue_order, Group};
use super::validate::{check_len, to_keys};
use super::{hyper, read, Active, KvStore};
use crate::backend::cpu::rows::{merge, Merged};
use crate::backend::{HomeValue, KeyFacts, Scattered};
use crate::comm::link::Round;
use crate::comm::{self, Ctx, KeyUpdate};
use crate::host::HostData;
use crate::row_sparse::{check_ids, check_rows, row_width};
use crate::{cpu, Error, IntoKey, NDArray, Result, RowSparse, Shape, Updater};

impl KvStore {
    /// Puts a copy of `value` in under `key` as a row-sparse key (MXNet's `row_sparse`
    /// storage): an array whose first dimension is its rows, such as an embedding. It is pushed
    /// by rows ([`KvStore::push_row_sparse`]) and read by rows ([`KvStore::row_sparse_pull`])
    /// or whole ([`KvStore::pull`]); a dense push to it is an [`Error::RowSparse`]. It is not
    /// compressed (an [`Error::Compression`] when compression is on, as in MXNet). On GPUs the
    /// rows go through host memory.
    pub fn init_row_sparse(&self, key: impl IntoKey, value: &NDArray) -> Result<()> {
        self.init_row_sparse_list(&[self.key_for("init", key)?], std::slice::from_ref(value))
    }

    /// Initializes many row-sparse keys at once (see [`KvStore::init_row_sparse`]): all of
    /// them, or none on error.
    pub fn init_row_sparse_list<K: IntoKey + Clone>(
        &self,
        keys: &[K],
        values: &[NDArray],
    ) -> Result<()> {
        let checked = (|| {
            if let Some(refusal) = self.row_sparse_refusal("init") {
                return Err(refusal);
            }
            for v in values {
                if v.shape().ndim() < 2 {
                    return Err(Error::RowSparse {
                        op: "init",
                        message: format!(
                            "a row-sparse key needs two or more dimensions (rows, then each \
                             row's shape), not {:?}: init it with init for a dense key",
                            v.shape().dims()
                        ),
                    });
                }
            }
            Ok(())
        })();
        checked.map_err(|e| self.rejected("init", e))?;
        self.init_with_homes(keys, values, None, true)
    }

    /// Why this store cannot hold row-sparse keys (gradient compression is on), or `None`.
    pub(super) fn row_sparse_refusal(&self, op: &'static str) -> Option<Error> {
        read(&self.compression).is_on().then(|| Error::Compression {
            op,
            message: "row-sparse keys are not compressed (as in MXNet): use a store without \
                      gradient compression for them"
                .to_owned(),
        })
    }

    /// Whether `key` is a row-sparse key ([`KvStore::init_row_sparse`]).
    pub fn is_row_sparse(&self, key: impl IntoKey) -> Result<bool> {
        Ok(read(&self.table).get("meta", &key.into_key()?)?.row_sparse)
    }

    /// Pushes row-sparse values to a row-sparse key: their rows are summed by id (repeated ids
    /// too), and the updater runs on those rows only, MXNet's lazy update: the other rows keep
    /// their values and state. The key's step (Adam's `t`) counts every push. A closure gets the
    /// rows as arrays of shape `[rows, ...]`; on a `dist_*` store's sliced key each rank's
    /// closure gets the parts of those rows in its slice, flattened (a row may straddle two
    /// slices), so it must work element by element. With no updater set (assign) the value
    /// becomes the sum: its rows at their ids, zeros elsewhere, as in MXNet.
    ///
    /// On a `dist_*` store every rank sums its own values first, then the ranks' sums are added
    /// in rank order, and each rank that holds a part of the key gets only the rows, or parts
    /// of rows, that fall in it: exactly those elements travel, with no padding.
    ///
    /// Errors ([`Error::RowSparse`], nothing changed): a dense key, a row id out of range,
    /// rows of another row shape or dtype.
    ///
    /// ```
    /// use kvstore::{KvStore, NDArray, RowSparse, Sgd, Updater};
    /// let kv = KvStore::create("local")?;
    /// kv.init_row_sparse("emb", &NDArray::ones([4, 2]))?;
    /// kv.set_updater(Updater::Sgd(Sgd { lr: 0.5, ..Sgd::default() }))?;
    /// let grad = RowSparse::new(vec![2], NDArray::full([1, 2], 1.0))?;
    /// kv.push_row_sparse("emb", &[grad])?;
    /// let got = kv.row_sparse_pull("emb", &[2, 0])?;
    /// assert_eq!(got.ids(), &[0, 2]);
    /// assert_eq!(got.rows().to_vec::<f32>()?, [1.0, 1.0, 0.5, 0.5]);
    /// # Ok::<(), kvstore::Error>(())
    /// ```
    pub fn push_row_sparse(&self, key: impl IntoKey, values: &[RowSparse]) -> Result<()> {
        self.push_row_sparse_list(&[self.key_for("push", key)?], &[values])
    }

    /// Pushes row-sparse values to many keys at once (see [`KvStore::push_row_sparse`]). A key
    /// listed more than once gets the sum of all its values. All or nothing.
    pub fn push_row_sparse_list<K: IntoKey + Clone, V: AsRef<[RowSparse]>>(
        &self,
        keys: &[K],
        values: &[V],
    ) -> Result<()> {
        let op = "push";
        let (groups, merged) = self
            .row_groups(op, keys, values)
            .and_then(|groups| {
                let merged = (groups.iter())
                    .map(|(g, v)| {
                        let parts: Vec<_> = v.iter().map(|r| (r.ids(), r.rows())).collect();
                        merge(&parts, row_width(g.slot.shape))
                    })
                    .collect::<Result<Vec<Merged>>>()?;
                Ok((groups.into_iter().map(|(g, _)| g).collect(), merged))
            })
            .map_err(|e| self.rejected(op, e))?;
        self.push_call(op, groups, None, Some(merged))
    }

    /// Rows `row_ids` of a row-sparse key: each distinct id once, ascending (as MXNet's
    /// `row_sparse_pull` dedups and sorts them), with its rows, in host memory. Ids out of
    /// range are an [`Error::RowSparse`]. Rows not pushed since an assign read as zeros.
    pub fn row_sparse_pull(&self, key: impl IntoKey, row_ids: &[u64]) -> Result<RowSparse> {
        let got = self.row_sparse_pull_here(key, row_ids);
        self.survive("pull", got)
    }

    fn row_sparse_pull_here(&self, key: impl IntoKey, row_ids: &[u64]) -> Result<RowSparse> {
        let op = "pull";
        let checked = (|| {
            let key = key.into_key()?;
            let slot = read(&self.table).get(op, &key)?;
            if !slot.row_sparse {
                return Err(Error::RowSparse {
                    op,
                    message: format!(
                        "key {key} is dense: read it with pull (row_sparse_pull is for keys \
                         initialized with init_row_sparse)"
                    ),
                });
            }
            check_ids(op, row_ids, slot.shape.dims()[0] as u64)?;
            Ok(slot)
        })();
        let slot = checked.map_err(|e| self.rejected(op, e))?;
        let mut ids = row_ids.to_vec();
        ids.sort_unstable();
        ids.dedup();
        let group = [Group {
            slot: slot.clone(),
            arrays: Default::default(),
            priority: 0,
        }];
        let d = &self.ranks;
        let mut call = d.begin_with(|| across::fingerprint(op, &group).note("row_sparse"))?;
        let cell = read(&slot.cell);
        let rows = (self.across).rows_pulled(&mut *call, d, &slot, &cell, &ids);
        let rows = call.ended(rows)?;
        let mut dims = slot.shape.dims().to_vec();
        dims[0] = ids.len();
        RowSparse::new(ids, NDArray::from_host(rows, Shape::new(&dims)?, cpu(0)))
    }

    /// Looks up the keys of a row-sparse push, merges repeats, and checks every value: groups
    /// in key order (the lock order), each with its values.
    fn row_groups<'a, K: IntoKey + Clone, V: AsRef<[RowSparse]>>(
        &self,
        op: &'static str,
        keys: &[K],
        values: &'a [V],
    ) -> Result<Vec<(Group<'a>, Vec<&'a RowSparse>)>> {
        check_len(op, keys.len(), values.len(), "values")?;
        let keys = to_keys(keys)?;
        let table = read(&self.table);
        let mut groups: Vec<(Group<'a>, Vec<&'a RowSparse>)> = Vec::new();
        for (key, list) in keys.iter().zip(values) {
            let slot = table.get(op, key)?;
            let list = list.as_ref();
            if !slot.row_sparse {
                return Err(Error::RowSparse {
                    op,
                    message: format!(
                        "key {key} is dense: push it with push (push_row_sparse is for keys \
                         initialized with init_row_sparse)"
                    ),
                });
            }
            if list.is_empty() {
                return Err(Error::Empty {
                    op,
                    key: key.clone(),
                    what: "values",
                });
            }
            for v in list {
                check_rows(op, v.ids(), v.rows(), slot.shape, Some(slot.dtype))
                    .map_err(|e| e.with_key(key))?;
            }
            match groups.iter_mut().find(|(g, _)| Arc::ptr_eq(&g.slot, &slot)) {
                Some((g, vs)) => {
                    g.arrays.extend(list.iter().map(RowSparse::rows));
                    vs.extend(list);
                }
                None => groups.push((
                    Group {
                        slot,
                        arrays: list.iter().map(RowSparse::rows).collect(),
                        priority: 0,
                    },
                    list.iter().collect(),
                )),
            }
        }
        groups.sort_by_key(|(g, _)| g.slot.order);
        Ok(groups)
    }
}

/// The update of a row-sparse push on this rank, its keys locked (`cells`): each key's `parts`
/// (the rows this rank updates) read out of the cells with their state, updated, and written
/// back only once every key's update has succeeded on every rank. `counts`: each key's update
/// count so far. The ranks of `call` (push `op`) agree at each step, and the push commits
/// ([`Round::commit`]) once every rank holds its new rows, before any is stored.
#[allow(clippy::too_many_arguments)]
pub(super) fn apply_rows(
    active: &Active,
    ctx: Ctx,
    groups: &[Group<'_>],
    mut parts: Vec<Option<Part>>,
    counts: &[u64],
    cells: &mut [RwLockWriteGuard<'_, HomeValue>],
    call: &mut dyn Round,
    op: &'static str,
) -> Result<()> {
    let hypers = hyper::for_push(active, groups, counts);
    // Each part's rows and their state, as values of their own: the update runs on them, and
    // they go back into the cells only once every key's update has succeeded.
    let gathered: Result<Vec<Option<(HomeValue, NDArray)>>> = (parts.iter_mut().zip(&*cells))
        .map(|(part, cell)| {
            let Some(p) = part else { return Ok(None) };
            let rows = cell.gather(active.generation, &p.segs)?;
            let grad = std::mem::replace(&mut p.grad, HostData::F32(Vec::new()));
            Ok(Some((rows, NDArray::from_host(grad, p.shape, cpu(0)))))
        })
        .collect();
    let together = call.agree(op, gathered.is_ok(), "reading its rows");
    let gathered = gathered?;
    together?;
    let (mut rows, grads): (Vec<Option<HomeValue>>, Vec<Option<NDArray>>) = gathered
        .into_iter()
        .map(|p| p.map_or((None, None), |(r, g)| (Some(r), Some(g))))
        .unzip();
    let grads: Vec<Option<[&NDArray; 1]>> = grads.iter().map(|g| g.as_ref().map(|g| [g])).collect();
    let mut taken: Vec<Option<&mut HomeValue>> = rows.iter_mut().map(Option::as_mut).collect();
    let mut jobs = Vec::with_capacity(groups.len());
    for i in issue_order(groups) {
        let (Some(value), Some(grad), Some(part)) = (taken[i].take(), &grads[i], &parts[i]) else {
            continue;
        };
        jobs.push(KeyUpdate {
            facts: KeyFacts {
                key: &groups[i].slot.key,
                shape: part.shape,
                dtype: groups[i].slot.dtype,
                home: cpu(0),
            },
            value,
            values: grad,
            hyper: hypers.of(i),
            owned: false,
        });
    }
    let mut in_updater = |ok: bool| call.agree(op, ok, "in the updater");
    comm::update(
        &active.updater,
        active.generation,
        ctx,
        jobs,
        Some(&mut in_updater),
    )?;
    // Every key's new value first (a GPU home's on its GPU, where that can fail), then all of
    // them into their cells, so that a failure changes no key.
    let clear = matches!(active.updater, Updater::Assign);
    let scattered: Result<Vec<Option<Scattered>>> = (cells.iter().zip(parts).zip(rows))
        .map(|((cell, part), rows)| match (part, rows) {
            (Some(p), Some(rows)) => cell
                .scatter(active.generation, p.segs, rows, clear)
                .map(Some),
            _ => Ok(None),
        })
        .collect();
    // Making the new values can fail on one rank (a GPU's memory): every rank commits, or
    // none does.
    let together = call.agree(op, scattered.is_ok(), "writing its new rows");
    let scattered: Vec<Option<Scattered>> = scattered?;
    together?;
    // Every survivor stores this push, or none (a rank lost before this point).
    call.commit()?;
    for (cell, s) in cells.iter_mut().zip(scattered) {
        if let Some(s) = s {
            s.commit(cell);
        }
    }
    hypers.commit(active);
    for (g, &c) in groups.iter().zip(counts) {
        g.slot.set_updates(active.generation, c + 1);
    }
    Ok(())
}
