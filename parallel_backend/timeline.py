"""A gradient's timeline: when each chunk of a host evaluation ran, and on which worker.

Every host evaluation (:func:`.host.evaluate`) leaves an :class:`EvaluationSpan` in its
executor's :class:`Timeline` (made there, so that an evaluation enters no module of its
own for it): when the callback started and ended and, per chunk, the
worker that ran it and when (``time.time()`` of the process that ran it: comparable on
one machine; across machines only as far as their clocks agree). A timeline keeps the
last few evaluations only (:data:`KEEP`), so a long run's memory does not grow;
``executor.stats(timeline=True)`` returns them.

:func:`losses` splits the capacity of an evaluation (its workers times its wall time)
into the chunks' own time and where the rest went: dispatch (before a worker's first
chunk and between its chunks: messages, transfers, waiting for a thread), load imbalance
(a worker done while another still runs), assembly (after the last chunk, inside the
callback), idle workers (no chunk at all) and, where the caller's time per gradient is
known, the caller's program around the callback. Imports the standard library only.
"""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

__all__ = [
    "KEEP",
    "LOSSES",
    "ChunkSpan",
    "EvaluationSpan",
    "Timeline",
    "largest",
    "largest_loss",
    "losses",
    "shares",
]

#: Evaluations a timeline keeps (the last ones).
KEEP = 16

#: The parts :func:`losses` names, in order.
LOSSES = ("dispatch", "load imbalance", "assembly", "idle workers", "caller's program")


class ChunkSpan(NamedTuple):
    """One chunk of an evaluation: the worker that ran it (process and thread, or a dask
    worker's address), its first block and block count, and when it started and ended
    (seconds since the epoch)."""

    worker: str
    first: int
    blocks: int
    start: float
    end: float


class EvaluationSpan(NamedTuple):
    """One host evaluation: the site, when its callback started and ended, and its
    chunks."""

    site: str
    start: float
    end: float
    chunks: tuple

    @property
    def wall(self) -> float:
        """Seconds from the callback's start to its end."""
        return self.end - self.start

    def as_dict(self) -> dict[str, Any]:
        """Plain values, times relative to the callback's start."""
        return {"site": self.site, "start": self.start, "seconds": self.wall,
                "chunks": [{"worker": c.worker, "first_block": c.first, "blocks": c.blocks,
                            "start": c.start - self.start, "end": c.end - self.start}
                           for c in self.chunks]}

    @classmethod
    def from_dict(cls, d: dict) -> EvaluationSpan:
        """The span :meth:`as_dict` gave ``d`` for (a record read back from JSON)."""
        start = float(d["start"])
        chunks = tuple(ChunkSpan(c["worker"], int(c["first_block"]), int(c["blocks"]),
                                 start + c["start"], start + c["end"]) for c in d["chunks"])
        return cls(d["site"], start, start + float(d["seconds"]), chunks)


class Timeline(collections.deque):
    """The last :data:`KEEP` evaluations of one executor, oldest first: a ``deque``, to
    which :func:`.host.evaluate` appends an :class:`EvaluationSpan` per evaluation (an
    append is atomic)."""

    def __init__(self, spans=(), keep: int = KEEP):
        super().__init__(spans, maxlen=keep)

    def last(self, n: int | None = None) -> list[EvaluationSpan]:
        """The last ``n`` evaluations (all kept, by default), oldest first."""
        spans = list(self)
        return spans if n is None else spans[-n:]


def losses(span: EvaluationSpan, workers: int,
           seconds_per_gradient: float | None = None) -> dict:
    """Where ``span``'s capacity went, in worker-seconds: ``chunks`` (their own compute)
    and each of :data:`LOSSES`; they add up to ``workers * wall`` (or ``workers *
    seconds_per_gradient`` where that is given: the whole gradient, the caller's program
    around the callback included). ``workers``: the executor's.

    >>> s = EvaluationSpan("f", 0.0, 1.0, (ChunkSpan("a", 0, 2, 0.1, 0.9),
    ...                                    ChunkSpan("b", 2, 2, 0.1, 0.5)))
    >>> {k: round(v, 2) for k, v in losses(s, 2, 1.25).items()}  # doctest: +NORMALIZE_WHITESPACE
    {'chunks': 1.2, 'dispatch': 0.2, 'load imbalance': 0.4, 'assembly': 0.2,
     'idle workers': 0.0, "caller's program": 0.5}
    """
    by_worker: dict = {}
    for c in span.chunks:
        by_worker.setdefault(c.worker, []).append(c)
    out = dict.fromkeys(("chunks", *LOSSES), 0.0)
    if not by_worker:  # nothing ran (a product along zero): all of it is overhead
        out["assembly"] = workers * span.wall
    else:
        last_end = max(c.end for c in span.chunks)
        for chunks in by_worker.values():
            busy = sum(c.end - c.start for c in chunks)
            first, end = min(c.start for c in chunks), max(c.end for c in chunks)
            out["chunks"] += busy
            out["dispatch"] += (first - span.start) + (end - first - busy)
            out["load imbalance"] += last_end - end
            out["assembly"] += span.end - last_end
        out["idle workers"] = max(workers - len(by_worker), 0) * span.wall
    if seconds_per_gradient is not None:
        out["caller's program"] = workers * max(seconds_per_gradient - span.wall, 0.0)
    return out


def shares(spans, workers: int, seconds_per_gradient: float | None = None) -> dict | None:
    """:func:`losses` summed over ``spans``, as shares of their capacity (they add up to
    one); ``None`` where there is none (no spans, or none with a duration)."""
    total = dict.fromkeys(("chunks", *LOSSES), 0.0)
    for span in spans:
        for k, v in losses(span, workers, seconds_per_gradient).items():
            total[k] += v
    capacity = sum(total.values())
    return {k: v / capacity for k, v in total.items()} if capacity > 0 else None


def largest(share: dict | None) -> tuple[str, float]:
    """The largest of :data:`LOSSES` in ``share`` (:func:`shares`) and its share."""
    share = share or {}
    name = max(LOSSES, key=lambda k: share.get(k, 0.0))
    return name, share.get(name, 0.0)


def largest_loss(spans, workers: int,
                 seconds_per_gradient: float | None = None) -> tuple[str, float]:
    """The largest of :data:`LOSSES` over ``spans`` and its share of their capacity."""
    return largest(shares(spans, workers, seconds_per_gradient))
