"""One ``reduce_sum`` call site: its data, its compiled block loops, its host path.

This module owns :class:`Site`: the user's ``fn``, the block plan, the data that
was concrete at trace time (resident: kept, never copied per call), and the
compiled chunk functions, cached per chunk shape. Both dispatch paths live here:

* the graph path (:meth:`Site.graph_partials`): the block loop inside the caller's
  XLA program, no callback;
* the host path (:meth:`Site.host_partials`): the same block loop, compiled once
  per chunk length, run on the executor's workers chunk by chunk.

Both produce the same per-block partials, because both run one ``while`` loop
whose body is the same block computation and whose trip count is a runtime value
(so XLA neither unrolls nor inlines it differently for different chunk lengths).
:func:`combine` then folds the partials in block order. Imports: jax, numpy and
the core modules only.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import Counter
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .blocks import BlockPlan, tree_sum
from .chunking import Chunk
from .errors import ChunkError

__all__ = ["Site", "ChunkResult", "combine"]


class ChunkResult(NamedTuple):
    """What one task returns: partials of its blocks and how long it computed."""

    chunk: Chunk
    values: Any  # (*batch, blocks)
    shared_grads: tuple  # each (*batch, blocks, *leaf_shape)
    data_grads: tuple  # each (*batch, rows, *row_shape)
    seconds: float


def combine(values, shared_grads, data_grads):
    """Fold per-block partials in block order: the one place partials meet."""
    return tree_sum(values), tuple(tree_sum(g) for g in shared_grads), tuple(data_grads)


class Site:
    """A ``reduce_sum`` call site, reusable across traces of the same model.

    Parameters
    ----------
    fn : callable
        ``fn(data_chunk, *shared) -> (rows,)`` pointwise log-density.
    data_treedef, shared_treedef : PyTreeDef
    resident : tuple
        Per data leaf: the concrete array, or ``None`` where the leaf is traced.
    plan : BlockPlan
    value_dtype : dtype
        dtype of ``fn``'s output.
    x64 : bool
        The caller's ``jax_enable_x64``; chunks run with the same precision.
    """

    def __init__(self, fn, data_treedef, shared_treedef, resident, plan: BlockPlan,
                 value_dtype, x64: bool, label: str = ""):
        self.fn = fn
        self.data_treedef = data_treedef
        self.shared_treedef = shared_treedef
        self.resident = tuple(resident)
        self.plan = plan
        self.value_dtype = np.dtype(value_dtype)
        self.x64 = bool(x64)
        self.label = label or getattr(fn, "__name__", "fn")
        self.traced_index = tuple(i for i, r in enumerate(self.resident) if r is None)
        self.traces = Counter()  # (rows per block, blocks per chunk) -> times traced
        self.chunker = None  # set by the executor that owns this site
        self.dispatch = None  # "graph" or "host", decided once per site
        self.timing = None  # seconds per evaluation on each path, when measured
        self._lock = threading.Lock()
        self._compiled: dict = {}
        self._device_resident = None

    # -- the block computation ---------------------------------------------------

    def _block_terms(self, resident_block, traced_block, shared):
        """``fn`` on one block: the pointwise log-density, cast to the value dtype."""
        leaves = list(resident_block)
        for i, leaf in zip(self.traced_index, traced_block):
            leaves[i] = leaf
        data = jax.tree_util.tree_unflatten(self.data_treedef, leaves)
        shared_args = jax.tree_util.tree_unflatten(self.shared_treedef, list(shared))
        return self.fn(data, *shared_args).astype(self.value_dtype)

    def block_loop(self, rows: int, length: int, diff_traced: tuple, diff_shared: tuple):
        """The loop over ``count`` blocks of ``rows`` rows, writing ``length`` slots.

        Returns ``run(resident, traced, shared, row_start, count)`` giving per-block
        values, per-block gradients of the differentiated shared leaves and per-row
        gradients of the differentiated traced data leaves.
        """
        key = (rows, length)

        def run(resident, traced, shared, row_start, count):
            self.traces[key] += 1
            values = jnp.zeros((length,), self.value_dtype)
            g_shared = tuple(jnp.zeros((length,) + jnp.shape(s), jnp.result_type(s))
                             for s, d in zip(shared, diff_shared) if d)
            g_data = tuple(jnp.zeros((length * rows,) + jnp.shape(t)[1:], jnp.result_type(t))
                           for t, d in zip(traced, diff_traced) if d)

            def body(i, carry):
                values, g_shared, g_data = carry
                start = row_start + i * rows
                r_blk = [None if r is None else lax.dynamic_slice_in_dim(r, start, rows)
                         for r in resident]
                t_blk = [lax.dynamic_slice_in_dim(t, start, rows) for t in traced]
                if not (any(diff_traced) or any(diff_shared)):
                    v = jnp.sum(self._block_terms(r_blk, t_blk, shared))
                    return values.at[i].set(v), g_shared, g_data
                td = [t for t, d in zip(t_blk, diff_traced) if d]
                sd = [s for s, d in zip(shared, diff_shared) if d]

                def terms(td, sd):
                    t_all, s_all = _merge(t_blk, td, diff_traced), _merge(shared, sd, diff_shared)
                    return self._block_terms(r_blk, t_all, s_all)

                # The gradient of a sum is the pullback of ones: no need to
                # differentiate through the reduction itself.
                pointwise, pullback = jax.vjp(terms, td, sd)
                v = jnp.sum(pointwise)
                gt, gs = pullback(jnp.ones_like(pointwise))
                values = values.at[i].set(v)
                g_shared = tuple(acc.at[i].set(g) for acc, g in zip(g_shared, gs))
                g_data = tuple(lax.dynamic_update_slice_in_dim(acc, g, i * rows, 0)
                               for acc, g in zip(g_data, gt))
                return values, g_shared, g_data

            return lax.fori_loop(0, count, body, (values, g_shared, g_data))

        return run

    def _segments(self, first: int, count: int):
        """(rows per block, blocks, first row) of the full and tail parts of a block run."""
        p = self.plan
        full = max(0, min(first + count, p.n_full) - first)
        if full:
            yield p.block_rows, full, first * p.block_rows
        if p.tail_rows and first + count > p.n_full:
            yield p.tail_rows, 1, p.n_full * p.block_rows

    # -- graph path --------------------------------------------------------------

    def graph_partials(self, traced, shared, diff_traced, diff_shared):
        """Per-block partials of all blocks, computed inside the caller's graph."""
        resident = tuple(None if r is None else jnp.asarray(r) for r in self.resident)
        # The barrier makes the loop's inputs opaque, as they are on the host: XLA may
        # neither fold the data constants into fn's code nor fuse the caller's
        # computation of a parameter (exp(log_sigma), say) into the loop body, either
        # of which would change the rounding.
        resident, traced, shared = lax.optimization_barrier(
            (resident, tuple(traced), tuple(shared)))
        parts = []
        for rows, length, row0 in self._segments(0, self.plan.n_blocks):
            row0, count = lax.optimization_barrier((jnp.int32(row0), jnp.int32(length)))
            run = self.block_loop(rows, length, diff_traced, diff_shared)
            parts.append(run(resident, traced, shared, row0, count))
        return _concat_parts(parts, batch_ndim=0)

    # -- host path ---------------------------------------------------------------

    def device_resident(self):
        """The concrete data leaves as arrays on the host CPU device, made once."""
        if self._device_resident is None:
            with self._lock:
                if self._device_resident is None:
                    cpu = host_device()
                    self._device_resident = tuple(
                        None if r is None else jax.device_put(r, cpu) for r in self.resident)
        return self._device_resident

    def compiled(self, rows: int, length: int, diff_traced, diff_shared, in_axes):
        """The jitted block loop for one chunk shape (and batching), cached."""
        key = (rows, length, diff_traced, diff_shared, in_axes)
        fn = self._compiled.get(key)
        if fn is None:
            run = self.block_loop(rows, length, diff_traced, diff_shared)
            if in_axes is not None:
                traced_axes, shared_axes = in_axes
                run = jax.vmap(run, in_axes=(None, traced_axes, shared_axes, None, None))
            fn = jax.jit(run)
            with self._lock:
                fn = self._compiled.setdefault(key, fn)
        return fn

    def run_chunk(self, chunk: Chunk, traced, shared, diff_traced, diff_shared, in_axes,
                  resident=None, row_offset: int = 0) -> ChunkResult:
        """Evaluate one chunk's blocks (on whichever worker calls this).

        ``resident`` and ``traced`` may hold only the rows from ``row_offset`` on (a
        worker that keeps a slice of the data); the blocks computed are the same.
        """
        t0 = time.perf_counter()
        resident = self.device_resident() if resident is None else resident
        parts = []
        try:
            # The same precision and device on every thread, so every thread hits the
            # same compiled chunk (pure_callback's thread has a default device set).
            with jax.enable_x64(self.x64), jax.default_device(host_device()):
                for rows, length, row0 in self._segments(chunk.first, chunk.count):
                    fn = self.compiled(rows, length, diff_traced, diff_shared, in_axes)
                    parts.append(fn(resident, traced, shared, np.int32(row0 - row_offset),
                                    np.int32(length)))
                values, g_shared, g_data = _concat_parts(parts, batch_ndim=0 if in_axes is None else 1)
                out = jax.device_get((values, g_shared, g_data))
        except Exception as e:
            raise ChunkError.wrap(e, chunk.rows(self.plan), self.label) from e
        return ChunkResult(chunk, out[0], tuple(out[1]), tuple(out[2]), time.perf_counter() - t0)

    def assemble(self, results, batch_shape, diff_traced_shapes, diff_shared_shapes):
        """Put chunk results into whole-call buffers, in block order."""
        p = self.plan
        values = np.empty(batch_shape + (p.n_blocks,), self.value_dtype)
        g_shared = [np.empty(batch_shape + (p.n_blocks,) + s, d) for s, d in diff_shared_shapes]
        g_data = [np.empty(batch_shape + (p.n_rows,) + s, d) for s, d in diff_traced_shapes]
        lead = (slice(None),) * len(batch_shape)
        for res in results:
            blocks = lead + (slice(res.chunk.first, res.chunk.first + res.chunk.count),)
            rows = lead + (slice(*res.chunk.rows(p)),)
            values[blocks] = res.values
            for buf, g in zip(g_shared, res.shared_grads):
                buf[blocks] = g
            for buf, g in zip(g_data, res.data_grads):
                buf[rows] = g
        return values, tuple(g_shared), tuple(g_data)

    def __repr__(self) -> str:
        p = self.plan
        return (f"Site({self.label}, rows={p.n_rows}, block_rows={p.block_rows}, "
                f"blocks={p.n_blocks}, dispatch={self.dispatch})")


@functools.cache
def host_device():
    """The CPU device on which host-path chunks run (looked up once: it is on the hot path)."""
    return jax.devices("cpu")[0]


def _merge(full, subset, mask):
    it = iter(subset)
    return [next(it) if m else x for x, m in zip(full, mask)]


def _concat_parts(parts, batch_ndim: int):
    """Join the (full, tail) segment outputs along the block/row axis."""
    if len(parts) == 1:
        return parts[0]
    axis = batch_ndim
    values = jnp.concatenate([p[0] for p in parts], axis=axis)
    g_shared = tuple(jnp.concatenate(gs, axis=axis) for gs in zip(*[p[1] for p in parts]))
    g_data = tuple(jnp.concatenate(gd, axis=axis) for gd in zip(*[p[2] for p in parts]))
    return values, g_shared, g_data
