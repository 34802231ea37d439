"""Chunk plans: which runs of consecutive blocks each task evaluates.

This module owns :class:`ChunkPlan`, :func:`fixed_chunks` (a user's ``grainsize``)
and :class:`AdaptiveChunker` (``grainsize=None``). It imports only the standard
library and :mod:`parallel_backend.blocks`.

Chunking never changes a result: every block is evaluated by the same compiled
body and partials are combined in block order elsewhere. It changes only speed,
so the chunker is free to adapt while a sampler runs.
"""

from __future__ import annotations

import math
import threading
from typing import NamedTuple

from .blocks import BlockPlan

__all__ = ["Chunk", "fixed_chunks", "AdaptiveChunker"]


class Chunk(NamedTuple):
    """Blocks ``[first, first + count)`` evaluated by one task."""

    first: int
    count: int

    def rows(self, plan: BlockPlan) -> tuple[int, int]:
        """Row range ``[start, stop)`` the chunk covers."""
        return plan.block_range(self.first)[0], plan.block_range(self.first + self.count - 1)[1]


def split_blocks(n_blocks: int, blocks_per_chunk: int, first: int = 0) -> list[Chunk]:
    """Runs of ``blocks_per_chunk`` blocks covering blocks ``[first, first + n_blocks)``;
    the last may be shorter."""
    k = max(1, int(blocks_per_chunk))
    return [Chunk(first + b, min(k, n_blocks - b)) for b in range(0, n_blocks, k)]


def even_slots(n_blocks: int, parts: int) -> list[Chunk]:
    """At most ``parts`` contiguous runs of blocks covering ``n_blocks``, none empty,
    their lengths differing by at most one: each worker's (or device's) share.

    Examples
    --------
    >>> even_slots(5, 2)
    [Chunk(first=0, count=2), Chunk(first=2, count=3)]
    >>> even_slots(2, 4)
    [Chunk(first=0, count=1), Chunk(first=1, count=1)]
    """
    parts = max(1, min(parts, n_blocks))
    edges = [round(i * n_blocks / parts) for i in range(parts + 1)]
    return [Chunk(a, b - a) for a, b in zip(edges, edges[1:])]


def blocks_for_grainsize(plan: BlockPlan, grainsize: int) -> int:
    """Whole blocks per chunk closest to ``grainsize`` rows (at least one)."""
    return max(1, round(grainsize / plan.block_rows))


def fixed_chunks(plan: BlockPlan, grainsize: int) -> list[Chunk]:
    """Chunks of ``grainsize`` rows, rounded to whole blocks.

    Examples
    --------
    >>> from parallel_backend.blocks import plan_blocks
    >>> fixed_chunks(plan_blocks(5000, block_rows=1000), grainsize=2000)
    [Chunk(first=0, count=2), Chunk(first=2, count=2), Chunk(first=4, count=1)]
    """
    return split_blocks(plan.n_blocks, blocks_for_grainsize(plan, grainsize))


def _pow2_floor(x: float) -> int:
    return 1 << max(0, int(math.floor(math.log2(max(x, 1.0)))))


class AdaptiveChunker:
    """Picks blocks per chunk from measured costs, like TBB's auto-partitioner.

    It starts with a few chunks per worker, then, from the measured time per block
    and per-task overhead, chooses the largest power-of-two chunk that still gives
    each worker ``chunks_per_worker`` chunks, but never so small that task overhead
    exceeds ``max_overhead`` of the work. Powers of two keep the number of distinct
    compiled chunk shapes to a handful. It settles (stops changing) after
    ``settle_after`` measured calls.

    Parameters
    ----------
    plan : BlockPlan
    workers : int
        Tasks that can run at once.
    chunks_per_worker : int
        Aim for this many chunks per worker, for load balance.
    max_overhead : float
        Largest acceptable share of task overhead in a chunk's time.
    settle_after : int
        Measured calls after which the choice is frozen.
    """

    def __init__(self, plan: BlockPlan, workers: int, *, chunks_per_worker: int = 2,
                 max_overhead: float = 0.05, settle_after: int = 4):
        self.plan = plan
        self.workers = max(1, int(workers))
        self.chunks_per_worker = chunks_per_worker
        self.max_overhead = max_overhead
        self.settle_after = settle_after
        self._lock = threading.Lock()
        self._block_seconds: list[float] = []
        self._overhead_seconds: list[float] = []
        target = plan.n_blocks / (self.workers * chunks_per_worker)
        self._blocks_per_chunk = _pow2_floor(target)

    @property
    def settled(self) -> bool:
        """Whether the choice is frozen."""
        return len(self._block_seconds) >= self.settle_after

    @property
    def blocks_per_chunk(self) -> int:
        """The current choice."""
        return self._blocks_per_chunk

    def chunks(self) -> list[Chunk]:
        """The chunk plan for the next call."""
        return split_blocks(self.plan.n_blocks, self._blocks_per_chunk)

    def record(self, blocks: int, compute_seconds: float, overhead_seconds: float) -> None:
        """Feed one measured chunk: its blocks, compute time and task overhead."""
        if blocks <= 0:
            return
        with self._lock:
            if self.settled:
                return
            self._block_seconds.append(compute_seconds / blocks)
            self._overhead_seconds.append(max(overhead_seconds, 0.0))
            self._blocks_per_chunk = self._choose()

    def _choose(self) -> int:
        per_block = sorted(self._block_seconds)[len(self._block_seconds) // 2]
        overhead = sorted(self._overhead_seconds)[len(self._overhead_seconds) // 2]
        balanced = self.plan.n_blocks / (self.workers * self.chunks_per_worker)
        # Fewest blocks for which overhead stays a small share of a chunk's work.
        needed = overhead / max(per_block * self.max_overhead, 1e-12)
        if needed > balanced:
            # Overhead dominates: fewer, larger chunks (one per worker at most).
            balanced = max(needed, self.plan.n_blocks / self.workers)
        return min(_pow2_floor(balanced), _pow2_floor(self.plan.n_blocks))

    def __repr__(self) -> str:
        return (f"AdaptiveChunker(blocks={self.plan.n_blocks}, workers={self.workers}, "
                f"blocks_per_chunk={self._blocks_per_chunk}, settled={self.settled})")
