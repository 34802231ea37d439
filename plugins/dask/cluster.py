"""Getting and keeping a dask cluster: connecting, starting a local one, knowing who is alive.

This module owns the cluster side of a
:class:`~parallel_backend.plugins.dask.DaskExecutor`: :func:`connect` (to a running
scheduler, with an error that says what to check), :func:`local_cluster` (worker
processes on this machine, each told how many XLA threads to use), and
:class:`Liveness` (the workers last seen, those that failed us recently, waiting
for one to come back, and whether the scheduler is still there: a lost scheduler is a
:func:`scheduler_lost` error that says what to do). Imports distributed and the core's
interface.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
import warnings
import weakref
from typing import ClassVar

from distributed import Client, LocalCluster
from distributed.comm.core import CommClosedError

from parallel_backend.extend import check_count, cpu_count

from .protocol import QUARANTINE_SECONDS

__all__ = ["Liveness", "Releases", "WorkerEvents", "connect", "local_cluster", "retirement",
           "scheduler_lost", "worker_env"]

#: Eigen's own thread pool off on workers: the worker's threads are the parallelism.
XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"


def worker_env(threads: int) -> dict:
    """Environment for a worker process of ``threads`` threads on a machine shared with
    others: XLA's thread pool sized to this worker's share of the cores (``NPROC``)."""
    return {"XLA_FLAGS": XLA_FLAGS, "NPROC": str(max(1, threads))}


def connect(address: str, timeout: float) -> Client:
    """A client of the scheduler at ``address``."""
    if not isinstance(address, str) or "://" not in address and ":" not in address:
        raise ValueError(f"DaskExecutor: address must look like 'tcp://host:port', got {address!r}")
    try:
        # Not dask's default scheduler: the executor's client is for its own work only.
        return Client(address, timeout=timeout, set_as_default=False)
    except (OSError, TimeoutError) as e:
        raise ConnectionError(f"DaskExecutor: no dask scheduler answered at {address!r} within "
                              f"{timeout:g} s ({type(e).__name__}: {e}). Is `dask scheduler` "
                              "running there, and is the address (and tls:// for a secured "
                              "cluster) right?") from e


def local_cluster(n_workers, threads_per_worker) -> LocalCluster:
    """Worker processes on 127.0.0.1: by default one per core, one thread each."""
    cores = cpu_count()
    if n_workers is None:
        n_workers = cores
    n_workers = check_count(n_workers, "n_workers", "DaskExecutor")
    threads_per_worker = check_count(threads_per_worker, "threads_per_worker", "DaskExecutor")
    try:
        import bokeh  # noqa: F401 - the dashboard needs it
        dashboard = "127.0.0.1:0"
    except ImportError:
        dashboard = None
    xla_threads = max(1, cores // n_workers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "port in use, using another" and the like
        return LocalCluster(n_workers=n_workers, threads_per_worker=threads_per_worker,
                            processes=True, host="127.0.0.1", dashboard_address=dashboard,
                            env=worker_env(xla_threads))


def scheduler_lost(address: str, why) -> ConnectionError:
    """The error of an evaluation whose scheduler went away (killed, crashed, network);
    ``why`` is the failure seen (an exception or a sentence)."""
    if isinstance(why, BaseException):
        why = f"{type(why).__name__}: {why}"
    return ConnectionError(
        f"DaskExecutor: lost the scheduler at {address}: it stopped answering "
        f"({why}), so the evaluation cannot go on. Start the "
        f"cluster again (`dask scheduler`, then `dask worker <its address>`) and use a new "
        f"DaskExecutor on it; a pb.sample run with checkpoint= continues from its last "
        f"checkpoint when called again")


#: Worker statuses of a worker the cluster is retiring (``retire_workers``, ``adapt``
#: scaling down, a job whose lifetime ends), as the scheduler's events name them.
LEAVING = frozenset({"closing_gracefully", "closing", "closed"})


def retirement(msg: dict) -> bool | None:
    """What a scheduler event about a worker says of its leaving: ``True`` where the
    cluster retires it (a status of :data:`LEAVING`, ``retired``, or its removal
    ``expected``), ``False`` where it was removed unexpectedly (it died), ``None`` for
    other events."""
    action = msg.get("action")
    if action == "worker-status-change":
        return True if msg.get("status") in LEAVING else None
    if action == "retired":
        return True
    if action == "remove-worker":
        return bool(msg.get("expected"))
    return None


class WorkerEvents:
    """The scheduler's events about each worker (it logs them under the worker's address),
    handed to every executor of one client that watches that worker: dask keeps one
    handler per topic and client, so executors sharing a client share this."""

    _of: ClassVar[weakref.WeakKeyDictionary] = weakref.WeakKeyDictionary()
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, client):
        self._client = weakref.ref(client)
        self._listeners: dict = {}  # address -> [listener(address, msg)]

    @classmethod
    def of(cls, client) -> WorkerEvents:
        with cls._lock:
            events = cls._of.get(client)
            if events is None:
                events = cls._of[client] = cls(client)
            return events

    def watch(self, address: str, listener) -> None:
        """Call ``listener(address, msg)`` for each event about ``address`` from now on."""
        with self._lock:
            listeners = self._listeners.setdefault(address, [])
            if listener in listeners:
                return
            listeners.append(listener)
            first = len(listeners) == 1
        client = self._client()
        if first and client is not None and client.status == "running":
            client.subscribe_topic(address, lambda event: self._dispatch(address, event))

    def forget(self, listener) -> None:
        """Stop calling ``listener``; topics nobody watches any more are unsubscribed."""
        with self._lock:
            done = []
            for address, listeners in self._listeners.items():
                if listener in listeners:
                    listeners.remove(listener)
                if not listeners:
                    done.append(address)
            for address in done:
                del self._listeners[address]
        client = self._client()
        if client is not None and client.status == "running":
            for address in done:
                with contextlib.suppress(Exception):  # already gone with the client
                    client.unsubscribe_topic(address)

    def _dispatch(self, address: str, event) -> None:
        with self._lock:
            listeners = list(self._listeners.get(address, ()))
        for listener in listeners:
            listener(address, event[1])


class Liveness:
    """The workers of a cluster as last seen (and those that joined since), less those
    that failed recently or left."""

    def __init__(self, client, timeout: float, nthreads: dict):
        self.client = client
        self.timeout = timeout
        self.nthreads = dict(nthreads)
        self.failures = 0
        #: Workers the cluster retired: they left, and failed nobody.
        self.departed: set = set()
        self._quarantine: dict = {}  # address -> time it failed
        self._why: dict = {}  # address -> how it failed, for the error of wait()
        self._listed: dict = {}  # the workers the scheduler listed last, failed or not
        # Kept: a client that lost its scheduler forgets the address.
        self.scheduler_address = client.scheduler.address

    def check(self) -> None:
        """Raise :func:`scheduler_lost` if the client has lost its scheduler (it is
        reconnecting, or gave up): an evaluation would only wait for it."""
        status = self.client.status
        if status != "running":
            raise scheduler_lost(self.scheduler_address, "the client is trying to reconnect"
                                 if status == "connecting" else f"the client is {status}")

    def lose(self, address: str, why: str = "") -> None:
        """``address`` did not answer (``why``): keep it out of the rotation for a while."""
        if address not in self._quarantine:  # one failure, however many calls saw it
            self.failures += 1
        self._quarantine[address] = time.monotonic()
        self._why[address] = why
        self.nthreads.pop(address, None)

    def join(self, address: str, threads: int) -> None:
        """A worker of ``threads`` threads joined (its probe said so, on the client's event
        loop): the next evaluation places data on it. One that failed us recently waits
        for the scheduler to list it again."""
        if address not in self._quarantine:
            self.nthreads[address] = max(1, int(threads))
            self.departed.discard(address)

    def leave(self, address: str) -> None:
        """A worker left cleanly (the cluster retired it): no message goes to it any more,
        and no failure is counted."""
        self.nthreads.pop(address, None)
        self.departed.add(address)

    async def retired(self, address: str) -> bool:
        """Whether the scheduler's events say the cluster retired ``address`` (asked where
        a message to it failed: a retired worker left, a dead one failed)."""
        if address in self.departed:
            return True
        try:
            events = await asyncio.wait_for(self.client.scheduler.events(topic=address),
                                            self.timeout)
        except Exception:  # noqa: BLE001 - no answer: the worker's failure, as before
            return False
        return any(retirement(msg) for _, msg in events or ())

    async def alive(self) -> dict:
        """Workers the scheduler lists now, less those that just failed us."""
        self.check()
        try:
            # Bounded: a scheduler that does not answer is as good as lost.
            info = await asyncio.wait_for(self.client.scheduler.identity(), self.timeout)
        except (TimeoutError, OSError, CommClosedError) as e:
            raise scheduler_lost(self.scheduler_address, e) from e
        now = time.monotonic()
        self._quarantine = {a: t for a, t in self._quarantine.items()
                            if now - t < QUARANTINE_SECONDS}
        self._listed = {a: w.get("nthreads", 1) for a, w in info.get("workers", {}).items()}
        alive = {a: n for a, n in self._listed.items() if a not in self._quarantine}
        if alive:
            self.nthreads = alive
        return alive

    async def wait(self) -> dict:
        """Workers alive now; waits up to ``timeout`` for one to (re)appear."""
        deadline = time.monotonic() + self.timeout
        while True:
            alive = await self.alive()
            if alive:
                return alive
            if time.monotonic() > deadline and self._listed:
                failed = "; ".join(f"{a} ({self._why.get(a) or 'no answer'})"
                                   for a in sorted(self._listed))
                raise RuntimeError(
                    f"DaskExecutor: the scheduler at {self.scheduler_address} lists "
                    f"{len(self._listed)} worker(s), but none of them answered this client: "
                    f"{failed}. If this client reaches only the scheduler (a port-forward, a "
                    "Kubernetes service, dask-gateway), use DaskExecutor(..., "
                    "transport='scheduler') or transport='auto' (the default); otherwise "
                    "check that the workers' addresses are reachable from here.")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"DaskExecutor: no workers left in the cluster at {self.scheduler_address} "
                    f"(waited {self.timeout:g} s for one to come back); the evaluation cannot go "
                    f"on. Start workers (`dask worker {self.scheduler_address}`), or use another "
                    "executor; a pb.sample run with checkpoint= continues from its last "
                    "checkpoint when called again.")
            await asyncio.sleep(0.1)


def wait_for_workers(client, timeout: float) -> dict:
    """``{address: threads}`` once at least one worker is there, or a clear error."""
    try:
        client.wait_for_workers(1, timeout=timeout)
    except TimeoutError as e:
        address = client.scheduler.address
        raise TimeoutError(f"DaskExecutor: the scheduler at {address} has no workers (waited "
                           f"{timeout:g} s); start some with `dask worker {address}`") from e
    return dict(client.nthreads())


def register(client, plugin, name: str) -> None:
    """Install ``plugin`` on every worker. A worker the scheduler still lists but that is
    gone (killed, unreachable) fails the broadcast with a closed stream: say that the
    workers were lost, and what to do, instead."""
    try:
        client.register_plugin(plugin, name=name)
    except (CommClosedError, OSError) as e:
        address = client.scheduler.address
        raise ConnectionError(
            f"DaskExecutor: the scheduler at {address} answered, but it has no workers that "
            f"answer: they were lost (killed or disconnected; {type(e).__name__}). Start "
            f"workers with `dask worker {address}` (or restart the cluster) and try again") from e


class Releases:
    """Messages telling every worker to forget a site's spec and data, sent without
    waiting (they are sent where a site is evicted: while a model is traced), and the
    means to wait for those on their way (tests, shutdown)."""

    def __init__(self, client, plugin: str, release_everywhere):
        # release_everywhere(client, plugin, tokens, data_tokens): .worker's coroutine
        # (passed in: .worker imports this module)
        self._client, self._plugin, self._release = client, plugin, release_everywhere
        self._lock = threading.Lock()
        self._pending: set = set()

    def send(self, tokens, data_tokens) -> None:
        """Send :func:`.worker.release` of ``tokens`` and ``data_tokens`` everywhere."""
        if self._client.status != "running":
            return
        try:
            future = asyncio.run_coroutine_threadsafe(
                self._release(self._client, self._plugin, tokens, data_tokens),
                self._client.loop.asyncio_loop)
        except RuntimeError:  # the client's event loop is closed: nothing left to tell
            return
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._done)

    def _done(self, future) -> None:
        with self._lock:
            self._pending.discard(future)

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the messages sent so far have reached the workers."""
        with self._lock:
            pending = list(self._pending)
        concurrent.futures.wait(pending, timeout)
