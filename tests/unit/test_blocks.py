"""Block plans, the fixed-order ``tree_sum`` and the chunk plans built on them."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallel_backend as pb
from parallel_backend import analysis
from parallel_backend.analysis import (
    ROW_REDUCE_BYTES,
    ROW_REDUCE_LOOP_ROWS,
    ROW_REDUCE_LOOP_THREADS,
    row_reduce_cap,
)
from parallel_backend.blocks import (
    MIN_BLOCK_ROWS,
    MIN_BLOCKS,
    ROW_ALIGN,
    SMALL_BLOCKS,
    SMALL_SPLIT_ROWS,
    TARGET_BLOCK_BYTES,
    YNN_REDUCE,
    BlockPlan,
    balance_blocks,
    plan_blocks,
    tree_sum,
    xla_threads,
)
from parallel_backend.chunking import AdaptiveChunker, Chunk, fixed_chunks, split_blocks

# -- plan_blocks ---------------------------------------------------------------------------


@pytest.mark.parametrize("n_rows, block_rows, expected", [
    (0, None, BlockPlan(0, 1, 0, 0)),
    (1, None, BlockPlan(1, 1, 1, 0)),
    (1000, None, BlockPlan(1000, 1000, 1, 0)),
    (4000, None, BlockPlan(4000, 4000, 1, 0)),
    (10_000, None, BlockPlan(10_000, 2512, 3, 2464)),
    (100_000, None, BlockPlan(100_000, 6256, 15, 6160)),
    (1000, 256, BlockPlan(1000, 256, 3, 232)),
    (1024, 256, BlockPlan(1024, 256, 4, 0)),
    (3, 256, BlockPlan(3, 256, 0, 3)),
    (5, 1, BlockPlan(5, 1, 5, 0)),
])
def test_plan_blocks(n_rows, block_rows, expected):
    assert plan_blocks(n_rows, block_rows) == expected


@pytest.mark.parametrize("n_rows", [0, 1, 7, 1023, 1024, 1025, 4096, 30_000, 65_537, 1_000_000, 10**8])
def test_default_plan_tiles_the_rows(n_rows):
    plan = plan_blocks(n_rows)
    assert plan.n_full * plan.block_rows + plan.tail_rows == n_rows
    assert 0 <= plan.tail_rows < plan.block_rows
    ranges = [plan.block_range(b) for b in range(plan.n_blocks)]
    if n_rows:
        assert ranges[0][0] == 0 and ranges[-1][1] == n_rows
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    if n_rows * 8 > TARGET_BLOCK_BYTES:  # more than one block's worth of data
        assert plan.block_rows >= MIN_BLOCK_ROWS
        # a power of two near the budget, or MIN_BLOCKS blocks of whole SIMD vectors
        pow2 = plan.block_rows & (plan.block_rows - 1) == 0
        assert pow2 or (plan.block_rows % ROW_ALIGN == 0 and plan.n_blocks == MIN_BLOCKS)
        assert plan.block_rows * 8 <= 2 * TARGET_BLOCK_BYTES
        assert plan.n_blocks >= MIN_BLOCKS
    elif n_rows >= SMALL_SPLIT_ROWS:
        assert plan.n_blocks == SMALL_BLOCKS
    else:
        assert plan.n_blocks <= 1


@pytest.mark.parametrize("row_bytes, expected", [(20, 16384), (84, 4096), (400, 1024)])
def test_default_block_size_follows_row_bytes(row_bytes, expected):
    assert plan_blocks(1_000_000, row_bytes=row_bytes).block_rows == expected


@pytest.mark.parametrize("n_rows, block_rows", [(-1, None), (10, 0), (10, -4)])
def test_plan_blocks_rejects_bad_sizes(n_rows, block_rows):
    with pytest.raises(ValueError, match=">= 0|>= 1"):
        plan_blocks(n_rows, block_rows)


def test_block_range():
    plan = plan_blocks(1000, 256)
    assert [plan.block_range(b) for b in range(plan.n_blocks)] == [
        (0, 256), (256, 512), (512, 768), (768, 1000)]


# -- tree_sum ---------------------------------------------------------------------------


def pairwise_reference(x):
    """The documented order, in plain numpy: halves added elementwise, odd one carried."""
    x = np.asarray(x)
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        head = x[:half] + x[half:2 * half]
        x = np.concatenate([head, x[2 * half:]]) if x.shape[0] % 2 else head
    return x[0]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 33, 1000])
def test_tree_sum_equals_sum(x64, n):
    x = np.random.default_rng(n).normal(size=n)
    np.testing.assert_allclose(jax.jit(tree_sum)(x), x.sum(), rtol=1e-12, atol=1e-12)
    ints = np.arange(n, dtype=np.int32)
    assert int(jax.jit(tree_sum)(ints)) == ints.sum()


@pytest.mark.parametrize("n", [2, 5, 64, 999])
def test_tree_sum_has_a_fixed_order(precision, n):
    # Values spread over many magnitudes, so a different order would round differently.
    rng = np.random.default_rng(n)
    x = (rng.normal(size=n) * 10.0 ** rng.integers(-6, 7, size=n)).astype(precision)
    expected = pairwise_reference(x)
    assert np.array_equal(np.asarray(jax.jit(tree_sum)(x)), expected)
    # Under vmap each row is summed in the same order as on its own.
    batch = np.stack([x, x[::-1], 2 * x])
    summed = np.asarray(jax.jit(jax.vmap(tree_sum))(batch))
    assert np.array_equal(summed, [pairwise_reference(row) for row in batch])


def test_tree_sum_axis_and_empty():
    x = jnp.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(tree_sum(x, axis=1), x.sum(axis=1))
    np.testing.assert_array_equal(tree_sum(x, axis=0), x.sum(axis=0))
    empty = tree_sum(jnp.zeros((0, 3)))
    assert empty.shape == (3,) and not np.any(np.asarray(empty))


# -- chunk plans -------------------------------------------------------------------------------


def assert_cover_once(chunks, n_blocks):
    covered = [b for c in chunks for b in range(c.first, c.first + c.count)]
    assert covered == list(range(n_blocks)), chunks
    assert all(c.count >= 1 for c in chunks)


@pytest.mark.parametrize("n_rows, block_rows", [(1, 1), (1000, 256), (1024, 256), (4096, 100),
                                                (3, 256)])
@pytest.mark.parametrize("grainsize", [1, 100, 255, 256, 500, 768, 1000, 10**6])
def test_fixed_chunks_cover_every_block_once(n_rows, block_rows, grainsize):
    plan = plan_blocks(n_rows, block_rows)
    chunks = fixed_chunks(plan, grainsize)
    assert_cover_once(chunks, plan.n_blocks)
    # Equal chunks but the last: grainsize rounded to whole blocks.
    assert len({c.count for c in chunks[:-1]}) <= 1
    assert chunks[-1].count <= chunks[0].count
    # Their row ranges tile [0, N).
    rows = [c.rows(plan) for c in chunks]
    assert rows[0][0] == 0 and rows[-1][1] == n_rows
    assert all(a[1] == b[0] for a, b in itertools.pairwise(rows))


def test_fixed_chunks_round_to_whole_blocks():
    plan = plan_blocks(5000, block_rows=1000)
    assert fixed_chunks(plan, 2000) == [Chunk(0, 2), Chunk(2, 2), Chunk(4, 1)]
    assert fixed_chunks(plan, 1) == [Chunk(b, 1) for b in range(5)]
    assert fixed_chunks(plan, 1400) == fixed_chunks(plan, 1000)
    assert fixed_chunks(plan, 1600) == fixed_chunks(plan, 2000)


@pytest.mark.parametrize("n_blocks, k", [(1, 1), (16, 1), (16, 3), (16, 16), (16, 100), (7, 2)])
def test_split_blocks_cover_every_block_once(n_blocks, k):
    assert_cover_once(split_blocks(n_blocks, k), n_blocks)


@pytest.mark.parametrize("n_rows, workers", [(100, 1), (1000, 2), (1000, 8), (64 * 37, 3)])
def test_adaptive_chunks_cover_every_block_once(n_rows, workers):
    plan = plan_blocks(n_rows, 64)
    chunker = AdaptiveChunker(plan, workers)
    for compute, overhead in [(1e-3, 1e-6), (1e-5, 1e-3), (1e-4, 1e-4), (1e-3, 0.0)]:
        assert_cover_once(chunker.chunks(), plan.n_blocks)
        chunker.record(2, compute, overhead)
    assert_cover_once(chunker.chunks(), plan.n_blocks)


# -- blocks sized by a reduction within rows -----------------------------------------------


def _mixture(k):
    def fn(y, mu):
        return jax.scipy.special.logsumexp(-0.5 * (y[:, None] - mu) ** 2, axis=-1)
    return fn


@pytest.mark.parametrize("k, rows", [(16, 1024), (96, MIN_BLOCK_ROWS)])
def test_a_reduction_within_rows_caps_or_loops_the_blocks(k, rows):
    """A mixture's ``logsumexp`` over ``k`` components reads ``k`` values per row. Where a
    block of ``ROW_REDUCE_LOOP_ROWS`` keeps that under ``YNN_REDUCE`` the blocks loop, each
    under it; else the batched blocks keep it under ``ROW_REDUCE_BYTES`` (float32), evened
    out. An elementwise ``fn`` over the same data keeps the data's blocks."""
    y, mu = jnp.zeros(1_000_000, jnp.float32), jnp.zeros(k, jnp.float32)
    with pb.SerialExecutor() as ex:
        pb.reduce_sum(_mixture(k), y, mu, executor=ex)
        pb.reduce_sum(lambda y, mu: -0.5 * (y - mu[0]) ** 2, y, mu, executor=ex)
        mixture, elementwise = ex.stats()["sites"]
    if ROW_REDUCE_LOOP_ROWS * k < YNN_REDUCE and xla_threads() <= ROW_REDUCE_LOOP_THREADS:
        assert mixture["form"] == "looped" and mixture["block_rows"] * k < YNN_REDUCE
    else:
        assert mixture["form"] == "batched" and rows // 2 < mixture["block_rows"] <= rows
        assert mixture["block_rows"] * k * 4 <= ROW_REDUCE_BYTES
    assert elementwise["form"] == "batched"
    assert elementwise["block_rows"] == balance_blocks(plan_blocks(1_000_000, row_bytes=4)).block_rows
    assert elementwise["block_rows"] > rows


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 3])
def test_a_few_elements_reduced_within_rows_loop_the_blocks(k, monkeypatch):
    """A ``logsumexp`` over two or three components per row runs one block at a time, in
    blocks whose reductions read fewer than ``YNN_REDUCE`` elements (XLA:CPU hands
    larger ones to YNNPACK); blocks the caller fixes loop where they are that small.
    The value and gradients match the unsplit sum's, and the graph's bits match the
    host's on two threads."""
    monkeypatch.setattr(analysis, "ROW_REDUCE_LOOP_THREADS", 1 << 20)  # on any machine
    rng = np.random.default_rng(k)
    y = jnp.asarray(rng.normal(size=20_000), jnp.float32)
    mu = jnp.linspace(-1.0, 1.0, k, dtype=jnp.float32)
    fn = _mixture(k)

    def total(mu, executor):
        return pb.reduce_sum(fn, y, mu, executor=executor)

    f = jax.jit(jax.value_and_grad(total), static_argnums=1)
    with pb.SerialExecutor() as serial, pb.ThreadExecutor(2, dispatch="host") as host:
        got, on_host = f(mu, serial), f(mu, host)
        (site,) = serial.stats()["sites"]
        pb.reduce_sum(fn, y, mu, executor=serial, block_rows=4096 // k + 64)
        pb.reduce_sum(fn, y, mu, executor=serial, block_rows=4096 // k - 64)
        _, large, small = serial.stats()["sites"]
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(on_host),
                                                    jax.tree.leaves(got)))
    assert site["form"] == "looped" and site["block_rows"] * k < YNN_REDUCE
    assert (large["form"], small["form"]) == ("batched", "looped")
    want = jax.value_and_grad(lambda mu: jnp.sum(fn(y, mu)))(mu)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-2)


def test_on_more_threads_a_reduction_within_rows_stays_batched(monkeypatch):
    """Where XLA has more threads than ``ROW_REDUCE_LOOP_THREADS`` (here: a limit under
    this machine's), the mixture's blocks stay one batch, which spreads the reduction
    over every thread as plain's program does; value and gradients still match the
    unsplit sum's, and the graph's bits the host's on two threads."""
    monkeypatch.setattr(analysis, "ROW_REDUCE_LOOP_THREADS", xla_threads() - 1)
    rng = np.random.default_rng(3)
    y = jnp.asarray(rng.normal(size=20_000), jnp.float32)
    mu = jnp.linspace(-1.0, 1.0, 3, dtype=jnp.float32)
    fn = _mixture(3)
    f = jax.jit(jax.value_and_grad(lambda mu, ex: pb.reduce_sum(fn, y, mu, executor=ex)),
                static_argnums=1)
    with pb.SerialExecutor() as serial, pb.ThreadExecutor(2, dispatch="host") as host:
        got, on_host = f(mu, serial), f(mu, host)
        (site,) = serial.stats()["sites"]
    assert site["form"] == "batched"
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(on_host),
                                                    jax.tree.leaves(got)))
    want = jax.value_and_grad(lambda mu: jnp.sum(fn(y, mu)))(mu)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-2)


def test_row_reduce_cap_reads_only_reductions_within_rows():
    rows = 1000
    y, mu = jnp.zeros(rows), jnp.zeros(3)
    assert row_reduce_cap(jax.make_jaxpr(_mixture(3))(y, mu), rows) == 1 << int(
        np.log2(ROW_REDUCE_BYTES // (3 * y.dtype.itemsize)))
    over_rows = jax.make_jaxpr(lambda y, mu: jnp.sum(y[:, None] * mu, axis=0).sum() + y)(y, mu)
    assert row_reduce_cap(over_rows, rows) == 0


# -- the machine: worker counts follow a container's CPU quota ---------------------------


def _cgroup(tmp_path, own: str, files: dict) -> tuple[str, str]:
    """A cgroup tree under ``tmp_path`` (``files``: path -> content) and a
    ``/proc/self/cgroup`` naming ``own``; returns ``(root, proc file)``."""
    root = tmp_path / "cgroup"
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    proc = tmp_path / "self"
    proc.write_text(own)
    return str(root), str(proc)


def test_cpu_quota_reads_cgroup_v2_and_v1_and_takes_the_tightest(tmp_path):
    from parallel_backend.blocks import cpu_quota

    root, proc = _cgroup(tmp_path / "v2", "0::/pod/job\n",
                         {"pod/cpu.max": "400000 100000\n", "pod/job/cpu.max": "max 100000\n"})
    assert cpu_quota(root, proc) == 4.0  # the job has none, its pod has 4 CPUs
    root, proc = _cgroup(tmp_path / "v1", "4:memory:/x\n2:cpu,cpuacct:/docker/abc\n",
                         {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000\n",
                          "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
                          "cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
                          "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert cpu_quota(root, proc) == 2.0
    root, proc = _cgroup(tmp_path / "none", "0::/\n", {"cpu.max": "max 100000\n"})
    assert cpu_quota(root, proc) is None
    assert cpu_quota(str(tmp_path / "missing"), str(tmp_path / "missing" / "self")) is None


def test_worker_counts_follow_the_quota_and_xla_threads_the_affinity(monkeypatch):
    """A quota lowers the default worker count, never the threads XLA's pool has (which a
    site's form reads), so it changes no bit."""
    from parallel_backend import blocks

    monkeypatch.delenv("NPROC", raising=False)
    monkeypatch.delenv("PJRT_NPROC", raising=False)
    monkeypatch.setattr(blocks, "affinity_count", lambda: 64)
    monkeypatch.setattr(blocks, "cpu_quota", lambda: 1.5)
    assert blocks.cpu_count() == 2 and blocks.xla_threads() == 64
    monkeypatch.setattr(blocks, "cpu_quota", lambda: None)
    assert blocks.cpu_count() == 64
