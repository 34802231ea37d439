"""``ThreadExecutor``: chunk tasks on a thread pool in this process.

JAX releases the GIL while a compiled chunk runs, so threads give real
parallelism without copying data: every worker reads the same resident arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, TypeVar

from ..blocks import cpu_count
from ..errors import check_count
from .base import STALL_TIMEOUT, Executor

__all__ = ["ThreadExecutor"]

_T = TypeVar("_T")
_R = TypeVar("_R")


class ThreadExecutor(Executor):
    """Evaluate chunks on a pool of ``workers`` threads.

    Parameters
    ----------
    workers : int, optional
        Threads in the pool; ``None`` means every core this process may use (its
        affinity mask, or its container's CPU quota where that is lower).
    dispatch : {"auto", "host", "graph"}
        ``"auto"`` (default): the threads where XLA leaves cores idle (a likelihood
        evaluated block by block, in two tiles or more), the graph
        elsewhere; inside ``pb.sample`` both are timed on real segments of the
        sampler and the faster is kept. ``"host"`` always uses the threads,
        ``"graph"`` never.
    count_calls, stall_timeout
        See :class:`~parallel_backend.executors.base.Executor` (``stall_timeout``: seconds
        an evaluation waits with no chunk finishing, 300 by default, before it raises
        :class:`~parallel_backend.errors.EvaluationStalled`; ``None``: forever).

    Examples
    --------
    >>> import jax.numpy as jnp, parallel_backend as pb
    >>> with pb.ThreadExecutor(2, dispatch="host") as ex:
    ...     v = pb.reduce_sum(lambda x, m: -(x - m) ** 2, jnp.arange(4.0), 1.0, executor=ex)
    ...     ex.stats()["host_calls"]
    1
    >>> float(v)
    -6.0
    """

    name = "thread"
    # Threads of one process on cores of the same speed: one chunk each. A second chunk
    # per thread evens out nothing here and costs a chunk program's start and a hand-off
    # (HMM, 10,000 sequences, 2 cores: 5 to 10% per gradient on both supported stacks).
    chunks_per_worker = 1

    def __init__(self, workers: int | None = None, *, dispatch: str = "auto",
                 count_calls: bool = False, stall_timeout: float | None = STALL_TIMEOUT,
                 ) -> None:
        if workers is None:
            workers = cpu_count()
        workers = check_count(workers, "workers", "ThreadExecutor", what="threads")
        super().__init__(dispatch=dispatch, count_calls=count_calls,
                         stall_timeout=stall_timeout)
        self._workers = workers

    @property
    def workers(self) -> int:
        return self._workers

    def task_threads(self) -> tuple[int, str]:
        return self._workers, "parallel_backend"

    def submit(self, func: Callable[..., _R], *args: Any) -> Future[_R]:
        """``func(*args)`` on one of the pool's threads: a ``concurrent.futures.Future``."""
        return self.task_pool().submit(func, *args)

    def map(self, func: Callable[[_T], _R], items: Iterable[_T]) -> list[_R]:
        items = list(items)
        if len(items) <= 1 or self._workers == 1:
            return super().map(func, items)
        pool = self.task_pool()
        return [f.result() for f in [pool.submit(func, item) for item in items]]
