"""The exceptions kvstore raises.

Every one derives from :class:`kvstore.Error` and from the built-in exception a Python user
would catch: ``KeyError`` for an unknown key, ``ValueError`` for a shape mismatch, and so on.
The message is the Rust library's, and after any of them the store is unchanged.
"""


class Error(Exception):
    """Base class of every kvstore error."""


class UnknownKeyError(Error, KeyError):
    """An operation named a key that was never initialized."""

    def __str__(self):  # KeyError would print the message in quotes.
        return Exception.__str__(self)


class DuplicateInitError(Error, ValueError):
    """``init`` (or ``broadcast``) of a key that already has a value."""


class ShapeMismatchError(Error, ValueError):
    """A value or out whose shape is not the key's."""


class DTypeMismatchError(Error, TypeError):
    """A pushed value whose dtype is not the key's."""


class KeyTypeError(Error, TypeError):
    """An int key in a store of str keys, or the reverse."""


class KeyOutOfRangeError(Error, OverflowError):
    """An int key outside the int32 range."""


class UnknownKindError(Error, ValueError):
    """``create`` got a store kind it does not know."""


class InvalidArgumentError(Error, ValueError):
    """A bad argument: keys and values of different lengths, no values for a key, a bad shape,
    out-of-range updater parameters, and the like."""


class RowSparseError(Error, ValueError):
    """A row-sparse value that does not fit its key (a row id out of range, rows of another
    shape or dtype), or a call that mixes row-sparse and dense keys."""


class UpdaterError(Error, RuntimeError):
    """The updater failed on a key; a Python updater's own exception is the ``__cause__``."""


class CheckpointError(Error, OSError):
    """A checkpoint could not be written or read, or does not fit the store."""


class DeviceError(Error, RuntimeError):
    """A CUDA or NCCL failure."""


class DeviceOutOfMemoryError(Error, MemoryError):
    """A GPU ran out of memory."""


class DistError(Error, RuntimeError):
    """Base class of the errors of a distributed store (``dist_sync``, ``dist_device_sync``).
    A failing rank never leaves the others waiting: each gets one of these within
    ``KVSTORE_TIMEOUT`` (default 300 s)."""


class DesyncError(DistError):
    """The ranks disagree on a call: its operation, keys, shapes, dtypes, settings or place in
    the order of calls. Every rank gets it for the same call, before any data moves; the
    distributed world is unusable afterwards (later calls raise :class:`DistFailedError`)."""


class RankRejectedError(DistError):
    """Another rank rejected its input for this call (that rank has its own error, such as a
    :class:`ShapeMismatchError`). Nothing changed on any rank, and the store stays usable."""


class RankFailedError(DistError):
    """Another rank failed its part of this call (its updater, or its part of a checkpoint);
    that rank has its own error. Nothing changed on any rank, and the store stays usable."""


class RankExitedError(DistError):
    """Another rank exited before making this call, so it can never complete; the distributed
    world is unusable afterwards."""


class WorldChangedError(DistError):
    """Ranks were lost and the survivors went on without them (``mpirun --with-ft ulfm``):
    this call did not complete, and the store now runs on fewer ranks (``kv.rank`` and
    ``kv.num_workers`` say the new numbers). Every key was reloaded from the store's last
    checkpoint (its last ``save`` or ``load``) at the new world size, or, where it had none,
    the store holds no key. Re-shard the data, and go on from that checkpoint's step."""


class TimeoutError(DistError, TimeoutError):  # noqa: A001 (as asyncio.TimeoutError)
    """A call did not complete within ``KVSTORE_TIMEOUT``: the message says where every other
    rank is. The distributed world is unusable afterwards."""


class DistFailedError(DistError):
    """A call after the distributed world failed (a timeout, a desync, a rank that exited):
    restart the job; the message names the first failure."""


class DistEnvError(DistError):
    """The distributed environment is wrong: the message names the variable (``RANK``,
    ``WORLD_SIZE``, ``KVSTORE_TIMEOUT``, ..., or ``MPI``) and what to do."""


class MpiError(DistError):
    """An MPI call failed; the distributed world is unusable afterwards."""


class _NoMpiLinkError(UnknownKindError):
    """A dist kind asked of the main extension, which has no MPI link (internal: ``create``
    then loads the ``kvstore-mpi`` companion)."""
