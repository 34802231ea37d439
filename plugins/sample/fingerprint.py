"""What identifies a ``pb.sample`` run, for its checkpoints.

A checkpoint (:mod:`.checkpoint`) holds, in its attributes, the run's *fingerprint*:
the settings, the model's name, the structure and a digest of its arguments, and the
structure of the sampler state and of the draws (which give the state's bytes their
meaning). A second call of ``pb.sample`` continues a file only if its fingerprint is
this run's; otherwise :class:`CheckpointError` lists what differs.

Owns :class:`CheckpointError`, :func:`fingerprint`, :func:`signature` and
:func:`check`. Imports numpy, jax, the core's public names and the NumPyro plugin's
:mod:`~parallel_backend.plugins.numpyro.internals`; no file is read or written here.
"""

from __future__ import annotations

import functools
import hashlib
import sys

import jax
import numpy as np

import parallel_backend as pb

from ..numpyro.internals import kernel_function, kernel_settings
from .loop import is_key

__all__ = ["CheckpointError", "check", "fingerprint", "signature"]


class CheckpointError(ValueError):
    """A checkpoint that this run cannot continue (or a file that is not one)."""


# -- what identifies a run --------------------------------------------------------------


def fingerprint(model, kernel, settings: dict, model_args, model_kwargs) -> dict:
    """``{item: description}`` of everything a continued run must share with the run
    that wrote the checkpoint, except the sampler state (see :func:`signature`).

    ``settings`` are ``pb.sample``'s (counts, chain method, seed, initial values).
    Executors among the model's arguments are left out: a run may continue on any.
    """
    args = {"args": tuple(model_args), "kwargs": dict(model_kwargs)}
    out = {"model": repr(_name(model)), "kernel": _describe_kernel(kernel)}
    out.update({k: _describe(v) for k, v in settings.items()})
    out["model arguments"] = _structure(args)
    out["model argument values"] = _digest(args)
    # jax before 0.12 gives its options no types (it sets them by setattr)
    x64 = jax.config.jax_enable_x64  # type: ignore[attr-defined, unused-ignore]
    out["precision"] = "float64" if x64 else "float32"
    out["byte order"] = sys.byteorder  # of the state's bytes
    return out


def signature(state, draws) -> dict:
    """The structure of one chain's sampler state and draws: another model (other
    latent or deterministic sites) or another NumPyro (other state fields) differ here."""
    return {"sampler state": str(jax.tree.structure(state)) + " " + _structure(state),
            "draws": _structure(draws)}


def _name(model) -> str:
    model = kernel_function(model) or model
    return getattr(model, "__qualname__", type(model).__name__)


def _describe_kernel(kernel) -> str:
    items = [f"{k}={_describe(v)}" for k, v in kernel_settings(kernel).items()]
    return f"{type(kernel).__name__}({', '.join(items)})"


def _describe(v) -> str:
    """A setting as text that is the same in every process (no addresses)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return repr(v)
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(_describe(x) for x in v) + ")"
    if isinstance(v, dict):
        items = sorted(v.items(), key=str)
        return "{" + ", ".join(f"{k!r}: {_describe(x)}" for k, x in items) + "}"
    if isinstance(v, functools.partial):
        parts = [*map(_describe, v.args),
                 *(f"{k}={_describe(x)}" for k, x in sorted(v.keywords.items()))]
        return f"{_describe(v.func)}({', '.join(parts)})"
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        return f"{_shape(v)}#{_digest(v)[:16]}"
    if callable(v):
        return getattr(v, "__qualname__", type(v).__name__)
    return type(v).__name__


def _leaves(tree):
    """``(path, leaf)`` of the leaves that identify data: executors left out."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(jax.tree_util.keystr(p), x) for p, x in flat if not isinstance(x, pb.Executor)]


def _host(x):
    return np.asarray(jax.random.key_data(x) if is_key(x) else x)


def _shape(x) -> str:
    return f"{x.dtype if is_key(x) else np.dtype(x.dtype).name}{list(x.shape)}"


def _structure(tree) -> str:
    parts = []
    for path, x in _leaves(tree):
        parts.append(f"{path}: {_shape(x) if hasattr(x, 'shape') else _describe(x)}")
    return "; ".join(parts)


def _digest(tree) -> str:
    h = hashlib.sha256()
    for path, x in _leaves(tree):
        h.update(path.encode())
        if hasattr(x, "shape"):
            a = np.ascontiguousarray(_host(x))
            h.update(f"{a.dtype.str}{a.shape}".encode())
            h.update(a.tobytes())
        else:
            h.update(_describe(x).encode())
    return h.hexdigest()


# -- checking ----------------------------------------------------------------------------


def check(saved, current: dict, path) -> None:
    """Raise :class:`CheckpointError` naming every item of ``current`` that differs from
    the fingerprint of ``saved`` (a :class:`~.checkpoint.Saved`)."""
    differ = [k for k in current if saved.fingerprint.get(k) != current[k]]
    if not differ:
        return
    lines = []
    for k in differ:
        old, new = saved.fingerprint.get(k, "(not recorded)"), current[k]
        if k == "model argument values":
            lines.append("  the model's arguments have the same shapes but other values")
        else:
            lines.append(f"  {k}: {_difference(old, new)}")
    raise CheckpointError(
        f"sample: the checkpoint {path!r} was written by another run, so this one cannot "
        "continue it:\n" + "\n".join(lines) + "\nCall pb.sample with the model, arguments "
        "and settings that wrote it to continue it, or pass another checkpoint path (or "
        "delete the file) to start a new run. The file was not changed.")


def _difference(old: str, new: str) -> str:
    a, b = old.split("; "), new.split("; ")
    if len(a) > 1 or len(b) > 1:  # a structure: show the entries that differ
        a, b = [x for x in a if x not in b][:3], [x for x in b if x not in a][:3]
        old, new = "; ".join(a) or "(none)", "; ".join(b) or "(none)"
    return f"{old} in the checkpoint, {new} now"
