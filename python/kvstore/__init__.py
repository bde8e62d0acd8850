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

from collections import namedtuple
from contextlib import contextmanager

from . import _arrays, _native, optimizer
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
    RankFailedError,
    RankRejectedError,
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
    "TimeoutError",
    "DistFailedError",
    "DistEnvError",
    "MpiError",
]

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
    if _arrays.is_array(v):
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
        if _arrays.is_array(values) or not isinstance(values, (list, tuple)):
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


class KVStore:
    """A key-value store: ``init`` values, ``push`` (sum, then update) and ``pull`` them.

    Keys are ints or strs (one kind per store). Values are arrays with ``__dlpack__``; ``pull``
    writes into the arrays given as ``out``. Every call releases the GIL while the store works,
    so other Python threads run meanwhile.
    """

    def __init__(self, name="local"):
        self._kv = _open(name)
        self._updater = None

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
                flat = _one_each(keys, values, "init", lent)
            self._kv.init(keys, flat)
        finally:
            self._end(lent)

    def push(self, key, value, priority=0):
        """Pushes one array or a list of arrays (from several devices) to ``key``, or one
        entry per key to a list of keys. The arrays of each key are summed, then merged into
        the stored value by the updater (assign by default)."""
        lent = _arrays.Lends()
        try:
            with _told(self._kv, "push"):
                keys, values = _key_lists(key, value, "push", "values")
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

    def _end(self, lent):
        """After a call with lent torch tensors: torch ordered after the store (``Lends.end``),
        and on an ``nccl`` store a wait for the store's GPU work, which raises the error of a
        collective aborted in the background (it surfaced in the host copies when CUDA tensors
        were staged)."""
        lent.end()
        if lent.tensors and self.type == "nccl":
            self.wait_all()

    def wait_all(self):
        """Waits until the store's work on its GPUs has run, and raises the error of any that
        failed (an aborted NCCL collective, a kernel fault). Calls on host arrays wait
        themselves; torch CUDA tensors are ordered by their streams instead (see README)."""
        self._kv.wait_all()

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

    def set_optimizer(self, optimizer):
        """Runs an optimizer in the store: ``kvstore.optimizer.SGD(...)`` or
        ``kvstore.optimizer.Adam(...)`` (or their names, as ``'sgd'``). Each push is then a
        gradient, and the stored value the weight. Its state starts afresh."""
        if isinstance(optimizer, str):
            optimizer = _optimizer.create(optimizer)
        apply = getattr(optimizer, "_apply", None)
        if apply is None:
            raise TypeError(
                f"set_optimizer takes kvstore.optimizer.SGD or Adam, got {type(optimizer).__name__}"
            )
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
        """Writes every value and the optimizer state to ``path`` (safetensors), atomically.
        On a dist store every rank calls it with the same ``path``, a directory: each rank
        writes its shard, and rank 0 commits the index last. The files are the Rust crate's
        own: either side loads what the other saved."""
        with _told(self._kv, "save"):
            path = str(path)
        self._kv.save(path)

    def load(self, path):
        """Reads what ``save`` wrote, a file or a sharded directory saved at any number of
        workers; set the optimizer first to restore its state."""
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
