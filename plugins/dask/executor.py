"""``DaskExecutor``: chunks evaluated by the workers of a dask.distributed cluster.

This module owns the client side of one evaluation: group the chunks by the
worker that holds their shard of the data (:mod:`.placement`), send each worker
one message with the traced values of its chunks and the shared parameters
(:mod:`.protocol`), straight to it or relayed by the scheduler (:mod:`.transport`),
install data a worker lacks, re-assign the chunks of a worker that died to those
that remain and place the data again over workers that joined (:mod:`.cluster`),
and tell the placement what each worker's message and compute took, so that it can
give faster workers more of the data. Since every block is computed by the same
code on the same prepared data, a re-assigned or re-placed chunk gives the same
bits. With no worker left, an evaluation fails after ``timeout``; with the
scheduler gone, at once (or once the client's reconnection times out), with a
``ConnectionError`` that names the scheduler and says what to do. What the cluster
did (routes chosen, data sent, workers lost and joined, data moved) goes to the
``parallel_backend.dask`` logger.

A site's spec and data stay on the workers while the executor caches the site. When
it leaves the cache, the workers are told to forget them (a message to every worker
through the scheduler, sent without waiting; a worker that is gone is skipped), unless
another cached site uses the same spec or data. An evicted site that a compiled
program still evaluates gets its data back, which is forgotten once nothing can
evaluate the site any more; ``close()`` forgets everything.

Imports the core's interface, numpy, cloudpickle and distributed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import cloudpickle
import jax
import numpy as np
from distributed import Client
from distributed.comm.core import CommClosedError

from parallel_backend.extend import (
    STALL_TIMEOUT,
    ChunkError,
    EvaluationStalled,
    Executor,
    InFlightLimit,
    chunks_within,
)

from . import cluster, probe
from . import worker as remote
from .placement import RemoteSite, assign, blocks_held, compute_span, forget_revived
from .protocol import ERROR, GONE, INSTALL_ATTEMPTS, LEAVING, MAX_ROUNDS, OK
from .transport import LOST, TRANSPORTS, Routes, SchedulerUnreachable

if TYPE_CHECKING:
    from jax.typing import ArrayLike

    from parallel_backend.extend import ChunkResult, SiteState, Task

__all__ = ["DaskExecutor"]

_T = TypeVar("_T")
_R = TypeVar("_R")

log = logging.getLogger("parallel_backend.dask")

#: The name under which a site holds its RemoteSite (``SiteState.placed``).
REMOTE = "dask.remote"
_EVALUATE = cloudpickle.dumps(remote.evaluate)
_INSTALL = cloudpickle.dumps(remote.install)


class _WorkerGone(Exception):
    """A worker did not answer, or lost this executor's state."""


class _WorkerLeaving(Exception):
    """The cluster is retiring a worker: it takes no more work, and failed nobody."""


class DaskExecutor(Executor):
    """Evaluate chunks on the workers of a dask.distributed cluster.

    The cluster runs the model's code (``fn`` is cloudpickled to the workers):
    use only clusters you trust, and TLS (``distributed.Security``) on networks
    you do not.

    Parameters
    ----------
    client : distributed.Client, optional
        A client the caller made (and keeps; ``close()`` leaves it open).
    address : str, optional
        A running scheduler, ``"tcp://host:port"`` (or ``tls://``); a client is
        made and closed with the executor.
    timeout : float
        Seconds to wait for a scheduler at ``address`` to answer, and for a worker
        to (re)appear when a cluster has none left.
    n_workers : int, optional
        With neither ``client`` nor ``address``: worker processes of the local
        cluster this executor starts (default: every core).
    threads_per_worker : int
        Threads per worker process of that local cluster.
    dispatch : {"auto", "host", "graph"}
        As for :class:`~parallel_backend.ThreadExecutor`; ``"host"`` always uses
        the cluster.
    count_calls : bool
        See :class:`~parallel_backend.Executor`.
    rebalance : bool
        Move data between workers after measuring them, so that a worker behind a slow
        link or with slower threads holds fewer blocks (``plugins/dask/placement.py``);
        ``False`` keeps the data where it was placed, in proportion to the workers'
        threads. Either way, workers that join take a share of the data at the next
        evaluation, and the shares of workers that leave go to those that remain.
        Results are bitwise the same either way.
    transport : {"auto", "direct", "scheduler"}
        How messages reach the workers (``plugins/dask/transport.py``): ``"direct"``, on
        connections from this client to each worker (one round trip; the client must
        reach every worker's address); ``"scheduler"``, relayed by the scheduler (the
        client needs to reach only the scheduler: a Kubernetes service or port-forward,
        dask-gateway, a managed service); ``"auto"``, direct to each worker that answers
        a direct call within a few seconds at its first message, else through the
        scheduler. ``stats()["transport"]`` says which is in use.
    stall_timeout : float or None
        Seconds a worker's evaluation waits with no chunk finishing before it answers
        :class:`~parallel_backend.EvaluationStalled` (see :class:`~parallel_backend.Executor`).

    Examples
    --------
    >>> import jax.numpy as jnp, parallel_backend as pb
    >>> with pb.DaskExecutor(n_workers=1, dispatch="host") as ex:
    ...     float(pb.reduce_sum(lambda x, m: -(x - m) ** 2, jnp.arange(4.0), 1.0, executor=ex))
    -6.0
    """

    name = "dask"

    def __init__(self, client: Client | None = None, address: str | None = None, *,
                 timeout: float = 10.0, n_workers: int | None = None,
                 threads_per_worker: int = 1, dispatch: str = "auto", count_calls: bool = False,
                 rebalance: bool = True, transport: str = "auto",
                 stall_timeout: float | None = STALL_TIMEOUT) -> None:
        if client is not None and address is not None:
            raise ValueError("DaskExecutor: give client= or address=, not both")
        if transport not in TRANSPORTS:
            raise ValueError(f"DaskExecutor: unknown transport {transport!r}; known: "
                             f"{sorted(TRANSPORTS)}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"DaskExecutor: timeout must be a positive number of seconds, got {timeout!r}")
        super().__init__(dispatch=dispatch, count_calls=count_calls,
                         stall_timeout=stall_timeout)
        self.timeout = float(timeout)
        self.rebalance = bool(rebalance)
        self._replacements = 0
        self._cluster = None
        self._own_client = client is None
        if client is not None:
            if not isinstance(client, Client):
                raise TypeError(f"DaskExecutor: client must be a distributed.Client, got "
                                f"{type(client).__name__}")
            self._client = client
        elif address is not None:
            self._client = cluster.connect(address, self.timeout)
        else:
            self._cluster = cluster.local_cluster(n_workers, threads_per_worker)
            self._client = Client(self._cluster, timeout=self.timeout, set_as_default=False)
        self._plugin = f"parallel_backend-{uuid.uuid4().hex[:12]}"
        self._releases = cluster.Releases(self._client, self._plugin, remote.release_everywhere)
        # What the cluster holds for a site is the site's own: its RemoteSite lives in
        # ``state.placed[REMOTE]`` and goes when the site is evicted or released. Sites
        # evicted from the cache are remembered weakly: one that a compiled program still
        # evaluates sends its data again, kept as long as the SiteState lives (_remote).
        self._retired: weakref.WeakSet[SiteState] = weakref.WeakSet()
        # (data token, tiles) -> Layout, shared by every site over the same data, so a
        # re-traced model finds its data where it was sent before.
        self._placements: dict = {}
        # Reentrant: a SiteState's finalizer (in _remote) may run, by garbage collection,
        # on a thread that holds it.
        self._remote_lock = threading.RLock()
        self._data_bytes = 0
        try:
            nthreads = cluster.wait_for_workers(self._client, self.timeout)
            cluster.register(self._client, remote.WorkerState(self._plugin), self._plugin)
            self._live = cluster.Liveness(self._client, self.timeout, nthreads)
            self._routes = Routes(self._client, transport, self.timeout)
            # Same bits everywhere? Each joiner's probe also tells the executor it joined.
            self._probe = probe.watch(self._client, self._plugin, on_join=self._live.join,
                                      on_leave=self._left)
            self._events = cluster.WorkerEvents.of(self._client)
            # Looked up once: it is a scheduler round trip, and repr/stats show it.
            services = self._client.scheduler_info().get("services", {})
            self._dashboard = self._client.dashboard_link if "dashboard" in services else None
        except BaseException:
            self._disconnect()
            raise
        log.info("DaskExecutor on %s: %d workers, %d threads; transport %s",
                 self.scheduler_address, len(nthreads), sum(nthreads.values()), transport)

    # -- cluster facts -------------------------------------------------------------

    @property
    def client(self) -> Client:
        """The ``distributed.Client`` in use."""
        return self._client

    @property
    def scheduler_address(self) -> str:
        return self._live.scheduler_address

    @property
    def dashboard_link(self) -> str | None:
        """The scheduler's dashboard, where it serves one."""
        return self._dashboard

    @property
    def workers(self) -> int:
        """Worker threads in the cluster (as last seen)."""
        return max(1, sum(self._live.nthreads.values()))

    # -- one evaluation ------------------------------------------------------------

    def _remote(self, state) -> RemoteSite:
        with self._remote_lock:
            r = state.placed.get(REMOTE)
            if r is None:
                r = state.placed[REMOTE] = self._new_remote(state)
                if state in self._retired:
                    # Evicted, yet evaluated by a program that still holds it (a model
                    # with more sites than the cache keeps): its data goes back to the
                    # workers and stays there until the state itself is gone.
                    weakref.finalize(state, forget_revived, weakref.ref(self), r).atexit = False
            return r

    def _held(self) -> list:
        """The RemoteSite of every site this executor holds: cached, or evicted but
        evaluated again."""
        states = [*self.sites(), *self._retired]
        return [r for r in (s.placed.get(REMOTE) for s in states) if r is not None]

    def _new_remote(self, state) -> RemoteSite:
        r = RemoteSite(state)
        r.layout = self._placements.setdefault((r.data_token, r.tiles), r.layout)
        return r

    def run_tasks(self, tasks: Sequence[Task]) -> list[ChunkResult]:
        """Each task's blocks on the worker that holds their data (cut where a task spans
        two workers' shares): only the chunk and its parameters travel."""
        self.check_open()
        if not tasks:
            return []
        state, evaluation, r = tasks[0].site, tasks[0].evaluation, self._remote(tasks[0].site)
        try:
            return self._map_chunks(r, state, [t.chunk for t in tasks], evaluation)
        finally:
            with self._remote_lock:
                orphan = state.placed.get(REMOTE) is not r
            if orphan:  # evicted while this evaluation ran, which may have sent data again
                self._forget(r)

    def _map_chunks(self, r: RemoteSite, state, chunks, evaluation):
        per = max(1, max(c.count for c in chunks) // r.tiles.tile_blocks) if chunks else 1
        self._live.check()
        try:
            return self._client.sync(self._run, r, per, evaluation)
        except (OSError, CommClosedError, RuntimeError) as e:
            # Failures of a client that lost its scheduler (its connection pool closes
            # under the evaluation) are that loss, whatever they say.
            if isinstance(e, ChunkError) or self._client.status == "running":
                raise
            log.error("lost the scheduler at %s (%s: %s)", self._live.scheduler_address,
                      type(e).__name__, e)
            raise cluster.scheduler_lost(self._live.scheduler_address, e) from e

    def bytes_per_call(self, traced: Sequence[ArrayLike], shared: Sequence[ArrayLike],
                       n_tasks: int) -> int:
        return 0  # counted message by message in _send

    def bytes_per_result(self, values: ArrayLike, shared_grads: Sequence[ArrayLike],
                         data_grads: Sequence[ArrayLike]) -> int:
        return 0  # counted message by message in _send

    def _retire(self, state) -> None:
        super()._retire(state)
        with self._remote_lock:  # what the client kept of a forgotten site goes with it
            self._retired.add(state)
            r = state.placed.pop(REMOTE, None)
        if r is not None:
            self._forget(r)

    def _forget(self, r: RemoteSite) -> None:
        """Tell the workers to forget ``r``'s spec and data, where no other site of this
        executor uses them (sites with the same spec or data share them there)."""
        with self._remote_lock:
            others = [x for x in self._held() if x is not r]
            tokens = [] if any(x.token == r.token for x in others) else [r.token]
            data = [] if any(x.data_token == r.data_token for x in others) else [r.data_token]
            for key in [k for k in self._placements if k[0] in data]:
                del self._placements[key]
        if (tokens or data) and not self.closed:  # close() drops everything at once
            self._releases.send(tokens, data)

    def _wait_released(self, timeout: float | None = None) -> None:
        """Wait until the release messages sent so far have reached the workers."""
        self._releases.wait(timeout)

    async def _run(self, r: RemoteSite, per: int, evaluation) -> list:
        """The results of every chunk of ``per`` tiles, in block order."""
        t0 = time.perf_counter()
        done: dict = {}
        # The workers last seen (and those that joined since, told by their probe's
        # event); the scheduler is asked again only after a failure (asking costs a
        # scheduler round trip per call).
        alive = dict(self._live.nthreads)
        layout = r.layout
        if not layout.shards:
            layout.start(alive or await self._live.wait())
        elif joined := sorted(set(alive) - layout.workers):
            before = layout.tiles_held()
            layout.grow(alive)
            log.info("site %r: worker(s) %s joined; its data is placed again over %d workers "
                     "(tiles per worker %s, before %s)", r.label, ", ".join(joined),
                     len(alive), layout.tiles_held(), before)
        # This evaluation's layout, whatever another evaluation decides meanwhile.
        shards, owners = layout.shards, layout.owners
        # Chunks never straddle shards: each shard's data lives on one worker.
        tasks = [(s, c) for s in shards for c in chunks_within(r.tiles, s, per)]
        pending = list(tasks)
        for round_ in range(MAX_ROUNDS):
            if not alive:
                alive = await self._live.wait()
            for addr in alive:  # the scheduler's word on each worker's leaving
                self._events.watch(addr, self._worker_event)
            orphans = [i for i, a in enumerate(owners) if a not in alive]
            retired = all(layout.vacated.get(i, owners[i]) in self._live.departed
                          for i in orphans)
            groups = assign(shards, owners, pending, alive)  # gives the orphans new owners
            if orphans:
                moved: dict[str, int] = {}
                for i in orphans:
                    moved[owners[i]] = moved.get(owners[i], 0) + shards[i].count
                log.log(logging.INFO if retired else logging.WARNING,
                        "site %r: %d blocks of workers %s now evaluated by %s", r.label,
                        sum(shards[i].count for i in orphans),
                        "that the cluster retired" if retired else "lost or gone",
                        ", ".join(f"{a} ({n})" for a, n in sorted(moved.items())))
            if round_:
                log.info("site %r: evaluation round %d re-sends %d of %d chunks",
                         r.label, round_ + 1, len(pending), len(tasks))
            outcomes = await asyncio.gather(
                *[self._call(addr, r, group, evaluation, alive.get(addr, 1))
                  for addr, group in groups.items()], return_exceptions=True)
            lost = False
            for (addr, group), out in zip(groups.items(), outcomes):
                if isinstance(out, SchedulerUnreachable):
                    lost = True  # the scheduler's fault, not the worker's: asked below
                elif isinstance(out, _WorkerLeaving) or (
                        isinstance(out, (_WorkerGone, *LOST)) and await self._live.retired(addr)):
                    self._left(addr)  # retired, not failed: its chunks go to the others
                    lost = True
                elif isinstance(out, (_WorkerGone, *LOST)):
                    why = f"{type(out).__name__}: {out}"
                    log.warning("worker %s lost (%s); its chunks go to the workers left",
                                addr, why)
                    self._lose(addr, why)
                    lost = True
                elif isinstance(out, BaseException):  # fn failed (ChunkError), or else
                    raise out
                else:
                    results, wall = out
                    done.update(zip(group, (r._replace(worker=addr) for r in results)))
                    layout.observe(shards, addr, alive.get(addr, 1), group, results, wall)
            pending = [t for t in tasks if t not in done]
            if not pending:
                before = layout.tiles_held()
                if self.rebalance and layout.evaluated(shards, time.perf_counter() - t0, alive):
                    self._replacements += 1
                    log.info("site %r: data placed again by measured cost (move %d): tiles "
                             "per worker %s, before %s", r.label, layout.moves,
                             layout.tiles_held(), before)
                return [done[t] for t in tasks]
            if lost:
                alive = await self._live.alive()
        raise RuntimeError(f"DaskExecutor: workers of {self.scheduler_address} kept failing; "
                           f"{len(pending)} of {len(tasks)} chunks could not be evaluated")

    def _lose(self, addr: str, why: str = "") -> None:
        self._live.lose(addr, why)
        self._forget_worker(addr)

    def _left(self, addr: str) -> None:
        """The cluster retired a worker (``retire_workers``, ``adapt`` scaling down, its
        job's lifetime ended): nothing more goes to it, and no failure is counted."""
        if addr in self._live.departed:
            return
        log.info("worker %s left the cluster", addr)
        self._live.leave(addr)
        self._forget_worker(addr)

    def _worker_event(self, addr: str, msg: dict) -> None:
        """The scheduler's event about ``addr`` (on the client's event loop): a worker being
        retired leaves at once, before any message could find it gone; one removed
        unexpectedly failed."""
        retired = cluster.retirement(msg)
        if retired:
            self._left(addr)
        elif retired is False and addr in self._live.nthreads:
            log.warning("worker %s lost (the scheduler removed it); its chunks go to the "
                        "workers left", addr)
            self._lose(addr, "removed by the scheduler")

    def _forget_worker(self, addr: str) -> None:
        self._routes.forget(addr)
        with self._remote_lock:
            layouts = list(self._placements.values())
        for layout in layouts:
            layout.lose(addr)

    async def _call(self, addr, r: RemoteSite, group, evaluation, threads: int):
        """``(results, seconds)`` of ``group`` on ``addr``: seconds of the message that
        computed them, ``None`` where data had to be installed first."""
        ev = evaluation
        payload = [(shard, chunk, ev.blocks(chunk.first, chunk.first + chunk.count))
                   for shard, chunk in group]
        # numpy, not jax arrays: a jax array would be rebuilt under the worker's default
        # precision (float32 unless x64 is on there).
        shared = tuple(np.asarray(s) for s in ev.shared)
        args = cloudpickle.dumps((self._plugin, r.token, r.data_token, payload, shared,
                                  ev.diff_traced, ev.diff_shared, ev.in_axes,
                                  self.stall_timeout))
        for attempt in range(INSTALL_ATTEMPTS):
            t0 = time.perf_counter()
            reply = await self._send(addr, _EVALUATE, args)
            if reply.status == OK:
                if attempt:
                    return reply.results, None
                wall = time.perf_counter() - t0
                self._routes.observe(addr, wall - compute_span(group, reply.results, threads))
                return reply.results, wall
            if reply.status == ERROR:  # fn's failure, or the worker's InFlightLimit or
                e = reply.error        # EvaluationStalled as itself
                raise e if isinstance(e, (InFlightLimit, EvaluationStalled)) else \
                    ChunkError.wrap(e, e.rows, r.label, self.name)
            if reply.status == GONE:
                raise _WorkerGone(reply.detail)
            if reply.status == LEAVING:
                raise _WorkerLeaving(reply.detail)
            await self._install(addr, r, reply.need_spec, reply.need_shards)
        raise _WorkerGone(f"{addr} did not keep the data sent to it")

    async def _install(self, addr, r: RemoteSite, need_spec: bool, shards) -> None:
        pieces = [r.piece(s) for s in shards]
        args = cloudpickle.dumps((self._plugin, r.token, r.spec if need_spec else None,
                                  r.data_token, pieces))
        self._data_bytes += len(args)
        log.info("site %r: sent %s%d shard(s) of data (%d blocks, %d bytes) to %s", r.label,
                 "its spec and " if need_spec else "", len(pieces),
                 sum(s.count for s in shards), len(args), addr)
        reply = await self._send(addr, _INSTALL, args)
        if reply.status == GONE:
            raise _WorkerGone(reply.detail)
        if reply.status == LEAVING:
            raise _WorkerLeaving(reply.detail)

    async def _send(self, addr, function: bytes, args: bytes):
        """The worker's :class:`~.protocol.Reply`; the bytes both ways are counted. A
        worker that left since this evaluation's round was planned (the scheduler's word
        arrived meanwhile, on this event loop) is not messaged: it is leaving."""
        if addr in self._live.departed:
            raise _WorkerLeaving(f"{addr} left the cluster")
        self.count(bytes_sent=len(function) + len(args))
        raw = await self._routes.send(addr, function, args)
        self.count(bytes_received=len(raw))
        return cloudpickle.loads(raw)

    # -- one-off work --------------------------------------------------------------

    def map(self, func: Callable[[_T], _R], items: Iterable[_T]) -> list[_R]:
        self.check_open()
        # Run with the caller's precision: a worker's JAX defaults to float32.
        # jax before 0.12 gives its options no types (it sets them by setattr)
        x64 = bool(jax.config.jax_enable_x64)  # type: ignore[attr-defined, unused-ignore]
        task = remote.WithPrecision(func, x64)
        futures = self._client.map(task, list(items), pure=False)
        return self._client.gather(futures)

    # -- reporting and shutdown ----------------------------------------------------

    def stats(self, timeline: bool = False) -> dict[str, Any]:
        """As :meth:`Executor.stats <parallel_backend.Executor.stats>` (a chunk's
        ``worker`` in the timeline is its dask worker's address), plus
        ``worker_failures``, ``data_bytes_sent`` (data installed on workers, included
        in ``bytes_sent``), ``replacements`` (times data was moved to weigh the workers),
        ``blocks_per_worker`` (address -> blocks it holds, over the sites cached now),
        ``transport`` (``"direct"``, ``"scheduler"``, ``"direct+scheduler"`` where some
        workers are reached each way, or the transport asked for before the first
        evaluation), ``routes`` (address -> ``"direct"`` or ``"scheduler"``, for the
        workers messaged), ``message_seconds`` (route -> median seconds a message cost
        beyond the workers' compute, over the last 64: what the route adds to each
        evaluation), ``scheduler`` and ``dashboard``."""
        out = super().stats(timeline)
        out["transport"] = self._routes.summary()
        out["routes"] = self._routes.routes()
        out["message_seconds"] = self._routes.cost()
        out["worker_failures"] = self._live.failures
        out["data_bytes_sent"] = self._data_bytes
        out["replacements"] = self._replacements
        with self._remote_lock:
            out["blocks_per_worker"] = blocks_held(self._placements.values())
        out["scheduler"] = None if self.closed else self.scheduler_address
        out["dashboard"] = None if self.closed else self._dashboard
        return out

    def release(self) -> None:
        cost = ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in self._routes.cost().items())
        log.info("DaskExecutor on %s closed: %d evaluations, transport %s%s",
                 self._live.scheduler_address, self.stats()["calls"], self._routes.summary(),
                 f" (a message beyond compute: {cost})" if cost else "")
        probe.unwatch(self._client, self._probe)
        self._events.forget(self._worker_event)
        # A cluster that is gone holds no state to drop.
        with contextlib.suppress(Exception):
            if self._client.status == "running":
                self._client.unregister_worker_plugin(self._plugin)
        with self._remote_lock:
            for state in [*self.sites(), *self._retired]:
                state.placed.pop(REMOTE, None)
            self._placements.clear()
        self._disconnect()

    def _disconnect(self) -> None:
        if self._own_client:
            self._client.close()
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None

    def __repr__(self) -> str:
        if self.closed:
            return "DaskExecutor(closed)"
        dash = f", dashboard={self._dashboard!r}" if self._dashboard else ""
        return (f"DaskExecutor(scheduler={self.scheduler_address!r}, workers={self.workers}"
                f"{dash}, dispatch={self.dispatch!r}, calls={self.stats()['calls']})")
