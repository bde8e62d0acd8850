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


class UpdaterError(Error, RuntimeError):
    """The updater failed on a key; a Python updater's own exception is the ``__cause__``."""


class CheckpointError(Error, OSError):
    """A checkpoint could not be written or read, or does not fit the store."""


class DeviceError(Error, RuntimeError):
    """A CUDA or NCCL failure."""


class DeviceOutOfMemoryError(Error, MemoryError):
    """A GPU ran out of memory."""
