//! Checks of a call's arguments, made before anything changes: list lengths, and each array's
//! shape and dtype against its key.

use super::groups::Group;
use crate::{DType, Error, IntoKey, Key, NDArray, Result, Shape};

pub(super) fn to_keys<K: IntoKey + Clone>(keys: &[K]) -> Result<Vec<Key>> {
    keys.iter().cloned().map(IntoKey::into_key).collect()
}

pub(super) fn check_len(
    op: &'static str,
    keys: usize,
    values: usize,
    what: &'static str,
) -> Result<()> {
    if keys != values {
        return Err(Error::LengthMismatch {
            op,
            keys,
            values,
            what,
        });
    }
    Ok(())
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

pub(super) fn check_arrays(
    op: &'static str,
    key: &Key,
    shape: Shape,
    dtype: Option<DType>,
    arrays: &[&NDArray],
    what: &'static str,
) -> Result<()> {
    if arrays.is_empty() {
        let what = if what == "value" { "values" } else { "outs" };
        return Err(Error::Empty {
            op,
            key: key.clone(),
            what,
        });
    }
    for (i, a) in arrays.iter().enumerate() {
        if a.shape() != shape {
            return Err(Error::ShapeMismatch {
                op,
                key: key.clone(),
                what: format!("{what} {i}"),
                expected: Box::new(shape),
                got: Box::new(a.shape()),
            });
        }
        if let Some(dtype) = dtype.filter(|&d| d != a.dtype()) {
            return Err(Error::DTypeMismatch {
                op,
                key: key.clone(),
                what: format!("{what} {i}"),
                expected: dtype,
                got: a.dtype(),
            });
        }
    }
    Ok(())
}
