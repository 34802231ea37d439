"""The executor protocol, its bookkeeping, and the host-path evaluation they share.

This module owns :class:`Executor`: a resource-owning context manager that runs
chunk tasks and counts what it did. Subclasses (serial, thread here; dask and
device as plugins) override :meth:`Executor.map_chunks` and, where they run no
host tasks, declare ``dispatch = "graph"``. It imports jax, numpy and the core.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import numpy as np

from ..chunking import AdaptiveChunker, fixed_chunks
from ..errors import ChunkError
from ..site import ChunkResult, Site

__all__ = ["Executor", "DISPATCH_MODES"]

DISPATCH_MODES = ("auto", "graph", "host")
#: Below this graph time per evaluation, a callback and task dispatch cannot pay.
GRAPH_ALWAYS_SECONDS = 1.5e-3
#: Measured cost of one host callback, added to the host path's time.
CALLBACK_SECONDS = 1e-4
#: The host path must beat the graph by this factor to be chosen.
HOST_MARGIN = 0.85


class Executor:
    """Base class of every executor.

    An executor decides, once per call site, whether the block loop stays inside
    the caller's XLA program (``"graph"``) or is cut into chunks that its workers
    evaluate through a host callback (``"host"``), and with ``"auto"`` it measures
    both. It counts every evaluation in :meth:`stats`.

    Parameters
    ----------
    dispatch : {"auto", "graph", "host"}
        Where the block loop runs. ``"auto"`` keeps small or already fast work in
        the graph and uses host workers only where they measured faster.
    count_calls : bool
        Count evaluations that stay in the graph (a tiny host callback per
        evaluation, about 0.1 ms). Host-path evaluations are always counted.
    """

    name: ClassVar[str] = "base"

    def __init__(self, *, dispatch: str = "auto", count_calls: bool = True):
        if dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch must be one of {list(DISPATCH_MODES)}, got {dispatch!r}")
        self.dispatch = dispatch
        self.count_calls = bool(count_calls)
        self._lock = threading.Lock()
        self._sites: dict = {}
        self._closed = False
        self._created = time.time()
        self._counts = dict(calls=0, graph_calls=0, host_calls=0, chunks=0, rows=0,
                            seconds_in_workers=0.0, bytes_sent=0)

    # -- what subclasses provide ---------------------------------------------------

    @property
    def workers(self) -> int:
        """How many chunk tasks can run at once."""
        return 1

    def map_chunks(self, site: Site, chunks, args) -> list[ChunkResult]:
        """Evaluate ``chunks`` of ``site``; results in chunk order. Serial by default."""
        return [site.run_chunk(c, *args) for c in chunks]

    def graph_partials(self, site: Site, traced, shared, diff_traced, diff_shared):
        """Per-block partials computed inside the caller's XLA program (no callback).

        Called while tracing. The default runs the whole block loop in place; an
        executor that maps blocks over devices overrides it and must return the
        same partials, bitwise.
        """
        return site.graph_partials(traced, shared, diff_traced, diff_shared)

    def map(self, func, items) -> list:
        """``[func(item) for item in items]`` on this executor's workers, in order.

        For one-off work beside sampling (pointwise log-likelihoods, profiling).
        ``func`` must be picklable (cloudpickle) for executors in other processes.
        """
        self._check_open()
        return [func(item) for item in items]

    def _bytes_per_call(self, traced, shared, n_tasks: int) -> int:
        """Parameter bytes handed to tasks in one call (an executor that sends
        messages counts what it sent instead)."""
        return sum(np.asarray(x).nbytes for x in (*traced, *shared)) * n_tasks

    def _shutdown(self) -> None:
        """Release threads, processes and connections."""

    # -- sites ---------------------------------------------------------------------

    def site(self, key, make):
        """The cached :class:`Site` for ``key``, made by ``make()`` on first use."""
        self._check_open()
        with self._lock:
            site = self._sites.get(key)
            if site is None:
                site = make()
                site.chunker = AdaptiveChunker(site.plan, self.workers)
                self._sites[key] = site
        return site

    # -- choosing graph or host, once per site --------------------------------------

    def choose_dispatch(self, site: Site, grainsize, data_leaves, shared_leaves) -> str:
        """``"graph"`` or ``"host"`` for ``site``; with ``"auto"``, measured.

        Small work stays in the graph. Otherwise both paths are timed on the data
        and on the parameter values at hand (ones where they are traced), and host
        workers are used only when they were clearly faster.
        """
        if self.dispatch != "auto":
            return self.dispatch
        if self.workers < 2 or site.plan.n_blocks < 2:
            return "graph"
        # Measure on a thread of its own: this runs while the caller's jit is tracing,
        # and on this thread every jax operation would be staged into that trace.
        with ThreadPoolExecutor(1, thread_name_prefix="parallel_backend_calibrate") as pool:
            timing = pool.submit(calibrate, self, site, grainsize, data_leaves,
                                 shared_leaves).result()
        site.timing = timing
        if timing["graph"] < GRAPH_ALWAYS_SECONDS:
            return "graph"
        return "host" if timing["host"] + CALLBACK_SECONDS < HOST_MARGIN * timing["graph"] else "graph"

    # -- the host path -------------------------------------------------------------

    def evaluate(self, site: Site, grainsize, traced, shared, diff_traced, diff_shared,
                 orig_ndims, count: bool = True):
        """Run one evaluation on the workers and return per-block partials.

        Called from the host callback with host arrays (jax 0.10 hands the callback
        ``jax.Array`` values, not numpy: an executor that pickles them converts them
        first). Batched arguments (under ``vmap``) carry leading batch axes; all batch
        members go in each task.
        """
        self._check_open()
        t0 = time.perf_counter()
        traced, shared, in_axes, batch_shape = _unbatch(traced, shared, orig_ndims)
        chunks = (site.chunker.chunks() if grainsize is None
                  else fixed_chunks(site.plan, grainsize))
        args = (traced, shared, diff_traced, diff_shared, in_axes)
        try:
            results = self.map_chunks(site, chunks, args)
        except ChunkError as e:
            raise ChunkError.wrap(e, e.rows, site.label, self.name) from e.__cause__
        wall = time.perf_counter() - t0
        busy = sum(r.seconds for r in results)
        if grainsize is None and results:
            overhead = max(wall * min(self.workers, len(results)) - busy, 0.0) / len(results)
            for r in results:
                site.chunker.record(r.chunk.count, r.seconds, overhead)
        k = math.prod(batch_shape) if batch_shape else 1
        if count:
            self._count(host_calls=1, calls=1, chunks=len(results), rows=site.plan.n_rows * k,
                        seconds_in_workers=busy,
                        bytes_sent=self._bytes_per_call(traced, shared, len(results)))
        axes_t, axes_s = in_axes if in_axes is not None else ((None,) * len(traced),
                                                               (None,) * len(shared))
        shapes_t = [(_unbatched_shape(t, a)[1:], np.asarray(t).dtype)
                    for t, a, d in zip(traced, axes_t, diff_traced) if d]
        shapes_s = [(_unbatched_shape(s, a), np.asarray(s).dtype)
                    for s, a, d in zip(shared, axes_s, diff_shared) if d]
        flat_batch = (k,) if in_axes is not None else ()
        out = site.assemble(results, flat_batch, shapes_t, shapes_s)
        return _restore_batch(out, flat_batch, batch_shape)

    def count_graph_call(self, site: Site, batch: int = 1) -> None:
        """Record one evaluation that ran inside the graph (``batch`` parameter sets)."""
        self._count(graph_calls=1, calls=1, chunks=1, rows=site.plan.n_rows * batch)

    # -- bookkeeping ---------------------------------------------------------------

    def _count(self, **inc) -> None:
        with self._lock:
            for k, v in inc.items():
                self._counts[k] += v

    def stats(self) -> dict:
        """What this executor did since it was made.

        Returns
        -------
        dict
            ``calls`` (evaluations, each value or value-and-gradient of one
            ``reduce_sum``; a ``vmap`` batch is one call), ``graph_calls`` and
            ``host_calls`` (where they ran), ``chunks`` (tasks run), ``rows``
            (rows evaluated, times the batch size), ``seconds_in_workers``,
            ``bytes_sent`` (parameter bytes handed to tasks), ``workers``, and per
            call site its block and chunk sizes.
        """
        with self._lock:
            out = dict(self._counts)
            sites = list(self._sites.values())
        out["executor"] = self.name
        out["workers"] = self.workers
        out["sites"] = [_site_stats(s) for s in sites]
        out["chunk_rows"] = sorted({r for s in out["sites"] for r in s["chunk_rows"]})
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed; make a new executor")

    def close(self) -> None:
        """Release every thread, process and connection; idempotent."""
        if not self._closed:
            self._closed = True
            self._shutdown()
            with self._lock:
                self._sites.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"calls={self._counts['calls']}"
        return f"{type(self).__name__}(workers={self.workers}, dispatch={self.dispatch!r}, {state})"


def calibrate(executor, site: Site, grainsize, data_leaves, shared_leaves, repeats: int = 5) -> dict:
    """Median seconds of one value-and-gradient evaluation on each path."""
    import jax

    from ..site import combine

    def probe(x):
        if isinstance(x, jax.core.Tracer):
            return np.ones(x.shape, x.dtype)
        return np.asarray(x)

    traced = tuple(probe(x) for x in data_leaves if isinstance(x, jax.core.Tracer))
    shared = tuple(probe(x) for x in shared_leaves)
    dt = tuple(np.issubdtype(x.dtype, np.inexact) for x in traced)
    ds = tuple(np.issubdtype(x.dtype, np.inexact) for x in shared)

    graph = jax.jit(lambda t, s: combine(*site.graph_partials(t, s, dt, ds)))
    host_args = (traced, shared, dt, ds, tuple(np.ndim(x) for x in (*traced, *shared)))

    def run_graph():
        jax.block_until_ready(graph(traced, shared))

    def run_host():
        executor.evaluate(site, grainsize, *host_args, count=False)

    # Host warm-up lasts until the chunker has settled, so no timed call compiles.
    host_warmup = 2 + (0 if grainsize is not None else site.chunker.settle_after)
    return {"graph": _median_time(run_graph, repeats, 2),
            "host": _median_time(run_host, repeats, host_warmup)}


def _median_time(fn, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def row_slice(traced, in_axes, start: int, stop: int) -> tuple:
    """Rows ``[start, stop)`` of the traced data leaves a host callback received.

    Under ``vmap`` (``in_axes`` from :func:`_unbatch`) a batched leaf carries the
    batch first and its rows on axis 1; an unbatched one has its rows on axis 0.
    """
    axes = in_axes[0] if in_axes is not None else (None,) * len(traced)
    return tuple(np.asarray(t)[(slice(None),) * (1 if a == 0 else 0) + (slice(start, stop),)]
                 for t, a in zip(traced, axes))


def _unbatched_shape(x, axis) -> tuple:
    shape = tuple(np.shape(x))
    return shape[1:] if axis == 0 else shape


def _site_stats(site: Site) -> dict:
    p = site.plan
    if site.dispatch == "host" and site.chunker is not None:
        rows = [min(site.chunker.blocks_per_chunk * p.block_rows, p.n_rows)]
    else:
        rows = [p.n_rows]
    return dict(label=site.label, rows=p.n_rows, block_rows=p.block_rows, blocks=p.n_blocks,
                dispatch=site.dispatch, chunk_rows=rows,
                settled=site.chunker.settled if site.dispatch == "host" and site.chunker else None)


def _unbatch(traced, shared, orig_ndims):
    """Flatten the leading vmap axes of callback arguments to one batch axis.

    With ``vmap_method="expand_dims"`` every argument carries one leading axis per
    vmap level, of size 1 where that argument is not batched. Unbatched arguments
    are squeezed (and get ``in_axes=None``) so the host compiles exactly what the
    graph path would under the same ``vmap``.
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
