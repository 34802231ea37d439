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

__all__ = ["BlockPlan", "plan_blocks", "tree_sum"]

#: Rows below which a call is one block: small work has nothing to split.
MIN_BLOCK_ROWS = 1024
#: The plan aims at no more than this many blocks, so per-block partials stay cheap.
TARGET_BLOCKS = 64


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


def plan_blocks(n_rows: int, block_rows: int | None = None) -> BlockPlan:
    """Cut ``n_rows`` rows into fixed-size blocks.

    The block size depends on ``n_rows`` only (never on the executor or the worker
    count): that is what makes results reproducible across executors.

    Parameters
    ----------
    n_rows : int
        Length of the sliced axis.
    block_rows : int, optional
        Rows per block. By default a power of two chosen so that there are at most
        ``TARGET_BLOCKS`` blocks of at least ``MIN_BLOCK_ROWS`` rows.

    Returns
    -------
    BlockPlan

    Examples
    --------
    >>> plan_blocks(10_000)
    BlockPlan(n_rows=10000, block_rows=1024, n_full=9, tail_rows=784)
    >>> plan_blocks(1_000_000).n_blocks
    62
    """
    if n_rows < 0:
        raise ValueError(f"n_rows must be >= 0, got {n_rows}")
    if block_rows is None:
        if n_rows <= MIN_BLOCK_ROWS:
            block_rows = max(n_rows, 1)
        else:
            per_block = max(MIN_BLOCK_ROWS, -(-n_rows // TARGET_BLOCKS))
            block_rows = 1 << math.ceil(math.log2(per_block))
    elif int(block_rows) < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    block_rows = int(block_rows)
    n_full, tail = divmod(n_rows, block_rows)
    return BlockPlan(n_rows, block_rows, n_full, tail)


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
