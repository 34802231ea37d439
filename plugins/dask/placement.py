"""Where a call site's data lives on a dask cluster, and how much of it each worker holds.

A call site's prepared data is cut into *shards*: contiguous runs of whole tiles, at
most one per worker thread, each named by its blocks (``Chunk(first, count)``). Each
shard is sent once to the worker that evaluates it and stays there, keyed by the
data's content, so a re-built model over the same data finds it. This module owns
:class:`RemoteSite` (what the client knows about one site on the cluster),
:class:`Layout` (the shards of one data set and who holds each, shared by every site
over that data) and the assignment of shards to workers.

The data starts out in proportion to the workers' threads, and is placed so again over
every worker present when workers join (:meth:`Layout.grow`); the shards of a worker that
leaves go to the least loaded of those that remain (:func:`assign`). How many tiles a
worker holds is then decided from measurements (:meth:`Layout.observe`):
its round trip (the time of its message less its compute) and its seconds per block
per thread. The data starts out in proportion to the workers' threads; after
``SETTLE + WINDOW`` evaluations :func:`share_tiles` gives each worker the tiles that
make the slowest worker's (round trip + compute) smallest, and the data is placed
again only where that gain, over ``HORIZON`` evaluations, pays for what the last
placement cost, and is at least ``MIN_GAIN`` of the predicted evaluation, a share
that doubles with every move; never back to a layout it left, at most ``MAX_MOVES``
times. Which
worker evaluates a block never changes its bits: the blocks are fixed, and their
partials are combined in block order by the core.

Imports numpy, cloudpickle and the core's interface.
"""

from __future__ import annotations

import hashlib
import statistics

import cloudpickle
import numpy as np

from parallel_backend.extend import Chunk, even_slots

__all__ = ["Layout", "RemoteSite", "assign", "blocks_held", "compute_span", "content_token",
           "forget_revived", "share_tiles"]

#: Evaluations after a placement left out of its measurements: they install data and
#: compile the new chunk shapes (their excess is what one placement costs).
SETTLE = 2
#: Evaluations measured before the layout is reconsidered (medians of these).
WINDOW = 6
#: The coming evaluations a re-placement must pay for itself over (a NUTS draw makes up
#: to ``2 ** max_tree_depth`` of them).
HORIZON = 1000
#: Least predicted gain worth the first re-placement, as a share of the predicted
#: evaluation (below it, the noise of the measurements would decide); doubled for each
#: further one, so that the layout settles.
MIN_GAIN = 0.1
#: Re-placements at most per layout.
MAX_MOVES = 3


class RemoteSite:
    """A call site as the cluster sees it.

    Attributes
    ----------
    label : str
        The site's label, for errors.
    spec : bytes
        The cloudpickled :class:`~parallel_backend.extend.SiteSpec`.
    token : str
        Hash of ``spec``: the site's name on the workers.
    data_token : str
        Hash of the prepared data's content: the data's name on the workers.
    tiles : TilePlan
        The site's tiles: a shard is a run of whole tiles.
    layout : Layout
        Its data's shards and who holds each (the executor shares it between sites
        over the same data).
    """

    def __init__(self, state):
        # Not the state itself: an evicted state's RemoteSite must not keep it alive.
        self.label = state.label
        try:
            self.spec = cloudpickle.dumps(state.spec)
        except Exception as e:
            raise TypeError(f"DaskExecutor: fn {state.label!r} (and what it refers to) must be "
                            f"picklable with cloudpickle to run on dask workers: "
                            f"{type(e).__name__}: {e}") from e
        self.token = hashlib.blake2b(self.spec, digest_size=16).hexdigest()
        self.arrays = tuple(np.asarray(x) for x in state.prepared())
        self.data_token = content_token(self.arrays, state.spec.plan)
        self.tiles = state.spec.tiles
        self.layout = Layout(self.tiles)

    def piece(self, shard: Chunk):
        """``(shard, first block, arrays of its blocks)``: what ``install`` sends."""
        return shard, shard.first, tuple(x[shard.first:shard.first + shard.count]
                                         for x in self.arrays)


def content_token(arrays, plan) -> str:
    """A hash of the prepared blocks and the block plan."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((plan.n_rows, plan.block_rows)).encode())
    for x in arrays:
        h.update(repr((x.shape, x.dtype.str)).encode())
        h.update(np.ascontiguousarray(x).data.cast("B"))
    return h.hexdigest()


def finish(cost, tiles: int) -> float:
    """Predicted seconds until a worker of ``cost = (round trip, seconds per tile per
    thread, threads)`` answers for ``tiles`` tiles (0 when it is not asked)."""
    trip, per_tile, threads = cost
    return 0.0 if tiles == 0 else trip + -(-tiles // threads) * per_tile


def share_tiles(n_tiles: int, costs: dict) -> dict:
    """Tiles per worker (``costs``: address -> ``(round trip, seconds per tile per thread,
    threads)``, in block order) that make the slowest worker's :func:`finish` smallest.

    Each tile in turn goes to the worker that would answer first with it; since every
    worker's finish grows with its tiles, the tiles given are the ``n_tiles`` smallest
    finishing times, which is the least maximum. Ties go to the worker listed first.

    Examples
    --------
    >>> share_tiles(12, {"a": (0.0, 1.0, 1), "b": (0.0, 1.0, 2)})  # by threads
    {'a': 4, 'b': 8}
    >>> share_tiles(12, {"a": (0.005, 0.002, 1), "b": (0.0005, 0.002, 2)})  # a slow link
    {'a': 2, 'b': 10}
    """
    counts = dict.fromkeys(costs, 0)
    for _ in range(n_tiles):
        best = min(costs, key=lambda w: finish(costs[w], counts[w] + 1))
        counts[best] += 1
    return counts


class Layout:
    """The shards of one data set on the cluster, who holds each, and the measurements
    that decide whether to move them.

    Attributes
    ----------
    tiles : TilePlan
        The tiles shards are made of.
    shards : list of Chunk
        Runs of whole tiles covering every block, in block order (empty until placed).
    owners : list
        Per shard, the address of the worker that holds it (``None``: its worker was
        lost; :func:`assign` gives it another). Both lists are replaced when the data
        is placed again, so an evaluation keeps the ones it started with.
    moves : int
        Re-placements made by measured cost since the workers last joined.
    workers : set
        The workers the last placement was made over (those that joined since are not
        among them).
    """

    def __init__(self, tiles):
        self.tiles = tiles
        self.shards: list = []
        self.owners: list = []
        #: The worker each shard without an owner (``None`` in :attr:`owners`) had.
        self.vacated: dict = {}
        self.workers: set = set()
        self.moves = 0
        self._placed: set = set()  # tile counts placed so far: never go back to one
        self._cost = None  # seconds the last placement cost (its settling evaluations)
        self._measure()

    def _measure(self) -> None:
        """Start measuring afresh: the layout (or its workers) just changed."""
        self._settle: list = []  # walls of the first SETTLE evaluations
        self._walls: list = []  # walls of the evaluations since
        self._samples: dict = {}  # address -> [(round trip, seconds per block per thread)]

    def tiles_held(self) -> dict:
        """Address -> tiles, for the workers that hold shards (in block order)."""
        held: dict = {}
        n = self.tiles.n_tiles
        size = self.tiles.tile_blocks
        for s, a in zip(self.shards, self.owners):
            t0, t1 = min(s.first // size, n - 1), min((s.first + s.count - 1) // size, n - 1)
            held[a] = held.get(a, 0) + t1 - t0 + 1
        return held

    def start(self, threads: dict) -> None:
        """Place the data in proportion to the workers' threads (``address -> threads``),
        workers in address order."""
        self.place(share_tiles(self.tiles.n_tiles, {a: (0.0, 1.0, threads[a])
                                                    for a in sorted(threads)}), threads)

    def grow(self, threads: dict) -> None:
        """Workers joined: place the data over all of ``threads`` (``address -> threads``)
        in proportion to their threads, the workers that hold shards first, in their
        order along the blocks, so that most of what they hold stays theirs. A new set of
        workers: the measured moves start again from 0."""
        held = [a for a in dict.fromkeys(self.owners) if a in threads]
        order = held + sorted(a for a in threads if a not in held)
        self.moves = 0
        self.place(share_tiles(self.tiles.n_tiles, {a: (0.0, 1.0, threads[a])
                                                    for a in order}), threads)

    def place(self, counts: dict, threads: dict) -> None:
        """Each worker its ``counts`` tiles (in block order), cut into one run per thread."""
        shards, owners, t = [], [], 0
        for addr, m in counts.items():
            for part in even_slots(m, min(threads.get(addr, 1), m)) if m else ():
                a = self.tiles.tile_range(t + part.first)[0]
                b = self.tiles.tile_range(t + part.first + part.count - 1)[1]
                shards.append(Chunk(a, b - a))
                owners.append(addr)
            t += m
        self.shards, self.owners, self.vacated = shards, owners, {}
        self.workers = set(threads)
        self._placed.add(tuple(counts.items()))
        self._cost = None
        self._measure()

    def lose(self, addr: str) -> None:
        """``addr`` is gone: its shards wait for :func:`assign` to give them to others (a
        worker that comes back at ``addr`` counts as joining)."""
        self.workers.discard(addr)
        if addr in self.owners:
            self.vacated.update((i, addr) for i, a in enumerate(self.owners) if a == addr)
            self.owners[:] = [None if a == addr else a for a in self.owners]
            self._measure()

    def observe(self, shards, addr: str, threads: int, group, results, wall) -> None:
        """One worker's part of an evaluation: ``group`` (shard, chunk) gave ``results``
        in ``wall`` seconds (``None``: data was installed on the way, not a measure)."""
        if shards is not self.shards or wall is None or len(self._settle) < SETTLE:
            return
        busy = sum(r.seconds for r in results)
        blocks = sum(c.count for _, c in group)
        self._samples.setdefault(addr, []).append(
            (max(wall - compute_span(group, results, threads), 0.0), busy / blocks))

    def evaluated(self, shards, wall: float, threads: dict) -> bool:
        """An evaluation of ``shards`` took ``wall`` seconds; after a window of them, place
        the data again if that pays (returns whether it did)."""
        if shards is not self.shards:
            return False
        (self._settle if len(self._settle) < SETTLE else self._walls).append(wall)
        if len(self._walls) < WINDOW:
            return False
        typical = statistics.median(self._walls)
        if self._cost is None:
            self._cost = sum(max(w - typical, 0.0) for w in self._settle)
        proposal = self.propose(threads)
        self._walls, self._samples = [], {}
        if proposal is None:
            return False
        self.moves += 1
        self.place(proposal, threads)
        return True

    def propose(self, threads: dict) -> dict | None:
        """The tile counts to move to, or ``None`` where the present ones should stay."""
        held = self.tiles_held()
        if self.moves >= MAX_MOVES or None in held or any(a not in self._samples
                                                          or a not in threads for a in held):
            return None
        per_tile = self.tiles.n_blocks / self.tiles.n_tiles
        costs = {a: (statistics.median(s[0] for s in self._samples[a]),
                     statistics.median(s[1] for s in self._samples[a]) * per_tile, threads[a])
                 for a in held}
        proposal = share_tiles(self.tiles.n_tiles, costs)
        now = max(finish(costs[a], m) for a, m in held.items())
        gain = now - max(finish(costs[a], m) for a, m in proposal.items())
        if (tuple(proposal.items()) in self._placed or gain < MIN_GAIN * 2 ** self.moves * now
                or gain * HORIZON < self._cost):
            return None
        return proposal


def compute_span(group, results, threads: int) -> float:
    """Seconds a worker of ``threads`` threads computed for one message: ``group``'s
    (shard, chunk) pairs gave ``results``; the chunks of one shard run one after another,
    those of different shards side by side. What a message took beyond this is its round
    trip."""
    per_shard: dict = {}
    for (shard, _), r in zip(group, results):
        per_shard[shard] = per_shard.get(shard, 0.0) + r.seconds
    busy = sum(per_shard.values())
    return max(max(per_shard.values(), default=0.0), busy / max(threads, 1))


def assign(shards, owners, tasks, alive: dict) -> dict:
    """Group ``tasks`` (shard, chunk) by the worker that holds (or will hold) their
    shard; shards whose worker is not alive move to the least loaded ones (``owners``
    is updated in place)."""
    load = dict.fromkeys(alive, 0.0)
    for s, a in zip(shards, owners):
        if a in load:
            load[a] += s.count / alive[a]
    for i, a in enumerate(owners):
        if a not in alive:
            best = min(load, key=lambda w: (load[w], w))
            owners[i] = best
            load[best] += shards[i].count / alive[best]
    where = dict(zip(shards, owners))
    groups: dict = {}
    for t in tasks:
        groups.setdefault(where[t[0]], []).append(t)
    return groups


def blocks_held(layouts) -> dict:
    """Worker address -> blocks it holds, over ``layouts``."""
    held: dict = {}
    for layout in layouts:
        for s, a in zip(layout.shards, layout.owners):
            held[a] = held.get(a, 0) + s.count
    return held


def forget_revived(executor_ref, r: RemoteSite) -> None:
    """An evicted site evaluated again is gone: its data leaves the workers (a
    ``weakref.finalize`` callback of the executor, held by a weak reference)."""
    executor = executor_ref()
    if executor is not None and not executor.closed:
        executor._forget(r)
