"""Every use of dask.distributed's private parts, in one place.

On the direct route an evaluation sends one message straight to each worker instead of a
task through the scheduler: that needs the client's connection pool and distributed's
request/reply call, neither of which is public API, and the worker side finds its state
among the worker's plugins. The route through the scheduler (``Client.run``) is public. Each use
is a small name here; ``tests/integration/test_dask.py::test_dask_internals`` fails,
naming the version, when a release changes one of them. Tested on dask and
distributed 2026.8.0 (Python 3.11, 3.12, 3.13); ``docs/layout.rst`` lists them.
"""

from __future__ import annotations

from distributed.core import send_recv as _send_recv

__all__ = ["connection_pool", "request", "run_on", "worker_plugin"]


def connection_pool(client):
    """The client's pool of connections to scheduler and workers (``Client.rpc``, a
    ``distributed.core.ConnectionPool``: ``connect(addr, timeout)``, ``reuse(addr,
    comm)``)."""
    return client.rpc


async def request(comm, **message):
    """Send ``message`` on ``comm`` and wait for the reply
    (``distributed.core.send_recv``; ``op="run"`` runs a pickled function on a worker,
    as ``Client.run`` does)."""
    return await _send_recv(comm, **message)


async def run_on(client, addr: str, function: bytes, args: bytes, timeout: float):
    """The reply of the worker at ``addr`` to running the pickled ``function`` on the
    pickled ``args``, over the client's pool (a connection that failed is dropped, not
    reused)."""
    pool = connection_pool(client)
    comm = await pool.connect(addr, timeout=timeout)
    ok = False
    try:
        reply = await request(comm, op="run", function=function, args=args, wait=True)
        ok = True
    finally:
        if ok:
            pool.reuse(addr, comm)
        else:
            comm.abort()
    return reply


def worker_plugin(dask_worker, name: str):
    """The worker plugin registered as ``name`` (``Worker.plugins``, a dict), or ``None``."""
    return getattr(dask_worker, "plugins", {}).get(name)
