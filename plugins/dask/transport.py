"""How the client's messages reach a worker: straight to it, or relayed by the scheduler.

Every message of an evaluation is a pickled function of :mod:`.worker` and its pickled
arguments, run by the worker's ``run`` handler, which answers with a
:class:`~.protocol.Reply`. Two routes carry it:

``"direct"``
    A connection of the client's pool straight to the worker (:func:`.internals.run_on`):
    one round trip, no other process involved. Needs a client that can open a connection
    to every worker's address (the same network as the cluster).
``"scheduler"``
    ``Client.run`` of :func:`.worker.relay` on that one worker: the scheduler forwards the
    same bytes to the worker on its own connection and the reply back. Two hops and the
    scheduler's event loop, but the client needs to reach only the scheduler (a Kubernetes
    service or port-forward, dask-gateway's proxy, a managed service). The worker runs
    the same function on the same arguments, so the results are the same bits.

:class:`Routes` picks one per worker. ``"direct"`` or ``"scheduler"`` given to the executor
is used for every worker. ``"auto"`` probes a worker at its first message: a trivial
call straight to it, bounded by :data:`PROBE_SECONDS`; if it answers, that worker is
messaged directly, else through the scheduler (where the scheduler cannot reach it either,
the worker is gone, as on any route). Once no worker has answered directly and some have
through the scheduler, workers that join later go through the scheduler without a probe.
:class:`Routes` also keeps what a message costs beyond the workers' compute on each
route, for ``stats()`` and the log.

Imports distributed, cloudpickle and the modules beside it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import statistics
import time

import cloudpickle
from distributed.comm.core import CommClosedError

from . import worker as remote
from .internals import run_on

__all__ = ["DIRECT", "LOST", "PROBE_SECONDS", "SCHEDULER", "TRANSPORTS", "Routes",
           "SchedulerUnreachable"]

log = logging.getLogger("parallel_backend.dask")

DIRECT, SCHEDULER = "direct", "scheduler"
#: What ``DaskExecutor(transport=...)`` takes.
TRANSPORTS = ("auto", DIRECT, SCHEDULER)
#: Longest wait for a worker's first direct answer before it is reached through the
#: scheduler (a blackholed address answers nothing; a reachable worker answers in ms).
PROBE_SECONDS = 3.0
#: Messages whose cost beyond compute is kept per route (the median is reported).
KEPT = 64

_PING = cloudpickle.dumps(remote.ping)
_NO_ARGS = cloudpickle.dumps(())
#: Failures that mean "this worker is gone" (connection refused, closed, timed out), not
#: "fn is wrong".
LOST = (OSError, CommClosedError, TimeoutError, EOFError)


class SchedulerUnreachable(Exception):
    """The scheduler did not relay a message (the client lost it, or it failed): not the
    worker's fault; the executor asks whether the scheduler is still there."""


class Routes:
    """The route to each worker, chosen per :data:`TRANSPORTS`, and what a message costs.

    Parameters
    ----------
    client : distributed.Client
    transport : {"auto", "direct", "scheduler"}
    timeout : float
        Seconds to wait for a connection to a worker on the direct route.
    """

    def __init__(self, client, transport: str, timeout: float):
        if transport not in TRANSPORTS:
            raise ValueError(f"DaskExecutor: unknown transport {transport!r}; known: "
                             f"{sorted(TRANSPORTS)}")
        self.client = client
        self.transport = transport
        self.timeout = timeout
        self._route: dict = {}  # address -> DIRECT or SCHEDULER
        self._probes: dict = {}  # address -> asyncio.Task of its probe
        self._cost: dict[str, collections.deque[float]] = {
            DIRECT: collections.deque(maxlen=KEPT), SCHEDULER: collections.deque(maxlen=KEPT)}

    # -- choosing ------------------------------------------------------------------

    async def route(self, addr: str) -> str:
        """The route to ``addr``; probed at its first message under ``"auto"``."""
        known = self._route.get(addr)
        if known is not None:
            return known
        if self.transport != "auto":
            self._route[addr] = self.transport
            log.info("worker %s: %s, as asked (transport=%r)", addr,
                     "direct" if self.transport == DIRECT else "through the scheduler",
                     self.transport)
            return self.transport
        if SCHEDULER in self._route.values() and DIRECT not in self._route.values():
            self._route[addr] = SCHEDULER
            log.info("worker %s: through the scheduler, as every worker before it (this "
                     "client reaches none directly)", addr)
            return SCHEDULER
        probe = self._probes.get(addr)
        if probe is None:  # one probe per worker, whoever asks first
            probe = self._probes[addr] = asyncio.ensure_future(self._probe(addr))
        try:
            return await asyncio.shield(probe)
        finally:
            if probe.done():
                self._probes.pop(addr, None)

    async def _probe(self, addr: str) -> str:
        wait = min(PROBE_SECONDS, self.timeout)
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(run_on(self.client, addr, _PING, _NO_ARGS, wait), wait)
        except (*LOST, RuntimeError) as e:
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        else:
            self._route[addr] = DIRECT
            log.info("worker %s: direct (a trivial call took %.1f ms)", addr,
                     1e3 * (time.perf_counter() - t0))
            return DIRECT
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(self._relay(addr, _PING, _NO_ARGS), self.timeout)
        except (*LOST, RuntimeError) as e:
            # Nobody reaches it: gone. The evaluation loses it and asks the scheduler again;
            # a later worker at this address is probed afresh.
            raise CommClosedError(f"the worker {addr} answers neither directly ({why}) nor "
                                  f"through the scheduler ({type(e).__name__}: {e})") from e
        self._route[addr] = SCHEDULER
        log.info("worker %s: through the scheduler (no direct answer within %.3g s: %s); a "
                 "trivial call through the scheduler took %.1f ms", addr, wait, why,
                 1e3 * (time.perf_counter() - t0))
        return SCHEDULER

    def forget(self, addr: str) -> None:
        """``addr`` is gone: a worker that comes back there is probed again."""
        self._route.pop(addr, None)

    # -- sending -------------------------------------------------------------------

    async def send(self, addr: str, function: bytes, args: bytes):
        """The :class:`~.protocol.Reply` of the worker at ``addr`` to ``function(*args)``
        (both pickled), by its route. Raises a connection error where the worker did not
        answer, :class:`SchedulerUnreachable` where the scheduler did not relay."""
        if await self.route(addr) == DIRECT:
            reply = await run_on(self.client, addr, function, args, self.timeout)
            if isinstance(reply, dict) and reply.get("status") == "OK":
                return reply["result"]
            # dask's error reply names the exception in "exception_text" (a task that
            # could not even be unpickled there, say)
            text = (reply.get("exception_text") or reply.get("text")
                    if isinstance(reply, dict) else reply)
            raise RuntimeError(f"DaskExecutor: worker {addr} failed to run a parallel_backend "
                               f"task: {text}")
        return await self._relay(addr, function, args)

    async def _relay(self, addr: str, function: bytes, args: bytes):
        try:
            out = await self.client.run(remote.relay, function, args, workers=[addr],
                                        on_error="return", asynchronous=True)
        except LOST as e:
            raise SchedulerUnreachable(f"{type(e).__name__}: {e}") from e
        if addr not in out:
            raise CommClosedError(f"the scheduler no longer knows the worker {addr}")
        reply = out[addr]
        if isinstance(reply, LOST):
            raise reply
        if not isinstance(reply, BaseException):
            return reply
        raise RuntimeError(f"DaskExecutor: worker {addr} failed to run a parallel_backend "
                           f"task: {type(reply).__name__}: {reply}") from reply

    # -- reporting -----------------------------------------------------------------

    def observe(self, addr: str, seconds: float) -> None:
        """A message to ``addr`` cost ``seconds`` beyond its compute."""
        route = self._route.get(addr)
        if route is not None:
            self._cost[route].append(seconds)

    def routes(self) -> dict:
        """Worker address -> its route, for the workers messaged so far."""
        return dict(self._route)

    def summary(self) -> str:
        """``"direct"``, ``"scheduler"``, ``"direct+scheduler"`` (some workers each way),
        or the transport asked for while no worker has been messaged."""
        used = set(self._route.values())
        if not used:
            return self.transport
        return "+".join(r for r in (DIRECT, SCHEDULER) if r in used)

    def cost(self) -> dict:
        """Route -> median seconds a message cost beyond its compute (the last
        :data:`KEPT` messages), for the routes used."""
        return {r: statistics.median(c) for r, c in self._cost.items() if c}
