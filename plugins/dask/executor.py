"""``DaskExecutor``: chunks evaluated by the workers of a dask.distributed cluster.

This module owns the client side. Each call site's data is cut into one
contiguous *slot* of blocks per worker thread; a slot's rows are sent once to
the worker that evaluates it and stay there (keyed by content, so re-tracing the
same model sends nothing again). Per gradient evaluation, one message per worker
carries only the traced values: the parameters, and the per-row parameters of
that worker's chunks. The messages go straight to the workers (dask's ``run``
handler on a pooled connection) rather than through the scheduler, whose batched
task stream adds about 10 ms per round trip.

When a worker dies, its slots move to the workers that remain (or to its
replacement), their data is sent again and the missing chunks are recomputed;
since every block is computed by the same compiled code, the result is bitwise
what it would have been. With no worker left, the call fails after ``timeout``.

Imports the core, numpy, cloudpickle and distributed.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
import uuid
import warnings

import cloudpickle
import numpy as np
from distributed import Client, LocalCluster
from distributed.comm.core import CommClosedError
from distributed.core import send_recv

from parallel_backend.chunking import even_slots, split_blocks
from parallel_backend.errors import ChunkError
from parallel_backend.executors.base import Executor, row_slice
from . import worker as remote

__all__ = ["DaskExecutor"]

#: Failures that mean "this worker is gone", not "fn is wrong".
_LOST = (OSError, CommClosedError, asyncio.TimeoutError, EOFError)
#: How long an address that failed is kept out of the rotation.
_QUARANTINE_S = 60.0
_EVALUATE = cloudpickle.dumps(remote.evaluate)
_INSTALL = cloudpickle.dumps(remote.install)


class _WorkerGone(Exception):
    """A worker did not answer, or lost this executor's state."""


class _Remote:
    """What the client knows about one site on the cluster."""

    def __init__(self, site, slots: int):
        self.site = site
        resident_mask = tuple(r is not None for r in site.resident)
        spec = (site.fn, site.data_treedef, site.shared_treedef, resident_mask, site.plan,
                site.value_dtype, site.x64, site.label)
        try:
            self.spec = cloudpickle.dumps(spec)
        except Exception as e:
            raise TypeError(f"DaskExecutor: fn {site.label!r} (and what it refers to) must be "
                            f"picklable with cloudpickle to run on dask workers: "
                            f"{type(e).__name__}: {e}") from e
        self.token = hashlib.blake2b(self.spec, digest_size=16).hexdigest()
        self.leaves = tuple(None if r is None else np.asarray(r) for r in site.resident)
        self.data_token = _content_token(self.leaves, site.plan)
        n = site.plan.n_blocks
        self.slots = even_slots(n, slots)
        self.placement: list = [None] * len(self.slots)  # slot -> worker address

    def piece(self, slot: int):
        r0, r1 = self.slots[slot].rows(self.site.plan)
        return slot, r0, tuple(None if x is None else x[r0:r1] for x in self.leaves)


def _content_token(leaves, plan) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((plan.n_rows, plan.block_rows)).encode())
    for x in leaves:
        if x is None:
            h.update(b"traced")
            continue
        h.update(repr((x.shape, x.dtype.str)).encode())
        h.update(memoryview(np.ascontiguousarray(x)).cast("B"))
    return h.hexdigest()


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

    Examples
    --------
    >>> import jax.numpy as jnp, parallel_backend as pb
    >>> with pb.DaskExecutor(n_workers=1, dispatch="host") as ex:
    ...     float(pb.reduce_sum(lambda x, m: -(x - m) ** 2, jnp.arange(4.0), 1.0, executor=ex))
    -6.0
    """

    name = "dask"

    def __init__(self, client=None, address=None, *, timeout: float = 10.0,
                 n_workers: int | None = None, threads_per_worker: int = 1,
                 dispatch: str = "auto", count_calls: bool = True):
        if client is not None and address is not None:
            raise ValueError("DaskExecutor: give client= or address=, not both")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"DaskExecutor: timeout must be a positive number of seconds, got {timeout!r}")
        super().__init__(dispatch=dispatch, count_calls=count_calls)
        self.timeout = float(timeout)
        self._cluster = None
        self._own_client = client is None
        if client is not None:
            if not isinstance(client, Client):
                raise TypeError(f"DaskExecutor: client must be a distributed.Client, got "
                                f"{type(client).__name__}")
            self._client = client
        elif address is not None:
            self._client = _connect(address, self.timeout)
        else:
            self._cluster = _local_cluster(n_workers, threads_per_worker)
            self._client = Client(self._cluster, timeout=self.timeout)
        self._plugin = f"parallel_backend-{uuid.uuid4().hex[:12]}"
        self._remotes: dict = {}
        # (data token, slots) -> slot placement, shared by every site over the same data,
        # so a re-traced model finds its data where it was sent before.
        self._placements: dict = {}
        self._remote_lock = threading.Lock()
        self._quarantine: dict = {}  # address -> time it failed
        self._extra = dict(worker_failures=0, data_bytes_sent=0)
        try:
            self._client.register_plugin(remote.WorkerState(self._plugin), name=self._plugin)
            self._nthreads = self._wait_for_workers()
            # Looked up once: it is a scheduler round trip, and repr/stats show it.
            services = self._client.scheduler_info().get("services", {})
            self._dashboard = self._client.dashboard_link if "dashboard" in services else None
        except BaseException:
            self._release()
            raise

    # -- cluster facts -------------------------------------------------------------

    @property
    def client(self):
        """The ``distributed.Client`` in use."""
        return self._client

    @property
    def scheduler_address(self) -> str:
        return self._client.scheduler.address

    @property
    def dashboard_link(self) -> str | None:
        """The scheduler's dashboard, where it serves one."""
        return self._dashboard

    @property
    def workers(self) -> int:
        """Worker threads in the cluster (as last seen)."""
        return max(1, sum(self._nthreads.values()))

    def _wait_for_workers(self) -> dict:
        try:
            self._client.wait_for_workers(1, timeout=self.timeout)
        except (TimeoutError, asyncio.TimeoutError) as e:
            raise TimeoutError(f"DaskExecutor: the cluster at {self.scheduler_address} has no "
                               f"workers (waited {self.timeout:g} s); start some with "
                               f"`dask worker {self.scheduler_address}`") from e
        return dict(self._client.nthreads())

    async def _alive(self) -> dict:
        """Workers the scheduler lists now, less those that just failed us."""
        info = await self._client.scheduler.identity()
        now = time.monotonic()
        self._quarantine = {a: t for a, t in self._quarantine.items() if now - t < _QUARANTINE_S}
        alive = {a: w.get("nthreads", 1) for a, w in info.get("workers", {}).items()
                 if a not in self._quarantine}
        if alive:
            self._nthreads = alive
        return alive

    async def _await_workers(self) -> dict:
        deadline = time.monotonic() + self.timeout
        while True:
            alive = await self._alive()
            if alive:
                return alive
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"DaskExecutor: no workers left in the cluster at {self.scheduler_address} "
                    f"(waited {self.timeout:g} s for one to come back); the evaluation cannot go "
                    "on. Start workers, or use another executor.")
            await asyncio.sleep(0.1)

    # -- one evaluation ------------------------------------------------------------

    def _remote(self, site) -> _Remote:
        with self._remote_lock:
            r = self._remotes.get(site)
            if r is None:
                r = self._remotes[site] = _Remote(site, self.workers)
                r.placement = self._placements.setdefault((r.data_token, len(r.slots)),
                                                          r.placement)
            return r

    def map_chunks(self, site, chunks, args):
        self._check_open()
        r = self._remote(site)
        per = max(c.count for c in chunks) if chunks else 1
        # Chunks never straddle slots: each slot's data lives on one worker.
        tasks = [(i, c) for i, s in enumerate(r.slots) for c in split_blocks(s.count, per, s.first)]
        results = self._client.sync(self._run, r, tasks, args)
        return [results[t] for t in tasks]

    def _bytes_per_call(self, traced, shared, n_tasks: int) -> int:
        return 0  # counted message by message in _call

    async def _run(self, r: _Remote, tasks, args) -> dict:
        traced, shared, diff_traced, diff_shared, in_axes = args
        done: dict = {}
        pending = list(tasks)
        # The workers last seen; the scheduler is asked again only after a failure
        # (asking costs a scheduler round trip per call).
        alive = dict(self._nthreads)
        for _ in range(8):
            if not alive:
                alive = await self._await_workers()
            groups = self._assign(r, pending, alive)
            outcomes = await asyncio.gather(
                *[self._call(addr, r, group, traced, shared, diff_traced, diff_shared,
                             in_axes) for addr, group in groups.items()],
                return_exceptions=True)
            lost = False
            for (addr, group), out in zip(groups.items(), outcomes):
                if isinstance(out, ChunkError):
                    raise out
                if isinstance(out, (_WorkerGone, *_LOST)):
                    self._lose(addr)
                    lost = True
                elif isinstance(out, BaseException):
                    raise out
                else:
                    done.update(zip(group, out))
            pending = [t for t in tasks if t not in done]
            if not pending:
                return done
            if lost:
                alive = await self._alive()
        raise RuntimeError(f"DaskExecutor: workers of {self.scheduler_address} kept failing; "
                           f"{len(pending)} of {len(tasks)} chunks could not be evaluated")

    def _assign(self, r: _Remote, tasks, alive: dict) -> dict:
        """Group tasks by the worker that holds (or will hold) their slot's data."""
        load = {a: 0.0 for a in alive}
        for a in r.placement:
            if a in load:
                load[a] += 1.0 / alive[a]
        for i, a in enumerate(r.placement):
            if a not in alive:
                best = min(load, key=lambda w: (load[w], w))
                r.placement[i] = best
                load[best] += 1.0 / alive[best]
        groups: dict = {}
        for t in tasks:
            groups.setdefault(r.placement[t[0]], []).append(t)
        return groups

    def _lose(self, addr: str) -> None:
        self._quarantine[addr] = time.monotonic()
        self._extra["worker_failures"] += 1
        for placement in self._placements.values():
            for i, a in enumerate(placement):
                if a == addr:
                    placement[i] = None

    async def _call(self, addr, r: _Remote, group, traced, shared, diff_traced, diff_shared,
                    in_axes):
        payload = []
        for slot, chunk in group:
            r0, r1 = chunk.rows(r.site.plan)
            payload.append((slot, chunk, row_slice(traced, in_axes, r0, r1)))
        # numpy, not jax arrays: a jax array would be rebuilt under the worker's default
        # precision (float32 unless x64 is on there).
        shared = tuple(np.asarray(s) for s in shared)
        args = cloudpickle.dumps((self._plugin, r.token, r.data_token, payload, shared,
                                  diff_traced, diff_shared, in_axes))
        for _ in range(3):
            reply = await self._send(addr, _EVALUATE, args)
            if reply[0] == "ok":
                return reply[1]
            if reply[0] == "error":
                raise ChunkError.wrap(reply[1], reply[1].rows, r.site.label, self.name)
            if reply[0] == "gone":
                raise _WorkerGone(reply[1])
            _, need_site, need_slots = reply
            await self._install(addr, r, need_site, need_slots)
        raise _WorkerGone(f"{addr} did not keep the data sent to it")

    async def _install(self, addr, r: _Remote, need_site: bool, slots) -> None:
        pieces = [r.piece(s) for s in slots]
        args = cloudpickle.dumps((self._plugin, r.token, r.spec if need_site else None,
                                  r.data_token, pieces))
        self._extra["data_bytes_sent"] += len(args)
        reply = await self._send(addr, _INSTALL, args)
        if reply[0] == "gone":
            raise _WorkerGone(reply[1])

    async def _send(self, addr, function: bytes, args: bytes):
        pool = self._client.rpc
        comm = await pool.connect(addr, timeout=self.timeout)
        ok = False
        try:
            reply = await send_recv(comm, op="run", function=function, args=args, wait=True)
            ok = True
        finally:
            if ok:
                pool.reuse(addr, comm)
            else:
                comm.abort()
        self._count(bytes_sent=len(function) + len(args))
        if not isinstance(reply, dict) or reply.get("status") != "OK":
            text = reply.get("text") if isinstance(reply, dict) else reply
            raise RuntimeError(f"DaskExecutor: worker {addr} failed to run a parallel_backend "
                               f"task: {text}")
        return reply["result"]

    # -- one-off work --------------------------------------------------------------

    def map(self, func, items) -> list:
        self._check_open()
        futures = self._client.map(func, list(items), pure=False)
        return self._client.gather(futures)

    # -- reporting and shutdown ----------------------------------------------------

    def stats(self) -> dict:
        out = super().stats()
        out.update(self._extra)
        out["scheduler"] = None if self._closed else self.scheduler_address
        out["dashboard"] = None if self._closed else self._dashboard
        return out

    def _shutdown(self) -> None:
        try:
            if self._client.status == "running":
                self._client.unregister_worker_plugin(self._plugin)
        except Exception:  # noqa: BLE001 - a cluster that is gone holds no state to drop
            pass
        self._remotes.clear()
        self._placements.clear()
        self._release()

    def _release(self) -> None:
        if self._own_client:
            self._client.close()
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None

    def __repr__(self) -> str:
        if self._closed:
            return "DaskExecutor(closed)"
        dash = f", dashboard={self._dashboard!r}" if self._dashboard else ""
        return (f"DaskExecutor(scheduler={self.scheduler_address!r}, workers={self.workers}"
                f"{dash}, dispatch={self.dispatch!r}, calls={self._counts['calls']})")


def _connect(address: str, timeout: float) -> Client:
    if not isinstance(address, str) or "://" not in address and ":" not in address:
        raise ValueError(f"DaskExecutor: address must look like 'tcp://host:port', got {address!r}")
    try:
        return Client(address, timeout=timeout)
    except (OSError, TimeoutError, asyncio.TimeoutError) as e:
        raise ConnectionError(f"DaskExecutor: no dask scheduler answered at {address!r} within "
                              f"{timeout:g} s ({type(e).__name__}: {e}). Is `dask scheduler` "
                              "running there, and is the address (and tls:// for a secured "
                              "cluster) right?") from e


def _local_cluster(n_workers, threads_per_worker) -> LocalCluster:
    if n_workers is None:
        try:
            n_workers = len(os.sched_getaffinity(0))
        except AttributeError:
            n_workers = os.cpu_count() or 1
    for name, v in (("n_workers", n_workers), ("threads_per_worker", threads_per_worker)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"DaskExecutor: {name} must be a positive int, got {v!r}")
    try:
        import bokeh  # noqa: F401 - the dashboard needs it
        dashboard = "127.0.0.1:0"
    except ImportError:
        dashboard = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "port in use, using another" and the like
        return LocalCluster(n_workers=n_workers, threads_per_worker=threads_per_worker,
                            processes=True, host="127.0.0.1", dashboard_address=dashboard,
                            env={"XLA_FLAGS": remote.XLA_FLAGS})
