"""The messages between a :class:`~parallel_backend.plugins.dask.DaskExecutor` and its workers.

The client calls two functions on a worker through dask's ``run`` handler (not the
scheduler's task stream, whose batched messages cost more per round trip), straight on
a pooled connection or relayed by the scheduler (:mod:`.transport`):
:func:`~.worker.evaluate` with the traced values of some chunks, and
:func:`~.worker.install` with a call site's spec and pieces of its data. Both answer
with a :class:`Reply`, whichever way they came. :func:`~.worker.release` (a site left the client's cache) goes
to every worker through the scheduler (``Client.run``), without waiting: it arrives in
any order with the others, and a worker that lost what it needs answers ``missing``
and is sent it again. This module owns the reply and the retry limits; it imports
the core's interface only.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = [
    "ERROR",
    "GONE",
    "INSTALL_ATTEMPTS",
    "LEAVING",
    "MAX_ROUNDS",
    "MISSING",
    "OK",
    "QUARANTINE_SECONDS",
    "Reply",
]

OK, MISSING, ERROR, GONE, LEAVING = "ok", "missing", "error", "gone", "leaving"
#: Times a worker is sent a call site's data before it counts as gone.
INSTALL_ATTEMPTS = 3
#: Rounds of re-assigning chunks after worker failures before an evaluation gives up.
MAX_ROUNDS = 8
#: How long a worker address that failed is kept out of the rotation.
QUARANTINE_SECONDS = 60.0


class Reply(NamedTuple):
    """A worker's answer.

    Attributes
    ----------
    status : {"ok", "missing", "error", "gone", "leaving"}
        ``ok``: ``results`` holds the chunk results; ``missing``: the worker needs
        the spec (``need_spec``) or data pieces (``need_shards``) first; ``error``:
        ``fn`` raised (``error``, a ``ChunkError``), or the worker's chunk programs
        could not start (``error``, an ``InFlightLimit``); ``gone``: the worker has no state
        for this executor (restarted), ``detail`` says which; ``leaving``: the cluster
        is retiring the worker (``retire_workers``, ``adapt`` scaling down, a job's
        lifetime ending), which takes no more work.
    """

    status: str
    results: Any = None
    need_spec: bool = False
    need_shards: tuple = ()
    error: Any = None
    detail: str = ""
