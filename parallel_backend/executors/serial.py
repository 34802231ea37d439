"""``SerialExecutor``: the reference; the block loop inside the caller's graph."""

from __future__ import annotations

from .base import STALL_TIMEOUT, Executor

__all__ = ["SerialExecutor"]


class SerialExecutor(Executor):
    """Evaluate the blocks one after another, in this process.

    By default the block loop stays inside the caller's XLA program (no host
    callback): the reference every other executor matches bit for bit, and the
    cheapest choice for small likelihoods. ``dispatch="host"`` runs the same
    chunks through the host callback instead, one after another on a thread of the
    executor's own (see ``Executor.run_tasks``).

    Parameters
    ----------
    dispatch : {"graph", "host", "auto"}
    count_calls, stall_timeout
        See :class:`~parallel_backend.executors.base.Executor`.

    Examples
    --------
    >>> import jax.numpy as jnp, parallel_backend as pb
    >>> with pb.SerialExecutor() as ex:
    ...     v = pb.reduce_sum(lambda x, m: -(x - m) ** 2, jnp.arange(4.0), 1.0, executor=ex)
    >>> float(v)
    -6.0
    """

    name = "serial"

    def __init__(self, *, dispatch: str = "graph", count_calls: bool = False,
                 stall_timeout: float | None = STALL_TIMEOUT) -> None:
        super().__init__(dispatch=dispatch, count_calls=count_calls,
                         stall_timeout=stall_timeout)
