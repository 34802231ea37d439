"""``pb.sample``'s checkpoint files: reading, writing, finishing, and what a run's parts add.

A checkpoint is a netCDF file (written by the ArviZ plugin's
:func:`~parallel_backend.plugins.arviz.io.write_groups`, so atomically, in the one
format both ArviZ majors read) with the draws so far in ``posterior`` and
``sample_stats`` (full size, ``attrs["draws_done"]`` per chain made), every chain's
sampler state in a ``sampler_state`` group (``state``: the bytes of the leaves of
NumPyro's state, one row per chain, see :func:`pack`; ``done``, the transitions each
chain has made), and in ``attrs`` the run's fingerprint (:mod:`.fingerprint`). When the
run has finished the file is replaced by the whole run
(``attrs["checkpoint_status"] == "finished"``).

The state is kept as raw bytes, one variable instead of one per leaf: exact by
construction, and a netCDF variable costs milliseconds to write, which a checkpoint pays
every ``checkpoint_every`` iterations. :func:`pack`/:func:`unpack` convert.

Owns :data:`FORMAT`, :class:`Saved`, :func:`read`, :func:`write`, :func:`finish`,
:func:`writer`, :func:`pack`, :func:`unpack`, :func:`draw_names` and :class:`History`.
Imports jax, numpy, xarray, numpyro, the core's public names, the ArviZ plugin's
:mod:`~parallel_backend.plugins.arviz.io` and :mod:`.fingerprint`.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import NamedTuple

import jax
import numpy as np
import numpyro
import xarray as xr

import parallel_backend as pb

from ..arviz.io import read_groups, save, write_groups
from .fingerprint import CheckpointError

__all__ = ["FORMAT", "STAT_NAMES", "History", "Saved", "draw_names", "finish", "pack", "read",
           "unpack", "warn_versions", "write", "writer"]

#: The layout of the files this version writes and reads.
FORMAT = 1

#: ArviZ's names of NumPyro's state fields in ``sample_stats`` (``lp`` is minus the
#: potential energy).
STAT_NAMES = {"potential_energy": "lp", "adapt_state.step_size": "step_size",
              "num_steps": "n_steps", "accept_prob": "acceptance_rate"}


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


def read(path) -> Saved | None:
    """The checkpoint at ``path``; ``None`` if there is no file.

    Raises
    ------
    CheckpointError
        The file is not a checkpoint, cannot be read, or was written in another format.
    """
    if not os.path.exists(path):
        return None
    try:
        attrs, groups = read_groups(path)
    except Exception as e:
        raise CheckpointError(
            f"sample: the checkpoint {path!r} exists but cannot be read as netCDF "
            f"({type(e).__name__}: {e}). Pass another checkpoint path, or delete the file to "
            "start over; it was not changed.") from e
    fmt = attrs.get("checkpoint_format")
    if fmt is None or "checkpoint_fingerprint" not in attrs:
        raise CheckpointError(
            f"sample: {path!r} exists but is not a pb.sample checkpoint (it has no "
            "checkpoint_format attribute). Pass another checkpoint path, or delete the file "
            "to start over; it was not changed.")
    if fmt != FORMAT:
        raise CheckpointError(
            f"sample: the checkpoint {path!r} was written by parallel_backend "
            f"{attrs.get('parallel_backend_version', '?')} in checkpoint format {fmt}; this is "
            f"parallel_backend {pb.__version__}, which reads format {FORMAT} only. Continue "
            "it with the version that wrote it, or pass another checkpoint path (or delete "
            "the file) to start over; it was not changed.")
    fp = json.loads(attrs["checkpoint_fingerprint"])
    if attrs.get("checkpoint_status") == "finished":
        return Saved(attrs, fp, True)
    st = groups.get("sampler_state")
    if st is None:
        raise CheckpointError(f"sample: the checkpoint {path!r} has no sampler_state group, so "
                              "it cannot be continued. Pass another checkpoint path, or delete "
                              "the file to start over; it was not changed.")
    draws = {(g, name): groups[g][name].values for g in ("posterior", "sample_stats")
             if g in groups for name in groups[g].data_vars}
    if ("sample_stats", "lp") in draws:  # stored as ArviZ's lp: back to the potential energy
        draws["sample_stats", "lp"] = -draws["sample_stats", "lp"]
    return Saved(attrs, fp, False, np.asarray(st["done"].values), st["state"].values, draws)


def write(path, *, attrs: dict, state_leaves, draws: dict, done, num_warmup: int) -> None:
    """Write a running checkpoint to ``path``, atomically (a crash leaves the previous one).

    Parameters
    ----------
    attrs : dict
        Root attributes, the fingerprint (as ``checkpoint_fingerprint``, JSON) included.
    state_leaves : list of numpy.ndarray
        The sampler state's leaves, stacked on a chain axis (typed keys as key data);
        stored packed.
    draws : dict
        ``{(group, name): (chains, draws, ...) array}``.
    done : sequence of int
        Transitions made per chain.
    num_warmup : int
    """
    done = np.asarray(done, np.int64)
    n_chains = len(done)
    groups: dict[str, dict] = {}
    for (group, name), value in draws.items():
        value = -value if (group, name) == ("sample_stats", "lp") else value
        dims = ("chain", "draw") + tuple(f"{name}_dim_{i}" for i in range(value.ndim - 2))
        groups.setdefault(group, {})[name] = (dims, value)
    datasets = {g: xr.Dataset(v, coords={"chain": np.arange(n_chains),
                                         "draw": np.arange(next(iter(v.values()))[1].shape[1])})
                for g, v in groups.items()}
    datasets["sampler_state"] = xr.Dataset({"state": (("chain", "state_byte"), pack(state_leaves)),
                                            "done": (("chain",), done)})
    write_groups(path, datasets, {
        **attrs, "checkpoint_format": FORMAT, "checkpoint_status": "running",
        "iteration": [int(d) for d in done],
        "draws_done": [int(max(d - num_warmup, 0)) for d in done]})


def finish(path, run, fingerprint: dict) -> None:
    """Replace the checkpoint at ``path`` by the whole ``run`` (its attributes marking it
    finished, for a later call to return as it is)."""
    run.attrs.update({"checkpoint_format": FORMAT, "checkpoint_status": "finished",
                      "checkpoint_fingerprint": json.dumps(fingerprint, sort_keys=True)})
    save(run, path)


def writer(path, chains, fields, draws, fingerprint, history, progress):
    """What runs after each segment: the checkpoint of everything so far."""
    names = draw_names(fields, draws)
    base = {"parallel_backend_version": pb.__version__, "jax_version": jax.__version__,
            "numpyro_version": numpyro.__version__,
            "checkpoint_fingerprint": json.dumps(fingerprint, sort_keys=True),
            "num_chains": chains.num_chains, "num_samples": chains.num_samples,
            "num_warmup": chains.num_warmup}

    def write_now():
        state, values, done = chains.snapshot()
        write(path, attrs={**base, **history.attrs(progress.seconds)}, state_leaves=state,
              draws=dict(zip(names, values)), done=done, num_warmup=chains.num_warmup)

    return write_now


def warn_versions(saved: Saved, path) -> None:
    """Warn where the checkpoint was written by another parallel_backend or JAX: the run
    continues, but its draws are promised bitwise an uninterrupted run's only within
    one version of each."""
    for name, now in (("parallel_backend", pb.__version__), ("jax", jax.__version__)):
        then = saved.attrs.get(f"{name}_version")
        if then is not None and then != now:
            warnings.warn(f"sample: the checkpoint {path!r} was written with {name} {then}, "
                          f"this is {name} {now}: the run continues, but its draws may differ "
                          "from those of an uninterrupted run in the last bits", stacklevel=3)


class History:
    """A run's parts so far: resumes (from a checkpoint's attributes) and wall seconds."""

    def __init__(self, saved, total: int, sequential: bool):
        before = saved.attrs if saved is not None else {}
        self.count = int(before.get("resume_count", 0)) + (saved is not None)
        self.resumed_from = list(before.get("resumed_from", []))
        self.resumed_chain = list(before.get("resumed_chain", []))
        self.seconds = {"warmup": float(before.get("warmup_seconds", 0.0)),
                        "sample": float(before.get("sampling_seconds", 0.0))}
        self.transitions = int(np.sum(saved.done)) if saved is not None else 0
        self.resumed_at = None
        self.sequential = sequential
        if saved is not None:
            # The first chain not finished: where this part starts.
            chain = next((c for c, d in enumerate(saved.done) if d < total), len(saved.done) - 1)
            self.resumed_at = int(saved.done[chain])
            self.resumed_from.append(self.resumed_at)
            self.resumed_chain.append(chain)

    def attrs(self, seconds: dict) -> dict:
        """``warmup_seconds``/``sampling_seconds`` of every part, and the resumes."""
        out = {"warmup_seconds": self.seconds["warmup"] + seconds["warmup"],
               "sampling_seconds": self.seconds["sample"] + seconds["sample"],
               "resume_count": self.count}
        if self.count:
            out["resumed_from"] = list(self.resumed_from)
            if self.sequential:
                out["resumed_chain"] = list(self.resumed_chain)
        return out


# -- the sampler state as bytes, the draws by name ---------------------------------------


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
