"""Calls a Python updater with NumPy arrays it may change in place, and names it for the
ranks of a dist store to compare."""

import hashlib
import types

import numpy as np


def call(fn, key, input_bytes, stored_bytes, shape, dtype):
    """Views the two buffers the store hands over as NumPy arrays and calls
    ``fn(key, input, stored)``. Whatever ``fn`` leaves in ``stored`` becomes the key's value."""
    inp = np.frombuffer(input_bytes, dtype=dtype).reshape(shape)
    stored = np.frombuffer(stored_bytes, dtype=dtype).reshape(shape)
    fn(key, inp, stored)


# Values read whole into the identity; anything else is known by its type alone.
_PLAIN = (int, float, complex, str, bytes, bool, type(None))
# How deep functions that call or capture other functions are followed.
_DEPTH = 4


def identity(fn):
    """What the ranks of a dist store compare of updater ``fn`` before every push: its name and
    a SHA-256 of its bytecode, constants, defaults, the values its closure captured and the
    plain values (numbers, strings, NumPy arrays) of the globals it reads, followed into the
    functions it captures or reads, as they are when it is set.

    Two ranks that set different functions, or one function that captured or reads different
    values, get different identities, so their pushes fail with a DesyncError instead of
    computing apart. Not seen: state read through an object's attributes at call time, and
    values changed after ``set_updater``. Ranks on different Python versions compile to
    different bytecode, and fail too."""
    h = hashlib.sha256()
    _feed(h, fn, _DEPTH, set())
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return f"python {module}.{name} sha256 {h.hexdigest()[:32]}"


def _feed(h, obj, depth, seen):
    """Adds ``obj`` to hash ``h``: plain values whole, functions by their code and what they
    capture, anything else by its type."""
    if isinstance(obj, _PLAIN):
        h.update(f"{type(obj).__name__}:{obj!r};".encode())
        return
    if isinstance(obj, (tuple, list, frozenset)):
        h.update(f"{type(obj).__name__}[{len(obj)}](".encode())
        items = sorted(obj, key=repr) if isinstance(obj, frozenset) else obj
        for x in items:
            _feed(h, x, depth, seen)
        h.update(b")")
        return
    if isinstance(obj, dict):
        h.update(f"dict[{len(obj)}](".encode())
        for k in sorted(obj, key=repr):
            _feed(h, k, depth, seen)
            _feed(h, obj[k], depth, seen)
        h.update(b")")
        return
    if isinstance(obj, np.ndarray):
        h.update(f"ndarray {obj.dtype} {obj.shape};".encode())
        h.update(np.ascontiguousarray(obj).tobytes())
        return
    if isinstance(obj, np.generic):
        h.update(f"{type(obj).__name__}:{obj!r};".encode())
        return
    if isinstance(obj, types.CodeType):
        h.update(f"code {obj.co_qualname if hasattr(obj, 'co_qualname') else obj.co_name};".encode())
        h.update(obj.co_code)
        _feed(h, obj.co_consts, depth, seen)
        _feed(h, obj.co_names, depth, seen)
        return
    if id(obj) in seen or depth <= 0:
        h.update(f"<{type(obj).__qualname__}>;".encode())
        return
    seen.add(id(obj))
    if isinstance(obj, types.FunctionType):
        h.update(f"function {obj.__module__}.{obj.__qualname__};".encode())
        _feed(h, obj.__code__, depth, seen)
        _feed(h, obj.__defaults__, depth, seen)
        _feed(h, obj.__kwdefaults__, depth, seen)
        for cell in obj.__closure__ or ():
            try:
                _feed(h, cell.cell_contents, depth - 1, seen)
            except ValueError:  # an empty cell
                h.update(b"<empty cell>;")
        for name in _global_names(obj.__code__):
            if name in obj.__globals__:
                value = obj.__globals__[name]
                if isinstance(value, (types.ModuleType, type)):
                    h.update(f"global {name} <{type(value).__name__}>;".encode())
                else:
                    h.update(f"global {name}=".encode())
                    _feed(h, value, depth - 1, seen)
        return
    if isinstance(obj, types.MethodType):
        h.update(b"method;")
        _feed(h, obj.__func__, depth, seen)
        _feed(h, obj.__self__, depth - 1, seen)
        return
    func = getattr(obj, "func", None)
    if callable(func) and hasattr(obj, "args") and hasattr(obj, "keywords"):  # functools.partial
        h.update(b"partial;")
        _feed(h, func, depth, seen)
        _feed(h, obj.args, depth, seen)
        _feed(h, obj.keywords, depth, seen)
        return
    # Any other object: its type, and its plain attributes (a callable object's settings).
    h.update(f"object {type(obj).__module__}.{type(obj).__qualname__};".encode())
    call_fn = getattr(type(obj), "__call__", None)
    if isinstance(call_fn, types.FunctionType):
        _feed(h, call_fn, depth - 1, seen)
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        _feed(h, {k: v for k, v in attrs.items() if _worth(v)}, depth - 1, seen)


def _worth(value):
    """Whether an attribute is data to compare (not a module, class or bound machinery)."""
    return not isinstance(value, (types.ModuleType, type))


def _global_names(code):
    """The global names ``code`` and the functions nested in it read."""
    names = list(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names.extend(_global_names(c))
    return sorted(set(names))
