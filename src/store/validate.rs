//! Checks of a call's arguments before anything changes: lengths, shapes and dtypes.

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
        Error::check_fit(op, key, format_args!("{what} {i}"), shape, dtype, a)?;
    }
    Ok(())
}
