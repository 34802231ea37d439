"""Chunk plans: which runs of consecutive tiles each task evaluates.

This module owns :class:`Chunk`, :func:`fixed_chunks` (a user's ``grainsize``),
:func:`even_slots` (each worker's share) and :class:`AdaptiveChunker`
(``grainsize=None``). A chunk is a run of whole tiles (see
:class:`~parallel_backend.blocks.TilePlan`); without a tile plan every block is a
tile. It imports only the standard library and :mod:`parallel_backend.blocks`.

Chunking never changes a result: a block's partials are the same bits in every
run of whole tiles, and partials are combined in block order elsewhere. It
changes only speed, so the chunker is free to adapt while a sampler runs.
"""

from __future__ import annotations

import itertools
import threading
from typing import NamedTuple

from .blocks import BlockPlan, TilePlan

__all__ = [
    "AdaptiveChunker",
    "Chunk",
    "chunks_within",
    "even_slots",
    "fixed_chunks",
    "split_blocks",
    "split_tiles",
]


class Chunk(NamedTuple):
    """Blocks ``[first, first + count)`` evaluated by one task."""

    first: int
    count: int  # type: ignore[assignment]  # a field named so hides tuple.count

    def rows(self, plan: BlockPlan) -> tuple[int, int]:
        """Row range ``[start, stop)`` the chunk covers."""
        return plan.block_range(self.first)[0], plan.block_range(self.first + self.count - 1)[1]


def split_blocks(n_blocks: int, blocks_per_chunk: int, first: int = 0) -> list[Chunk]:
    """Runs of ``blocks_per_chunk`` blocks covering blocks ``[first, first + n_blocks)``;
    the last may be shorter (single-block tiles; see :func:`split_tiles`)."""
    k = max(1, int(blocks_per_chunk))
    return [Chunk(first + b, min(k, n_blocks - b)) for b in range(0, n_blocks, k)]


def split_tiles(tiles: TilePlan, tiles_per_chunk: int, first_tile: int = 0,
                n_tiles: int | None = None) -> list[Chunk]:
    """Runs of ``tiles_per_chunk`` whole tiles covering tiles ``[first_tile,
    first_tile + n_tiles)`` (default: to the last tile), as chunks of blocks.

    Examples
    --------
    >>> split_tiles(TilePlan(n_blocks=10, tile_blocks=4), 1)
    [Chunk(first=0, count=4), Chunk(first=4, count=6)]
    """
    last = tiles.n_tiles if n_tiles is None else first_tile + n_tiles
    k = max(1, int(tiles_per_chunk))
    out = []
    for t in range(first_tile, last, k):
        a = tiles.tile_range(t)[0]
        b = tiles.tile_range(min(t + k, last) - 1)[1]
        out.append(Chunk(a, b - a))
    return out


def chunks_within(tiles: TilePlan, share: Chunk, tiles_per_chunk: int) -> list[Chunk]:
    """Runs of ``tiles_per_chunk`` whole tiles covering ``share`` (itself a run of whole
    tiles, such as a worker's share from :func:`even_slots`).

    Examples
    --------
    >>> tiles = TilePlan(n_blocks=20, tile_blocks=4)
    >>> chunks_within(tiles, Chunk(8, 12), 2)
    [Chunk(first=8, count=8), Chunk(first=16, count=4)]
    """
    last = tiles.n_tiles - 1
    t0 = min(share.first // tiles.tile_blocks, last)
    t1 = min((share.first + share.count - 1) // tiles.tile_blocks, last)
    return split_tiles(tiles, tiles_per_chunk, t0, t1 - t0 + 1)


def even_slots(tiles, parts: int) -> list[Chunk]:
    """At most ``parts`` contiguous runs of whole tiles covering every block, none
    empty, their tile counts differing by at most one: each worker's (or device's)
    share. ``tiles`` is a :class:`TilePlan`, or a number of single-block tiles.

    Examples
    --------
    >>> even_slots(5, 2)
    [Chunk(first=0, count=2), Chunk(first=2, count=3)]
    >>> even_slots(2, 4)
    [Chunk(first=0, count=1), Chunk(first=1, count=1)]
    >>> even_slots(TilePlan(n_blocks=10, tile_blocks=4), 2)
    [Chunk(first=0, count=4), Chunk(first=4, count=6)]
    """
    if not isinstance(tiles, TilePlan):
        tiles = TilePlan(int(tiles), 1)
    n = tiles.n_tiles
    parts = max(1, min(parts, n))
    edges = [round(i * n / parts) for i in range(parts + 1)]
    return [Chunk(tiles.tile_range(a)[0], tiles.tile_range(b - 1)[1] - tiles.tile_range(a)[0])
            for a, b in itertools.pairwise(edges)]


def fixed_chunks(plan: BlockPlan, grainsize: int, tiles: TilePlan | None = None) -> list[Chunk]:
    """Chunks of about ``grainsize`` rows, rounded to whole tiles (at least one).

    Examples
    --------
    >>> from parallel_backend.blocks import plan_blocks
    >>> fixed_chunks(plan_blocks(5000, block_rows=1000), grainsize=2000)
    [Chunk(first=0, count=2), Chunk(first=2, count=2), Chunk(first=4, count=1)]
    """
    tiles = tiles or TilePlan(plan.n_blocks, 1)
    per = max(1, round(grainsize / (plan.block_rows * tiles.tile_blocks)))
    return split_tiles(tiles, per)


class AdaptiveChunker:
    """Picks how many chunks a call makes from measured costs, like TBB's
    auto-partitioner.

    Chunks are even runs of whole tiles (:func:`even_slots`: their tile counts differ
    by at most one) and their number is a multiple of the workers, so every worker
    gets the same work: ``chunks_per_worker`` chunks each, or fewer, larger ones where
    task overhead would otherwise exceed ``max_overhead`` of a chunk's work (one per
    worker at least). Chunks of unequal size leave a worker idle at the end of every
    call while the other finishes. An even split into ``m`` chunks has at most two
    chunk shapes, so the compiled chunk shapes stay a handful. It settles (stops
    changing) after ``settle_after`` measured calls.

    Parameters
    ----------
    plan : BlockPlan
    workers : int
        Tasks that can run at once.
    chunks_per_worker : int
        Aim for this many chunks per worker (the executor's ``chunks_per_worker``):
        more than one evens out workers of unequal speed, at the cost of a task each.
    max_overhead : float
        Largest acceptable share of task overhead in a chunk's time.
    settle_after : int
        Measured calls after which the choice is frozen.
    tiles : TilePlan, optional
        The tiles chunks are made of; default: every block a tile.

    Examples
    --------
    >>> from parallel_backend.blocks import plan_blocks
    >>> chunker = AdaptiveChunker(plan_blocks(800 * 250, block_rows=250), workers=2)
    >>> [c.count for c in chunker.chunks()]
    [200, 200, 200, 200]
    """

    def __init__(self, plan: BlockPlan, workers: int, *, chunks_per_worker: int = 2,
                 max_overhead: float = 0.05, settle_after: int = 4,
                 tiles: TilePlan | None = None):
        self.plan = plan
        self.tiles = tiles or TilePlan(plan.n_blocks, 1)
        self.workers = max(1, int(workers))
        self.chunks_per_worker = max(1, int(chunks_per_worker))
        self.max_overhead = max_overhead
        self.settle_after = settle_after
        self._lock = threading.Lock()
        self._block_seconds: list[float] = []
        self._overhead_seconds: list[float] = []
        self._plans: dict = {}  # number of chunks -> chunks
        self._parts = min(self.tiles.n_tiles, self.workers * self.chunks_per_worker)

    @property
    def settled(self) -> bool:
        """Whether the choice is frozen."""
        return len(self._block_seconds) >= self.settle_after

    @property
    def parts(self) -> int:
        """The current choice: chunks per call."""
        return self._parts

    @property
    def tiles_per_chunk(self) -> int:
        """Tiles in the largest chunk of the current choice."""
        return -(-self.tiles.n_tiles // self._parts)

    @property
    def blocks_per_chunk(self) -> int:
        """Blocks in the largest chunk of the current choice."""
        return max(c.count for c in self.chunks())

    def chunks(self) -> list[Chunk]:
        """The chunk plan for the next call (each plan made once: a settled chunker
        hands out the same list at every evaluation)."""
        k = self._parts
        plan = self._plans.get(k)
        if plan is None:
            plan = self._plans[k] = even_slots(self.tiles, k)
        return plan

    def record(self, blocks: int, compute_seconds: float, overhead_seconds: float) -> None:
        """Feed one measured chunk: its blocks, compute time and task overhead."""
        if blocks <= 0:
            return
        with self._lock:
            if self.settled:
                return
            self._block_seconds.append(compute_seconds / blocks)
            self._overhead_seconds.append(max(overhead_seconds, 0.0))
            self._parts = self._choose()

    def _choose(self) -> int:
        per_tile = sorted(self._block_seconds)[len(self._block_seconds) // 2] * self.tiles.tile_blocks
        overhead = sorted(self._overhead_seconds)[len(self._overhead_seconds) // 2]
        n, w = self.tiles.n_tiles, self.workers
        parts = w * self.chunks_per_worker
        # Fewest tiles for which overhead stays a small share of a chunk's work.
        needed = overhead / max(per_tile * self.max_overhead, 1e-12)
        if needed * parts > n:
            # Overhead dominates: fewer, larger chunks, still the same number per worker
            # (one per worker at least).
            parts = max(w, int(n / needed) // w * w)
        return max(1, min(parts, n))

    def __repr__(self) -> str:
        return (f"AdaptiveChunker(tiles={self.tiles.n_tiles}, workers={self.workers}, "
                f"chunks={self._parts}, settled={self.settled})")
