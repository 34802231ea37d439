"""What identifies a ``pb.sample`` run, and its sampler state as bytes.

A checkpoint (written and read by :mod:`parallel_backend.plugins.arviz.checkpoint`)
holds the draws so far, every chain's sampler state and, in its attributes, the run's
*fingerprint*: the settings, the model's name, the structure and a digest of its
arguments, and the structure of the sampler state and of the draws. A second call of
``pb.sample`` continues a file only if its fingerprint is this run's; otherwise
:class:`CheckpointError` lists what differs.

The state is kept as raw bytes, one variable instead of one per leaf: exact by
construction, and a netCDF variable costs milliseconds to write, which a checkpoint pays
every ``checkpoint_every`` iterations. :func:`pack`/:func:`unpack` convert; the
structure that gives the bytes their meaning is in the fingerprint.

Owns :class:`CheckpointError`, :class:`Saved`, :func:`fingerprint`, :func:`signature`,
:func:`draw_names`, :func:`pack`, :func:`unpack` and :func:`check`. Imports numpy, jax
and the core's public names; no file is read or written here.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from typing import NamedTuple

import jax
import numpy as np

import parallel_backend as pb

from .driver import is_key
from .internals import kernel_function, kernel_settings

__all__ = ["CheckpointError", "Saved", "fingerprint", "signature", "draw_names", "pack",
           "unpack", "check", "STAT_NAMES"]

#: ArviZ's names of NumPyro's state fields in ``sample_stats`` (``lp`` is minus the
#: potential energy).
STAT_NAMES = {"potential_energy": "lp", "adapt_state.step_size": "step_size",
              "num_steps": "n_steps", "accept_prob": "acceptance_rate"}


class CheckpointError(ValueError):
    """A checkpoint that this run cannot continue (or a file that is not one)."""


class Saved(NamedTuple):
    """What a checkpoint file holds.

    Attributes
    ----------
    attrs : dict
        The file's attributes (settings, fingerprint, resume history, seconds).
    fingerprint : dict
        ``{item: description}`` of the run that wrote it.
    finished : bool
        The file holds the whole run (ArviZ data; nothing else is read).
    done : numpy.ndarray or None
        Transitions made per chain.
    state : numpy.ndarray or None
        The sampler state's leaves as bytes, ``(chains, bytes)`` (see :func:`unpack`).
    draws : dict or None
        ``{(group, name): (chains, draws, ...) array}``, named as by :func:`draw_names`.
    """

    attrs: dict
    fingerprint: dict
    finished: bool
    done: np.ndarray | None = None
    state: list | None = None
    draws: dict | None = None


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
    out["precision"] = "float64" if jax.config.jax_enable_x64 else "float32"
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
        return "{" + ", ".join(f"{k!r}: {_describe(x)}" for k, x in sorted(v.items(), key=str)) + "}"
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


def pack(leaves) -> np.ndarray:
    """The sampler state's leaves (each ``(chains, ...)``) as one ``(chains, bytes)``
    ``uint8`` array: each chain's leaves' bytes, one after another in tree order."""
    rows = [b"".join(np.ascontiguousarray(x[c]).tobytes() for x in leaves)
            for c in range(leaves[0].shape[0])]
    return np.stack([np.frombuffer(r, np.uint8) for r in rows])


def unpack(packed, like) -> list:
    """The leaves :func:`pack` packed, given one chain's leaves (or their shapes and
    dtypes) ``like``, in tree order."""
    out, start = [], 0
    for t in like:
        size = np.dtype(t.dtype).itemsize * int(np.prod(t.shape))
        out.append(np.stack([np.frombuffer(row[start:start + size].tobytes(), t.dtype)
                             .reshape(t.shape) for row in packed]))
        start += size
    if start != packed.shape[1]:
        raise CheckpointError(f"sample: a checkpoint's sampler state has {packed.shape[1]} bytes "
                              f"per chain where this run's has {start}")
    return out


def draw_names(fields, buffers) -> list:
    """``(group, name)`` of each leaf of the collected ``buffers`` (one tree per field),
    in tree order: the sample field's sites go to ``posterior`` (named by site, or
    ``Param:i`` as ``arviz.from_numpyro`` names them), the others to ``sample_stats``
    under ArviZ's names."""
    names = []
    for k, (field, tree) in enumerate(zip(fields, buffers)):
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        for i, (path, _) in enumerate(flat):
            if k == 0:
                keys = [str(getattr(p, "key", "")) for p in path]
                names.append(("posterior", ".".join(keys) if all(keys) and keys
                              else f"Param:{i}"))
            else:
                base = STAT_NAMES.get(field, field)
                names.append(("sample_stats", base if len(flat) == 1 else f"{base}.{i}"))
    return names


# -- checking ----------------------------------------------------------------------------


def check(saved: Saved, current: dict, path) -> None:
    """Raise :class:`CheckpointError` naming every item of ``current`` that differs from
    the checkpoint's fingerprint."""
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
