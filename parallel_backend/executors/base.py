"""The executor protocol: lifecycle, bookkeeping, and the hooks subclasses override.

This module owns :class:`Executor`, a resource-owning context manager that
evaluates chunk tasks and counts what it did. Subclasses (serial and thread here;
dask and device as plugins) override :meth:`Executor.map_chunks` and, where they
need to, :attr:`Executor.workers`, :meth:`Executor.graph_partials`,
:meth:`Executor.bytes_per_call` and :meth:`Executor.release`. The host path
itself lives in :mod:`parallel_backend.host`, the graph/host decision in
:mod:`parallel_backend.dispatch`. Imports the core only.
"""

from __future__ import annotations

import threading
import time
from typing import ClassVar

import numpy as np

from .. import dispatch as _dispatch
from ..counting import GraphCounter
from ..site import SiteCache, SiteState

__all__ = ["Executor", "DISPATCH_MODES"]

DISPATCH_MODES = ("auto", "graph", "host")


class Executor:
    """Base class of every executor.

    An executor decides, once per call site, whether the blocks are evaluated
    inside the caller's XLA program (``"graph"``) or as chunks on its workers
    through a host callback (``"host"``); with ``"auto"`` it measures. Either way
    every block is computed the same way, so the choice never changes a result.
    It counts every evaluation in :meth:`stats`.

    Parameters
    ----------
    dispatch : {"auto", "graph", "host"}
        Where the blocks are evaluated. ``"auto"`` keeps small or already fast work
        in the graph and uses the workers only where they measured clearly faster.
    count_calls : bool
        Count evaluations that run in the graph for :meth:`stats` (a counter compiled
        into the program, about 10-15 us per evaluation on CPU). Host-path
        evaluations are always counted.
    """

    name: ClassVar[str] = "base"

    def __init__(self, *, dispatch: str = "auto", count_calls: bool = True):
        if dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch must be one of {list(DISPATCH_MODES)}, got {dispatch!r}")
        self.dispatch = dispatch
        self.count_calls = bool(count_calls)
        self._lock = threading.Lock()
        self._states = SiteCache(on_forget=self._retire)
        self._counters: dict = {}  # id(state) -> GraphCounter
        self._closed = False
        self._created = time.time()
        self._counts = dict(calls=0, graph_calls=0, host_calls=0, chunks=0, rows=0,
                            seconds_in_workers=0.0, bytes_sent=0)

    # -- hooks subclasses override ----------------------------------------------------

    @property
    def workers(self) -> int:
        """How many chunk tasks can run at once."""
        return 1

    def map_chunks(self, state: SiteState, chunks, evaluation) -> list:
        """Evaluate ``chunks`` of ``state``'s call site; results in chunk order.

        ``evaluation`` is a :class:`parallel_backend.host.Evaluation`; each chunk is a
        run of whole tiles. The default runs them one after another on this thread.
        """
        return [state.run_chunk(c, evaluation) for c in chunks]

    def graph_partials(self, state: SiteState, traced, shared, diff_traced, diff_shared):
        """Per-block partials computed inside the caller's XLA program (no callback).

        Called while tracing. The default evaluates every block in place; an
        executor that maps blocks over devices overrides it.
        """
        return state.program.graph_partials(state.prepared(), traced, shared, diff_traced,
                                            diff_shared)

    def map(self, func, items) -> list:
        """``[func(item) for item in items]`` on this executor's workers, in order.

        For one-off work beside sampling (pointwise log-likelihoods, profiling).
        ``func`` must be picklable (cloudpickle) for executors in other processes.
        """
        self.check_open()
        return [func(item) for item in items]

    def bytes_per_call(self, traced, shared, n_tasks: int) -> int:
        """Parameter bytes handed to tasks in one evaluation (an executor that sends
        messages counts what it sent instead, with :meth:`count`)."""
        return sum(np.asarray(x).nbytes for x in (*traced, *shared)) * n_tasks

    def release(self) -> None:
        """Release threads, processes and connections (called once, by :meth:`close`)."""

    # -- call sites --------------------------------------------------------------------

    def site_state(self, key, make, leaves=()) -> SiteState:
        """The :class:`SiteState` for ``key``, made by ``make()`` on first use; forgotten
        when any of ``leaves`` (the resident data) is garbage collected."""
        self.check_open()
        return self._states.get(key, make, leaves)

    def sites(self) -> list:
        """The call sites this executor holds, as :class:`SiteState` records."""
        return self._states.values()

    def decide(self, state: SiteState, grainsize, data_leaves, shared_leaves):
        """Where ``state``'s site should run, ``("graph" or "host", timing)``; see
        :mod:`parallel_backend.dispatch`. Subclasses may override it."""
        return _dispatch.decide(self, state, grainsize, data_leaves, shared_leaves)

    def route(self, state: SiteState, grainsize, data_leaves, shared_leaves) -> str:
        """Where ``state``'s site runs: decided (by :meth:`decide`) the first time, then
        kept. Called by ``reduce_sum`` while tracing."""
        with state.deciding():
            if state.decision is None:
                state.settle(*self.decide(state, grainsize, data_leaves, shared_leaves))
        return state.decision

    # -- bookkeeping ---------------------------------------------------------------------

    def count(self, **inc) -> None:
        """Add to the counters :meth:`stats` reports (``calls=1, chunks=4, ...``)."""
        with self._lock:
            for k, v in inc.items():
                self._counts[k] = self._counts.get(k, 0) + v

    def graph_counter(self, state: SiteState) -> GraphCounter:
        """The counter compiled into ``state``'s graph evaluations (made on first use)."""
        with self._lock:
            counter = self._counters.get(id(state))
            if counter is None:
                counter = self._counters[id(state)] = GraphCounter()
            return counter

    def graph_counts(self, state: SiteState, calls: int, batches: int) -> dict:
        """What ``calls`` graph evaluations of ``state`` (``batches`` parameter sets in all)
        add to :meth:`stats`; an executor that splits the graph over devices overrides it."""
        return dict(graph_calls=calls, calls=calls, chunks=calls,
                    rows=state.spec.plan.n_rows * batches)

    def _retire(self, state: SiteState) -> None:
        """A forgotten state's graph counts stay in the totals."""
        with self._lock:
            counter = self._counters.pop(id(state), None)
        if counter is not None:
            self.count(**self.graph_counts(state, *counter.retire()))

    def _graph_totals(self) -> dict:
        out: dict = {}
        for state in self.sites():
            with self._lock:
                counter = self._counters.get(id(state))
            if counter is not None:
                for k, v in self.graph_counts(state, *counter.counts()).items():
                    out[k] = out.get(k, 0) + v
        return out

    def stats(self) -> dict:
        """What this executor did since it was made.

        Returns
        -------
        dict
            ``calls`` (evaluations, each value or value-and-gradient of one
            ``reduce_sum``; a ``vmap`` batch is one call), ``graph_calls`` and
            ``host_calls`` (where they ran), ``chunks`` (tasks run), ``rows``
            (rows evaluated, times the batch size), ``seconds_in_workers``,
            ``bytes_sent`` (parameter bytes handed to tasks), ``workers``,
            ``counting`` (``"all"``, or ``"host only"`` when made with
            ``count_calls=False``: evaluations inside the graph are then not in
            ``calls``), and per call site its block, tile and chunk sizes.
        """
        with self._lock:
            out = dict(self._counts)
        for k, v in self._graph_totals().items():
            out[k] = out.get(k, 0) + v
        out["executor"] = self.name
        out["workers"] = self.workers
        out["counting"] = "all" if self.count_calls else "host only"
        out["sites"] = [site_stats(s) for s in self.sites()]
        out["chunk_rows"] = sorted({r for s in out["sites"] for r in s["chunk_rows"]})
        return out

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        """Raise if the executor was closed."""
        if self._closed:
            raise RuntimeError(f"{self!r} is closed; make a new executor")

    def close(self) -> None:
        """Release every thread, process and connection; idempotent."""
        if not self._closed:
            self._closed = True
            self.release()
            self._states.clear()
            with self._lock:
                counters, self._counters = self._counters, {}
            for counter in counters.values():
                counter.retire()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"calls={self.stats()['calls']}"
        return f"{type(self).__name__}(workers={self.workers}, dispatch={self.dispatch!r}, {state})"


def site_stats(state: SiteState) -> dict:
    """One call site's entry in :meth:`Executor.stats`."""
    spec = state.spec
    p = spec.plan
    host = state.decision == "host"
    if host:
        rows = [min(state.chunker.blocks_per_chunk * p.block_rows, p.n_rows)]
    else:
        rows = [p.n_rows]
    out = dict(label=spec.label, rows=p.n_rows, block_rows=p.block_rows, blocks=p.n_blocks,
               tile_blocks=spec.tiles.tile_blocks, tiles=spec.tiles.n_tiles, form=spec.form,
               dispatch=state.decision, chunk_rows=rows,
               settled=state.chunker.settled if host else None)
    if state.timing:
        out["timing"] = {k: float(np.median(v)) for k, v in state.timing.items() if v}
    return out
