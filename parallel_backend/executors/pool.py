"""``TaskPool``: the threads that run an executor's chunk tasks in this process.

A ``concurrent.futures``-shaped pool (``submit`` gives a ``Future``), but of daemon
threads that nothing joins without a bound: a chunk program that never returns (XLA
waiting for work that cannot start) holds one of its threads for good, and neither
``shutdown`` nor the interpreter's exit may wait for that thread, as they would for a
``ThreadPoolExecutor``'s. An executor whose evaluation stalled drops its pool (the stuck
threads with it) and starts a new one at its next evaluation. Imports the standard
library only.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

__all__ = ["TaskPool"]

_STOP = object()


class TaskPool:
    """``threads`` daemon threads named ``name-<i>``, started at the first ``submit``.

    Examples
    --------
    >>> pool = TaskPool(2, "example")
    >>> pool.submit(pow, 2, 10).result()
    1024
    >>> pool.shutdown()
    """

    def __init__(self, threads: int, name: str):
        self.threads, self.name = int(threads), name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn, *args) -> Future:
        """``fn(*args)`` on one of the pool's threads."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"TaskPool {self.name!r} is shut down")
            if not self._workers:
                for i in range(self.threads):
                    t = threading.Thread(target=self._work, name=f"{self.name}-{i}",
                                         daemon=True)
                    t.start()
                    self._workers.append(t)
            self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                    future.set_exception(e)
            # Nothing of the task stays referenced while the thread waits for the next
            # (its data would outlive the site that holds it).
            del item, future, fn, args

    def shutdown(self, wait: bool = True, cancel_futures: bool = False,
                 timeout: float | None = 10.0) -> None:
        """Stop the threads once they are idle; ``cancel_futures``: cancel what has not
        started. ``wait``: wait for the threads, at most ``timeout`` seconds in all (a
        thread stuck in native code is left behind: a daemon, it holds up nothing)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = list(self._workers)
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    item[0].cancel()
        for _ in workers:
            self._queue.put(_STOP)
        if wait:
            end = None if timeout is None else time.monotonic() + timeout
            for t in workers:
                t.join(None if end is None else max(0.0, end - time.monotonic()))
