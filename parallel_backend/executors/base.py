"""The executor protocol: lifecycle, bookkeeping, and the hooks subclasses override.

This module owns :class:`Executor`, a resource-owning context manager that
evaluates chunk tasks and counts what it did, and :class:`TaskPool`, the threads that
run its tasks in this process. Subclasses (serial and thread here;
dask and device as plugins) override :meth:`Executor.run_tasks` and, where they
need to, :attr:`Executor.workers`, :meth:`Executor.graph_partials`,
:meth:`Executor.bytes_per_call`, :meth:`Executor.bytes_per_result` and
:meth:`Executor.release`. The host path
itself lives in :mod:`parallel_backend.host`, the graph/host decision in
:mod:`parallel_backend.routes`. Imports the core only.
"""

from __future__ import annotations

import numbers
import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypeVar

import numpy as np

from .. import routes as _routes
from ..errors import EvaluationStalled
from ..guards import gather
from ..kernels import Wrt, kernel_for
from ..routes import GraphCounter
from ..site import SiteCache, SiteState
from ..tasks import run_task
from ..timeline import Timeline

if TYPE_CHECKING:
    from jax.typing import ArrayLike

    from ..tasks import ChunkResult, Task

__all__ = ["DISPATCH_MODES", "STALL_TIMEOUT", "Executor", "TaskPool", "check_stall_timeout"]

DISPATCH_MODES = ("auto", "graph", "host")
#: Seconds an evaluation waits with no chunk finishing before it raises
#: :class:`~parallel_backend.errors.EvaluationStalled` (an executor's default
#: ``stall_timeout``): far longer than a chunk of any sampler's gradient takes, compiling
#: included, and short enough that a stuck run says so within minutes.
STALL_TIMEOUT = 300.0

_T = TypeVar("_T")
_R = TypeVar("_R")


def check_stall_timeout(value: float | None, where: str) -> float | None:
    """``value`` as seconds (a positive number) or ``None``, else a ``ValueError`` naming
    ``where``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{where}: stall_timeout must be a positive number of seconds or "
                         f"None (wait forever), got {value!r}")
    return float(value)

_STOP = object()


class TaskPool:
    """The threads that run an executor's chunk tasks in this process: ``threads``
    daemon threads named ``name-<i>``, started at the first ``submit``.

    A ``concurrent.futures``-shaped pool (``submit`` gives a ``Future``) whose threads
    nothing joins without a bound: a chunk program that never returns (XLA waiting for
    work that cannot start) holds one of them for good, and neither ``shutdown`` nor the
    interpreter's exit may wait for it, as they would for a ``ThreadPoolExecutor``'s. An
    executor whose evaluation stalled drops its pool (the stuck threads with it) and
    starts a new one at its next evaluation.

    Examples
    --------
    >>> pool = TaskPool(2, "example")
    >>> pool.submit(pow, 2, 10).result()
    1024
    >>> pool.shutdown()
    """

    def __init__(self, threads: int, name: str) -> None:
        self.threads, self.name = int(threads), name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., _R], *args: Any) -> Future[_R]:
        """``fn(*args)`` on one of the pool's threads."""
        future: Future[_R] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"TaskPool {self.name!r} is shut down")
            if not self._workers:
                for i in range(self.threads):
                    t = threading.Thread(target=self._work, name=f"{self.name}-{i}",
                                         daemon=True)
                    t.start()
                    self._workers.append(t)
            self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                    future.set_exception(e)
            # Nothing of the task stays referenced while the thread waits for the next
            # (its data would outlive the site that holds it).
            del item, future, fn, args

    def shutdown(self, wait: bool = True, cancel_futures: bool = False,
                 timeout: float | None = 10.0) -> None:
        """Stop the threads once they are idle; ``cancel_futures``: cancel what has not
        started. ``wait``: wait for the threads, at most ``timeout`` seconds in all (a
        thread stuck in native code is left behind: a daemon, it holds up nothing)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = list(self._workers)
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    item[0].cancel()
        for _ in workers:
            self._queue.put(_STOP)
        if wait:
            end = None if timeout is None else time.monotonic() + timeout
            for t in workers:
                t.join(None if end is None else max(0.0, end - time.monotonic()))


class Executor:
    """Base class of every executor.

    An executor evaluates each call site's blocks inside the caller's XLA program
    (``"graph"``) or as chunks on its workers through a host callback (``"host"``).
    Either way every block is computed the same way, so the choice never changes a
    result. With ``"auto"`` a rule of the site's shapes picks where nothing was
    measured, and ``pb.sample`` measures both on real segments of the sampler and
    keeps the faster (see ``parallel_backend.routes``). It counts evaluations
    in :meth:`stats`.

    Parameters
    ----------
    dispatch : {"auto", "graph", "host"}
        Where the blocks are evaluated.
    count_calls : bool
        Also count evaluations that run in the graph outside ``pb.sample`` (a
        callback compiled into the program, tens of microseconds per evaluation).
        Host-path evaluations are always counted, and ``pb.sample`` counts the
        graph's from the sampler's leapfrog steps.
    stall_timeout : float or None
        Seconds an evaluation on the executor's workers waits with no chunk finishing
        before it raises :class:`~parallel_backend.errors.EvaluationStalled` (default
        ``STALL_TIMEOUT``, 300); ``None`` waits forever.
    """

    name: ClassVar[str] = "base"
    #: Chunks per worker that the adaptive chunker aims for (fewer, larger ones where task
    #: overhead dominates): two, so that workers of unequal speed (a cluster's) even out.
    chunks_per_worker: ClassVar[int] = 2

    def __init__(self, *, dispatch: str = "auto", count_calls: bool = False,
                 stall_timeout: float | None = STALL_TIMEOUT) -> None:
        if dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch must be one of {list(DISPATCH_MODES)}, got {dispatch!r}")
        self.dispatch = dispatch
        #: The route ``dispatch`` fixes (:class:`~parallel_backend.routes.GraphRoute` or
        #: :class:`~parallel_backend.routes.HostRoute`), or ``None`` for ``"auto"``.
        self.fixed_route: type[_routes.Route] | None = _routes.ROUTES.get(dispatch)
        self.count_calls = bool(count_calls)
        self.stall_timeout = check_stall_timeout(stall_timeout, type(self).__name__)
        self._lock = threading.Lock()
        self._states = SiteCache(on_forget=self._retire)
        self._closed = False
        self._runner: TaskPool | None = None  # the thread pool of run_tasks (task_pool)
        #: The last host evaluations, chunk by chunk (``stats(timeline=True)``).
        self.timeline = Timeline()
        self._created = time.time()
        self._counts: dict[str, float] = {
            "calls": 0, "graph_calls": 0, "host_calls": 0, "chunks": 0, "rows": 0,
            "seconds_in_workers": 0.0, "bytes_sent": 0, "bytes_received": 0}

    # -- hooks subclasses override ----------------------------------------------------

    @property
    def workers(self) -> int:
        """How many chunk tasks can run at once."""
        return 1

    def run_tasks(self, tasks: Sequence[Task]) -> list[ChunkResult]:
        """Run chunk tasks (:class:`~parallel_backend.tasks.Task`, plain values) and return
        their results in task order (or more results, in block order, where an executor
        splits a task at its own data's boundaries).

        The default hands each task to :func:`~parallel_backend.tasks.run_task` on the
        executor's own thread pool (:meth:`task_threads` threads, made at first use, ended
        by :meth:`close`) and waits with :func:`~parallel_backend.guards.gather`: at most
        :attr:`stall_timeout` seconds without a chunk finishing, and with guard
        ``stall_probe`` (run on the waiting thread itself, a chunk that can never start
        would hang the callback instead of raising
        :class:`~parallel_backend.errors.InFlightLimit`). After a stall the pool, with its
        stuck threads, is dropped and the next evaluation starts a new one. An executor
        with workers elsewhere hands each task to one, as ``concurrent.futures`` would.
        """
        if not tasks:
            return []
        pool = self.task_pool()
        futures = [pool.submit(run_task, t) for t in tasks]
        spec = tasks[0].program.spec
        try:
            return gather(futures, [t.resident.device for t in tasks], spec.label,
                          self.stall_timeout,
                          lambda: [spec.rows(t.chunk.first, t.chunk.count) for t in tasks],
                          self.name)
        except EvaluationStalled:
            tasks[0].site.stalled = True
            self.drop_pool(pool)
            raise

    def task_threads(self) -> tuple[int, str]:
        """How many threads the pool of :meth:`run_tasks` has, and their name's prefix:
        one, which runs the tasks in turn."""
        return 1, "parallel_backend-tasks"

    def task_pool(self) -> TaskPool:
        """The threads that run this executor's tasks (made at first use: daemon
        threads, which a stuck chunk program never makes ``close()`` or the
        interpreter's exit wait for)."""
        pool = self._runner
        if pool is None:
            with self._lock:
                self.check_open()
                if self._runner is None:
                    threads, name = self.task_threads()
                    self._runner = TaskPool(threads, name)
                pool = self._runner
        return pool

    def drop_pool(self, pool: TaskPool) -> None:
        """Leave ``pool`` (threads stuck in a stalled evaluation) behind: the next
        evaluation starts a new one."""
        with self._lock:
            if self._runner is pool:
                self._runner = None
        pool.shutdown(wait=False, cancel_futures=True)

    def graph_partials(self, state: SiteState, traced: Sequence[ArrayLike],
                       shared: Sequence[ArrayLike], diff_traced: Sequence[bool],
                       diff_shared: Sequence[bool],
                       set_axes: tuple[Sequence[int | None], Sequence[int | None]] | None = None,
                       ) -> tuple[Any, ...]:
        """Per-block partials computed inside the caller's XLA program (no callback).

        Called while tracing. The default evaluates every block in place, or, on an
        accelerator (:func:`parallel_backend.routes.accelerator`), plain NumPyro's
        program; an executor that maps blocks over devices overrides it. ``set_axes``: a
        batch of parameter sets (see :func:`parallel_backend.batching.over_blocks`).
        """
        wrt = Wrt(tuple(diff_traced), tuple(diff_shared))
        kernel = kernel_for(1, wrt)
        if _routes.accelerator():
            return state.program.plain_partials(state.resident(), traced, shared, wrt, kernel,
                                                set_axes)
        return state.program.graph_partials(state.prepared(), traced, shared, wrt, kernel,
                                            set_axes)

    def map(self, func: Callable[[_T], _R], items: Iterable[_T]) -> list[_R]:
        """``[func(item) for item in items]`` on this executor's workers, in order.

        For one-off work beside sampling (pointwise log-likelihoods, profiling).
        ``func`` must be picklable (cloudpickle) for executors in other processes.
        """
        self.check_open()
        return [func(item) for item in items]

    def bytes_per_call(self, traced: Sequence[ArrayLike], shared: Sequence[ArrayLike],
                       n_tasks: int) -> int:
        """Bytes one evaluation hands the executor: what crosses the host callback into
        it, the parameters once (tasks on this process's threads read the same arrays).
        An executor that sends messages counts what it sent instead, with :meth:`count`,
        and returns 0."""
        return sum(np.asarray(x).nbytes for x in (*traced, *shared))

    def bytes_per_result(self, values: ArrayLike, shared_grads: Sequence[ArrayLike],
                         data_grads: Sequence[ArrayLike]) -> int:
        """Bytes one evaluation hands back: the per-block partials (and per-row gradients
        of traced data leaves) that cross the host callback out of it. An executor that
        receives messages counts what it received instead, with :meth:`count`, and
        returns 0."""
        return sum(np.asarray(x).nbytes for x in (values, *shared_grads, *data_grads))

    def release(self) -> None:
        """Release threads, processes and connections (called once, by :meth:`close`)."""

    # -- call sites --------------------------------------------------------------------

    def site_state(self, key: Hashable, make: Callable[[], SiteState]) -> SiteState:
        """The :class:`SiteState` for ``key`` (what the site is: see
        :func:`parallel_backend.identity.site_key`), made by ``make()`` on first use."""
        self.check_open()
        return self._states.get(key, make)

    def sites(self) -> list[SiteState]:
        """The call sites this executor holds, as :class:`SiteState` records."""
        return self._states.values()

    def decide(self, state: SiteState) -> type[_routes.Route]:
        """Where ``state``'s site runs where nothing was measured: the route class
        (:class:`~parallel_backend.routes.GraphRoute` or
        :class:`~parallel_backend.routes.HostRoute`) that
        :func:`parallel_backend.routes.default_route` gives. Subclasses may override it;
        it must not time or compile anything (it runs while tracing)."""
        return _routes.default_route(self, state)

    def has_host_path(self, state: SiteState) -> bool:
        """Whether ``state``'s site can be evaluated through the host callback at all,
        paying or not (it always can but where a subclass says no)."""
        return True

    def can_use_host(self, state: SiteState) -> bool:
        """Whether the host path can pay at all for ``state``'s site: several workers and
        several tiles, where :meth:`has_host_path`."""
        return self.has_host_path(state) and self.workers >= 2 and state.spec.tiles.n_tiles >= 2

    def route(self, state: SiteState) -> type[_routes.Route]:
        """Where ``state``'s site runs by default: decided (by :meth:`decide`) the first
        time, then kept. Called by ``reduce_sum`` while tracing."""
        decision = state.decision
        if decision is None:
            decision = self.decide(state)
            state.settle(decision)
        return decision

    # -- bookkeeping ---------------------------------------------------------------------

    def count(self, **inc: float) -> None:
        """Add to the counters :meth:`stats` reports (``calls=1, chunks=4, ...``)."""
        with self._lock:
            for k, v in inc.items():
                self._counts[k] = self._counts.get(k, 0) + v

    def graph_counter(self, state: SiteState) -> GraphCounter:
        """The counter compiled into ``state``'s graph evaluations (made on first use)."""
        with self._lock:
            if state.counter is None:
                state.counter = GraphCounter()
            return state.counter

    def count_sampled(self, state: SiteState, calls: int, batches: int) -> None:
        """Add ``calls`` graph evaluations of ``state`` (``batches`` parameter sets in all)
        that ``pb.sample`` counted from the sampler's figures."""
        with self._lock:
            state.sampled[0] += int(calls)
            state.sampled[1] += int(batches)

    def graph_counts(self, state: SiteState, calls: int, batches: int) -> dict[str, int]:
        """What ``calls`` graph evaluations of ``state`` (``batches`` parameter sets in all)
        add to :meth:`stats`; an executor that splits the graph over devices overrides it."""
        return {"graph_calls": calls, "calls": calls, "chunks": calls,
                "rows": state.spec.plan.n_rows * batches}

    def _graph_calls(self, state: SiteState) -> tuple[int, int]:
        with self._lock:
            counter = state.counter
            calls, batches = state.sampled
        if counter is not None:
            c, b = counter.counts()
            calls, batches = calls + c, batches + b
        return calls, batches

    def _retire(self, state: SiteState) -> None:
        """A forgotten state's graph counts stay in the totals. Subclasses that keep
        something per site (worker-resident data, device buffers) drop it here too."""
        calls, batches = self._graph_calls(state)
        with self._lock:
            state.counter, state.sampled = None, [0, 0]
        if calls:
            self.count(**self.graph_counts(state, calls, batches))

    def _graph_totals(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for state in self.sites():
            calls, batches = self._graph_calls(state)
            if calls:
                for k, v in self.graph_counts(state, calls, batches).items():
                    out[k] = out.get(k, 0) + v
        return out

    def stats(self, timeline: bool = False) -> dict[str, Any]:
        """What this executor did since it was made.

        Parameters
        ----------
        timeline : bool
            Also ``timeline``: the last host evaluations (at most
            ``timeline.KEEP``), each a dict with the site, its
            start (seconds since the epoch), ``seconds``, ``workers`` (the executor's
            now) and its
            ``chunks`` (``worker``, ``first_block``, ``blocks``, ``start`` and ``end``
            in seconds from the evaluation's start).

        Returns
        -------
        dict
            ``calls`` (evaluations, each value or value-and-gradient of one
            ``reduce_sum``; a ``vmap`` batch is one call), ``graph_calls`` and
            ``host_calls`` (where they ran), ``chunks`` (tasks run), ``rows``
            (rows evaluated, times the batch size), ``seconds_in_workers``,
            ``bytes_sent`` and ``bytes_received`` (what crossed the host callback, or
            the wire, into the executor and back: parameters out, partials back; data
            sent to workers included), ``workers``,
            ``counting`` (``"all"`` when made with ``count_calls=True``; else
            ``"host, and the graph inside pb.sample"``: evaluations that ran inside
            the caller's program outside ``pb.sample`` are then not in ``calls``), and
            per call site its block, tile and chunk sizes, where it ran and what
            ``pb.sample`` measured.
        """
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
        for k, v in self._graph_totals().items():
            out[k] = out.get(k, 0) + v
        out["executor"] = self.name
        out["workers"] = self.workers
        out["counting"] = "all" if self.count_calls else "host, and the graph inside pb.sample"
        out["sites"] = [site_stats(s) for s in self.sites()]
        out["chunk_rows"] = sorted({r for s in out["sites"] for r in s["chunk_rows"]})
        if timeline:
            out["timeline"] = [span.as_dict() for span in self.timeline.last()]
            for entry in out["timeline"]:
                entry["workers"] = out["workers"]
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
            with self._lock:
                runner, self._runner = self._runner, None
            if runner is not None:  # waits a little for idle threads, never for stuck ones
                runner.shutdown(wait=True, cancel_futures=True)
            self._states.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"calls={self.stats()['calls']}"
        return f"{type(self).__name__}(workers={self.workers}, dispatch={self.dispatch!r}, {state})"


def site_stats(state: SiteState) -> dict[str, Any]:
    """One call site's entry in :meth:`Executor.stats`."""
    spec = state.spec
    p = spec.plan
    route = state.measured.route if state.measured is not None else state.decision
    host = route is _routes.HostRoute
    if host:
        rows = [min(state.chunker.blocks_per_chunk * p.block_rows, p.n_rows)]
    else:
        rows = [p.n_rows]
    out = {"label": spec.label, "rows": p.n_rows, "block_rows": p.block_rows,
           "blocks": p.n_blocks, "tile_blocks": spec.tiles.tile_blocks,
           "tiles": spec.tiles.n_tiles, "form": spec.form, "sets": spec.sets,
           "dispatch": _name(route), "default": _name(state.decision), "chunk_rows": rows,
           "settled": state.chunker.settled if host else None}
    if state.measured is not None:
        out["measured"] = {"route": state.measured.route.name,
                           "host_over_graph": state.measured.ratio,
                           "reason": state.measured.reason}
    return out


def _name(route) -> str | None:
    """A route's name as ``stats()`` shows it (``None``: not decided yet)."""
    return None if route is None else route.name
