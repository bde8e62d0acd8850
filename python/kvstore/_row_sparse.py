"""Row-sparse values: some rows of an array, by row id, in place of MXNet's
``RowSparseNDArray``. A value given to ``push`` as a :class:`RowSparse`, a SciPy sparse
matrix (its rows with stored entries), or, in ``push_row_sparse``, an ``(ids, rows)`` pair.
"""

import numpy as np

from ._errors import RowSparseError


class RowSparse:
    """Rows ``rows`` (one per id, along the first axis) at row ids ``ids`` of an array of
    ``shape``, whose other rows are zero: MXNet's ``RowSparseNDArray``. ``ids`` may repeat and
    come in any order; a push sums repeated rows. ``shape`` defaults to the smallest array
    that holds the rows (``max(ids) + 1`` rows)."""

    def __init__(self, ids, rows, shape=None):
        ids = np.asarray(_host(ids))
        if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
            raise RowSparseError(
                f"row ids must be a 1-D array of ints, got {ids.dtype} of shape {ids.shape}"
            )
        if ids.size and ids.min() < 0:
            raise RowSparseError(f"row id {int(ids.min())} is negative: ids count rows from 0")
        rows_shape = tuple(getattr(rows, "shape", np.shape(rows)))
        if not rows_shape or rows_shape[0] != ids.size:
            raise RowSparseError(
                f"{ids.size} row ids but rows of shape {rows_shape}: give one row per id, "
                "along the first axis"
            )
        self.shape_given = shape is not None
        if shape is None:
            shape = (int(ids.max()) + 1 if ids.size else 0,) + rows_shape[1:]
        shape = tuple(int(d) for d in shape)
        if len(shape) < 2 or tuple(rows_shape[1:]) != shape[1:]:
            raise RowSparseError(
                f"rows of shape {rows_shape} for an array of shape {shape}: each row must "
                f"have shape {shape[1:]}, and the array two or more dimensions"
            )
        if ids.size and ids.max() >= shape[0]:
            raise RowSparseError(
                f"row id {int(ids.max())} is out of range: the array has {shape[0]} rows"
            )
        self.ids = ids.astype(np.uint64)
        self.rows = rows
        self.shape = shape

    def __repr__(self):
        return f"<kvstore.RowSparse {len(self.ids)} rows of shape {self.shape}>"

    def to_dense(self):
        """The dense NumPy array this stands for: rows at their ids (repeats summed), zeros
        elsewhere."""
        rows = np.asarray(_host(self.rows))
        out = np.zeros(self.shape, dtype=rows.dtype)
        np.add.at(out, self.ids.astype(np.int64), rows)
        return out


def _host(a):
    """``a`` as an array NumPy can read (a torch tensor is copied to the host)."""
    if hasattr(a, "detach") and hasattr(a, "cpu"):
        return a.detach().cpu().numpy()
    return a


def is_sparse(v):
    """Whether ``v`` is a row-sparse value: a :class:`RowSparse` or a SciPy sparse matrix."""
    return isinstance(v, RowSparse) or _is_scipy_sparse(v)


def _is_scipy_sparse(v):
    module = type(v).__module__ or ""
    return module.startswith("scipy.sparse") and hasattr(v, "tocsr")


def from_value(v):
    """A :class:`RowSparse` from a row-sparse value: itself, a SciPy sparse matrix (the rows
    holding stored entries, as a CSR's row pointer shows them), or an ``(ids, rows)`` pair."""
    if isinstance(v, RowSparse):
        return v
    if _is_scipy_sparse(v):
        m = v.tocsr()
        ids = np.flatnonzero(np.diff(m.indptr))
        return RowSparse(ids, m[ids].toarray(), m.shape)
    if isinstance(v, tuple) and len(v) == 2:
        return RowSparse(v[0], v[1])
    raise TypeError(
        "a row-sparse value is a kvstore.RowSparse, a SciPy sparse matrix or an (ids, rows) "
        f"pair, not {type(v).__name__}"
    )
