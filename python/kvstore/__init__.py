"""kvstore: a tensor key-value store for data-parallel training, with MXNet KVStore semantics.

``import kvstore as kv`` stands in for ``mx.kv``, and NumPy arrays or torch tensors for
``mx.nd`` arrays::

    import numpy as np
    import kvstore as kv

    store = kv.create('local')
    store.init(3, np.ones((2, 3)) * 2)
    a = np.zeros((2, 3))
    store.pull(3, out=a)          # a is now all 2
    store.push(3, [np.ones((2, 3))] * 4)
    store.pull(3, out=a)          # the four values summed: 4

Values go in and out through DLPack, so NumPy >= 1.22, PyTorch, JAX and CuPy arrays all work.
"""

import atexit
import warnings
import weakref
from collections import namedtuple
from contextlib import contextmanager

from . import _arrays, _native, _row_sparse, optimizer
from . import optimizer as _optimizer
from ._errors import (
    CheckpointError,
    DesyncError,
    DeviceError,
    DeviceOutOfMemoryError,
    DistEnvError,
    DistError,
    DistFailedError,
    DTypeMismatchError,
    DuplicateInitError,
    Error,
    InvalidArgumentError,
    KeyOutOfRangeError,
    KeyTypeError,
    MpiError,
    RankExitedError,
    WorldChangedError,
    RankFailedError,
    RankRejectedError,
    RowSparseError,
    ShapeMismatchError,
    TimeoutError,
    UnknownKeyError,
    UnknownKindError,
    UpdaterError,
    _NoMpiLinkError,
)

__version__ = _native.__version__

__all__ = [
    "create",
    "KVStore",
    "cpu",
    "gpu",
    "Context",
    "optimizer",
    "Error",
    "UnknownKeyError",
    "DuplicateInitError",
    "ShapeMismatchError",
    "DTypeMismatchError",
    "KeyTypeError",
    "KeyOutOfRangeError",
    "UnknownKindError",
    "InvalidArgumentError",
    "UpdaterError",
    "CheckpointError",
    "DeviceError",
    "DeviceOutOfMemoryError",
    "DistError",
    "DesyncError",
    "RankRejectedError",
    "RankFailedError",
    "RankExitedError",
    "WorldChangedError",
    "TimeoutError",
    "DistFailedError",
    "DistEnvError",
    "MpiError",
    "RowSparse",
    "RowSparseError",
]

RowSparse = _row_sparse.RowSparse


Context = namedtuple("Context", ["device_type", "device_id"])
Context.__doc__ = """A device name, as MXNet's ``mx.cpu(i)``. NumPy and torch arrays carry their
own device, so the store needs none; it is here so that tutorial code ports line by line."""


def cpu(device_id=0):
    """MXNet's ``mx.cpu(i)``."""
    return Context("cpu", device_id)


def gpu(device_id=0):
    """MXNet's ``mx.gpu(i)``."""
    return Context("gpu", device_id)


def _as_list(v, op, what):
    if _arrays.is_array(v) or _row_sparse.is_sparse(v):
        return [v]
    if isinstance(v, (list, tuple)):
        return list(v)
    raise TypeError(
        f"{op}: expected an array or a list of arrays as {what}, got {type(v).__name__}"
    )


def _one_each(keys, values, op, lent):
    """The one value of each key, read (init and broadcast take one per key)."""
    for k, vs in zip(keys, values):
        if len(vs) != 1:
            raise InvalidArgumentError(
                f"{op}: key {k} got {len(vs)} values: {op} takes one value per key"
            )
    return [_arrays.read(vs[0], lent) for vs in values]


def _priority(priority):
    """``priority`` as the native call takes it: an int that fits 32 bits."""
    p = int(priority)
    if not -(2**31) <= p < 2**31:
        raise OverflowError(f"priority {p} does not fit a 32-bit int")
    return p


def _key_lists(key, values, op, what):
    """MXNet's call forms as (keys, one list of arrays per key): ``(3, a)``, ``(3, [a, b])``,
    ``([5, 7], [a, b])`` and ``([5, 7], [[a, b], [c, d]])``."""
    if isinstance(key, (list, tuple)):
        keys = list(key)
        if (
            _arrays.is_array(values)
            or _row_sparse.is_sparse(values)
            or not isinstance(values, (list, tuple))
        ):
            raise TypeError(
                f"{op}: {len(keys)} keys need a list of {what}, one entry per key; got "
                f"{type(values).__name__}"
            )
        if len(values) != len(keys):
            raise InvalidArgumentError(
                f"{op}: {len(keys)} keys but {len(values)} {what}: pass one entry per key"
            )
        return keys, [_as_list(v, op, what) for v in values]
    return [key], [_as_list(values, op, what)]


def _np():
    import numpy

    return numpy


def _all_or_none_sparse(values, op):
    """Whether the values of a call are row-sparse: all of them, or none (an error else)."""
    flags = [_row_sparse.is_sparse(v) for vs in values for v in vs]
    if any(flags) and not all(flags):
        raise RowSparseError(
            f"{op}: a call mixes row-sparse and dense values: make one call for each"
        )
    return bool(flags) and all(flags)


def _sparse_lists(key, values, op):
    """``push_row_sparse``'s call forms as (keys, a list of row-sparse values per key): a tuple
    is one ``(ids, rows)`` pair, never a list of values."""

    def entries(v):
        if isinstance(v, tuple) or _row_sparse.is_sparse(v):
            return [v]
        if isinstance(v, list):
            return v
        raise TypeError(
            f"{op}: a row-sparse value is a kvstore.RowSparse, a SciPy sparse matrix or an "
            f"(ids, rows) pair, or a list of them; got {type(v).__name__}"
        )

    if isinstance(key, (list, tuple)):
        keys = list(key)
        if not isinstance(values, list) or len(values) != len(keys):
            raise InvalidArgumentError(
                f"{op}: {len(keys)} keys need a list of {len(keys)} entries, one per key"
            )
        return keys, [entries(v) for v in values]
    return [key], [entries(values)]


def _fill_rows(out, got):
    """Writes a ``row_sparse_pull``'s rows into ``out``: nothing for ``None``, the parts of a
    :class:`RowSparse`, or rows at their ids with zeros elsewhere for a dense array."""
    if out is None:
        return
    if isinstance(out, RowSparse):
        out.ids, out.rows, out.shape = got.ids, got.rows, got.shape
        return
    if tuple(getattr(out, "shape", ())) != got.shape:
        raise ShapeMismatchError(
            f"row_sparse_pull: out has shape {tuple(getattr(out, 'shape', ()))}, the key "
            f"{got.shape}"
        )
    if type(out).__module__.startswith("torch"):
        import torch

        out.zero_()
        idx = torch.as_tensor(got.ids.astype("int64"), device=out.device)
        out[idx] = torch.as_tensor(got.rows, device=out.device, dtype=out.dtype)
        return
    out[...] = 0
    out[got.ids.astype("int64")] = got.rows


@contextmanager
def _told(native, op):
    """Runs the Python half of call ``op``: an error raised inside is first told to the other
    workers of a dist store, which then fail their ``op`` with ``RankRejectedError`` instead of
    waiting for this worker (or pairing this worker's next call with it)."""
    try:
        yield
    except Exception as e:
        # Raises DistFailedError instead when the world failed earlier.
        native.reject(op, f"{type(e).__name__}: {e}")
        raise


# Every store made, for the drain at exit.
_LIVE = weakref.WeakSet()


@atexit.register
def _drain_at_exit():
    """Runs each store's queued calls to their end before the interpreter shuts down. A call
    still queued then would release the arrays it borrowed (or run a Python updater) on the
    store's worker thread while Python finalizes, which aborts the process. On a dist store
    every worker queued the same calls, so each one's drain meets the others'; the wait has the
    store's timeout, and an error is a warning, since the program is ending."""
    for kv in list(_LIVE):
        try:
            kv.wait_all()
        except Exception as e:  # noqa: BLE001 (exiting: say it, do not raise)
            warnings.warn(f"kvstore: a call queued on {kv!r} failed at exit: {e}", stacklevel=1)


class KVStore:
    """A key-value store: ``init`` values, ``push`` (sum, then update) and ``pull`` them.

    Keys are ints or strs (one kind per store). Values are arrays with ``__dlpack__``; ``pull``
    writes into the arrays given as ``out``. Every call releases the GIL while the store works,
    so other Python threads run meanwhile.
    """

    def __init__(self, name="local"):
        self._kv = _open(name)
        self._updater = None
        # Queued calls that lent torch CUDA tensors or copy results back (see ``_finish``):
        # (keys, Lends, functions to run after, the native call's outcome).
        self._queued = []
        _LIVE.add(self)

    def __repr__(self):
        return f"<kvstore.KVStore type={self.type!r} keys={len(self._kv.keys())}>"

    @property
    def type(self):
        """The kind the store was created with (``'local'``, ``'device'``, ...)."""
        return self._kv.type_name

    @property
    def rank(self):
        """This worker's rank: 0 in a single process."""
        return self._kv.rank

    @property
    def num_workers(self):
        """The number of workers: 1 in a single process."""
        return self._kv.num_workers

    @property
    def local_rank(self):
        """This worker's rank among the workers on its machine: 0 in a single process."""
        return self._kv.local_rank

    def barrier(self):
        """Waits until every worker has called ``barrier`` (MXNet's ``_barrier``); bounded by
        ``KVSTORE_TIMEOUT``. A no-op in a single process."""
        self._kv.barrier()

    _barrier = barrier

    def agree(self, what):
        """Checks that every worker passes the same ``what`` (a str), in a call every worker
        makes at the same point: a ``DesyncError`` on every worker when they differ. The store
        compares what it sees before every call (keys, shapes, dtypes, its optimizer); this is
        for what it does not see, as a framework's optimizer settings or a data seed. Returns
        at once in a single process."""
        with _told(self._kv, "agree"):
            if not isinstance(what, str):
                raise TypeError(f"agree takes a str, got {type(what).__name__}")
            what.encode("utf-8")  # the native call takes UTF-8 (no lone surrogates)
        self._kv.agree(what)

    def any_of(self, what, flags):
        """For each of ``flags`` (bools), whether any worker passed True: a call every worker
        makes at the same point, with as many flags and the same ``what`` (a str), else a
        ``DesyncError`` on every worker. The flags themselves in a single process."""
        with _told(self._kv, "agree"):
            if not isinstance(what, str):
                raise TypeError(f"any_of takes a str, got {type(what).__name__}")
            what.encode("utf-8")
            flags = [bool(f) for f in flags]
        return self._kv.any_of(what, flags)

    def set_tag(self, tag):
        """Sets a tag (a str, or None for none) that the check of every later call carries:
        workers whose tags differ fail the call with ``DesyncError``, whose message shows each
        side's tag. A framework wrapper puts its step count here, so that a worker that skipped
        a step fails at its next call instead of pairing it with another step's. A queued call
        carries the tag in force when it runs: set it while no call is queued. No effect in a
        single process."""
        if tag is not None and not isinstance(tag, str):
            raise TypeError(f"set_tag takes a str or None, got {type(tag).__name__}")
        self._kv.set_tag(tag)

    def keys(self):
        """The keys, in update order (ints ascending, strs in init order)."""
        return self._kv.keys()

    def init(self, key, value):
        """Puts a copy of ``value`` in under ``key``; a list of keys takes a list of values.
        Each key is initialized once."""
        lent = _arrays.Lends()
        try:
            with _told(self._kv, "init"):
                keys, values = _key_lists(key, value, "init", "values")
                sparse = _all_or_none_sparse(values, "init")
                if sparse:
                    values = [[_row_sparse.from_value(v).to_dense() for v in vs] for vs in values]
                flat = _one_each(keys, values, "init", lent)
            if sparse:
                self._kv.init_row_sparse(keys, flat)
            else:
                self._kv.init(keys, flat)
        finally:
            self._end(lent)

    def init_row_sparse(self, key, value):
        """Puts a copy of the dense array ``value`` in under ``key`` as a row-sparse key (two
        or more dimensions; the first is its rows): ``init`` with a :class:`RowSparse` or a
        SciPy sparse matrix does the same with its dense form. A row-sparse key is pushed by
        rows (``push`` with row-sparse values, or ``push_row_sparse``) and read by rows
        (``row_sparse_pull``) or whole (``pull``)."""
        lent = _arrays.Lends()
        try:
            with _told(self._kv, "init"):
                keys, values = _key_lists(key, value, "init", "values")
                flat = _one_each(keys, values, "init", lent)
            self._kv.init_row_sparse(keys, flat)
        finally:
            self._end(lent)

    def push_row_sparse(self, key, value):
        """Pushes row-sparse values to row-sparse keys: per key, one value or a list of them
        (from several devices), each a :class:`RowSparse`, a SciPy sparse matrix or an
        ``(ids, rows)`` pair. The rows are summed by id and the optimizer updates the rows
        present only (MXNet's ``lazy_update``): other rows keep their values and state.
        ``push`` takes :class:`RowSparse` and SciPy values the same way."""
        with _told(self._kv, "push"):
            keys, values = _sparse_lists(key, value, "push")
        self._push_rows(keys, values)

    def _push_rows(self, keys, values):
        lent = _arrays.Lends()
        try:
            with _told(self._kv, "push"):
                pairs = []
                for k, vs in zip(keys, values):
                    rs = [_row_sparse.from_value(v) for v in vs]
                    shape = tuple(self._kv.meta(k)[0])
                    for r in rs:
                        ids = _np().asarray(r.ids)
                        if ids.size and ids.astype("int64").min() < 0:
                            raise RowSparseError(f"push: key {k!r}: a row id is negative")
                        if r.shape_given and r.shape != shape:
                            raise ShapeMismatchError(
                                f"push: key {k!r} has shape {shape}, but a row-sparse value "
                                f"stands for an array of shape {r.shape}"
                            )
                    pairs.append([(r.ids.tolist(), _arrays.read(r.rows, lent)) for r in rs])
            self._kv.push_row_sparse(keys, pairs)
        finally:
            self._end(lent)

    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None):
        """Rows ``row_ids`` of a row-sparse key (MXNet's ``row_sparse_pull``; the ids are
        deduplicated and sorted). With ``out=None`` it returns them as a :class:`RowSparse`;
        a dense NumPy array or torch tensor of the key's shape as ``out`` gets those rows and
        zeros elsewhere (what MXNet's row-sparse out holds); a :class:`RowSparse` out is
        replaced. A list of outs takes one id array each, or shares one."""
        with _told(self._kv, "pull"):
            if row_ids is None:
                raise InvalidArgumentError("row_sparse_pull: pass the rows to fetch as row_ids=")
            shape, dtype, sparse = self._kv.meta(key)
            if not sparse:
                raise RowSparseError(
                    f"row_sparse_pull: key {key!r} is dense: read it with pull "
                    "(row_sparse_pull is for row-sparse keys)"
                )
            single = not isinstance(out, (list, tuple))
            outs = [out] if single else list(out)
            per_out = isinstance(row_ids, (list, tuple)) and all(
                _np().ndim(r) >= 1 for r in row_ids
            ) and len(row_ids) > 0 and not single
            ids_list = list(row_ids) if per_out else [row_ids] * len(outs)
            if len(ids_list) != len(outs):
                raise InvalidArgumentError(
                    f"row_sparse_pull: {len(outs)} outs but {len(ids_list)} row_ids"
                )
            # Every out checked before any is written.
            for o in outs:
                got = tuple(getattr(o, "shape", ()))
                if o is not None and not isinstance(o, RowSparse) and got != tuple(shape):
                    raise ShapeMismatchError(
                        f"row_sparse_pull: out has shape {got}, the key {tuple(shape)}"
                    )
        results = [self._pull_rows(key, shape, dtype, ids) for ids in ids_list]
        for o, r in zip(outs, results):
            _fill_rows(o, r)
        if single and out is None:
            return results[0]
        return None

    def _pull_rows(self, key, shape, dtype, row_ids):
        np = _np()
        with _told(self._kv, "pull"):
            ids = _row_sparse._host(row_ids)
            ids = np.asarray(ids).ravel()
            if ids.size and not np.issubdtype(ids.dtype, np.integer):
                raise RowSparseError(f"row ids must be ints, got {ids.dtype}")
            if ids.size and ids.min() < 0:
                raise RowSparseError(f"row id {int(ids.min())} is negative")
            ids = np.unique(ids).astype(np.uint64)
            if dtype == "bfloat16":
                raise RowSparseError(
                    "row_sparse_pull returns NumPy arrays, which have no bfloat16: keep "
                    "row-sparse keys float32, float16 or float64"
                )
            rows = np.zeros((len(ids),) + tuple(shape[1:]), dtype=dtype)
            capsule = _arrays.write(rows, [], _arrays.Lends())
        self._kv.row_sparse_pull(key, ids.tolist(), capsule)
        return RowSparse(ids, rows, shape)

    def push(self, key, value, priority=0):
        """Pushes one array or a list of arrays (from several devices) to ``key``, or one
        entry per key to a list of keys. The arrays of each key are summed, then merged into
        the stored value by the updater (assign by default)."""
        with _told(self._kv, "push"):
            keys, values = _key_lists(key, value, "push", "values")
            sparse = _all_or_none_sparse(values, "push")
            priority = _priority(priority)
        if sparse:
            return self._push_rows(keys, values)
        lent = _arrays.Lends()
        try:
            with _told(self._kv, "push"):
                reads = [[_arrays.read(v, lent) for v in vs] for vs in values]
                priority = _priority(priority)
            self._kv.push(keys, reads, priority)
        finally:
            self._end(lent)

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        """Copies the value of ``key`` into ``out``: one array or a list of arrays, or one entry
        per key for a list of keys."""
        with _told(self._kv, "pull"):
            if out is None:
                raise InvalidArgumentError("pull: pass the arrays to write into as out=")
            keys, outs = _key_lists(key, out, "pull", "outs")
        after, lent = [], _arrays.Lends()
        try:
            with _told(self._kv, "pull"):
                capsules = [[_arrays.write(o, after, lent) for o in os_] for os_ in outs]
                priority = _priority(priority)
            self._kv.pull(keys, capsules, priority)
        finally:
            self._end(lent)
        for f in after:
            f()

    def pushpull(self, key, value, out=None, priority=0):
        """``push`` then ``pull`` in one call; with no ``out`` the values are updated in place.
        For a list of keys every push is done before any pull."""
        with _told(self._kv, "pushpull"):
            keys, values = _key_lists(key, value, "pushpull", "values")
            if out is None:
                outs = values
            else:
                _, outs = _key_lists(key, out, "pushpull", "outs")
        after, lent = [], _arrays.Lends()
        try:
            with _told(self._kv, "pushpull"):
                reads = [[_arrays.read(v, lent) for v in vs] for vs in values]
                writes = [[_arrays.write(o, after, lent) for o in os_] for os_ in outs]
            self._kv.pushpull(keys, reads, writes)
        finally:
            self._end(lent)
        for f in after:
            f()

    def broadcast(self, key, value, out, priority=0):
        """``init`` with ``value``, then ``pull`` into ``out``."""
        with _told(self._kv, "broadcast"):
            keys, values = _key_lists(key, value, "broadcast", "values")
            _, outs = _key_lists(key, out, "broadcast", "outs")
        after, lent = [], _arrays.Lends()
        try:
            with _told(self._kv, "broadcast"):
                flat = _one_each(keys, values, "broadcast", lent)
                writes = [[_arrays.write(o, after, lent) for o in os_] for os_ in outs]
            self._kv.broadcast(keys, flat, writes)
        finally:
            self._end(lent)
        for f in after:
            f()

    # Asynchronous calls: MXNet's push and pull returned at once and ran in the background.

    def push_async(self, key, value, priority=0):
        """``push``, queued: returns at once, and the store's worker runs it in the background,
        in issue order (on one process, calls of higher ``priority`` may pass waiting calls on
        other keys). Host arrays are copied before it returns; a torch CUDA tensor is read in
        place when the call runs, so do not write it before ``wait``. An error comes from the
        next ``wait`` on one of its keys, or ``wait_all`` (or any blocking call on the store),
        raised as the call's own error would be; calls queued after a failed one are not run
        until ``wait_all`` has raised it."""
        with self._told_async("push", priority):
            keys, values = _key_lists(key, value, "push", "values")
            if _all_or_none_sparse(values, "push"):
                raise InvalidArgumentError(
                    "push_async takes dense arrays: push row-sparse values with push"
                )
            priority = _priority(priority)
            lent = _arrays.Lends()
            reads = [[_arrays.read(v, lent) for v in vs] for vs in values]
        done = self._kv.push_async(keys, reads, priority)
        self._track(keys, lent, [], done)

    def pull_async(self, key, out=None, priority=0):
        """``pull``, queued: ``out`` is written when the call runs. Read it only after
        ``wait(key)`` or ``wait_all()``. Errors as for ``push_async``."""
        with self._told_async("pull", priority):
            if out is None:
                raise InvalidArgumentError("pull_async: pass the arrays to write into as out=")
            keys, outs = _key_lists(key, out, "pull", "outs")
            priority = _priority(priority)
            after, lent = [], _arrays.Lends()
            capsules = [[_arrays.write(o, after, lent) for o in os_] for os_ in outs]
        done = self._kv.pull_async(keys, capsules, priority)
        self._track(keys, lent, after, done)

    def pushpull_async(self, key, value, out=None, priority=0):
        """``pushpull``, queued (with no ``out``, the values are updated in place when it
        runs). Host values are copied before it returns; read the outs only after ``wait``."""
        with self._told_async("pushpull", priority):
            keys, values = _key_lists(key, value, "pushpull", "values")
            if out is None:
                outs = values
            else:
                _, outs = _key_lists(key, out, "pushpull", "outs")
            priority = _priority(priority)
            after, lent = [], _arrays.Lends()
            reads = [[_arrays.read(v, lent) for v in vs] for vs in values]
            writes = [[_arrays.write(o, after, lent) for o in os_] for os_ in outs]
        done = self._kv.pushpull_async(keys, reads, writes, priority)
        self._track(keys, lent, after, done)

    def wait(self, key):
        """Waits until every queued call on ``key`` has run. Raises the first error of a queued
        call since the last ``wait_all``, if one of ``key``'s calls failed or was not run
        because of it."""
        try:
            self._kv.wait(key)
        finally:
            self._finish(lambda keys: key in keys)

    def set_timeline(self, on=True):
        """Starts (or, with False, stops) recording when each queued call ran."""
        self._kv.set_timeline(bool(on))

    def take_timeline(self):
        """The queued calls finished since the timeline was started or last taken: a list of
        ``(call, queued, started, finished, ok)``, times in seconds on ``clock()``'s scale."""
        return self._kv.take_timeline()

    def clock(self):
        """Seconds on the scale of ``take_timeline``'s times, to put the caller's own events
        on one timeline with the store's calls."""
        return self._kv.clock()

    @contextmanager
    def _told_async(self, op, priority):
        """As ``_told``, for a queued call: an error in its arguments is raised now, and the
        call is queued as refused, so that every worker's queue fails the same call."""
        try:
            yield
        except Exception as e:
            try:
                p = _priority(priority)
            except Exception:
                p = 0
            self._kv.refuse_async(op, f"{type(e).__name__}: {e}", p)
            raise

    def _track(self, keys, lent, after, done):
        if lent.tensors or after:
            self._queued.append((list(keys), lent, after, done))

    def _finish(self, over):
        """Ends the lends of the queued calls ``over(keys)`` selects (their calls are over), and
        copies their results back into the caller's arrays, for the calls that succeeded only:
        a failed call, or one not run after it, leaves the caller's arrays as they were."""
        keep = []
        for keys, lent, after, done in self._queued:
            if over(keys):
                lent.end()
                if done.ok():
                    for f in after:
                        f()
            else:
                keep.append((keys, lent, after, done))
        self._queued = keep

    def _end(self, lent):
        """After a call with lent torch tensors: torch ordered after the store (``Lends.end``),
        and on an ``nccl`` store a wait for the store's GPU work, which raises the error of a
        collective aborted in the background (it surfaced in the host copies when CUDA tensors
        were staged)."""
        lent.end()
        if lent.tensors and self.type == "nccl":
            self.wait_all()

    def wait_all(self):
        """Waits until every queued call (``push_async``, ...) has run, then until the store's
        work on its GPUs has, and raises the first error of a queued call since the last
        ``wait_all``, or of GPU work (an aborted NCCL collective, a kernel fault). Blocking
        calls on host arrays wait themselves; torch CUDA tensors are ordered by their streams
        instead (see README)."""
        try:
            self._kv.wait_all()
        finally:
            self._finish(lambda keys: True)

    def set_updater(self, updater):
        """Sets a Python function ``updater(key, input, stored)`` that merges each push: it gets
        NumPy arrays (``input``, the sum of the pushed values, and ``stored``) and changes
        ``stored`` in place, e.g. ``stored += input * 2``. ``None`` restores assign. The
        function must not call this store.

        On a dist store the workers compare their updaters before every push: the function's
        name and a hash of its code, defaults, captured values and the plain globals it reads
        (``kvstore._updater.identity``). Workers whose updaters differ fail the push with a
        ``DesyncError`` instead of computing apart."""
        if updater is None:
            self._kv.set_assign()
            self._updater = None
            return
        if not callable(updater):
            raise TypeError(f"the updater must be callable, got {type(updater).__name__}")
        from . import _updater

        self._kv.set_python_updater(_updater.call, updater, _updater.identity(updater))
        self._updater = updater

    _set_updater = set_updater

    def set_optimizer(self, optimizer, keep_state=False):
        """Runs an optimizer in the store: ``kvstore.optimizer.SGD(...)`` or
        ``kvstore.optimizer.Adam(...)`` (or their names, as ``'sgd'``). Each push is then a
        gradient, and the stored value the weight. Its state starts afresh; with
        ``keep_state=True`` the optimizer in force (of the same kind, with the same state
        buffers) takes the new hyperparameters and keeps every key's state and step."""
        if isinstance(optimizer, str):
            optimizer = _optimizer.create(optimizer)
        apply = getattr(optimizer, "_apply", None)
        if apply is None:
            raise TypeError(
                f"set_optimizer takes kvstore.optimizer.SGD or Adam, got {type(optimizer).__name__}"
            )
        if keep_state:
            apply(self._kv, keep_state=True)
        else:
            apply(self._kv)
        self._updater = optimizer

    def set_gradient_compression(self, compression_params):
        """MXNet's gradient compression, ``{'type': '2bit', 'threshold': 0.5}``: each pushed
        value is quantized, element by element, to ``+threshold``, ``-threshold`` or 0, what that
        drops is kept for the same key's next push (error feedback), and the quantized values
        are summed. Init and pull are never compressed. ``threshold`` defaults to 0.5 and must
        be above 0; compressed keys must be float32.

        ``{'type': 'bf16'}`` or ``{'type': 'fp16'}`` (not MXNet settings) send each element
        rounded to bfloat16 or float16 instead, half the bytes of float32, and keep the rounding
        error for the next push in the same way.

        Call it before the first ``init``, on every worker of a dist store with the same
        setting (a worker that differs fails the first push everywhere with ``DesyncError``).
        It works on ``device`` stores and on ``dist_sync`` stores of CPU workers.
        Anything else raises ``InvalidArgumentError``: another type, an unknown setting (MXNet
        ignores those; a typo here would silently leave the default), a ``local`` store, or a
        store that already holds keys."""
        if not isinstance(compression_params, dict):
            raise TypeError(
                "set_gradient_compression takes a dict such as {'type': '2bit', 'threshold': "
                f"0.5}}, got {type(compression_params).__name__}"
            )
        params = dict(compression_params)
        kind = params.pop("type", None)
        if kind not in ("2bit", "bf16", "fp16"):
            raise InvalidArgumentError(
                f"set_gradient_compression: the type must be '2bit' (MXNet 1.9.1's one type), "
                f"'bf16' or 'fp16', got {kind!r}: pass {{'type': '2bit', 'threshold': 0.5}}"
            )
        threshold = params.pop("threshold", 0.5) if kind == "2bit" else 0.5
        if params:
            allowed = "'type' and 'threshold'" if kind == "2bit" else "'type' alone"
            raise InvalidArgumentError(
                f"set_gradient_compression: unknown settings {sorted(params)}: the settings of "
                f"{kind!r} are {allowed}"
            )
        try:
            threshold = float(threshold)
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"set_gradient_compression: the threshold must be a number, got {threshold!r}"
            ) from None
        self._kv.set_gradient_compression(kind, threshold)

    def set_learning_rate(self, lr):
        """Changes the optimizer's learning rate, keeping its state (momentum, moments)."""
        self._kv.set_learning_rate(float(lr))

    @property
    def learning_rate(self):
        """The optimizer's learning rate, or None without one."""
        return self._kv.learning_rate

    @property
    def num_update(self):
        """The number of updates the optimizer has made: the largest step count of any key."""
        return self._kv.num_update

    def is_capable(self, capability):
        """MXNet's capability query: this store can run an optimizer."""
        if capability == "optimizer":
            return True
        raise ValueError(f"Unknown capability: {capability}")

    def save(self, path):
        """Writes every value and the optimizer state into the directory ``path`` (created if
        missing; safetensors shards and an index), atomically. Every rank of a dist store calls
        it with the same ``path``: each rank writes its shard, and rank 0 commits the index
        last; a single-process store writes one shard. The files are the Rust crate's own:
        either side loads what the other saved."""
        with _told(self._kv, "save"):
            path = str(path)
        self._kv.save(path)

    def load(self, path):
        """Reads what ``save`` wrote, a directory saved at any number of workers (or a single
        file an earlier version saved); set the optimizer first to restore its state."""
        with _told(self._kv, "load"):
            path = str(path)
        self._kv.load(path)

    save_optimizer_states = save
    load_optimizer_states = load


_MPI_HELP = (
    "the dist kinds need the MPI link, which is the companion package kvstore-mpi: install it "
    "with `pip install 'kvstore[mpi]'` (from a checkout: `pip install ./python ./python/mpi`; "
    "it brings Open MPI 5 from PyPI) and start the workers with `mpirun -np N python train.py`. "
    "GPU workers can instead use 'dist_device_sync' under `torchrun`, which needs no MPI"
)


def _open(name):
    """The native store of kind ``name``. The main extension has every kind but the ones that
    need MPI; those come from the ``kvstore_mpi`` companion, loaded on first use."""
    try:
        return _native.Store(name)
    except _NoMpiLinkError as e:
        first = e
    try:
        from kvstore_mpi import native_module
    except ImportError as e:
        raise UnknownKindError(f"kind '{name}' is not available: {_MPI_HELP} ({e})") from None
    try:
        mpi_native = native_module()
    except (OSError, ImportError) as e:
        raise UnknownKindError(f"kind '{name}' is not available: {e}") from first
    return mpi_native.Store(name)


def create(name="local"):
    """A new store: ``'local'``, ``'device'``, ``'nccl'``, ``'dist_sync'``,
    ``'dist_device_sync'`` or an alias (MXNet's ``mx.kv.create``). An unknown name is an
    ``UnknownKindError`` that lists the valid ones.

    The dist kinds synchronise the processes of one job: CPU workers started by
    ``mpirun -np N python train.py`` (needs ``pip install 'kvstore[mpi]'``), or GPU workers
    started by ``torchrun --nproc-per-node N train.py`` (``dist_device_sync``, over NCCL)."""
    if not isinstance(name, str):
        raise TypeError(f"create takes the kind's name as a str, got {type(name).__name__}")
    return KVStore(name)
