"""Fixed-size row blocks and the order-fixed sums that make results reproducible.

This module owns the block plan (how the ``N`` rows of ``data`` are cut into
blocks of ``block_rows``) and :func:`tree_sum`, the only reduction used to combine
per-row and per-block partials. It imports only ``jax`` and ``numpy``.

Why blocks: every executor evaluates each block with the same compiled loop body
and returns one partial per block; the partials are then combined in block order
by :func:`tree_sum`, whose additions are elementwise and in a fixed pairing. So the
result cannot depend on how blocks were grouped into chunks, on which worker ran
them, or on how many workers there were.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp

__all__ = ["BlockPlan", "plan_blocks", "row_bytes", "tree_sum"]

#: Bytes of data per block the default plan aims at: a block's working set then
#: stays in cache, which measured faster than both small and very large blocks.
TARGET_BLOCK_BYTES = 256 * 1024
#: The default plan keeps at least this many blocks when the data allows...
MIN_BLOCKS = 16
#: ...and blocks of at least this many rows.
MIN_BLOCK_ROWS = 256


class BlockPlan(NamedTuple):
    """How the rows of one ``reduce_sum`` call are cut into blocks.

    Attributes
    ----------
    n_rows : int
        ``N``, the length of the sliced axis.
    block_rows : int
        Rows in every full block.
    n_full : int
        Number of full blocks.
    tail_rows : int
        Rows in the last, partial block (0 when ``block_rows`` divides ``N``).
    """

    n_rows: int
    block_rows: int
    n_full: int
    tail_rows: int

    @property
    def n_blocks(self) -> int:
        """Full blocks plus the tail block, if any."""
        return self.n_full + (1 if self.tail_rows else 0)

    def block_range(self, block: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` of block number ``block``."""
        start = block * self.block_rows
        return start, min(start + self.block_rows, self.n_rows)


def plan_blocks(n_rows: int, block_rows: int | None = None, row_bytes: int = 8) -> BlockPlan:
    """Cut ``n_rows`` rows into fixed-size blocks.

    The default block size depends only on ``n_rows`` and on the bytes of data per
    row (never on the executor, the worker count or a measurement): that is what
    makes results reproducible. It is a power of two near ``TARGET_BLOCK_BYTES``
    of data, at least ``MIN_BLOCK_ROWS`` rows, and small enough to leave
    ``MIN_BLOCKS`` blocks; data that fits one block's budget is one block.

    Parameters
    ----------
    n_rows : int
        Length of the sliced axis.
    block_rows : int, optional
        Rows per block, overriding the default.
    row_bytes : int
        Bytes of data per row (all data leaves together).

    Returns
    -------
    BlockPlan

    Examples
    --------
    >>> plan_blocks(10_000, row_bytes=8)
    BlockPlan(n_rows=10000, block_rows=10000, n_full=1, tail_rows=0)
    >>> plan_blocks(100_000, row_bytes=8)
    BlockPlan(n_rows=100000, block_rows=4096, n_full=24, tail_rows=1696)
    >>> plan_blocks(1_000_000, row_bytes=20).block_rows
    16384
    >>> plan_blocks(1_000, row_bytes=84)
    BlockPlan(n_rows=1000, block_rows=1000, n_full=1, tail_rows=0)
    """
    if n_rows < 0:
        raise ValueError(f"n_rows must be >= 0, got {n_rows}")
    if block_rows is None:
        block_rows = default_block_rows(n_rows, row_bytes)
    elif isinstance(block_rows, bool) or int(block_rows) != block_rows or block_rows < 1:
        raise ValueError(f"block_rows must be an int >= 1, got {block_rows!r}")
    block_rows = int(block_rows)
    n_full, tail = divmod(n_rows, block_rows)
    return BlockPlan(n_rows, block_rows, n_full, tail)


def row_bytes(leaves) -> int:
    """Bytes of data per row: one row of every leaf (arrays or tracers), in the dtypes
    JAX will use (float64 data counts as float32 unless x64 is on).

    Examples
    --------
    >>> import numpy as np
    >>> row_bytes([np.zeros((10, 3), np.float32), np.zeros(10, np.int32)])
    16
    """
    return sum(math.prod(jnp.shape(x)[1:]) * jnp.result_type(x).itemsize for x in leaves)


def default_block_rows(n_rows: int, row_bytes: int) -> int:
    """The default rows per block (see :func:`plan_blocks`)."""
    budget = max(1, TARGET_BLOCK_BYTES // max(int(row_bytes), 1))
    if n_rows <= max(budget, MIN_BLOCK_ROWS):
        return max(n_rows, 1)
    rows = 1 << math.ceil(math.log2(budget))
    rows = min(rows, 1 << int(math.log2(max(n_rows // MIN_BLOCKS, 1))))
    return max(rows, MIN_BLOCK_ROWS)


def tree_sum(x, axis: int = 0):
    """Sum ``x`` along ``axis`` by pairwise elementwise additions in a fixed order.

    Unlike ``jnp.sum``, whose accumulation order is the compiler's choice and may
    change with batching (``vmap``) or fusion, every addition here is elementwise
    between two fixed halves, so the rounding is the same in every context.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> float(tree_sum(jnp.arange(5.0)))
    10.0
    """
    x = jnp.moveaxis(jnp.asarray(x), axis, 0)
    n = x.shape[0]
    if n == 0:
        return jnp.zeros(x.shape[1:], x.dtype)
    while n > 1:
        half = n // 2
        head = x[:half] + x[half : 2 * half]
        x = jnp.concatenate([head, x[2 * half :]]) if n % 2 else head
        n = x.shape[0]
    return x[0]
