"""Arrays in and out of the store through DLPack.

Anything with ``__dlpack__`` is an array: NumPy >= 1.22, PyTorch, JAX, CuPy. Host arrays are
handed to the native module as DLPack capsules, which it reads (push) or writes (pull) in place.
Arrays on a GPU or another device are staged through host memory with the framework's own copy,
which orders itself after the framework's current stream.
"""

from . import _native

_CPU = 1  # kDLCPU
_CUDA_HOST = 3  # kDLCUDAHost: pinned host memory


def is_array(x):
    """Whether ``x`` is an array (has ``__dlpack__``)."""
    return hasattr(x, "__dlpack__")


def _device_type(arr):
    try:
        return int(arr.__dlpack_device__()[0])
    except AttributeError:
        return _CPU


def _detached(arr):
    # A torch tensor that requires grad refuses to export itself; detach() shares its memory.
    if getattr(arr, "requires_grad", False):
        return arr.detach()
    return arr


def _capsule(arr, write):
    try:
        try:
            return arr.__dlpack__(max_version=_native.DLPACK_MAX_VERSION)
        except TypeError:
            # A producer from before DLPack 1.0 (NumPy < 2.1, older PyTorch): the legacy ABI.
            return arr.__dlpack__()
    except BufferError:
        if write:
            raise BufferError(
                "pull needs a writable out array, but this one is read-only: pass a writable "
                "array (for NumPy: a.copy())"
            ) from None
        # NumPy < 2 refuses to export a read-only array; read a copy instead.
        import numpy as np

        return np.array(arr, copy=True).__dlpack__()


def _to_host(arr):
    if hasattr(arr, "cpu"):  # torch
        return arr.detach().cpu()
    if hasattr(arr, "get"):  # cupy
        return arr.get()
    import numpy as np  # jax and the rest

    return np.asarray(arr)


def read(arr):
    """A capsule to read ``arr``'s elements from."""
    if not is_array(arr):
        raise TypeError(
            f"expected an array with __dlpack__ (NumPy, PyTorch, JAX, CuPy), got "
            f"{type(arr).__name__}"
        )
    arr = _detached(arr)
    if _device_type(arr) not in (_CPU, _CUDA_HOST):
        arr = _to_host(arr)
    return _capsule(arr, write=False)


def write(arr, after):
    """A capsule to write ``arr``'s elements into. For a device array, a host copy is written
    and a function that copies it back is appended to ``after``."""
    if not is_array(arr):
        raise TypeError(
            f"expected an array with __dlpack__ (NumPy, PyTorch, CuPy) as out, got "
            f"{type(arr).__name__}"
        )
    arr = _detached(arr)
    if _device_type(arr) in (_CPU, _CUDA_HOST):
        return _capsule(arr, write=True)
    if hasattr(arr, "copy_"):  # torch
        host = arr.cpu()
        after.append(lambda: arr.copy_(host))
    elif hasattr(arr, "set") and hasattr(arr, "get"):  # cupy
        host = arr.get()
        after.append(lambda: arr.set(host))
    else:
        raise TypeError(
            f"cannot write into a {type(arr).__name__} on a device in place (it may be "
            f"immutable, as JAX arrays are): pull into a host array, or a torch or CuPy array"
        )
    return _capsule(host, write=True)
