"""Fixed-size row blocks, the tiles they are evaluated in, and the order-fixed sum.

This module owns the block plan (how the ``N`` rows of ``data`` are cut into
blocks of ``block_rows``), the tile plan (how consecutive blocks are grouped into
the smallest unit any executor evaluates) and :func:`tree_sum`, the only
reduction used to combine per-block partials. It imports only ``jax``, ``numpy``
and the standard library.

Why blocks: every executor returns one partial per block, and the partials are
combined in block order by :func:`tree_sum`, whose additions are elementwise and
in a fixed pairing. Why tiles: a block's partials must be the same bits whichever
run of blocks it was evaluated with. XLA compiles a batch of ``k`` blocks with
shape-dependent choices (how a reduction is split over its threads), and these
agree for every ``k`` only once a batch is wide enough: at least
``MIN_TILE_ROWS`` rows and at least as many blocks as XLA has threads. A tile is
that many blocks, and every evaluation covers whole tiles (see
``docs/how_it_works.rst``).
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from jax.typing import ArrayLike

__all__ = [
    "BlockPlan",
    "TilePlan",
    "accelerator",
    "balance_blocks",
    "block_axis",
    "cpu_count",
    "device_shards",
    "looped_blocks",
    "pad_blocks",
    "plan_blocks",
    "plan_tiles",
    "row_bytes",
    "take_blocks",
    "tree_sum",
    "xla_threads",
]

#: Bytes of data per block the default plan aims at: a block's working set then
#: stays in cache, which measured faster than both small and very large blocks.
TARGET_BLOCK_BYTES = 256 * 1024
#: The default plan keeps at least this many blocks when the data allows...
MIN_BLOCKS = 16
#: ...and blocks of at least this many rows.
MIN_BLOCK_ROWS = 256
#: Data within one block's budget but of at least this many rows is cut into
#: ``SMALL_BLOCKS`` blocks: XLA splits a batched operation over its threads along the
#: block axis, which one block does not have (negative binomial, float32, 5,000 to
#: 13,000 rows: four blocks measured faster than one).
SMALL_SPLIT_ROWS = 4096
SMALL_BLOCKS = 4
#: A tile (the smallest batch of blocks evaluated together) has at least this many
#: blocks and rows, and at least one block per XLA thread: measured, narrower batches
#: of blocks were rounded differently from wide ones (see the module docstring).
MIN_TILE_BLOCKS = 4
MIN_TILE_ROWS = 8192


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
    of data, at least ``MIN_BLOCK_ROWS`` rows, and no larger than ``MIN_BLOCKS``
    blocks of whole ``ROW_ALIGN`` vectors; data that fits one block's budget is one block, or
    ``SMALL_BLOCKS`` blocks from ``SMALL_SPLIT_ROWS`` rows on.

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
    >>> plan_blocks(3_000, row_bytes=8)
    BlockPlan(n_rows=3000, block_rows=3000, n_full=1, tail_rows=0)
    >>> plan_blocks(10_000, row_bytes=8)
    BlockPlan(n_rows=10000, block_rows=2512, n_full=3, tail_rows=2464)
    >>> plan_blocks(100_000, row_bytes=8)
    BlockPlan(n_rows=100000, block_rows=6256, n_full=15, tail_rows=6160)
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


#: Balanced blocks hold a multiple of this many rows (whole SIMD vectors).
ROW_ALIGN = 16


def balance_blocks(plan: BlockPlan) -> BlockPlan:
    """The same number of blocks, each as even as whole multiples of ``ROW_ALIGN`` rows
    allow: every block of a batched evaluation is padded to ``block_rows``, so this
    keeps the padding (wasted work) under ``ROW_ALIGN`` rows per block. Where the block
    count divides ``N``, blocks of ``N / n_blocks`` rows instead: no block is padded,
    so none needs the (costly) mask.

    Examples
    --------
    >>> plan = plan_blocks(1_000_000, row_bytes=20)
    >>> plan.n_blocks, plan.n_blocks * plan.block_rows - plan.n_rows
    (62, 15808)
    >>> even = balance_blocks(plan)
    >>> even.block_rows, even.n_blocks, even.n_blocks * even.block_rows - even.n_rows
    (16144, 62, 928)
    >>> balance_blocks(plan_blocks(200_000, row_bytes=20)).block_rows
    12500
    >>> balance_blocks(plan_blocks(10_000, row_bytes=20)).block_rows
    2500
    """
    n = plan.n_blocks
    if n <= 1:
        return plan
    if plan.n_rows % n == 0:
        rows = plan.n_rows // n
    else:
        rows = ROW_ALIGN * -(-plan.n_rows // (ROW_ALIGN * n))
    if rows * (n - 1) >= plan.n_rows or rows > plan.block_rows:
        return plan
    n_full, tail = divmod(plan.n_rows, rows)
    return BlockPlan(plan.n_rows, rows, n_full, tail)


#: Bytes of one value per row of a looped block (a ``scan`` per row, one block per loop
#: iteration) at large ``N``: 2,000 float32 rows, 1,000 float64. Each iteration runs the
#: scan's steps over one block, so small blocks pay the per-step overhead once per
#: block, and a step of more than about 8 KB per value left the cache: larger blocks
#: (10 KB) and powers of two measured slower on AMD EPYC and Intel Xeon machines
#: (the sweeps: git history of docs/performance.md).
LOOPED_BYTES = 8000
#: The rows of :data:`LOOPED_BYTES` in float32.
LOOPED_ROWS = LOOPED_BYTES // 4
#: ...and at least this many blocks (of at least ``LOOPED_MIN_ROWS`` rows), so that
#: threads have blocks to share where plain NumPyro leaves cores idle (HMM, 3,000 to
#: 5,000 sequences: 384 to 1,008 rows per block all ran alike on two threads).
LOOPED_MIN_BLOCKS = 8
LOOPED_MIN_ROWS = 500


#: XLA:CPU (jaxlib 0.10.2 and 0.12.0.1) hands a reduction (sum, max, min) that reads at
#: least this many elements to YNNPACK, a call that costs far more than the reduction
#: inside a ``scan``'s step: an HMM's ``logsumexp`` over ``(rows, states, states)`` per
#: step at 4 states ran 5.5 ms per 1,000 sequences in blocks of 200-250 rows and 7.6-8.5
#: in blocks of 300-1,000 (value and gradient, one core, Intel Xeon; the same step at 2,
#: 3 and 6 states, float32 and float64 on jax 0.10, float32 on jax 0.12: wherever rows
#: times 4, 9 or 36 passed 4,096). A looped block stays below it where ``fn``'s scan
#: reduces.
YNN_REDUCE = 4096
#: ...but never fewer rows than this (each block costs a loop iteration).
LOOPED_FLOOR_ROWS = 48


def looped_blocks(n_rows: int, itemsize: int = 4, reduce_per_row: float = 0.0) -> BlockPlan:
    """The default block plan of a looped evaluation: blocks of about
    :data:`LOOPED_BYTES` per value (``itemsize``: bytes of the log-density's dtype),
    and of fewer rows than keep the largest reduction in ``fn``'s ``scan`` (reading
    ``reduce_per_row`` elements per row) under :data:`YNN_REDUCE`, at least
    :data:`LOOPED_MIN_BLOCKS` of them where that
    leaves :data:`LOOPED_MIN_ROWS` rows each, all of one size where the count divides
    ``N`` (else multiples of ``ROW_ALIGN``), and never a power of two (whose strides
    measured slower: 2,048 rows against 2,000).

    Examples
    --------
    >>> looped_blocks(50_000)
    BlockPlan(n_rows=50000, block_rows=2000, n_full=25, tail_rows=0)
    >>> looped_blocks(3_000).block_rows, looped_blocks(10_000).block_rows
    (500, 1250)
    >>> looped_blocks(16_384)
    BlockPlan(n_rows=16384, block_rows=1824, n_full=8, tail_rows=1792)
    >>> looped_blocks(700)
    BlockPlan(n_rows=700, block_rows=700, n_full=1, tail_rows=0)
    >>> looped_blocks(10_000, itemsize=8).block_rows
    1000
    >>> looped_blocks(50_000, reduce_per_row=16)  # an HMM of 4 states
    BlockPlan(n_rows=50000, block_rows=250, n_full=200, tail_rows=0)
    >>> looped_blocks(16_384, reduce_per_row=16)
    BlockPlan(n_rows=16384, block_rows=240, n_full=68, tail_rows=64)
    >>> looped_blocks(3_000, reduce_per_row=16).block_rows
    250
    """
    most = max(LOOPED_BYTES // max(int(itemsize), 1), 1)
    cap = None
    if reduce_per_row > 0:
        cap = max(int((YNN_REDUCE - 1) // reduce_per_row), LOOPED_FLOOR_ROWS)
        most = min(most, cap)
    n = max(-(-n_rows // most), min(LOOPED_MIN_BLOCKS, n_rows // LOOPED_MIN_ROWS), 1)
    if cap is not None:  # a few more blocks where that makes them all of one size
        n = next((m for m in range(n, n + n // 8 + 1) if n_rows % m == 0), n)
    if n_rows % n == 0:
        rows = n_rows // n
    else:
        rows = ROW_ALIGN * -(-n_rows // (ROW_ALIGN * n))
        while cap is not None and rows > cap and rows > ROW_ALIGN:  # one block more
            n += 1
            rows = ROW_ALIGN * -(-n_rows // (ROW_ALIGN * n))
    if rows > ROW_ALIGN and rows & (rows - 1) == 0 and n > 1:
        rows += ROW_ALIGN if cap is None or rows + ROW_ALIGN <= cap else -ROW_ALIGN
    n_full, tail = divmod(n_rows, max(rows, 1))
    return BlockPlan(n_rows, max(rows, 1), n_full, tail)


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
        if n_rows >= SMALL_SPLIT_ROWS:
            return ROW_ALIGN * -(-n_rows // (SMALL_BLOCKS * ROW_ALIGN))
        return max(n_rows, 1)
    rows = 1 << math.ceil(math.log2(budget))
    rows = min(rows, ROW_ALIGN * -(-n_rows // (MIN_BLOCKS * ROW_ALIGN)))
    return max(rows, MIN_BLOCK_ROWS)


def tree_sum(x: ArrayLike, axis: int = 0) -> jax.Array:
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


def affinity_count() -> int:
    """Cores this process may run on by its affinity mask (where the OS has one): what
    XLA sizes its CPU thread pool by."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cpu_quota(root: str = "/sys/fs/cgroup", cgroup: str = "/proc/self/cgroup") -> float | None:
    r"""CPUs this process's cgroup may use: the tightest CPU quota over its period along
    its cgroup path (``cpu.max`` of cgroup v2, ``cpu.cfs_quota_us`` and
    ``cpu.cfs_period_us`` of v1's ``cpu`` controller), or ``None`` where none is set
    (a container limited to 2 CPUs on a 64-core node has a quota of 2).

    Examples
    --------
    >>> import os, tempfile
    >>> root = tempfile.mkdtemp()
    >>> os.makedirs(os.path.join(root, "job"))
    >>> _ = open(os.path.join(root, "job", "cpu.max"), "w").write("150000 100000\n")
    >>> _ = open(os.path.join(root, "self"), "w").write("0::/job\n")
    >>> cpu_quota(root, os.path.join(root, "self"))
    1.5
    """
    try:
        with open(cgroup) as f:
            lines = [line.strip().split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    found = []
    for _, controllers, path in lines:
        if controllers == "":  # v2: one hierarchy
            dirs, read = [root], _quota_v2
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own hierarchy
            dirs = [os.path.join(root, name) for name in
                    (controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu")]
            read = _quota_v1
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for base in dict.fromkeys(dirs):
            for depth in range(len(parts), -1, -1):  # the cgroup and each one above it
                quota = read(os.path.join(base, *parts[:depth]))
                if quota is not None:
                    found.append(quota)
    return min(found) if found else None


def _quota_v2(folder: str) -> float | None:
    try:
        with open(os.path.join(folder, "cpu.max")) as f:
            quota, period = (f.read().split() + ["100000"])[:2]
    except OSError:
        return None
    return None if quota == "max" else int(quota) / int(period)


def _quota_v1(folder: str) -> float | None:
    try:
        with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
            period = int(f.read())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def cpu_count() -> int:
    """Cores this process may use: its affinity mask, less where its cgroup's CPU quota
    is lower (rounded up). What worker counts default to; a site's form and blocks
    follow XLA's pool (:func:`xla_threads`) instead, so that a quota never changes a bit."""
    cores = affinity_count()
    quota = cpu_quota()
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def xla_threads() -> int:
    """Threads of XLA's CPU thread pool in this process: ``NPROC`` (or
    ``PJRT_NPROC``) where set, else the cores of its affinity mask (XLA reads no cgroup
    quota)."""
    for name in ("PJRT_NPROC", "NPROC"):
        value = os.environ.get(name, "")
        if value.strip().isdigit() and int(value) > 0:
            return int(value)
    return affinity_count()


def accelerator() -> bool:
    """Whether the caller's programs run on an accelerator (JAX's default backend is not
    the CPU): where the graph evaluates plain NumPyro's program instead of blocks."""
    return jax.default_backend() != "cpu"


def device_shards() -> int:
    """How many devices run the program being traced at once, one shard each: the
    product of the manual axes of the mesh it is traced under (``jax.pmap``, NumPyro's
    ``chain_method="parallel"``, a ``shard_map``), else 1."""
    mesh = jax.sharding.get_abstract_mesh()
    return math.prod(mesh.shape[name] for name in mesh.manual_axes)



class TilePlan(NamedTuple):
    """How the blocks of a plan are grouped into tiles, the unit of evaluation.

    Tile ``i < n_tiles - 1`` holds blocks ``[i * tile_blocks, (i + 1) * tile_blocks)``;
    the last tile holds the rest (between ``tile_blocks`` and ``2 * tile_blocks - 1``
    blocks besides a padded last block, or every block when there are fewer).

    Attributes
    ----------
    n_blocks : int
        Blocks in the plan (the tail block counts as one).
    tile_blocks : int
        Blocks per tile.
    tail : bool
        The last block is padded and evaluated on its own after the others (batched
        form): it is not counted toward the last tile's width.
    """

    n_blocks: int
    tile_blocks: int
    tail: bool = False

    @property
    def n_tiles(self) -> int:
        """Number of tiles (at least one when there are blocks)."""
        full = self.n_blocks - (1 if self.tail else 0)
        return max(1, full // self.tile_blocks) if self.n_blocks else 0

    def tile_range(self, tile: int) -> tuple[int, int]:
        """Blocks ``[first, stop)`` of tile number ``tile``."""
        first = tile * self.tile_blocks
        stop = self.n_blocks if tile == self.n_tiles - 1 else first + self.tile_blocks
        return first, stop


def plan_tiles(plan: BlockPlan, batched: bool = True, threads: int | None = None) -> TilePlan:
    """Group the blocks of ``plan`` into tiles.

    A batched evaluation (many blocks in one ``vmap``) needs tiles of at least
    ``MIN_TILE_BLOCKS`` blocks, ``MIN_TILE_ROWS`` rows and one block per XLA thread;
    a looped one (one block per loop iteration, the same loop body everywhere) is
    bitwise the same for any run of blocks, so its tiles are single blocks.

    Examples
    --------
    >>> plan = plan_blocks(200_000, row_bytes=20)
    >>> plan.block_rows, plan.n_blocks
    (12512, 16)
    >>> tiles = plan_tiles(plan, threads=2)
    >>> tiles.tile_blocks, tiles.tail, tiles.n_tiles, tiles.tile_range(3)
    (4, True, 3, (12, 16))
    >>> plan_tiles(plan, batched=False).tile_blocks
    1
    """
    if not batched:
        return TilePlan(plan.n_blocks, 1)
    threads = xla_threads() if threads is None else max(1, int(threads))
    wide = -(-MIN_TILE_ROWS // max(plan.block_rows, 1))
    tile = max(MIN_TILE_BLOCKS, threads, wide)
    return TilePlan(plan.n_blocks, max(1, min(tile, plan.n_blocks)), plan.tail_rows > 0)


# -- rows laid out in blocks ----------------------------------------------------------


def block_axis(set_axis) -> int:
    """Where a leaf's block axis is: after its set axis (``0``), else first."""
    return 1 if set_axis == 0 else 0


def take_blocks(traced, set_axes, start, stop):
    """Blocks ``[start:stop]`` of each traced leaf (its block axis after any set axis)."""
    return tuple(x[:, start:stop] if a == 0 else x[start:stop] for x, a in zip(traced, set_axes))


def pad_rows(x, total: int, axis: int = 0, xp=np):
    """Rows of ``x`` on ``axis`` padded to ``total`` with copies of the last row (values
    ``fn`` handles as it handles that row: masked, they pull back zeros, never NaN).
    ``xp`` is numpy or jax.numpy."""
    n = x.shape[axis]
    if total <= n:
        return x
    last = xp.take(x, xp.asarray([n - 1]), axis=axis) if xp is not np else x.take([n - 1],
                                                                                  axis=axis)
    shape = list(x.shape)
    shape[axis] = total - n
    return xp.concatenate([x, xp.broadcast_to(last, tuple(shape))], axis=axis)


def pad_blocks(x, plan, axis: int = 0, xp=np):
    """Rows of ``x`` on ``axis`` padded (copies of the last row) to whole blocks and
    reshaped to ``(blocks, block_rows)`` there. ``xp`` is numpy or jax.numpy."""
    rows = plan.block_rows
    n_blocks = plan.n_full + (1 if plan.tail_rows else 0)  # plan.n_blocks, inlined: hot
    x = pad_rows(x, n_blocks * rows, axis, xp)
    shape = x.shape[:axis] + (n_blocks, rows) + x.shape[axis + 1:]
    return x.reshape(shape)
