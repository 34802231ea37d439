"""The worker side of :class:`DaskExecutor`: state kept in each dask worker process.

This module owns :class:`WorkerState`, a ``distributed.WorkerPlugin`` that holds,
per worker, the call sites (``fn`` and its block plan, sent once, cloudpickled),
the pieces of data that live there (sent once, keyed by content), the compiled
chunk functions (compiled there once per chunk shape) and a thread pool that
runs them. The client reaches it with :func:`evaluate` and :func:`install`,
called straight on the worker (dask's ``run`` handler), not through the
scheduler: a scheduler round trip costs about 10 ms, a direct call about 1 ms.

Imports the core's names, jax (lazily, after the XLA flags are set), numpy,
cloudpickle and distributed.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import cloudpickle
import numpy as np
from distributed import WorkerPlugin

from parallel_backend.errors import ChunkError

__all__ = ["WorkerState", "evaluate", "install", "XLA_FLAGS"]

#: XLA's own threading off on workers: the worker's threads are the parallelism, and
#: several worker processes on one host must not each start a pool per core.
XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
#: Chunk views (device arrays of a chunk's rows) kept per worker, most recent first.
MAX_VIEWS = 32


class WorkerState(WorkerPlugin):
    """Per-worker sites, data pieces and compiled chunks of one executor.

    Parameters
    ----------
    name : str
        The plugin name, unique per executor, so executors sharing a cluster
        never see each other's state.
    limit_xla_threads : bool
        Set :data:`XLA_FLAGS` in the worker before JAX is first imported there.
    """

    def __init__(self, name: str, limit_xla_threads: bool = True):
        self.name = name
        self.limit_xla_threads = limit_xla_threads

    def __getstate__(self):
        return {"name": self.name, "limit_xla_threads": self.limit_xla_threads}

    def __setstate__(self, state):
        self.__dict__.update(state)

    def setup(self, worker) -> None:
        flags = os.environ.get("XLA_FLAGS", "")
        if self.limit_xla_threads and XLA_FLAGS not in flags:
            # XLA reads the flags when its CPU client starts (the first computation), so
            # this takes effect in a fresh worker; one that already ran JAX keeps its own.
            os.environ["XLA_FLAGS"] = f"{flags} {XLA_FLAGS}".strip()
        threads = getattr(worker.state, "nthreads", None) or getattr(worker, "nthreads", 1)
        self.address = worker.address
        self.pool = ThreadPoolExecutor(max(1, int(threads)),
                                       thread_name_prefix="parallel_backend_dask")
        self.sites: dict = {}  # site token -> Site
        self.pieces: dict = {}  # (data token, slot) -> (first row, leaves: array or None)
        self.views: OrderedDict = OrderedDict()  # (data token, first, count) -> device arrays
        self.lock = threading.Lock()

    def teardown(self, worker) -> None:
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        self.sites, self.pieces, self.views = {}, {}, OrderedDict()

    # -- state ---------------------------------------------------------------------

    def missing(self, token, data_token, slots) -> tuple[bool, list]:
        """Whether the site is missing, and which data pieces are."""
        return token not in self.sites, sorted({s for s in slots
                                               if (data_token, s) not in self.pieces})

    def add(self, token, spec, data_token, pieces) -> None:
        if spec is not None and token not in self.sites:
            self.sites[token] = _site_from_spec(cloudpickle.loads(spec))
        for slot, first_row, leaves in pieces:
            self.pieces[(data_token, slot)] = (first_row, leaves)

    def _view(self, site, data_token, slot, chunk):
        """The resident rows of ``chunk`` as device arrays, made once per chunk shape."""
        import jax

        from parallel_backend.site import host_device

        key = (data_token, chunk.first, chunk.count)
        with self.lock:
            view = self.views.get(key)
            if view is not None:
                self.views.move_to_end(key)
                return view
        first_row, leaves = self.pieces[(data_token, slot)]
        r0, r1 = chunk.rows(site.plan)
        # Under the site's precision: without x64, device_put would make float64 data float32.
        with jax.enable_x64(site.x64):
            view = tuple(None if x is None else jax.device_put(x[r0 - first_row:r1 - first_row],
                                                               host_device())
                         for x in leaves)
        with self.lock:
            self.views[key] = view
            while len(self.views) > MAX_VIEWS:
                self.views.popitem(last=False)
        return view

    def run_task(self, token, data_token, task, shared, diff_traced, diff_shared, in_axes):
        slot, chunk, traced = task
        site = self.sites[token]
        view = self._view(site, data_token, slot, chunk)
        return site.run_chunk(chunk, traced, shared, diff_traced, diff_shared, in_axes,
                              resident=view, row_offset=chunk.rows(site.plan)[0])


def _site_from_spec(spec):
    from parallel_backend.site import Site

    fn, data_treedef, shared_treedef, resident_mask, plan, value_dtype, x64, label = spec
    # Resident leaves come per chunk (see WorkerState._view); the mask only tells
    # the site which data leaves are traced.
    resident = tuple(True if r else None for r in resident_mask)
    return Site(fn, data_treedef, shared_treedef, resident, plan, value_dtype, x64, label=label)


def _state(dask_worker, name):
    plugins = getattr(dask_worker, "plugins", {})
    return plugins.get(name)


async def evaluate(name, token, data_token, tasks, shared, diff_traced, diff_shared, in_axes,
                   dask_worker=None):
    """Run ``tasks`` (slot, chunk, traced rows) on this worker's pool.

    Returns ``("ok", [ChunkResult])``, ``("missing", site?, [slots])`` when the
    site or data must be sent first, or ``("error", ChunkError)``.
    """
    state = _state(dask_worker, name)
    if state is None:
        return ("gone", f"the worker {dask_worker.address} has no parallel_backend state {name}")
    need_site, need_slots = state.missing(token, data_token, [t[0] for t in tasks])
    if need_site or need_slots:
        return ("missing", need_site, need_slots)
    loop = asyncio.get_running_loop()
    futures = [loop.run_in_executor(state.pool, state.run_task, token, data_token, task, shared,
                                    diff_traced, diff_shared, in_axes) for task in tasks]
    results = await asyncio.gather(*futures, return_exceptions=True)
    for task, r in zip(tasks, results):
        if isinstance(r, BaseException):
            site = state.sites[token]
            return ("error", ChunkError.wrap(r, task[1].rows(site.plan), site.label, "dask"))
    return ("ok", results)


def install(name, token, spec, data_token, pieces, dask_worker=None):
    """Keep a site (``spec``, cloudpickled, or ``None``) and data pieces on this worker."""
    state = _state(dask_worker, name)
    if state is None:
        return ("gone", f"the worker {dask_worker.address} has no parallel_backend state {name}")
    state.add(token, spec, data_token,
              [(slot, first, tuple(None if x is None else np.asarray(x) for x in leaves))
               for slot, first, leaves in pieces])
    return ("ok", None)
