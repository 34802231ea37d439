"""What a call site is: a key made of what it is, never of ``id()``.

NumPyro traces a model again for every ``run``, ``Predictive`` and ``log_likelihood``,
and a model that builds its data itself (``y[:, None]``, ``x.astype(...)``) hands
``reduce_sum`` a new array object each time. A site keyed by the array's ``id()`` was
prepared again at every trace, and forgotten when that temporary died. Here a site's
key is made of its function (code and what it closes over), the structure, shapes
and dtypes of its arguments, the block plan, the precision and a digest of the
*content* of its resident data, so every trace of the same model finds the same site.

Digests are memoized per live array (a weak reference guards against a reused
``id``), so an array is hashed once however often it is traced. Imports numpy,
hashlib and the standard library.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import types
import weakref

import numpy as np

__all__ = ["digest", "function_key", "site_key"]

_lock = threading.Lock()
_memo: dict = {}  # id(array) -> (weakref to it, digest)


def digest(x) -> str:
    """A digest of an array's dtype, shape and bytes (memoized while the array lives).

    Examples
    --------
    >>> import numpy as np
    >>> digest(np.arange(3.0)) == digest(np.arange(3.0)), digest(np.arange(3.0)) == digest(np.ones(3))
    (True, False)
    """
    key = id(x)
    with _lock:
        hit = _memo.get(key)
    if hit is not None and hit[0]() is x:
        return hit[1]
    a = np.ascontiguousarray(np.asarray(x))
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{a.dtype.str}{a.shape}".encode())
    h.update(memoryview(a).cast("B") if a.size else b"")
    out = h.hexdigest()
    try:
        ref = weakref.ref(x, functools.partial(_drop, key))
    except TypeError:  # not weakly referenceable: hashed again next time
        return out
    with _lock:
        _memo[key] = (ref, out)
    return out


def _drop(key, ref) -> None:
    with _lock:
        hit = _memo.get(key)
        if hit is not None and hit[0] is ref:
            del _memo[key]


def function_key(fn, _depth: int = 0):
    """A hashable key under which a function rebuilt at every trace (a closure defined
    inside the model, a ``functools.partial``) is the same function: its code and the
    keys of what it closes over (arrays by content, functions recursively, scalars and
    strings by value, anything else by identity)."""
    if _depth > 8:
        return ("deep", id(fn))
    if isinstance(fn, functools.partial):
        return ("partial", function_key(fn.func, _depth + 1),
                tuple(_value_key(a, _depth) for a in fn.args),
                tuple((k, _value_key(v, _depth)) for k, v in sorted(fn.keywords.items())))
    if isinstance(fn, types.MethodType):
        return ("method", function_key(fn.__func__, _depth + 1), _value_key(fn.__self__, _depth))
    code = getattr(fn, "__code__", None)
    if code is None:
        return ("object", id(fn))
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(_value_key(cell.cell_contents, _depth))
        except ValueError:  # an empty cell (a name not yet bound)
            cells.append(("empty",))
    defaults = tuple(_value_key(d, _depth) for d in (fn.__defaults__ or ()))
    return ("function", code, tuple(cells), defaults)


def _value_key(v, depth: int):
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        return ("value", type(v).__name__, v)
    if hasattr(v, "shape") and hasattr(v, "dtype") and hasattr(v, "__array__"):
        try:
            return ("array", digest(v))
        except Exception:  # noqa: BLE001 - a tracer or an array without host bytes
            return ("id", id(v))
    if callable(v):
        return function_key(v, depth + 1)
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_value_key(x, depth + 1) for x in v))
    if isinstance(v, types.ModuleType):
        return ("module", v.__name__)
    return ("id", id(v))


def site_key(fn, data_treedef, shared_treedef, plan, x64: bool, resident, leaf_avals,
             shared_avals) -> tuple:
    """The key of a ``reduce_sum`` call site (see the module docstring); ``resident`` are
    the concrete data leaves, whose content is part of the key."""
    return (function_key(fn), data_treedef, shared_treedef, plan, bool(x64),
            tuple(digest(x) for x in resident), tuple(leaf_avals), tuple(shared_avals))
