"""What a call site is: a key made of what it is, never of ``id()``.

NumPyro traces a model again for every ``run``, ``Predictive`` and ``log_likelihood``,
and a model that builds its data itself (``y[:, None]``, ``x.astype(...)``) hands
``reduce_sum`` a new array object each time. A site keyed by the array's ``id()`` would be
prepared again at every trace, and forgotten when that temporary died. Here a site's
key is made of its function (code, what it closes over and the global arrays it
reads), what the function computes (:func:`.analysis.computes`: its jaxpr on the call's
blocks, with its constants by content), the structure, shapes and dtypes of its
arguments, the block plan, the precision and a digest of the *content* of its resident
data, so every trace of the same model finds the same site, and a trace that computes
anything else (a helper redefined, a module's or a class's attribute changed) finds
another.

A key is true only while what it describes cannot change, and content is hashed as
rarely as that allows (:func:`digest`). An array that cannot change (a JAX array, or a
NumPy array that is read-only down to the memory it views) is hashed once while it lives
and remembered by object, with a weak reference that guards against a reused ``id``. A
writable NumPy array can be changed in place between two fits, so it is hashed at every
trace (make it read-only, ``a.flags.writeable = False``, to spare that); a site keeps
its own read-only copy of it (:func:`snapshot`), and of the NumPy arrays its function
closes over (:func:`frozen`), made when the site is made, so that what the site holds
is what its key says whatever the user does to the arrays afterwards. An object with
attributes of its own (``self`` of a bound method, a configuration, a distribution
closed over) is keyed by its class and the keys of its attributes, and copied with its
NumPy arrays the same way, so that ``self.w[0] = 2.0`` between two fits is seen; objects
of libraries that hold live state (clients, pools, executors, loggers, progress bars)
and anything else are keyed by identity (:class:`Same`), which is safe because the key
holds the object: its ``id`` cannot be reused while the key lives, and such an object is
what it is whatever its state. Imports jax, numpy, hashlib and the standard library.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import threading
import types
import weakref
from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = ["SiteKey", "digest", "frozen", "function_key", "immutable", "owned", "site_key",
           "snapshot"]

#: How deep :func:`function_key` and :func:`frozen` follow functions, containers and
#: callable objects (a cycle ends here too).
MAX_DEPTH = 8

#: The top-level packages whose objects are keyed by identity, never by their
#: attributes: they hold live state (clients, pools, executors, threads, loggers,
#: progress bars) that changes while the object stays what it is.
LIVE_PACKAGES = frozenset({"parallel_backend", "distributed", "dask", "concurrent",
                           "threading", "multiprocessing", "asyncio", "queue", "socket",
                           "logging", "tqdm", "jax", "jaxlib"})

_lock = threading.Lock()
_memo: dict = {}  # id(array) -> (weakref to it, digest), for arrays that cannot change


def digest(x) -> str:
    """A digest of an array's dtype, shape and bytes.

    An array that cannot change (:func:`immutable`) is hashed once while it lives; any
    other (a writable NumPy array) at every call.

    Examples
    --------
    >>> import numpy as np
    >>> a = np.arange(3.0)
    >>> before = digest(a)
    >>> a[0] = 7.0
    >>> before == digest(np.arange(3.0)), before == digest(a)
    (True, False)
    """
    fixed = immutable(x)
    if fixed:
        key = id(x)
        with _lock:
            hit = _memo.get(key)
        if hit is not None and hit[0]() is x:
            return hit[1]
    a = np.ascontiguousarray(np.asarray(x))
    # sha256: with the SHA instructions of current CPUs the fastest of hashlib's hashes.
    h = hashlib.sha256()
    h.update(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.data.cast("B") if a.size else b"")
    out = h.hexdigest()
    if fixed:
        try:
            ref = weakref.ref(x, functools.partial(_drop, key))
        except TypeError:  # not weakly referenceable: hashed again next time
            return out
        with _lock:
            _memo[key] = (ref, out)
    return out


def immutable(x) -> bool:
    """Whether ``x``'s content cannot change while it lives: a JAX array, or a NumPy array
    that is read-only and views only read-only NumPy memory (a writable base could be
    changed through another view).

    Examples
    --------
    >>> import numpy as np
    >>> a = np.arange(3.0)
    >>> immutable(a), immutable(snapshot(a)), immutable(a[:2].view())
    (False, True, False)
    """
    if isinstance(x, jax.Array):
        return True
    if not isinstance(x, np.ndarray):
        return False
    while isinstance(x, np.ndarray):
        if x.flags.writeable:
            return False
        x = x.base
    return x is None


def _drop(key, ref) -> None:
    with _lock:
        hit = _memo.get(key)
        if hit is not None and hit[0] is ref:
            del _memo[key]


def snapshot(x):
    """``x``, or a read-only copy of it where it can change in place (a writable NumPy
    array): what a site keeps of the user's data (and whose digest is then made once)."""
    if not isinstance(x, np.ndarray) or immutable(x):
        return x
    copy_ = np.array(x, copy=True)
    copy_.flags.writeable = False
    return copy_


def owned(a: np.ndarray) -> np.ndarray:
    """``a``, copied if it is a view of memory numpy does not own (a JAX array's
    buffer): a view would keep the user's array alive as long as the site, and the
    site is forgotten only when that array dies."""
    base = a
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return a if isinstance(base, np.ndarray) else a.copy()


class Same:
    """A key part that is its object, by identity (for what has no content to key by: a
    function, a class, an object holding live state); holding the object, it keeps the
    object's ``id`` from being reused while the key lives."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other) -> bool:
        return isinstance(other, Same) and other.obj is self.obj

    def __repr__(self) -> str:
        return f"Same({type(self.obj).__name__})"


def function_key(fn, _depth: int = 0):
    """A hashable key under which a function rebuilt at every trace (a closure defined
    inside the model, a ``functools.partial``, a callable object) is the same function:
    its code, the keys of what it closes over (arrays by content, functions and callable
    objects recursively, containers item by item, scalars and strings by value, objects
    by their attributes, anything else by identity) and of the globals its code names
    (see :func:`_globals_key`). What it computes is keyed apart (:func:`computes`)."""
    if _depth > MAX_DEPTH:
        return ("deep", Same(fn))
    if isinstance(fn, functools.partial):
        return ("partial", function_key(fn.func, _depth + 1),
                tuple(_value_key(a, _depth) for a in fn.args),
                tuple((k, _value_key(v, _depth)) for k, v in sorted(fn.keywords.items())))
    if isinstance(fn, types.MethodType):
        return ("method", function_key(fn.__func__, _depth + 1), _value_key(fn.__self__, _depth))
    code = getattr(fn, "__code__", None)
    if code is None:
        if _is_callable_object(fn):
            return ("callable", Same(type(fn)), function_key(type(fn).__call__, _depth + 1),
                    tuple((k, _value_key(v, _depth)) for k, v in vars(fn).items()))
        return ("object", Same(fn))
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(_value_key(cell.cell_contents, _depth))
        except ValueError:  # an empty cell (a name not yet bound)
            cells.append(("empty",))
    defaults = tuple(_value_key(d, _depth) for d in (fn.__defaults__ or ()))
    kwdefaults = tuple((k, _value_key(v, _depth))
                       for k, v in sorted((fn.__kwdefaults__ or {}).items()))
    return ("function", code, tuple(cells), defaults, kwdefaults, _globals_key(fn, _depth))


def _globals_key(fn, depth: int) -> tuple:
    """``(name, key)`` of the globals ``fn``'s code (and the code nested in it) names:
    arrays by a digest, values and objects by content (see :func:`_attributes`),
    functions, classes and other callables by identity; modules and builtins are left
    out. A helper or a class attribute changed between two fits, or a module's
    attribute, changes what ``fn`` computes, and :func:`computes` sees that."""
    found = getattr(fn, "__globals__", None) or {}
    out: list[tuple[str, object]] = []
    for name in sorted(_names(fn.__code__)):
        v = found.get(name)
        if v is None or isinstance(v, (types.ModuleType, types.BuiltinFunctionType)):
            continue
        if _is_array(v):
            try:
                out.append((name, digest(v)))
            except Exception:  # noqa: BLE001 - an array without host bytes: by identity
                out.append((name, Same(v)))
        elif callable(v):
            out.append((name, Same(v)))
        else:  # a value, a container, an object
            out.append((name, _value_key(v, depth + 1)))
    return tuple(out)


def _names(code, depth: int = 0) -> set:
    names = set(code.co_names)
    if depth < MAX_DEPTH:
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                names |= _names(c, depth + 1)
    return names


def _is_array(v) -> bool:
    return hasattr(v, "shape") and hasattr(v, "dtype") and hasattr(v, "__array__")


def _is_callable_object(fn) -> bool:
    """An instance whose class defines ``__call__`` in Python, with attributes of its own
    (a callable that ``reduce_sum``'s callers build at every trace)."""
    return (callable(fn) and isinstance(type(fn).__call__, types.FunctionType)
            and isinstance(getattr(fn, "__dict__", None), dict))


def _value_key(v, depth: int):
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        return ("value", type(v).__name__, v)
    if _is_array(v):
        try:
            return ("array", digest(v))
        except Exception:  # noqa: BLE001 - a tracer or an array without host bytes
            return ("same", Same(v))
    if isinstance(v, types.ModuleType):
        return ("module", v.__name__)
    if callable(v):
        return function_key(v, depth + 1)
    if depth > MAX_DEPTH:
        return ("deep", Same(v))
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_value_key(x, depth + 1) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((_value_key(k, depth + 1), _value_key(x, depth + 1))
                              for k, x in v.items()))
    attrs = _attributes(v)
    if attrs is not None:
        return ("object", Same(type(v)),
                tuple((k, _value_key(x, depth + 1)) for k, x in attrs.items()))
    return ("same", Same(v))


def _attributes(v):
    """The attributes of ``v`` that make it what it is (``vars(v)``), or ``None`` where
    it is to be keyed by identity: an object without a ``__dict__``, with ``__slots__``
    (state outside it), or of a package that holds live state (:data:`LIVE_PACKAGES`)."""
    attrs = getattr(v, "__dict__", None)
    if not isinstance(attrs, dict) or isinstance(v, (type, types.ModuleType)):
        return None
    kind = type(v)
    if (kind.__module__ or "").partition(".")[0] in LIVE_PACKAGES:
        return None
    if any(getattr(c, "__slots__", ()) for c in kind.__mro__[:-1]):
        return None
    return attrs


def frozen(fn):
    """``fn``, or, where it holds NumPy arrays (closed over, as defaults, as a
    ``functools.partial``'s arguments, a callable object's or another object's
    attributes, a bound method's ``self``: what :func:`function_key` keys by content),
    the same function over copies of them.

    A site traces ``fn``'s block programs later (at its first evaluation, on a dask
    worker); over the user's arrays it would compute with whatever they hold then,
    not with what its key says. Global arrays are keyed, not copied.

    Examples
    --------
    >>> import numpy as np
    >>> def scaled(w):
    ...     return lambda x: x * w
    >>> w = np.ones(2)
    >>> f = frozen(scaled(w))
    >>> w[:] = 5.0
    >>> f(1.0).tolist()
    [1.0, 1.0]
    """
    return _freeze(fn, 0)


def _freeze(v, depth: int):
    if isinstance(v, np.ndarray):  # a copy as the user's was (fn may write to it)
        return v if immutable(v) else np.array(v, copy=True)
    if depth > MAX_DEPTH or v is None or isinstance(v, (bool, int, float, complex, str, bytes,
                                                        types.ModuleType, type)):
        return v
    if isinstance(v, functools.partial):
        func = _freeze(v.func, depth + 1)
        args = tuple(_freeze(a, depth + 1) for a in v.args)
        keywords = {k: _freeze(x, depth + 1) for k, x in v.keywords.items()}
        if _same(func, v.func) and _same(args, v.args) and _same(keywords, v.keywords):
            return v
        return functools.partial(func, *args, **keywords)
    if isinstance(v, types.MethodType):
        func, owner = _freeze(v.__func__, depth + 1), _freeze(v.__self__, depth + 1)
        if func is v.__func__ and owner is v.__self__:
            return v
        return types.MethodType(func, owner)
    if isinstance(v, types.FunctionType):
        return _freeze_function(v, depth)
    if _is_callable_object(v) or _attributes(v) is not None:
        attrs = {k: _freeze(x, depth + 1) for k, x in vars(v).items()}
        if _same(attrs, vars(v)):
            return v
        try:
            out = copy.copy(v)
            out.__dict__.update(attrs)
        except Exception:  # noqa: BLE001 - not copyable: keyed by content, kept as it is
            return v
        return out
    if isinstance(v, (tuple, list)):
        items = [_freeze(x, depth + 1) for x in v]
        if _same(items, v):
            return v
        if isinstance(v, list):
            return items
        return type(v)(*items) if hasattr(v, "_fields") else type(v)(items)
    if isinstance(v, dict):
        entries = {k: _freeze(x, depth + 1) for k, x in v.items()}
        return v if _same(entries, v) else entries
    return v


def _freeze_function(fn, depth: int):
    closure, changed = [], False
    for cell in fn.__closure__ or ():
        try:
            old = cell.cell_contents
        except ValueError:  # an empty cell (a name not yet bound)
            closure.append(cell)
            continue
        new = _freeze(old, depth + 1)
        # A cell left as it was stays shared with whoever shares it.
        closure.append(cell if new is old else types.CellType(new))
        changed |= new is not old
    defaults = tuple(_freeze(d, depth + 1) for d in (fn.__defaults__ or ()))
    kwdefaults = {k: _freeze(x, depth + 1) for k, x in (fn.__kwdefaults__ or {}).items()}
    if (not changed and _same(defaults, fn.__defaults__ or ())
            and _same(kwdefaults, fn.__kwdefaults__ or {})):
        return fn
    out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, defaults or None,
                             tuple(closure) or None)
    out.__kwdefaults__ = kwdefaults or None
    out.__qualname__, out.__module__, out.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    out.__dict__.update(fn.__dict__)
    return out


def _same(new, old) -> bool:
    """Whether :func:`_freeze` left every item of ``old`` as it was."""
    if isinstance(old, dict):
        return all(new[k] is x for k, x in old.items())
    return all(a is b for a, b in zip(new, old))


class SiteKey(NamedTuple):
    """The key of a ``reduce_sum`` call site (see the module docstring)."""

    function: Any
    traces: tuple
    data_treedef: Any
    shared_treedef: Any
    plan: Any
    x64: bool
    data: tuple
    leaf_avals: tuple
    shared_avals: tuple


def site_key(fn, data_treedef, shared_treedef, plan, x64: bool, resident, leaf_avals,
             shared_avals, traces=()) -> SiteKey:
    """The key of a ``reduce_sum`` call site; ``resident`` are the concrete data leaves,
    whose content is part of the key (:attr:`SiteKey.data`, their digests); ``traces``
    are the :func:`.analysis.computes` digests of ``fn`` traced on the call's blocks."""
    return SiteKey(function_key(fn), tuple(traces), data_treedef, shared_treedef, plan,
                   bool(x64), tuple(digest(x) for x in resident), tuple(leaf_avals),
                   tuple(shared_avals))
