"""Where a call site's data lives on a dask cluster.

A call site's prepared data is cut into *shards*: contiguous runs of whole tiles,
one per worker thread (see ``even_slots``). Each shard is sent once to the worker
that evaluates it and stays there, keyed by the data's content, so a re-built model
over the same data finds it. This module owns :class:`RemoteSite` (what the client
knows about one site on the cluster) and the assignment of shards to workers. It
imports numpy, cloudpickle and the core's interface.
"""

from __future__ import annotations

import hashlib

import cloudpickle
import numpy as np

from parallel_backend.extend import even_slots

__all__ = ["RemoteSite", "assign", "content_token", "forget_revived"]


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
    shards : list of Chunk
        Each worker's share of the blocks.
    placement : list
        Per shard, the address of the worker that holds it (``None``: not placed).
    """

    def __init__(self, state, shards: int):
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
        self.shards = even_slots(state.spec.tiles, shards)
        self.placement: list = [None] * len(self.shards)

    def piece(self, shard: int):
        """``(shard, first block, arrays of its blocks)``: what ``install`` sends."""
        c = self.shards[shard]
        return shard, c.first, tuple(x[c.first:c.first + c.count] for x in self.arrays)


def content_token(arrays, plan) -> str:
    """A hash of the prepared blocks and the block plan."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((plan.n_rows, plan.block_rows)).encode())
    for x in arrays:
        h.update(repr((x.shape, x.dtype.str)).encode())
        h.update(memoryview(np.ascontiguousarray(x)).cast("B"))
    return h.hexdigest()


def assign(site: RemoteSite, tasks, alive: dict) -> dict:
    """Group ``tasks`` (shard, chunk) by the worker that holds (or will hold) their
    shard; shards on workers no longer alive move to the least loaded ones."""
    load = {a: 0.0 for a in alive}
    for a in site.placement:
        if a in load:
            load[a] += 1.0 / alive[a]
    for i, a in enumerate(site.placement):
        if a not in alive:
            best = min(load, key=lambda w: (load[w], w))
            site.placement[i] = best
            load[best] += 1.0 / alive[best]
    groups: dict = {}
    for t in tasks:
        groups.setdefault(site.placement[t[0]], []).append(t)
    return groups


def forget_revived(executor_ref, r: RemoteSite) -> None:
    """An evicted site evaluated again is gone: its data leaves the workers (a
    ``weakref.finalize`` callback of the executor, held by a weak reference)."""
    executor = executor_ref()
    if executor is not None and not executor.closed:
        executor._forget(r)
