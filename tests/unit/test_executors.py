"""Executors: what they count, how one is chosen, that they clean up, that they serve
several callers, that chunk functions compile once per shape, and the adaptive chunker.
"""

import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallel_backend as pb
from parallel_backend.blocks import plan_blocks, plan_tiles
from parallel_backend.chunking import AdaptiveChunker

N = 32_768
BLOCK_ROWS = 2048
#: Rows of one tile, the smallest run of blocks a chunk holds (4 blocks on up to 4 cores).
TILE_ROWS = plan_tiles(plan_blocks(N, BLOCK_ROWS)).tile_blocks * BLOCK_ROWS
STATS_KEYS = {"calls", "chunks", "rows", "seconds_in_workers", "bytes_sent"}


def gaussian(x, mu):
    return -0.5 * (x - mu) ** 2


@pytest.fixture
def x():
    return jnp.linspace(-2.0, 2.0, N)


def jitted_value_and_grad(x, **kwargs):
    return jax.jit(jax.value_and_grad(lambda mu: pb.reduce_sum(gaussian, x, mu, **kwargs)))


# -- stats --------------------------------------------------------------------------------


#: Where each executor evaluates ``gaussian``: "thread2" (``dispatch="auto"``) keeps an
#: elementwise site in the caller's graph on a CPU (``routes.default_route``).
ROUTES = [("serial", "graph"), ("serial-host", "host"), ("thread2-host", "host"),
          ("thread2", "graph")]


@pytest.mark.parametrize(("executor", "route"), ROUTES, indirect=["executor"])
def test_stats_count_evaluations_not_traces(executor, route, x):
    stats = executor.stats()
    assert STATS_KEYS <= set(stats)
    assert all(stats[k] == 0 for k in STATS_KEYS)

    f = jitted_value_and_grad(x, executor=executor, block_rows=BLOCK_ROWS, grainsize=TILE_ROWS)
    for mu in [0.1, 0.2, 0.3]:
        jax.block_until_ready(f(mu))
    after = executor.stats()
    assert after["calls"] == 3
    assert after["rows"] == 3 * x.shape[0]
    assert [site["dispatch"] for site in after["sites"]] == [route]
    if route == "host":
        # One chunk per tile per evaluation.
        assert (after["host_calls"], after["graph_calls"]) == (3, 0)
        assert after["chunks"] == 3 * (N // TILE_ROWS)
        assert after["seconds_in_workers"] > 0
        assert after["bytes_sent"] > 0
    else:
        assert (after["host_calls"], after["graph_calls"]) == (0, 3)
        assert after["chunks"] == 3

    jax.block_until_ready(f(0.4))
    assert executor.stats()["calls"] == 4


def test_graph_evaluations_are_counted_only_when_asked(x):
    """By default an evaluation inside the caller's program outside pb.sample has no
    callback to count it (the compiled-in counter is opt-in): stats() says so."""
    with pb.SerialExecutor() as quiet, pb.SerialExecutor(count_calls=True) as counting:
        for ex in (quiet, counting):
            jax.block_until_ready(jitted_value_and_grad(x, executor=ex)(0.5))
        assert quiet.stats()["calls"] == 0 and counting.stats()["calls"] == 1
        assert quiet.stats()["counting"] == "host, and the graph inside pb.sample"
        assert counting.stats()["counting"] == "all"


def test_graph_counter_counts_batches_and_distinct_evaluations(x):
    """The opt-in graph counter: a batch of parameter sets counts all of them, also with
    one argument unbatched, and two evaluations in one program that differ only in a
    later parameter element count twice."""
    executor = pb.SerialExecutor(count_calls=True)

    def scaled(x, mu, sigma):
        return -0.5 * ((x - mu) / sigma) ** 2

    f = jax.jit(jax.vmap(jax.value_and_grad(
        lambda m, s: pb.reduce_sum(scaled, x, m, s, executor=executor)), in_axes=(0, None)))
    jax.block_until_ready(f(jnp.arange(3.0), 1.5))
    nested = jax.jit(jax.vmap(jax.vmap(lambda m, s: pb.reduce_sum(scaled, x, m, s,
                                                                   executor=executor),
                                       in_axes=(0, None)), in_axes=(None, 0)))
    jax.block_until_ready(nested(jnp.arange(3.0), jnp.ones(4)))
    stats = executor.stats()
    assert (stats["calls"], stats["rows"]) == (2, (3 + 12) * N)

    def packed(x, p):
        return -0.5 * ((x - p[0]) / p[1]) ** 2

    other = pb.SerialExecutor(count_calls=True)
    both = jax.jit(lambda: pb.reduce_sum(packed, x, jnp.array([0.0, 1.0]), executor=other)
                   + pb.reduce_sum(packed, x, jnp.array([0.0, 2.0]), executor=other))
    jax.block_until_ready(both())
    assert (other.stats()["calls"], other.stats()["rows"]) == (2, 2 * N)


def test_stats_are_per_executor(fresh_executor, x):
    a, b = fresh_executor("thread2-host"), fresh_executor("serial-host")
    jax.block_until_ready(jitted_value_and_grad(x, executor=a)(0.5))
    assert a.stats()["calls"] == 1
    assert b.stats()["calls"] == 0


# -- choosing the executor ----------------------------------------------------------------


def calls(*executors):
    return [ex.stats()["calls"] for ex in executors]


def test_executor_precedence(fresh_executor, x):
    default, outer, inner, explicit = (fresh_executor("serial") for _ in range(4))

    def evaluate(**kwargs):
        return float(pb.reduce_sum(gaussian, x, 0.5, **kwargs))

    assert pb.get_default_executor() is not default
    evaluate()
    assert calls(default, outer, inner, explicit) == [0, 0, 0, 0]

    pb.set_default_executor(default)
    assert pb.get_default_executor() is default
    evaluate()
    assert calls(default, outer, inner, explicit) == [1, 0, 0, 0]

    with pb.use_executor(outer):
        evaluate()
        assert calls(default, outer, inner, explicit) == [1, 1, 0, 0]
        with pb.use_executor(inner) as current:
            assert current is inner
            evaluate()
            assert calls(default, outer, inner, explicit) == [1, 1, 1, 0]
            evaluate(executor=explicit)
            assert calls(default, outer, inner, explicit) == [1, 1, 1, 1]
        evaluate()  # back to the outer one
        assert calls(default, outer, inner, explicit) == [1, 2, 1, 1]
    evaluate()
    assert calls(default, outer, inner, explicit) == [2, 2, 1, 1]

    pb.set_default_executor(None)
    assert isinstance(pb.get_default_executor(), pb.SerialExecutor)
    assert pb.get_default_executor() is not default
    evaluate()
    assert calls(default, outer, inner, explicit) == [2, 2, 1, 1]


def test_executor_fixed_when_traced(fresh_executor, x):
    """A jitted function keeps the executor it was traced with."""
    first, second = fresh_executor("serial"), fresh_executor("serial")
    f = jax.jit(lambda mu: pb.reduce_sum(gaussian, x, mu))
    with pb.use_executor(first):
        jax.block_until_ready(f(0.5))
    with pb.use_executor(second):
        jax.block_until_ready(f(0.6))
    assert calls(first, second) == [2, 0]


def test_use_executor_by_name(x):
    with pb.use_executor("thread") as ex:
        assert isinstance(ex, pb.ThreadExecutor)
        np.testing.assert_allclose(pb.reduce_sum(gaussian, x, 0.5), gaussian(x, 0.5).sum(),
                                   rtol=1e-5)
        ex.close()


def test_use_executor_is_per_thread(fresh_executor, x):
    mine, other_thread_saw = fresh_executor("serial"), []
    with pb.use_executor(mine):
        t = threading.Thread(target=lambda: other_thread_saw.append(
            pb.executors.resolve_executor()))
        t.start()
        t.join()
    assert other_thread_saw[0] is not mine


# -- lifecycle -----------------------------------------------------------------------------


def worker_threads():
    return {t for t in threading.enumerate() if t.name.startswith("parallel_backend")}


@pytest.mark.parametrize("workers", [2, 4])
def test_close_leaves_no_thread(x, workers):
    before = worker_threads()
    with pb.ThreadExecutor(workers, dispatch="host") as ex:
        jax.block_until_ready(jitted_value_and_grad(x, executor=ex, block_rows=BLOCK_ROWS,
                                                    grainsize=TILE_ROWS)(0.5))
        assert len(worker_threads() - before) >= 2  # the pool really ran
    assert worker_threads() == before
    ex.close()  # idempotent
    assert worker_threads() == before


@pytest.mark.parametrize("make", [
    pb.SerialExecutor,
    lambda: pb.SerialExecutor(dispatch="host"),
    lambda: pb.ThreadExecutor(2, dispatch="host"),
    lambda: pb.ThreadExecutor(2),
], ids=["serial", "serial-host", "thread2-host", "thread2"])
def test_executors_are_context_managers(make, x):
    with make() as ex:
        assert isinstance(ex, pb.Executor)
        float(pb.reduce_sum(gaussian, x, 0.5, executor=ex, block_rows=BLOCK_ROWS))
    with pytest.raises(RuntimeError, match="closed"):
        pb.reduce_sum(gaussian, x, 0.5, executor=ex)


@pytest.mark.parametrize("workers", [0, -1, 1.5, True])
def test_thread_executor_rejects_bad_worker_counts(workers):
    with pytest.raises((ValueError, TypeError), match="workers must be an int >= 1"):
        pb.ThreadExecutor(workers)


def test_unknown_dispatch():
    with pytest.raises(ValueError, match=r"dispatch must be one of \['auto', 'graph', 'host'\]"):
        pb.ThreadExecutor(2, dispatch="threads")


# -- concurrency ---------------------------------------------------------------------------


def test_one_executor_serves_concurrent_callers(fresh_executor, x):
    executor = fresh_executor("thread2-host")
    f = jitted_value_and_grad(x, executor=executor, block_rows=BLOCK_ROWS, grainsize=TILE_ROWS)
    mus = np.linspace(-1.0, 1.0, 4)
    expected = {mu: jax.value_and_grad(lambda m: gaussian(x, m).sum())(mu) for mu in mus}
    with pb.SerialExecutor(dispatch="host") as alone:  # one caller, one chunk after another
        serial = jitted_value_and_grad(x, executor=alone, block_rows=BLOCK_ROWS)
        bits = {mu: serial(mu) for mu in mus}
    results, errors = {mu: [] for mu in mus}, []
    start = threading.Barrier(len(mus))

    def caller(mu):
        try:
            start.wait()
            for _ in range(5):
                results[mu].append(jax.block_until_ready(f(mu)))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(mu,)) for mu in mus]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for mu in mus:
        assert len(results[mu]) == 5
        for value, grad in results[mu]:
            np.testing.assert_allclose(value, expected[mu][0], rtol=1e-5)
            np.testing.assert_allclose(grad, expected[mu][1], rtol=1e-4, atol=1e-3)
            # The bits of one caller alone, whatever else ran at the same time.
            np.testing.assert_array_equal(value, bits[mu][0])
            np.testing.assert_array_equal(grad, bits[mu][1])
    assert executor.stats()["calls"] == 4 * 5


# -- compile once per chunk shape ------------------------------------------------------------


def trace_counts(executor):
    return [dict(site.traces) for site in executor.sites()]


@pytest.mark.parametrize("executor", ["serial", "serial-host", "thread2-host"], indirect=True)
def test_chunk_function_traced_once_per_shape(executor, x):
    f = jitted_value_and_grad(x, executor=executor, block_rows=BLOCK_ROWS,
                              grainsize=2 * TILE_ROWS)
    mus = jnp.linspace(-1.0, 1.0, 11)  # one argument type: the outer jit traces once
    jax.block_until_ready(f(mus[0]))
    first = trace_counts(executor)
    assert first and all(first)
    for mu in mus[1:]:
        jax.block_until_ready(f(mu))
    assert trace_counts(executor) == first
    assert executor.stats()["calls"] == 11
    # One site, value and gradient only: every chunk shape was traced exactly once.
    (counts,) = first
    assert set(counts.values()) == {1}, counts


@pytest.mark.parametrize("executor", ["serial-host", "thread2-host"], indirect=True)
def test_host_chunks_compiled_once_across_traces(executor, x):
    """NumPyro traces a model several times (init, warmup, sampling); each new trace of the
    same call site reuses the compiled chunk functions."""
    for mu in np.linspace(-1.0, 1.0, 5):
        f = jitted_value_and_grad(x, executor=executor, block_rows=BLOCK_ROWS,
                                  grainsize=2 * TILE_ROWS)  # a new jit: a new trace
        jax.block_until_ready(f(mu))
    assert len(executor.sites()) == 1
    (counts,) = trace_counts(executor)
    assert set(counts.values()) == {1}, counts


@pytest.mark.parametrize("executor", ["thread2-host"], indirect=True)
def test_changing_chunk_plan_reuses_compiled_shapes(executor, x):
    """One chunk per call runs on the calling thread, several run on the pool; the same
    chunk shape must not be compiled again for either (the adaptive chunker does both)."""
    for grainsize in [2 * TILE_ROWS, x.shape[0], 2 * TILE_ROWS, x.shape[0]]:
        f = jitted_value_and_grad(x, executor=executor, block_rows=BLOCK_ROWS,
                                  grainsize=grainsize)
        jax.block_until_ready(f(0.5))
    (counts,) = trace_counts(executor)
    assert set(counts.values()) == {1}, counts


# -- the adaptive chunker --------------------------------------------------------------------


def _even(chunks) -> bool:
    sizes = [c.count for c in chunks]
    return max(sizes) - min(sizes) <= 1


def test_adaptive_chunker_settles_on_even_chunks_per_worker():
    plan = plan_blocks(66 * 100, block_rows=100)  # 66 blocks: no multiple of 4 workers
    chunker = AdaptiveChunker(plan, workers=4)
    assert not chunker.settled
    first = chunker.chunks()
    assert sum(c.count for c in first) == plan.n_blocks
    assert len(first) == 8 and _even(first)
    seen = {chunker.parts}
    # Cheap overhead, 1 ms per block: the chunker keeps two chunks per worker.
    for _ in range(10):
        chunker.record(4, compute_seconds=4e-3, overhead_seconds=1e-5)
        seen.add(chunker.parts)
    assert chunker.settled
    k = chunker.parts
    assert k == 8 and _even(chunker.chunks()) and len(seen) == 1
    assert chunker.blocks_per_chunk == 9  # 66 blocks in 8 chunks: 8 or 9 blocks each
    chunker.record(1, compute_seconds=10.0, overhead_seconds=10.0)  # ignored once settled
    assert chunker.parts == k


def test_adaptive_chunks_leave_no_worker_idle():
    """800 blocks on 2 workers: every worker gets the same blocks (the largest power of
    two that gave two chunks per worker was 128, and the chunks 128, ..., 128, 32 left a
    worker idle for a quarter of every call)."""
    chunker = AdaptiveChunker(plan_blocks(800 * 250, block_rows=250), workers=2)
    for _ in range(4):
        chunker.record(200, compute_seconds=0.5, overhead_seconds=1e-4)
    chunks = chunker.chunks()
    assert [c.count for c in chunks] == [200] * 4


def test_adaptive_chunker_grows_chunks_when_overhead_dominates():
    plan = plan_blocks(64 * 100, block_rows=100)
    cheap = AdaptiveChunker(plan, workers=4)
    costly = AdaptiveChunker(plan, workers=4)
    for _ in range(4):
        cheap.record(1, compute_seconds=1e-3, overhead_seconds=1e-6)
        costly.record(1, compute_seconds=1e-5, overhead_seconds=1e-3)
    assert costly.blocks_per_chunk > cheap.blocks_per_chunk
    assert costly.blocks_per_chunk <= plan.n_blocks
    assert costly.parts == 4 and _even(costly.chunks())  # one chunk per worker at least


@pytest.mark.parametrize("executor", ["thread2-host"], indirect=True)
def test_adaptive_chunking_settles_with_few_shapes(executor):
    x = jnp.linspace(-2.0, 2.0, 65_536)
    f = jitted_value_and_grad(x, executor=executor, block_rows=512)  # 128 blocks, 8 tiles
    for mu in np.linspace(-1.0, 1.0, 12):
        jax.block_until_ready(f(mu))
    (site,) = executor.sites()
    assert site.chunker.settled
    settled = site.chunker.blocks_per_chunk
    counts_then = dict(site.traces)
    for mu in np.linspace(-1.0, 1.0, 5):
        jax.block_until_ready(f(mu))
    assert site.chunker.blocks_per_chunk == settled
    assert dict(site.traces) == counts_then
    assert len(site.traces) <= 4, site.traces  # a handful of compiled chunk shapes
    assert executor.stats()["chunk_rows"] == [settled * 512]


def test_a_thread_pool_makes_one_chunk_per_thread_other_executors_two_per_worker():
    """Threads of one process share cores of one speed: a second chunk each evens out
    nothing; elsewhere (a cluster's workers) two per worker do."""
    assert pb.ThreadExecutor.chunks_per_worker == 1
    assert pb.SerialExecutor.chunks_per_worker == 2
    x = jnp.linspace(-2.0, 2.0, 65_536)
    with pb.ThreadExecutor(2, dispatch="host") as ex:
        f = jitted_value_and_grad(x, executor=ex, block_rows=512)  # 128 blocks
        for mu in np.linspace(-1.0, 1.0, 6):
            jax.block_until_ready(f(mu))
        (site,) = ex.sites()
        assert site.chunker.settled and site.chunker.parts == 2
        assert [c.blocks for c in ex.timeline.last(1)[0].chunks] == [64, 64]


# -- import weight ---------------------------------------------------------------------------


def test_import_is_light():
    code = ("import sys, parallel_backend as pb; "
            "heavy = [m for m in ('dask', 'distributed', 'arviz', 'numpyro') if m in sys.modules]; "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "", f"import parallel_backend imported {out.stdout.strip()}"


def test_factor_is_loaded_lazily():
    code = ("import sys, parallel_backend as pb; assert 'numpyro' not in sys.modules; "
            "f = pb.factor; assert 'numpyro' in sys.modules; print(f.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=False, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "parallel_backend.plugins.numpyro.factor"


@pytest.mark.parametrize("executor", ["serial", "thread2-host"], indirect=True)
def test_map_keeps_order(executor):
    out = executor.map(lambda i: i * i, range(7))
    assert out == [i * i for i in range(7)]


# -- likelihoods that block XLA's thread pool ------------------------------------------------

LAPACK_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
import parallel_backend as pb
from parallel_backend.blocks import xla_threads
import sys
sys.path.insert(0, {tests!r})
from helpers import group_loglik  # a Cholesky and a triangular solve per group (row)

N, BLOCK_ROWS = {n}, {block_rows}
rng = np.random.default_rng(0)
data = {{"t": jnp.asarray(np.sort(rng.uniform(0, 10, size=(N, 12)), axis=1), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(N, 12)), jnp.float32)}}
def vg(ex):
    return jax.jit(jax.value_and_grad(lambda p: pb.reduce_sum(group_loglik, data, p, executor=ex,
                                                               block_rows=BLOCK_ROWS)))
with pb.ThreadExecutor(max(2, xla_threads()), dispatch="host") as ex:
    f = vg(ex)
    for i in range(20):
        out = jax.block_until_ready(f(0.1 * i))
    stats = ex.stats()
with pb.SerialExecutor() as serial:
    f = vg(serial)
    for i in range(20):
        ref = jax.block_until_ready(f(0.1 * i))
assert stats["host_calls"] == 20 and stats["chunks"] >= 20, stats
assert all(np.array_equal(a, b) for a, b in zip(out, ref)), (out, ref)
print("ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("n, block_rows", [(20000, 2000), (2000, 300)],
                         ids=["whole-blocks", "padded-tail"])
def test_lapack_likelihood_on_every_thread_does_not_hang(n, block_rows):
    """A batched Cholesky/triangular solve blocks a thread of XLA's pool while its pieces
    run on the others: as many chunk programs as the pool has threads used to wait for
    each other forever. The host path now runs fewer of them at once. Inside one program
    the padded last block ran beside the others and two such kernels hung the pool in the
    graph too (2,000 groups in blocks of 300: 2 runs of 3); now it waits for them."""
    script = LAPACK_SCRIPT.format(n=n, block_rows=block_rows,
                                  tests=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, check=False,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_gather_waits_for_slow_chunks_while_the_device_can_start_programs(monkeypatch):
    """``gather`` checks whether XLA's device can start a program only after no task
    finished for ``STALL_SECONDS``; a task that is merely slow (the device free) is waited
    for, however long, and the results come in task order."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from parallel_backend import guards

    monkeypatch.setattr(guards, "STALL_SECONDS", 0.1)
    monkeypatch.setattr(guards, "PROBE_SECONDS", 0.5)
    device = jax.devices("cpu")[0]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(lambda s=s: (time.sleep(s), s)[1]) for s in (1.2, 0.0, 0.6)]
        assert guards.gather(futures, [device] * 3, "slow") == [1.2, 0.0, 0.6]
