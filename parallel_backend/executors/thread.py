"""``ThreadExecutor``: chunk tasks on a thread pool in this process.

JAX releases the GIL while a compiled chunk runs, so threads give real
parallelism without copying data: every worker reads the same resident arrays.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from ..blocks import cpu_count
from ..errors import check_count
from ..guards import gather
from ..tasks import run_task
from .base import Executor

__all__ = ["ThreadExecutor"]


class ThreadExecutor(Executor):
    """Evaluate chunks on a pool of ``workers`` threads.

    Parameters
    ----------
    workers : int, optional
        Threads in the pool; ``None`` means every core this process may use.
    dispatch : {"auto", "host", "graph"}
        ``"auto"`` (default): the threads where XLA leaves cores idle (a likelihood
        evaluated block by block, in two tiles or more), the graph
        elsewhere; inside ``pb.sample`` both are timed on real segments of the
        sampler and the faster is kept. ``"host"`` always uses the threads,
        ``"graph"`` never.
    count_calls : bool
        See :class:`~parallel_backend.executors.base.Executor`.

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

    def __init__(self, workers: int | None = None, *, dispatch: str = "auto",
                 count_calls: bool = False):
        if workers is None:
            workers = cpu_count()
        workers = check_count(workers, "workers", "ThreadExecutor", what="threads")
        super().__init__(dispatch=dispatch, count_calls=count_calls)
        self._workers = workers
        self._pool = None
        self._pool_lock = threading.Lock()

    @property
    def workers(self) -> int:
        return self._workers

    def _get_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            self.check_open()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="parallel_backend")
            return self._pool

    def run_tasks(self, tasks) -> list:
        # Every task on the pool, one alone too: the thread that waits for them watches
        # that they can start (gather), which it could not do for a task it ran itself.
        if not tasks:
            return []
        pool = self._get_pool()
        futures = [pool.submit(run_task, t) for t in tasks]
        return gather(futures, [t.resident.device for t in tasks], tasks[0].program.spec.label)

    def submit(self, func, *args):
        """``func(*args)`` on one of the pool's threads: a ``concurrent.futures.Future``."""
        return self._get_pool().submit(func, *args)

    def map(self, func, items) -> list:
        items = list(items)
        if len(items) <= 1 or self._workers == 1:
            return super().map(func, items)
        return list(self._get_pool().map(func, items))

    def release(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
