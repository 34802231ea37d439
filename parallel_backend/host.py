"""The host path, end to end: one evaluation run as chunk tasks on an executor's workers.

Called from the host callback of :mod:`.reduce` with the traced data leaves and
the shared leaves (host arrays; under ``vmap`` with leading batch axes). In order:

1. :func:`unbatch` flattens any batch axes to one and notes which leaves carry it;
2. the traced leaves are cut into blocks and the chunks are planned (the adaptive
   chunker, or the user's ``grainsize``), runs of whole tiles;
3. ``executor.map_chunks(state, chunks, evaluation)`` runs them on the workers,
   each through :func:`run_chunk` (here, or in another process);
4. :func:`assemble` puts the per-block partials back in block order and the batch
   shape is restored; :mod:`.reduce` folds them.

Imports jax, numpy and the core.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from .blocks import TilePlan, xla_threads
from .chunking import Chunk, fixed_chunks
from .errors import ChunkError
from .sets import block_axis, take_blocks
from .spec import Program, pad_blocks

__all__ = ["Evaluation", "ChunkResult", "evaluate", "run_chunk", "assemble", "unbatch",
           "tile_ranges"]


class Evaluation(NamedTuple):
    """What every chunk task of one host evaluation needs.

    Attributes
    ----------
    traced : tuple
        Per traced data leaf: its blocks, ``(blocks, block_rows, *row)``, or
        ``(batch, blocks, block_rows, *row)`` where ``in_axes`` marks it batched; the
        blocks from ``first`` on.
    shared : tuple
        The shared leaves (a leading batch axis where ``in_axes`` says so).
    diff_traced, diff_shared : tuple of bool
        Which leaves get gradients.
    in_axes : tuple or None
        ``(traced_axes, shared_axes)`` (0 or None per leaf) under a batch of parameter
        sets (``vmap``), else ``None``.
    first : int
        The block that ``traced``'s block axis starts at.
    """

    traced: tuple
    shared: tuple
    diff_traced: tuple
    diff_shared: tuple
    in_axes: Any
    first: int = 0

    def blocks(self, a: int, b: int) -> tuple:
        """The traced leaves' blocks ``[a, b)`` (absolute block numbers)."""
        axes = self.in_axes[0] if self.in_axes is not None else (None,) * len(self.traced)
        lo, hi = a - self.first, b - self.first
        return take_blocks(self.traced, axes, lo, hi)

    def restrict(self, a: int, b: int) -> "Evaluation":
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
    """

    chunk: Chunk
    values: Any
    shared_grads: tuple
    data_grads: tuple
    seconds: float


#: Chunk programs that may block a thread of XLA's CPU pool (``Program.blocks_pool``:
#: batched LAPACK kernels) run at most this many at a time in this process, so that one
#: pool thread always stays free to do the work they wait for; otherwise as many of them
#: as the pool has threads wait for each other forever. Process-wide, as the pool is.
POOL_SLOTS = max(1, xla_threads() - 1)
_POOL_GATE = threading.BoundedSemaphore(POOL_SLOTS)


def tile_ranges(tiles: TilePlan, chunk: Chunk) -> list[tuple[int, int]]:
    """The tiles ``[a, b)`` (in blocks) that make up ``chunk`` (a run of whole tiles)."""
    out, a, stop = [], chunk.first, chunk.first + chunk.count
    while a < stop:
        t = min(a // tiles.tile_blocks, tiles.n_tiles - 1)
        b = tiles.tile_range(t)[1]
        out.append((a, b))
        a = b
    return out


def run_chunk(program: Program, resident, chunk: Chunk, evaluation: Evaluation) -> ChunkResult:
    """Evaluate the blocks of ``chunk`` (a run of whole tiles) on the calling thread, with
    one compiled call: one ``vmap`` over its blocks in the batched form, one loop over
    them in the looped form (one per parameter set under a batch of them).

    ``resident`` (a :class:`~parallel_backend.site.Resident`) holds the prepared data of
    at least the chunk's blocks; ``evaluation`` the traced blocks from its ``first``.
    """
    spec = program.spec
    ev = evaluation
    gate = _POOL_GATE if program.blocks_pool else contextlib.nullcontext()
    try:
        # The same precision and device on every thread, so every thread hits the same
        # compiled function (a pure_callback's thread has a default device set).
        with gate, jax.enable_x64(spec.x64), jax.default_device(resident.device):
            t0 = time.perf_counter()  # after the gate: the chunker wants compute time
            a, b = chunk.first, chunk.first + chunk.count
            last = b == spec.plan.n_blocks
            if spec.form == "looped":
                out = _looped(program, resident, chunk, ev, last)
            elif last and spec.tiles.tail:  # the padded block apart (see Program.batched)
                fn = program.compiled(chunk.count, ev.diff_traced, ev.diff_shared, ev.in_axes,
                                      last)
                tail = (resident.view(b - 1, b), ev.blocks(b - 1, b), program.valid[b - 1:b])
                out = fn(resident.view(a, b - 1), ev.blocks(a, b - 1), ev.shared,
                         program.valid[a:b - 1], tail)
            else:
                fn = program.compiled(chunk.count, ev.diff_traced, ev.diff_shared, ev.in_axes,
                                      last)
                out = fn(resident.view(a, b), ev.blocks(a, b), ev.shared, program.valid[a:b])
            out = jax.device_get(out)
            seconds = time.perf_counter() - t0
    except Exception as e:
        raise ChunkError.wrap(e, spec.rows(chunk.first, chunk.count), spec.label) from e
    return ChunkResult(chunk, out.values, tuple(out.shared_grads), tuple(out.data_grads),
                       seconds)


def _looped(program: Program, resident, chunk: Chunk, ev: Evaluation, last: bool):
    """A looped chunk: one call of the unbatched program, or one per parameter set of a
    batch (``vmap``): a set's partials are then the bits of the unbatched program, as
    in the graph path (see :func:`.batching.set_batching`)."""
    a, b = chunk.first, chunk.first + chunk.count
    fn = program.compiled(chunk.count, ev.diff_traced, ev.diff_shared, None, last)

    def call(traced, shared):
        return fn(resident.everything(), traced, shared, program.valid[a:b],
                  np.int32(a - resident.first), np.int32(chunk.count))

    traced = ev.blocks(a, b)
    if ev.in_axes is None:
        return call(traced, ev.shared)
    axes_t, axes_s = ev.in_axes
    k = next(x.shape[0] for x, ax in zip(traced + ev.shared, axes_t + axes_s) if ax == 0)

    def member(leaves, axes, m):
        return tuple(x[m] if ax == 0 else x for x, ax in zip(leaves, axes))

    sets = [jax.device_get(call(member(traced, axes_t, m), member(ev.shared, axes_s, m)))
            for m in range(k)]
    return jax.tree.map(lambda *xs: np.stack(xs), *sets)


def assemble(program: Program, results, batch: tuple, traced_shapes, shared_shapes):
    """Whole-call buffers from chunk results, in block order: per-block values and shared
    gradients, per-row data gradients (``N`` rows, padding dropped)."""
    spec = program.spec
    p = spec.plan
    values = np.empty(batch + (p.n_blocks,), np.dtype(spec.value_dtype))
    g_shared = [np.empty(batch + (p.n_blocks,) + s, d) for s, d in shared_shapes]
    g_data = [np.empty(batch + (p.n_blocks * p.block_rows,) + s, d) for s, d in traced_shapes]
    lead = (slice(None),) * len(batch)
    for res in results:
        c = res.chunk
        blocks = lead + (slice(c.first, c.first + c.count),)
        rows = lead + (slice(c.first * p.block_rows, (c.first + c.count) * p.block_rows),)
        values[blocks] = res.values
        for buf, g in zip(g_shared, res.shared_grads):
            buf[blocks] = g
        for buf, g in zip(g_data, res.data_grads):
            g = np.asarray(g)
            buf[rows] = g.reshape(g.shape[:len(batch)] + (-1,) + g.shape[len(batch) + 2:])
    g_data = [g[lead + (slice(0, p.n_rows),)] for g in g_data]
    return values, tuple(g_shared), tuple(g_data)


def evaluate(executor, state, grainsize, traced, shared, diff_traced, diff_shared, orig_ndims,
             count: bool = True):
    """One evaluation on ``executor``'s workers: per-block partials of every block.

    Called from the host callback with host arrays (jax 0.10 hands a callback
    ``jax.Array`` values, not numpy: an executor that pickles them converts them
    first). Under ``vmap`` the arguments carry leading batch axes; every batch member
    goes in each task.
    """
    executor.check_open()
    program = state.program
    plan = program.spec.plan
    t0 = time.perf_counter()
    traced, shared, in_axes, batch_shape = unbatch(traced, shared, orig_ndims)
    axes_t = in_axes[0] if in_axes is not None else (None,) * len(traced)
    blocked = tuple(pad_blocks(np.asarray(t), plan, axis=block_axis(ax))
                    for t, ax in zip(traced, axes_t))
    # numpy, not the callback's jax arrays: those are committed to the caller's device,
    # and a chunk may run on another (a DeviceExecutor's).
    evaluation = Evaluation(blocked, tuple(np.asarray(s) for s in shared), tuple(diff_traced),
                            tuple(diff_shared), in_axes)
    chunks = (state.chunker.chunks() if grainsize is None
              else fixed_chunks(plan, grainsize, program.spec.tiles))
    try:
        results = executor.map_chunks(state, chunks, evaluation)
    except ChunkError as e:
        raise ChunkError.wrap(e, e.rows, state.label, executor.name) from e.__cause__
    wall = time.perf_counter() - t0
    busy = sum(r.seconds for r in results)
    if grainsize is None and results:
        overhead = max(wall * min(executor.workers, len(results)) - busy, 0.0) / len(results)
        for r in results:
            state.chunker.record(r.chunk.count, r.seconds, overhead)
    k = math.prod(batch_shape) if batch_shape else 1
    if count:
        executor.count(host_calls=1, calls=1, chunks=len(results), rows=plan.n_rows * k,
                       seconds_in_workers=busy,
                       bytes_sent=executor.bytes_per_call(traced, shared, len(results)))
    axes_s = in_axes[1] if in_axes is not None else (None,) * len(shared)
    shapes_t = [(_unbatched_shape(t, a)[1:], np.asarray(t).dtype)
                for t, a, d in zip(traced, axes_t, diff_traced) if d]
    shapes_s = [(_unbatched_shape(s, a), np.asarray(s).dtype)
                for s, a, d in zip(shared, axes_s, diff_shared) if d]
    flat_batch = (k,) if in_axes is not None else ()
    out = assemble(program, results, flat_batch, shapes_t, shapes_s)
    return _restore_batch(out, flat_batch, batch_shape)


def _unbatched_shape(x, axis) -> tuple:
    shape = tuple(np.shape(x))
    return shape[1:] if axis == 0 else shape


def unbatch(traced, shared, orig_ndims):
    """Flatten the leading vmap axes of callback arguments to one batch axis.

    With ``vmap_method="expand_dims"`` every argument carries one leading axis per
    vmap level, of size 1 where that argument is not batched. Unbatched arguments
    are squeezed (and get ``in_axes=None``) so the host compiles exactly what the
    graph path would under the same ``vmap``.

    Returns ``(traced, shared, in_axes, batch_shape)``.
    """
    leaves = list(traced) + list(shared)
    if not leaves:
        return tuple(traced), tuple(shared), None, ()
    nb = np.ndim(leaves[0]) - orig_ndims[0]
    if nb == 0:
        return tuple(traced), tuple(shared), None, ()
    leads = [np.shape(x)[:nb] for x in leaves]
    batch_shape = tuple(np.broadcast_shapes(*leads))
    k = math.prod(batch_shape)
    out, axes = [], []
    for x, lead in zip(leaves, leads):
        x = np.asarray(x)
        rest = x.shape[nb:]
        if all(d == 1 for d in lead):
            out.append(x.reshape(rest))
            axes.append(None)
        else:
            out.append(np.broadcast_to(x, batch_shape + rest).reshape((k,) + rest))
            axes.append(0)
    n = len(traced)
    if all(a is None for a in axes):
        return tuple(out[:n]), tuple(out[n:]), None, batch_shape
    return tuple(out[:n]), tuple(out[n:]), (tuple(axes[:n]), tuple(axes[n:])), batch_shape


def _restore_batch(out, flat_batch, batch_shape):
    """Restore the caller's batch shape on host-path outputs."""
    values, g_shared, g_data = out
    if flat_batch == tuple(batch_shape):
        return values, g_shared, g_data

    def fix(x):
        x = np.asarray(x)
        return x.reshape(tuple(batch_shape) + x.shape[len(flat_batch):])

    return fix(values), tuple(fix(g) for g in g_shared), tuple(fix(g) for g in g_data)
