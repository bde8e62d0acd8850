//! Row-sparse values ([`RowSparse`], MXNet's `RowSparseNDArray`): some rows of an array by row
//! id, and the checks of them against a key.

use crate::backend::cpu::rows::{merge, scatter};
use crate::host::HostData;
use crate::{Error, NDArray, Result, Shape};

/// Rows of an array by id: `rows[i]` is row `ids[i]` of an array whose other rows are zero
/// (for an embedding `[n, d]`, `rows` is `[ids.len(), d]`). Ids may come in any order and
/// repeat; a push sums the rows of repeated ids.
///
/// ```
/// use kvstore::{NDArray, RowSparse};
/// let rows = NDArray::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2])?;
/// let grad = RowSparse::new(vec![7, 2], rows)?;
/// assert_eq!(grad.ids(), &[7, 2]);
/// assert!(RowSparse::new(vec![7], NDArray::zeros([2, 2])).is_err());
/// # Ok::<(), kvstore::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct RowSparse {
    ids: Vec<u64>,
    rows: NDArray,
}

impl RowSparse {
    /// `rows` (one per id, along the first dimension) under `ids`, or [`Error::RowSparse`].
    pub fn new(ids: Vec<u64>, rows: NDArray) -> Result<RowSparse> {
        let dims = rows.shape().dims().to_vec();
        if dims.first() != Some(&ids.len()) {
            return Err(Error::RowSparse {
                op: "RowSparse::new",
                message: format!(
                    "{} row ids but rows of shape {dims:?}: give one row per id, along the \
                     first dimension",
                    ids.len()
                ),
            });
        }
        Ok(RowSparse { ids, rows })
    }

    /// The row ids, in the order given.
    pub fn ids(&self) -> &[u64] {
        &self.ids
    }

    /// The rows, one per id.
    pub fn rows(&self) -> &NDArray {
        &self.rows
    }

    /// The ids and the rows.
    pub fn into_parts(self) -> (Vec<u64>, NDArray) {
        (self.ids, self.rows)
    }

    /// The dense host array of `shape` this stands for (repeated ids summed).
    pub fn to_dense(&self, shape: impl Into<Shape>) -> Result<NDArray> {
        let shape = shape.into();
        check_rows("to_dense", &self.ids, &self.rows, shape, None)?;
        let width = row_width(shape);
        let merged = merge(&[(&self.ids, &self.rows)], width)?;
        let mut dense = HostData::try_filled(self.rows.dtype(), shape.size(), 0.0)?;
        let segs: Vec<_> = (merged.ids.iter())
            .map(|&id| id as usize * width..(id as usize + 1) * width)
            .collect();
        scatter(&merged.rows, &segs, &mut dense);
        Ok(NDArray::from_host(dense, shape, crate::cpu(0)))
    }
}

/// The elements of one row of an array of `shape` (its first dimension is the rows).
pub(crate) fn row_width(shape: Shape) -> usize {
    shape.dims().iter().skip(1).product()
}

/// An [`Error::RowSparse`] unless `rows` under `ids` fit an array of `shape` (and `dtype`).
pub(crate) fn check_rows(
    op: &'static str,
    ids: &[u64],
    rows: &NDArray,
    shape: Shape,
    dtype: Option<crate::DType>,
) -> Result<()> {
    let fail = |message: String| Err(Error::RowSparse { op, message });
    if shape.ndim() < 2 {
        return fail(format!(
            "row-sparse values need two or more dimensions (rows, then each row's shape), \
             not {:?}",
            shape.dims()
        ));
    }
    let (want, got) = (&shape.dims()[1..], rows.shape());
    if got.dims().len() != shape.ndim() || &got.dims()[1..] != want {
        return fail(format!(
            "rows of shape {:?} for an array of shape {:?}: each row must have shape {want:?}",
            got.dims(),
            shape.dims()
        ));
    }
    if let Some(dtype) = dtype.filter(|&d| d != rows.dtype()) {
        return fail(format!(
            "rows of dtype {} for a key of dtype {dtype}: convert them with .astype",
            rows.dtype()
        ));
    }
    check_ids(op, ids, shape.dims()[0] as u64)
}

/// An [`Error::RowSparse`] naming the first id that is not below `rows`.
pub(crate) fn check_ids(op: &'static str, ids: &[u64], rows: u64) -> Result<()> {
    match ids.iter().find(|&&id| id >= rows) {
        None => Ok(()),
        Some(&bad) => Err(Error::RowSparse {
            op,
            message: format!(
                "row id {bad} is out of range: the array has {rows} rows (ids 0 to {})",
                rows.saturating_sub(1)
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_sums_repeated_ids_in_order_and_sorts() {
        let a = RowSparse::new(
            vec![3, 0, 3],
            NDArray::from_vec(vec![1f32, 2., 10., 20., 100., 200.], [3, 2]).unwrap(),
        )
        .unwrap();
        let b = RowSparse::new(
            vec![1, 0],
            NDArray::from_vec(vec![5f32, 6., 7., 8.], [2, 2]).unwrap(),
        )
        .unwrap();
        let m = merge(&[(a.ids(), a.rows()), (b.ids(), b.rows())], 2).unwrap();
        assert_eq!(m.ids, vec![0, 1, 3]);
        assert_eq!(m.rows.to_vec::<f32>(), vec![17., 28., 5., 6., 101., 202.]);
        let dense = a.to_dense([4, 2]).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(dense, vec![10., 20., 0., 0., 0., 0., 101., 202.]);
    }

    #[test]
    fn rows_that_do_not_fit_are_refused() {
        let rows = NDArray::zeros([2, 3]);
        let ok = |ids: &[u64], shape: &[usize]| {
            check_rows("t", ids, &rows, Shape::new(shape).unwrap(), None).is_ok()
        };
        assert!(ok(&[0, 4], &[5, 3]));
        assert!(!ok(&[0, 5], &[5, 3]), "id out of range");
        assert!(!ok(&[0, 1], &[5, 4]), "wrong width");
        assert!(!ok(&[0, 1], &[6]), "one dimension");
        assert!(!ok(&[0, 1], &[5, 3, 1]), "wrong row shape");
    }
}
