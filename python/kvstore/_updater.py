"""Calls a Python updater with NumPy arrays it may change in place, and names it for the
ranks of a dist store to compare."""

import functools
import hashlib
import types
from decimal import Decimal
from fractions import Fraction

import numpy as np


def call(fn, key, input_bytes, stored_bytes, shape, dtype):
    """Views the two buffers the store hands over as NumPy arrays and calls
    ``fn(key, input, stored)``. Whatever ``fn`` leaves in ``stored`` becomes the key's value."""
    inp = np.frombuffer(input_bytes, dtype=dtype).reshape(shape)
    stored = np.frombuffer(stored_bytes, dtype=dtype).reshape(shape)
    fn(key, inp, stored)


# Values read whole into the identity, by their repr (which is the same in every process).
_PLAIN = (int, float, complex, str, bytes, bool, type(None), range, Decimal, Fraction)
# How deep functions that call or capture other functions, and objects' attributes, are
# followed.
_DEPTH = 8
# Arrays and tensors up to this many elements are read whole; larger ones by shape and dtype.
_MAX_ELEMENTS = 1 << 20


def identity(fn):
    """What the ranks of a dist store compare of updater ``fn`` before every push: its name and
    a SHA-256 of its bytecode, constants and defaults, and of the values it can reach: its
    closure's cells and the globals it reads, followed into functions, classes (their own
    attributes), objects (their attributes), containers, NumPy arrays and torch tensors, as
    they are when it is set. Modules are known by name only.

    Two ranks that set different functions, or one function that captured or reads different
    values, get different identities, so their pushes fail with a DesyncError instead of
    computing apart. An updater that can reach per-rank values (an object holding its rank)
    fails the same way: pass it only what every rank shares. Not seen: values changed after
    ``set_updater``. They cannot be compared at every push: an updater that keeps state (a
    momentum dict, MXNet's ``Updater.states``, a step count) changes it on the rank that holds
    each key only, so that state differs across ranks by design. Ranks on different Python
    versions compile to different bytecode, and fail too."""
    h = hashlib.sha256()
    _feed(h, fn, _DEPTH, {})
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return f"python {module}.{name} sha256 {h.hexdigest()[:32]}"


def _feed(h, obj, depth, seen):
    """Adds ``obj`` to hash ``h``."""
    if isinstance(obj, _PLAIN):
        h.update(f"{type(obj).__name__}:{obj!r};".encode())
        return
    if isinstance(obj, types.ModuleType):
        # By name: a module's namespace holds per-process state (and hash-ordered sets).
        h.update(f"module {obj.__name__};".encode())
        return
    if isinstance(obj, types.CodeType):
        h.update(f"code {getattr(obj, 'co_qualname', obj.co_name)};".encode())
        h.update(obj.co_code)
        _feed(h, obj.co_consts, depth, seen)
        _feed(h, obj.co_names, depth, seen)
        return
    if id(obj) in seen or depth <= 0:
        h.update(f"<{type(obj).__qualname__}>;".encode())
        return
    # Held, not only its id: a temporary (a class's attribute dict made here) freed while the
    # walk goes on would hand its id to the next one, which would then read as seen.
    seen[id(obj)] = obj
    if isinstance(obj, (tuple, list)):
        h.update(f"{type(obj).__name__}[{len(obj)}](".encode())
        for x in obj:
            _feed(h, x, depth, seen)
        h.update(b")")
    elif isinstance(obj, (set, frozenset)):
        # In the order of the elements' own digests: a repr may hold an address or follow the
        # hash seed, and both differ between processes.
        h.update(f"set[{len(obj)}](".encode())
        for d in sorted(_digest(x, depth, seen) for x in obj):
            h.update(d)
        h.update(b")")
    elif isinstance(obj, dict):
        h.update(f"dict[{len(obj)}](".encode())
        for d in sorted(_digest(k, depth, seen) + _digest(v, depth, seen) for k, v in obj.items()):
            h.update(d)
        h.update(b")")
    elif isinstance(obj, (np.ndarray, np.generic)):
        _feed_array(h, np.asarray(obj), depth, seen)
    elif _is_tensor(obj):
        what = f"tensor {obj.dtype} {tuple(obj.shape)}"
        h.update(f"{what};".encode())
        t = obj.detach().cpu() if obj.numel() <= _MAX_ELEMENTS else None
        if t is not None and str(t.dtype) == "torch.bfloat16":  # NumPy has no bfloat16
            t = t.float()
        _feed_array(h, None if t is None else t.numpy(), depth, seen, what=what)
    elif isinstance(obj, types.FunctionType):
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
                h.update(f"global {name}=".encode())
                _feed(h, obj.__globals__[name], depth - 1, seen)
    elif isinstance(obj, types.MethodType):
        h.update(b"method;")
        _feed(h, obj.__func__, depth, seen)
        _feed(h, obj.__self__, depth - 1, seen)
    elif isinstance(obj, types.BuiltinMethodType):
        # A builtin function, or a builtin method of an object (`{1, 2}.__contains__`).
        h.update(f"builtin {obj.__qualname__};".encode())
        _feed(h, obj.__self__, depth - 1, seen)
    elif isinstance(obj, functools.partial):
        h.update(b"partial;")
        _feed(h, obj.func, depth, seen)
        _feed(h, obj.args, depth, seen)
        _feed(h, obj.keywords, depth, seen)
    elif isinstance(obj, (staticmethod, classmethod)):
        h.update(f"{type(obj).__name__};".encode())
        _feed(h, obj.__func__, depth, seen)
    elif isinstance(obj, property):
        h.update(b"property;")
        _feed(h, (obj.fget, obj.fset, obj.fdel), depth, seen)
    elif isinstance(obj, type):
        # A class: its name, and the attributes of it and its bases (methods, `__call__` too,
        # and class-level settings), up to `object`.
        h.update(f"class {obj.__module__}.{obj.__qualname__};".encode())
        for cls in obj.__mro__:
            if cls is object:
                continue
            h.update(f"base {cls.__module__}.{cls.__qualname__};".encode())
            _feed(h, {k: v for k, v in vars(cls).items() if k not in _CLASS_NOISE}, depth - 1, seen)
    else:
        # Any other object: its class, its name where it has one (a builtin slot wrapper), its
        # attributes (__dict__ and __slots__), and what it pickles as when it has no
        # attributes (`operator.itemgetter(0)`).
        h.update(b"object;")
        _feed(h, type(obj), depth - 1, seen)
        name = getattr(obj, "__qualname__", None)
        if isinstance(name, str):
            h.update(f"named {name};".encode())
        attrs = _attributes(obj)
        _feed(h, attrs, depth - 1, seen)
        if not attrs:
            try:
                reduced = obj.__reduce_ex__(4)
            except Exception:  # not picklable: its type and name are all there is
                reduced = None
            if isinstance(reduced, tuple):
                _feed(h, reduced[1:3], depth - 1, seen)


# Class attributes that every class has, or that say where it was written, not what it does.
_CLASS_NOISE = frozenset(
    ["__dict__", "__weakref__", "__doc__", "__module__", "__qualname__", "__firstlineno__",
     "__static_attributes__"]
)


def _digest(obj, depth, seen):
    """``obj`` fed alone, as bytes: sorts the elements of sets and dicts alike in every
    process."""
    # Its own copy of what was seen: with a shared one, an object two elements reach would be
    # read whole in whichever came first, and that order is what is being made independent.
    h = hashlib.sha256()
    _feed(h, obj, depth, dict(seen))
    return h.digest()


def _feed_array(h, a, depth, seen, what=None):
    """An array's dtype, shape and elements (numbers by their bytes, objects one by one);
    ``a`` None, or one over ``_MAX_ELEMENTS``, by ``what`` (its dtype and shape) alone."""
    if a is None or a.size > _MAX_ELEMENTS:
        h.update(f"{what or f'ndarray {a.dtype} {a.shape}'} (not read);".encode())
        return
    h.update(f"ndarray {a.dtype.str} {a.shape};".encode())
    if a.dtype.hasobject:
        _feed(h, a.tolist(), depth - 1, seen)
    else:
        h.update(np.ascontiguousarray(a).tobytes())


def _is_tensor(obj):
    """Whether ``obj`` is a torch tensor (without importing torch)."""
    return type(obj).__module__.startswith("torch") and hasattr(obj, "detach") and hasattr(
        obj, "numel"
    )


def _attributes(obj):
    """An object's attributes, from its ``__dict__`` and its ``__slots__``."""
    attrs = dict(getattr(obj, "__dict__", None) or {})
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if isinstance(name, str) and hasattr(obj, name):
                attrs.setdefault(name, getattr(obj, name))
    return attrs


def _global_names(code):
    """The global names ``code`` and the functions nested in it read."""
    names = list(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names.extend(_global_names(c))
    return sorted(set(names))
