"""Exceptions of parallel_backend."""

from __future__ import annotations

__all__ = ["ChunkError"]


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
    executor : str
        Name of the executor that ran the chunk.
    """

    def __init__(self, exc_type: str, message: str, rows: tuple, site: str, executor: str = "?"):
        self.exc_type, self.message, self.rows = exc_type, message, tuple(rows)
        self.site, self.executor = site, executor
        super().__init__(str(self))

    def __str__(self) -> str:
        return (f"{self.exc_type}: {self.message} (raised by fn {self.site!r} on rows "
                f"[{self.rows[0]}, {self.rows[1]}) on executor {self.executor!r})")

    def __reduce__(self):
        return type(self), (self.exc_type, self.message, self.rows, self.site, self.executor)

    @classmethod
    def wrap(cls, exc: BaseException, rows, site: str, executor: str = "?") -> "ChunkError":
        """A ChunkError describing ``exc`` (a ChunkError is re-labelled, not nested)."""
        if isinstance(exc, ChunkError):
            return cls(exc.exc_type, exc.message, exc.rows, exc.site, executor)
        return cls(type(exc).__name__, str(exc), rows, site, executor)
