"""The worker side of :class:`DaskExecutor`: state kept in each dask worker process.

This module owns :class:`WorkerState`, a ``distributed.WorkerPlugin`` that holds,
per worker, the call sites (their specs, sent once, cloudpickled, and the block
computations rebuilt from them), the shards of prepared data that live there
(sent once, keyed by content and blocks; a shard cut from one held here is served
from it, so a worker whose share shrank receives nothing), and a thread pool that
runs chunks. The client reaches it with :func:`evaluate` and :func:`install`,
called straight on the worker or, relayed by the scheduler, through :func:`relay`
(see :mod:`.protocol` and :mod:`.transport`), with :func:`ping` to find a route, and
with :func:`release` when a site leaves its cache; :func:`holdings` says what a worker
keeps.

Imports the core's interface, jax (lazily, after the environment is set),
numpy, cloudpickle and distributed.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import threading
from concurrent.futures import CancelledError
from typing import cast

import cloudpickle
import numpy as np
from distributed import WorkerPlugin

from .cluster import XLA_FLAGS
from .internals import worker_plugin
from .protocol import ERROR, GONE, LEAVING, MISSING, OK, Reply

__all__ = ["WorkerState", "evaluate", "holdings", "install", "ping", "relay", "release",
           "release_everywhere"]


class WorkerState(WorkerPlugin):
    """Per-worker sites, data shards and thread pool of one executor.

    Parameters
    ----------
    name : str
        The plugin name, unique per executor, so executors sharing a cluster
        never see each other's state.
    limit_xla_threads : bool
        Set XLA's flags in the worker before JAX is first used there.
    """

    def __init__(self, name: str, limit_xla_threads: bool = True):
        self.name = name
        self.limit_xla_threads = limit_xla_threads

    def __getstate__(self):
        return {"name": self.name, "limit_xla_threads": self.limit_xla_threads}

    def __setstate__(self, state):
        self.__dict__.update(state)

    def setup(self, worker) -> None:
        # dask logs every call of its run handler; an evaluation's messages would be a line
        # each, thousands a minute, in the worker's log (and a job queue's output file).
        logging.getLogger("distributed.worker").addFilter(_quiet_runs)
        flags = os.environ.get("XLA_FLAGS", "")
        if self.limit_xla_threads and XLA_FLAGS not in flags:
            # XLA reads the flags when its CPU client starts (the first computation), so
            # this takes effect in a fresh worker; one that already ran JAX keeps its own.
            os.environ["XLA_FLAGS"] = f"{flags} {XLA_FLAGS}".strip()
        threads = getattr(worker.state, "nthreads", None) or getattr(worker, "nthreads", 1)
        self.address = worker.address
        self.threads = max(1, int(cast(int, threads)))
        self.pool = self.new_pool()
        self.specs: dict = {}  # site token -> SiteSpec
        self.sites: dict = {}  # site token -> Program, built at the site's first chunk
        self.shards: dict = {}  # (data token, shard: its first block and count) -> Resident
        self.lock = threading.Lock()
        self.torn_down = False

    def teardown(self, worker) -> None:
        self.torn_down = True  # chunks still running fail as the worker's leaving, not fn's
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if not getattr(self, "stalled", False):  # freeing a copy in use waits for its user
            for resident in getattr(self, "shards", {}).values():
                resident.delete()  # those a running chunk holds: once it is done
        self.specs, self.sites, self.shards = {}, {}, {}

    def new_pool(self):
        """The threads that run this worker's chunks (daemons: a stuck chunk holds up
        neither the worker's exit nor, once its evaluation stalled, the next one)."""
        from parallel_backend.extend import TaskPool

        return TaskPool(self.threads, "parallel_backend_dask")

    def drop_pool(self, pool) -> None:
        """Leave a pool whose evaluation stalled behind, stuck threads and all (and the
        data they may read: see :meth:`teardown`)."""
        self.stalled = True
        if self.pool is pool:
            self.pool = self.new_pool()
        pool.shutdown(wait=False, cancel_futures=True)

    def missing(self, token, data_token, shards) -> tuple[bool, tuple]:
        """Whether the site is missing, and which data shards are."""
        return token not in self.specs, tuple(sorted({s for s in shards
                                                      if self.find(data_token, s) is None}))

    def find(self, data_token, shard):
        """The data held here that covers ``shard`` (first block, count): that shard, or
        one it was cut from when the client placed the data again; ``None`` if neither."""
        resident = self.shards.get((data_token, shard))
        if resident is None:
            resident = next((r for (d, held), r in self.shards.items()
                             if d == data_token and _covers(held, shard)), None)
        return resident

    def drop(self, tokens, data_tokens) -> None:
        """Forget sites and the shards of data their client no longer uses. Dropped, not
        deleted: a chunk running holds its own references, and the arrays are freed with
        the last of them."""
        data_tokens = set(data_tokens)
        with self.lock:
            for token in tokens:
                self.specs.pop(token, None)
                self.sites.pop(token, None)
            for key in [k for k in self.shards if k[0] in data_tokens]:
                del self.shards[key]

    def add(self, token, spec, data_token, pieces) -> None:
        from parallel_backend.extend import Resident

        if spec is not None and token not in self.specs:
            self.specs[token] = cloudpickle.loads(spec)
        if token not in self.specs:
            # Released since the worker said it had the spec: without it the data's
            # precision is unknown, so keep nothing; the next evaluation asks for both.
            return
        x64 = self.specs[token].x64
        for shard, first, arrays in pieces:
            self.shards[(data_token, shard)] = Resident(arrays, first, x64)
        # What a new, larger shard covers is held twice: keep the larger one.
        new = [p[0] for p in pieces]
        for key in [k for k in self.shards if k[0] == data_token and k[1] not in new
                    and any(_covers(s, k[1]) for s in new)]:
            del self.shards[key]

    def program(self, token, spec):
        """The block computations of a site, traced here at its first chunk (where an
        ``fn`` that fails on this worker fails as a chunk, with its rows)."""
        from parallel_backend.extend import Program

        with self.lock:
            program = self.sites.get(token)
            if program is None:
                program = Program(spec)
                if self.specs.get(token) is spec:  # not released meanwhile
                    self.sites[token] = program
            return program

    def run_task(self, token, spec, resident, task, shared, diff_traced, diff_shared,
                 in_axes):
        from parallel_backend.extend import ChunkError, Evaluation, run_chunk

        _, chunk, traced = task
        try:
            program = self.program(token, spec)
        except Exception as e:
            raise ChunkError.wrap(e, spec.rows(chunk.first, chunk.count), spec.label) from e
        evaluation = Evaluation(traced, shared, diff_traced, diff_shared, in_axes, chunk.first)
        return run_chunk(program, resident, chunk, evaluation)

    def holdings(self) -> dict:
        """What this worker keeps: sites, their programs, data shards and their bytes."""
        with self.lock:
            shards = list(self.shards.values())
            return {"sites": len(self.specs), "programs": len(self.sites),
                    "shards": len(shards), "bytes": sum(r.nbytes for r in shards)}


def _quiet_runs(record: logging.LogRecord) -> bool:
    """Drop dask's "Run out-of-band function" line for this module's own functions."""
    return not (record.msg == "Run out-of-band function %r" and isinstance(record.args, tuple)
                and record.args and record.args[0] in _MESSAGES)


def _covers(outer, inner) -> bool:
    """Whether the blocks of shard ``outer`` include those of ``inner`` (first, count)."""
    return outer[0] <= inner[0] and inner[0] + inner[1] <= outer[0] + outer[1]


class WithPrecision:
    """``func(item)`` on a worker with the caller's ``jax_enable_x64`` (one-off work such
    as the pointwise log-likelihood; a site's chunks carry it in their spec)."""

    def __init__(self, func, x64: bool):
        # Pickled here and unpickled under the caller's precision: a jax array in
        # ``func`` unpickled with x64 off would already be float32.
        self.payload, self.x64 = cloudpickle.dumps(func), bool(x64)
        self._func = None

    def __getstate__(self):
        return {"payload": self.payload, "x64": self.x64, "_func": None}

    def __call__(self, item):
        import jax

        with jax.enable_x64(self.x64):
            if self._func is None:
                self._func = cloudpickle.loads(self.payload)
            return self._func(item)


def _state(dask_worker, name):
    return worker_plugin(dask_worker, name)


def _gone(dask_worker, name) -> Reply:
    return Reply(GONE, detail=f"the worker {dask_worker.address} has no parallel_backend "
                              f"state {name} (it restarted)")


async def evaluate(name, token, data_token, tasks, shared, diff_traced, diff_shared, in_axes,
                   stall_timeout=None, dask_worker=None) -> bytes:
    """Run ``tasks`` (shard, chunk, traced blocks) on this worker's pool, waiting at most
    ``stall_timeout`` seconds with no chunk finishing: the :class:`~.protocol.Reply`,
    pickled (the client counts the bytes it receives)."""
    return cloudpickle.dumps(await _evaluate(name, token, data_token, tasks, shared,
                                             diff_traced, diff_shared, in_axes, stall_timeout,
                                             dask_worker))


async def _evaluate(name, token, data_token, tasks, shared, diff_traced, diff_shared, in_axes,
                    stall_timeout, dask_worker) -> Reply:
    """:func:`evaluate`'s reply.

    Waited for with ``gather`` (on a thread beside the event loop): where the worker
    shares XLA's device with the caller (a cluster in the caller's process) and the
    chunk programs can never start, it answers ``InFlightLimit`` instead of waiting."""
    from parallel_backend.extend import ChunkError, EvaluationStalled, InFlightLimit, gather

    if _leaving(dask_worker):
        return Reply(LEAVING, detail=f"the worker {dask_worker.address} is being retired")
    state = _state(dask_worker, name)
    if state is None:
        return _gone(dask_worker, name)
    need_spec, need_shards = state.missing(token, data_token, [t[0] for t in tasks])
    if need_spec or need_shards:
        return Reply(MISSING, need_spec=need_spec, need_shards=need_shards)
    # Looked up here, on the worker's event loop, where release() runs too: a site
    # released while its chunks run keeps what they use until they finish.
    spec = state.specs[token]
    residents = {t[0]: state.find(data_token, t[0]) for t in tasks}
    loop = asyncio.get_running_loop()

    def outcome(task):  # a chunk's own failure as its result: gather waits for them all
        try:
            return state.run_task(token, spec, residents[task[0]], task, shared, diff_traced,
                                  diff_shared, in_axes)
        except Exception as e:  # noqa: BLE001 - reported per chunk below
            return e

    pool = state.pool
    futures = [pool.submit(outcome, task) for task in tasks]
    try:
        results = await loop.run_in_executor(
            None, gather, futures, [residents[t[0]].device for t in tasks], spec.label,
            stall_timeout, lambda: [spec.rows(t[1].first, t[1].count) for t in tasks], "dask")
    except EvaluationStalled as e:  # arrives as itself; the next evaluation gets new threads
        state.drop_pool(pool)
        return Reply(ERROR, error=e)
    except InFlightLimit as e:  # the caller's queue, not fn: it arrives as itself
        return Reply(ERROR, error=e)
    except CancelledError:
        # The worker's pool cancelled queued chunks: it is shutting down (killed, retired,
        # scaled down), not fn failing. The client hands the chunks to other workers.
        return Reply(GONE, detail=f"the worker {dask_worker.address} is shutting down "
                                  "(its pool cancelled the chunks)")
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed and (getattr(state, "torn_down", False) or _leaving(dask_worker)):
        # The worker was closed under its chunks (its scheduler gone, killed, retired):
        # what they raised says nothing of fn. The client hands them to other workers.
        return Reply(GONE, detail=f"the worker {dask_worker.address} closed during the "
                                  f"evaluation ({type(failed[0]).__name__}: {failed[0]})")
    for task, r in zip(tasks, results):
        if isinstance(r, BaseException):
            rows = spec.rows(task[1].first, task[1].count)
            return Reply(ERROR, error=ChunkError.wrap(r, rows, spec.label, "dask"))
    return Reply(OK, results=results)


def _leaving(dask_worker) -> bool:
    """Whether the cluster is retiring this worker (its status is no longer running)."""
    from distributed.core import Status

    return getattr(dask_worker, "status", Status.running) in (
        Status.closing_gracefully, Status.closing, Status.closed)


def install(name, token, spec, data_token, pieces, dask_worker=None) -> bytes:
    """Keep a site (``spec``, cloudpickled, or ``None``) and data shards on this worker;
    the :class:`~.protocol.Reply`, pickled."""
    if _leaving(dask_worker):
        return cloudpickle.dumps(Reply(LEAVING, detail=f"the worker {dask_worker.address} is "
                                                       "being retired"))
    state = _state(dask_worker, name)
    if state is None:
        return cloudpickle.dumps(_gone(dask_worker, name))
    state.add(token, spec, data_token,
              [(shard, first, tuple(np.asarray(x) for x in arrays))
               for shard, first, arrays in pieces])
    return cloudpickle.dumps(Reply(OK))


def release(name, tokens, data_tokens, dask_worker=None) -> Reply:
    """Forget the sites ``tokens`` and the data ``data_tokens`` on this worker (the client
    sends it when they leave its cache; a worker that never had them has nothing to do)."""
    state = _state(dask_worker, name)
    if state is None:
        return _gone(dask_worker, name)
    state.drop(tokens, data_tokens)
    return Reply(OK)


def ping(dask_worker=None) -> None:
    """Nothing: the call that tells whether, and how fast, a route reaches this worker."""


async def relay(function: bytes, args: bytes, dask_worker=None):
    """``function(*args)`` (both cloudpickled) on this worker: a message that the scheduler
    relayed (``Client.run``) arrives as the same bytes a direct one carries, and runs the
    same function, as dask's ``run`` handler runs a direct one."""
    out = cloudpickle.loads(function)(*cloudpickle.loads(args), dask_worker=dask_worker)
    return await out if inspect.isawaitable(out) else out


def holdings(name, dask_worker=None) -> dict:
    """What the executor whose plugin is ``name`` keeps on this worker: ``sites``,
    ``programs``, data ``shards`` and their ``bytes`` (all 0 once it is closed).

    Examples
    --------
    >>> client.run(holdings, name)  # doctest: +SKIP
    {'tcp://127.0.0.1:40155': {'sites': 2, 'programs': 2, 'shards': 2, 'bytes': 160000}, ...}
    """
    state = _state(dask_worker, name)
    if state is None or not hasattr(state, "lock"):
        return {"sites": 0, "programs": 0, "shards": 0, "bytes": 0}
    return state.holdings()


#: The functions the client runs on workers, by the name dask logs them under.
_MESSAGES = frozenset({"evaluate", "install", "release", "ping", "relay", "holdings"})


async def release_everywhere(client, plugin, tokens, data_tokens) -> None:
    """:func:`release` on every worker the scheduler lists, from the client's event loop:
    a worker that is gone is skipped, and a cluster that is gone holds nothing to forget."""
    with contextlib.suppress(Exception):
        await client.run(release, plugin, tokens, data_tokens, on_error="ignore",
                         asynchronous=True)
