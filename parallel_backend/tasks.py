"""Chunk tasks: plain values an executor runs, and the one function that runs them.

A :class:`Task` says which compiled program, which blocks (a :class:`Chunk`), on which
prepared data (a :class:`Resident`) and with which parameters (an :class:`Evaluation`);
:func:`run_task` evaluates it on the calling thread and returns a :class:`ChunkResult`
(the per-block partials, plain arrays); :func:`combine` folds partials in block order,
the one place they meet. An executor only runs tasks, here or in another
process (where it rebuilds the program from the site's picklable spec and holds its own
share of the data): it never calls back into the site or the host path that made them.
This module imports jax, numpy, :mod:`.blocks` and :mod:`.errors` only.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import OrderedDict
from typing import Any, NamedTuple

import jax
import numpy as np

from .blocks import tree_sum
from .errors import ChunkError
from .guards import pin

__all__ = [
    "ChunkResult",
    "Evaluation",
    "Partials",
    "Resident",
    "Task",
    "combine",
    "host_device",
    "program_key",
    "run_chunk",
    "run_task",
]

#: Chunk views (device arrays of a run of blocks) kept per holder, least recently used
#: out first, and at most this many times the bytes of the data held.
MAX_VIEWS = 64
MAX_VIEW_COPIES = 2


class Partials(NamedTuple):
    """Per-block partials of a run of blocks (leading axes: any batch, then blocks).

    Attributes
    ----------
    values : array
        ``(*batch, blocks)``: each block's summed log-density.
    shared_grads : tuple
        Per differentiated shared leaf, ``(*batch, blocks, *leaf_shape)``.
    data_grads : tuple
        Per differentiated traced data leaf, ``(*batch, blocks, block_rows, *row_shape)``.
    """

    values: Any
    shared_grads: tuple
    data_grads: tuple

    def pinned(self, on: bool = True) -> Partials:
        """These partials, bit for bit, beside the small product of guard ``pin``
        (:func:`.guards.pin`); ``on=False``: as they are."""
        if not on:
            return self
        values, shared_grads = pin(self.values, *self.shared_grads)
        return Partials(values, tuple(shared_grads), self.data_grads)


def combine(values, shared_grads, data_grads):
    """Fold per-block partials in block order: the one place partials meet."""
    return tree_sum(values), tuple(tree_sum(g) for g in shared_grads), tuple(data_grads)


class Evaluation(NamedTuple):
    """The parameters of one host evaluation, what every task of it reads.

    Attributes
    ----------
    traced : tuple
        Per traced data leaf: its blocks, ``(blocks, block_rows, *row)``, or
        ``(batch, blocks, block_rows, *row)`` where ``in_axes`` marks it batched; the
        blocks from ``first`` on. In a Hessian-vector product (:attr:`order` 2) the
        leaves ``diff_traced`` marks follow, each with its tangent, blocked the same way.
    shared : tuple
        The shared leaves (a leading batch axis where ``in_axes`` says so); in a
        Hessian-vector product followed by the tangents of those ``diff_shared`` marks.
    diff_traced, diff_shared : tuple of bool
        Which leaves get gradients (one flag per leaf, tangents not counted).
    in_axes : tuple or None
        ``(traced_axes, shared_axes)`` (0 or None per leaf, tangents included) under a
        batch of parameter sets or of tangents (``vmap``), else ``None``.
    first : int
        The block that ``traced``'s block axis starts at.
    """

    traced: tuple
    shared: tuple
    diff_traced: tuple
    diff_shared: tuple
    in_axes: Any
    first: int = 0

    @property
    def order(self) -> int:
        """1: value and gradients; 2: the tangent of value and gradients along the
        tangents that follow the leaves (a Hessian-vector product per block). Told by
        the leaves alone, so every executor that carries them carries the order."""
        plain = (len(self.traced), len(self.shared)) == (len(self.diff_traced),
                                                         len(self.diff_shared))
        return 1 if plain else 2

    def blocks(self, a: int, b: int) -> tuple:
        """The traced leaves' blocks ``[a, b)`` (absolute block numbers; the block axis after
        any axis of sets, as :func:`.blocks.take_blocks` reads it)."""
        axes = self.in_axes[0] if self.in_axes is not None else (None,) * len(self.traced)
        lo, hi = a - self.first, b - self.first
        return tuple(x[:, lo:hi] if ax == 0 else x[lo:hi] for x, ax in zip(self.traced, axes))

    def restrict(self, a: int, b: int) -> Evaluation:
        """The same evaluation with only blocks ``[a, b)`` of the traced leaves (what a
        worker that evaluates only those needs to receive)."""
        return self._replace(traced=self.blocks(a, b), first=a)


class ChunkResult(NamedTuple):
    """What one task returns.

    Attributes
    ----------
    chunk : Chunk
    values : array
        ``(*batch, blocks)``.
    shared_grads : tuple
        Each ``(*batch, blocks, *leaf_shape)``.
    data_grads : tuple
        Each ``(*batch, blocks, block_rows, *row_shape)``.
    seconds : float
        Time the task computed.
    started : float
        When it started (``time.time()`` where it ran).
    worker : str
        Where it ran: ``"process/thread"``, or a dask worker's address.
    """

    chunk: Any
    values: Any
    shared_grads: tuple
    data_grads: tuple
    seconds: float
    started: float = 0.0
    worker: str = ""


class Task(NamedTuple):
    """One chunk of one evaluation, as a value.

    Attributes
    ----------
    site : SiteState
        The call site (an executor that holds data for it elsewhere finds it by this).
    program : Program
        The site's block computations in this process.
    resident : Resident
        The prepared data here (at least the chunk's blocks).
    chunk : Chunk
        The blocks ``[chunk.first, chunk.first + chunk.count)``, a run of whole tiles.
    evaluation : Evaluation
        The parameters (every task of an evaluation shares one).
    """

    site: Any
    program: Any
    resident: Any
    chunk: Any
    evaluation: Evaluation


class Resident:
    """Prepared blocks ``[first, first + n)`` a worker holds, as numpy arrays, with device
    copies of runs of them made once (a tile's, or the whole run's) and kept.

    Parameters
    ----------
    arrays : tuple of numpy arrays
        Each ``(n, block_rows, ...)``.
    first : int
        The first block held.
    x64 : bool
        Precision to place them in (without x64, float64 data would become float32).
    device : jax.Device, optional
        Where the views live; default: the host CPU device.
    """

    def __init__(self, arrays, first: int = 0, x64: bool = False, device=None):
        self.arrays = tuple(arrays)
        self.first = int(first)
        self.n = int(self.arrays[0].shape[0]) if self.arrays else 0
        self.x64 = bool(x64)
        self.device = device if device is not None else host_device()
        self._views: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self._users = 0  # chunks between fetching their views and having their results
        self._doomed = False  # delete() came while some were: the last one frees

    def view(self, a: int, b: int) -> tuple:
        """Device arrays of blocks ``[a, b)`` (absolute block numbers)."""
        key = (a, b)
        with self._lock:
            view = self._views.get(key)
            if view is not None:
                self._views.move_to_end(key)
                return view
        lo, hi = a - self.first, b - self.first
        with jax.enable_x64(self.x64):
            view = tuple(jax.device_put(x[lo:hi], self.device) for x in self.arrays)
        with self._lock:
            self._views[key] = view
            budget = MAX_VIEW_COPIES * max(self.nbytes, 1)
            while len(self._views) > 1 and (len(self._views) > MAX_VIEWS
                                            or self._view_bytes() > budget):
                self._views.popitem(last=False)
        return view

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.arrays)

    def _view_bytes(self) -> int:
        return sum(a.nbytes for view in self._views.values() for a in view)

    def everything(self) -> tuple:
        """Device arrays of every block held."""
        return self.view(self.first, self.first + self.n)

    @contextlib.contextmanager
    def in_use(self):
        """Hold the device copies for one chunk: a :meth:`delete` meanwhile (the site
        released, the worker torn down) frees them when the last holder is done, instead
        of under a program that fetched them and has yet to run (it would fail with
        "Buffer has been deleted")."""
        with self._lock:
            self._users += 1
        try:
            yield self
        finally:
            with self._lock:
                self._users -= 1
                free = self._doomed and not self._users
            if free:
                self._free()

    def delete(self) -> None:
        """Free the device copies: now, or once the chunks holding them (:meth:`in_use`)
        are done. The numpy arrays stay: a later :meth:`view` copies again."""
        with self._lock:
            if self._users:
                self._doomed = True
                return
        self._free()

    def _free(self) -> None:
        with self._lock:
            if self._users:  # taken again since: its last holder frees
                return
            self._doomed = False
            views, self._views = list(self._views.values()), OrderedDict()
        for view in views:
            for arr in view:
                with contextlib.suppress(Exception):  # already freed or aliased
                    arr.delete()


_HOST: list = []


def host_device():
    """The CPU device on which host-path chunks run (looked up once: it is on the hot path)."""
    if not _HOST:
        _HOST.append(jax.devices("cpu")[0])
    return _HOST[0]


def program_key(blocks: int, diff_traced, diff_shared, in_axes, split: bool,
                order: int = 1) -> tuple:
    """The key of a compiled chunk program in ``Program.cache``."""
    return (blocks, diff_traced, diff_shared, in_axes, split, order)


def run_task(task: Task) -> ChunkResult:
    """Evaluate ``task`` on the calling thread, with one compiled call: one ``vmap`` over
    its blocks in the batched form, one loop over them in the looped form; under a batch
    of parameter sets where the site evaluates them one at a time (``Program.sets_each``),
    that mapped over the sets (:func:`.batching.map_sets`), as in the graph path."""
    program, resident, chunk, ev = task.program, task.resident, task.chunk, task.evaluation
    spec = program.spec
    try:
        # The same precision and device on every thread, so every thread hits the same
        # compiled function (a pure_callback's thread has a default device set).
        with jax.enable_x64(spec.x64), jax.default_device(resident.device):
            started, t0 = time.time(), time.perf_counter()  # after the gate: compute time
            with resident.in_use():
                out = jax.device_get(_call(program, resident, chunk, ev))
            seconds = time.perf_counter() - t0
    except Exception as e:
        raise ChunkError.wrap(e, spec.rows(chunk.first, chunk.count), spec.label) from e
    return ChunkResult(chunk, out.values, tuple(out.shared_grads), tuple(out.data_grads),
                       seconds, started, f"{os.getpid()}/{threading.current_thread().name}")


def run_chunk(program, resident, chunk, evaluation: Evaluation) -> ChunkResult:
    """:func:`run_task` of the task these make (for executors that hold their own data
    and program, such as a dask worker)."""
    return run_task(Task(None, program, resident, chunk, evaluation))


def _call(program, resident, chunk, ev: Evaluation):
    """The chunk's partials: one call of its compiled program, its arrays passed as the
    site's form takes them (:data:`CHUNK_CALLS`)."""
    b = chunk.first + chunk.count
    split = b == len(program.valid) and program.split_tail
    fn = program.cache.get(program_key(chunk.count, ev.diff_traced, ev.diff_shared,
                                       ev.in_axes, split, ev.order))
    if fn is None:
        fn = program.compiled(chunk.count, ev.diff_traced, ev.diff_shared, ev.in_axes,
                              b == len(program.valid), ev.order)
    return CHUNK_CALLS[program.spec.form](fn, program, resident, chunk, ev)


def _batched_call(fn, program, resident, chunk, ev: Evaluation):
    """A batched chunk program (:meth:`.kernels.Batched.chunk_program`) on the chunk's
    blocks, the padded last block apart where the site's tiles say so."""
    a, b = chunk.first, chunk.first + chunk.count
    if b == len(program.valid) and program.split_tail:
        tail = (resident.view(b - 1, b), ev.blocks(b - 1, b), program.valid[b - 1:b])
        return fn(resident.view(a, b - 1), ev.blocks(a, b - 1), ev.shared,
                  program.valid[a:b - 1], tail)
    return fn(resident.view(a, b), ev.blocks(a, b), ev.shared, program.valid[a:b])


def _looped_call(fn, program, resident, chunk, ev: Evaluation):
    """A looped chunk program (:meth:`.kernels.Looped.chunk_program`): the resident data
    from the chunk's first block on."""
    a, b = chunk.first, chunk.first + chunk.count
    return fn(resident.everything(), ev.blocks(a, b), ev.shared, program.valid[a:b],
              np.int32(a - resident.first), np.int32(chunk.count))


#: How the compiled chunk program of each form (:attr:`.spec.SiteSpec.form`) takes its
#: arrays.
CHUNK_CALLS = {"batched": _batched_call, "looped": _looped_call}
