//! What one call works on: its keys looked up with their arrays and priorities (repeats
//! merged), in ascending key order (the lock order), and the order work is issued in.

use std::sync::{Arc, RwLockWriteGuard};

use super::table::Slot;
use super::validate::{check_arrays, check_len};
use super::{read, write, KvStore};
use crate::backend::cpu::Few;
use crate::backend::HomeValue;
use crate::{Error, IntoKey, Key, NDArray, Result};

/// One or more arrays for one key (a push's values, a pull's outs): an [`NDArray`], or a
/// slice, vector or array of them.
pub trait ValueList {
    /// The arrays.
    fn arrays(&self) -> &[NDArray];
}

impl ValueList for NDArray {
    fn arrays(&self) -> &[NDArray] {
        std::slice::from_ref(self)
    }
}

impl ValueList for [NDArray] {
    fn arrays(&self) -> &[NDArray] {
        self
    }
}

impl ValueList for Vec<NDArray> {
    fn arrays(&self) -> &[NDArray] {
        self
    }
}

impl<const N: usize> ValueList for [NDArray; N] {
    fn arrays(&self) -> &[NDArray] {
        self
    }
}

impl<T: ValueList + ?Sized> ValueList for &T {
    fn arrays(&self) -> &[NDArray] {
        (**self).arrays()
    }
}

/// A key's arrays in one call, inline up to four (one per device of a process), so that a
/// call of many keys allocates nothing per key for them.
pub(super) type Arrays<'a> = smallvec::SmallVec<[&'a NDArray; 4]>;

/// A key and the arrays an operation gives it, merged over repeats of the key.
pub(super) struct Group<'a> {
    pub slot: Arc<Slot>,
    pub arrays: Arrays<'a>,
    /// Work for higher priorities is issued first (the highest, over repeats of the key).
    pub priority: i32,
}

impl KvStore {
    /// Every key with its arrays and priority (default 0), in key order, repeats merged.
    pub(super) fn groups<'a, K: IntoKey + Clone, V: ValueList>(
        &self,
        op: &'static str,
        keys: &[K],
        lists: &'a [V],
        what: &'static str,
        priorities: Option<&[i32]>,
    ) -> Result<Vec<Group<'a>>> {
        check_len(op, keys.len(), lists.len(), what)?;
        if let Some(p) = priorities {
            check_len(op, keys.len(), p.len(), "priorities")?;
        }
        let table = read(&self.table);
        let mut groups = keys
            .iter()
            .zip(lists)
            .enumerate()
            .map(|(i, (k, list))| {
                let key: Key = k.clone().into_key()?;
                Ok(Group {
                    slot: table.get(op, &key)?,
                    arrays: list.arrays().iter().collect(),
                    priority: priorities.map_or(0, |p| p[i]),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        drop(table);
        groups.sort_by_key(|g| g.slot.order);
        groups.dedup_by(|later, kept| {
            let same = later.slot.order == kept.slot.order;
            if same {
                kept.arrays.append(&mut later.arrays);
                kept.priority = kept.priority.max(later.priority);
            }
            same
        });
        Ok(groups)
    }
}

/// The order work is issued in: descending priority, ties in key order (a stable sort).
pub(super) fn issue_order(groups: &[Group<'_>]) -> Few<usize> {
    let mut order: Few<usize> = (0..groups.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(groups[i].priority));
    order
}

/// Write locks on the groups' cells, taken in ascending key order.
pub(super) fn lock_cells<'a>(groups: &'a [Group<'_>]) -> Vec<RwLockWriteGuard<'a, HomeValue>> {
    groups.iter().map(|g| write(&g.slot.cell)).collect()
}

/// Pushed values must match the key's shape and dtype exactly.
pub(super) fn check_values(op: &'static str, groups: &[Group<'_>]) -> Result<()> {
    for g in groups {
        if g.slot.row_sparse {
            return Err(Error::RowSparse {
                op,
                message: format!(
                    "key {} holds a row-sparse value: push its rows as RowSparse values with \
                     push_row_sparse (a dense push would replace rows it does not mean to)",
                    g.slot.key
                ),
            });
        }
        check_arrays(
            op,
            &g.slot.key,
            g.slot.shape,
            Some(g.slot.dtype),
            &g.arrays,
            "value",
        )?;
    }
    Ok(())
}

/// Outs must match the key's shape; a pull converts to the out's dtype.
pub(super) fn check_outs(op: &'static str, groups: &[Group<'_>]) -> Result<()> {
    for g in groups {
        check_arrays(op, &g.slot.key, g.slot.shape, None, &g.arrays, "out")?;
    }
    Ok(())
}
