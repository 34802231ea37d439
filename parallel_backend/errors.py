"""Exceptions of parallel_backend, and the one check of count arguments.

Imports the standard library and numpy only.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any, Literal, overload

__all__ = ["ChunkError", "EvaluationStalled", "InFlightLimit", "TracedElsewhere", "check_count"]


@overload
def check_count(value: object, name: str, where: str, *, least: int = ...,
                none_ok: Literal[False] = ..., what: str = ...) -> int: ...
@overload
def check_count(value: object, name: str, where: str, *, least: int = ..., none_ok: bool,
                what: str = ...) -> int | None: ...
def check_count(value: object, name: str, where: str, *, least: int = 1, none_ok: bool = False,
                what: str = "") -> int | None:
    """``value`` as an ``int >= least`` (or ``None`` where allowed), else an error that
    names the caller, the argument and the value: ``TypeError`` for a value that is not
    an int, ``ValueError`` for one that is too small.

    Examples
    --------
    >>> check_count(3, "workers", "ThreadExecutor")
    3
    >>> check_count(0, "workers", "ThreadExecutor")
    Traceback (most recent call last):
    ...
    ValueError: ThreadExecutor: workers must be an int >= 1, got 0
    """
    if value is None and none_ok:
        return None
    expected = f"an int >= {least}" + (" or None" if none_ok else "") + (f" ({what})" if what else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: {name} must be {expected}, got {value!r}")
    if value < least:
        raise ValueError(f"{where}: {name} must be {expected}, got {value!r}")
    return int(value)


class ChunkError(RuntimeError):
    """``fn`` raised while a worker evaluated a chunk.

    Raised inside the host callback, so under ``jit`` JAX re-raises it as a
    runtime error whose message ends with this one: the original exception's type
    and message, the chunk's row range and the executor. Outside a callback (a
    direct ``executor.evaluate``) it arrives as is, chained to the original.

    Attributes
    ----------
    exc_type : str
        Name of the original exception type (``"KeyError"``).
    message : str
        The original message.
    rows : tuple[int, int]
        The chunk's rows ``[start, stop)``.
    fn_name : str
        The name of ``fn``.
    executor : str
        Name of the executor that ran the chunk.
    """

    def __init__(self, exc_type: str, message: str, rows: Sequence[int], fn_name: str,
                 executor: str = "?") -> None:
        self.exc_type, self.message, self.rows = exc_type, message, tuple(rows)
        self.fn_name, self.executor = fn_name, executor
        super().__init__(str(self))

    def __str__(self) -> str:
        return (f"{self.exc_type}: {self.message} (raised by fn {self.fn_name!r} on rows "
                f"[{self.rows[0]}, {self.rows[1]}) on executor {self.executor!r})")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.exc_type, self.message, self.rows, self.fn_name, self.executor)

    @classmethod
    def wrap(cls, exc: BaseException, rows: Sequence[int], fn_name: str,
             executor: str = "?") -> ChunkError:
        """A ChunkError describing ``exc`` (a ChunkError is re-labelled, not nested)."""
        if isinstance(exc, ChunkError):
            return cls(exc.exc_type, exc.message, exc.rows, exc.fn_name, executor)
        return cls(type(exc).__name__, str(exc), rows, fn_name, executor)


class TracedElsewhere(RuntimeError):
    """A process traced a site's ``fn`` (for its block programs: a dask worker, or this
    process later) and it computes something else than where the site was made."""

    def __init__(self, label: str) -> None:
        super().__init__(
            f"reduce_sum: {label} computes here something else than where its model was "
            "traced: it reads state that differs between the two (a module's attribute "
            "changed after import, a file edited since, another JAX version). Pass such "
            "values to reduce_sum as arguments.")


class InFlightLimit(RuntimeError):
    """A host-route evaluation's chunk programs cannot start: every place XLA's device
    keeps for programs in flight is held by programs that wait for this evaluation's
    result (operations queued on it before it was ready). Waiting would never end."""

    def __init__(self, label: str, seconds: float) -> None:
        self.label, self.seconds = label, seconds
        super().__init__(
            f"reduce_sum: {label}: no chunk finished for {seconds:.0f} s and XLA's device "
            "could not start a program: every place it keeps for programs in flight is "
            "held by programs waiting on this result (operations queued on it before it "
            "was ready). Wait for a result (jax.block_until_ready) before queuing many "
            "operations on it, or set jax_cpu_enable_async_dispatch to False before JAX "
            "starts.")

    # crosses processes (a dask worker's answer) as itself
    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.label, self.seconds)


class EvaluationStalled(RuntimeError):
    """No chunk of an evaluation finished for the executor's ``stall_timeout`` seconds:
    a chunk program waits for something that never comes (a kernel waiting on XLA's
    thread pool, a lock in ``fn``) or runs far longer than any evaluation should. The
    chunks not started are cancelled; the executor starts new threads for its next
    evaluation, and nothing waits for the stuck ones.

    Attributes
    ----------
    label : str
        The site's ``fn``.
    seconds : float
        The executor's ``stall_timeout``.
    rows : tuple
        The row ranges ``[start, stop)`` of the chunks that had not finished.
    executor : str
    """

    def __init__(self, label: str, seconds: float, rows: Iterable[Iterable[int]] = (),
                 executor: str = "?") -> None:
        self.label, self.seconds = label, seconds
        self.rows, self.executor = tuple(tuple(r) for r in rows), executor
        pending = ", ".join(f"[{a}, {b})" for a, b in self.rows[:4])
        more = f" and {len(self.rows) - 4} more" if len(self.rows) > 4 else ""
        super().__init__(
            f"reduce_sum: {label}: no chunk finished for {seconds:g} s on executor "
            f"{executor!r} (rows {pending or '?'}{more} still running): a chunk program "
            "waits for something that never comes, or runs longer than any evaluation "
            "should. Where a chunk legitimately takes that long, give the executor a "
            "larger stall_timeout (seconds; None waits forever).")

    # crosses processes (a dask worker's answer) as itself
    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.label, self.seconds, self.rows, self.executor)
