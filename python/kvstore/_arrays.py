"""Arrays in and out of the store through DLPack.

Anything with ``__dlpack__`` is an array: NumPy >= 1.22, PyTorch, JAX, CuPy. Host arrays are
handed to the native module as DLPack capsules, which it reads (push) or writes (pull) in place.

PyTorch CUDA tensors are lent to the store in place, with no copy, and DLPack's stream
handshake: the capsule is exported with the store's stream for the tensor's GPU
(``__dlpack__(stream=...)``), so torch's pending work on the tensor runs first; after the call
torch's current stream waits for the store's, and the tensor is recorded on the store's stream
(``record_stream``), so neither torch's next kernels nor its allocator touch the memory before
the store is done with it. A tensor that is not contiguous is read through a contiguous copy,
and written through one that is copied back. Arrays of other libraries on a GPU are staged
through host memory with the library's own copy, which orders itself after its current stream.
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


def _is_torch_cuda(arr):
    return type(arr).__module__.startswith("torch") and bool(getattr(arr, "is_cuda", False))


def _torch_cpu_capsule(arr):
    """A capsule of a host torch tensor from torch's own C export, or None for anything else.
    Torch's ``__dlpack__`` and ``__dlpack_device__`` are Python: about 7 µs a tensor, which in
    a step of a thousand parameters (pushed, then pulled) was 14 ms. The checks they make that
    matter here are made first: a tensor that requires grad is detached by the caller, and one
    with its conjugate or negative bit set (a lazy view) goes the long way, which refuses it."""
    if not type(arr).__module__.startswith("torch") or getattr(arr, "is_cpu", False) is not True:
        return None
    if arr.requires_grad or arr.is_conj() or arr.is_neg():
        return None
    import torch.utils.dlpack

    return torch.utils.dlpack.to_dlpack(arr)


class Lends:
    """The torch CUDA tensors lent to one store call, and what to do once it returns."""

    def __init__(self):
        self.tensors = []  # (tensor, written by the call)
        self.device = None  # torch's current device before the first lend

    def lend(self, t, written):
        """A capsule of torch CUDA tensor ``t``'s own memory, exported on the store's stream."""
        import torch

        if self.device is None:
            self.device = torch.cuda.current_device()
        stream = _native.cuda_stream(t.device.index)
        self.tensors.append((t, written))
        # torch orders the export after the current stream of the current device: make that
        # the tensor's.
        with torch.cuda.device(t.device):
            try:
                return t.__dlpack__(stream=stream, max_version=_native.DLPACK_MAX_VERSION)
            except TypeError:
                return t.__dlpack__(stream=stream)

    def end(self):
        """After the call: torch's current stream on each GPU waits once for the store's; the
        allocator keeps each tensor's memory until the store's work on it has run; an out's
        version counter moves, as an in-place write's does (autograd then refuses a backward
        through a value the pull replaced); torch's current device is what it was (the store
        makes its own GPU's context current on the calling thread)."""
        if not self.tensors:
            return
        import torch

        stores = {}
        for t, _ in self.tensors:
            if t.device not in stores:
                store = torch.cuda.ExternalStream(
                    _native.cuda_stream(t.device.index), device=t.device
                )
                torch.cuda.current_stream(t.device).wait_stream(store)
                stores[t.device] = store
        bump = getattr(torch.autograd.graph, "increment_version", None)
        for t, written in self.tensors:
            t.record_stream(stores[t.device])
            if written:
                if bump is not None:
                    bump(t)
                else:
                    t.add_(0)
        torch.cuda.set_device(self.device)


def _to_host(arr):
    if hasattr(arr, "cpu"):  # torch
        return arr.detach().cpu()
    if hasattr(arr, "get"):  # cupy
        return arr.get()
    import numpy as np  # jax and the rest

    return np.asarray(arr)


def read(arr, lent):
    """A capsule to read ``arr``'s elements from. A torch CUDA tensor is lent, through
    ``lent`` (a ``Lends``; call its ``end`` after the call)."""
    if not is_array(arr):
        raise TypeError(
            f"expected an array with __dlpack__ (NumPy, PyTorch, JAX, CuPy), got "
            f"{type(arr).__name__}"
        )
    arr = _detached(arr)
    fast = _torch_cpu_capsule(arr)
    if fast is not None:
        return fast
    if _is_torch_cuda(arr):
        return lent.lend(arr.contiguous(), written=False)
    if _device_type(arr) not in (_CPU, _CUDA_HOST):
        arr = _to_host(arr)
    return _capsule(arr, write=False)


def write(arr, after, lent):
    """A capsule to write ``arr``'s elements into. A contiguous torch CUDA tensor is lent
    through ``lent``; for another device array, a copy is written and a function that copies it
    back is appended to ``after``, to run after ``lent.end()``."""
    if not is_array(arr):
        raise TypeError(
            f"expected an array with __dlpack__ (NumPy, PyTorch, CuPy) as out, got "
            f"{type(arr).__name__}"
        )
    arr = _detached(arr)
    fast = _torch_cpu_capsule(arr)
    if fast is not None:
        return fast
    if _device_type(arr) in (_CPU, _CUDA_HOST):
        return _capsule(arr, write=True)
    if _is_torch_cuda(arr):
        if arr.is_contiguous():
            return lent.lend(arr, written=True)
        import torch

        tmp = torch.empty_like(arr, memory_format=torch.contiguous_format)
        after.append(lambda: arr.copy_(tmp))
        return lent.lend(tmp, written=False)
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
