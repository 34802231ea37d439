"""Executors given by name are one per name and process: tracing a model again and again
under ``executor="thread"`` (or ``"dask"``, or ``use_executor("thread")``) reuses one
executor, never a new pool or cluster per trace."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallel_backend as pb
from parallel_backend.executors.registry import named_executor

X = np.linspace(-1.0, 1.0, 500)
#: Sequences of a scan per row: ThreadExecutor() runs such a site on its threads.
SEQ = np.random.default_rng(0).normal(size=(4_000, 8)).astype(np.float32)


def loglik(x, mu):
    return -0.5 * (x - mu) ** 2


def scanned(x, mu):
    def step(c, xt):
        c = 0.5 * c + mu
        return c, -0.5 * (xt - c) ** 2

    return jax.lax.scan(step, jnp.zeros(x.shape[0]), x.T)[1].sum(0)


def trace_many(times, fn=loglik, data=X, **kwargs):
    """``times`` fresh traces (a new function each time, so ``jit`` cannot reuse one)."""
    out = []
    for i in range(times):
        f = jax.jit(lambda mu, i=i: pb.reduce_sum(fn, data, mu, **kwargs) + 0 * i)
        out.append(float(f(jnp.asarray(0.25))))
    return out


def new_sites(ex, before) -> list:
    """The sites ``ex`` holds that it did not hold ``before`` (other tests in this process
    may have used the same named executor)."""
    return [s for s in ex.sites() if not any(s is b for b in before)]


def test_thread_by_name_is_one_pool():
    before = threading.active_count()
    held = list(named_executor("thread").sites())
    calls = named_executor("thread").stats()["host_calls"]
    values = trace_many(20, scanned, SEQ, executor="thread")
    with pb.use_executor("thread"):
        values += trace_many(5, scanned, SEQ)
    ex = named_executor("thread")
    assert ex is named_executor("thread") and not ex.closed
    assert ex.stats()["host_calls"] - calls == 25  # the pool's threads ran every call
    # one pool: at most its workers were added, not a pool per trace
    assert threading.active_count() - before <= ex.workers
    assert len(new_sites(ex, held)) <= 1  # every trace found the one site on the one executor
    want = float(scanned(SEQ, 0.25).sum())
    np.testing.assert_allclose(values, want, rtol=1e-5)


def test_a_closed_named_executor_is_made_again():
    ex = named_executor("thread")
    ex.close()
    again = named_executor("thread")
    assert again is not ex and not again.closed
    assert trace_many(1, executor="thread")[0] == pytest.approx(float(loglik(X, 0.25).sum()),
                                                                rel=1e-6)


@pytest.mark.dask
def test_dask_by_name_is_one_cluster():
    pytest.importorskip("distributed")
    try:
        held = list(named_executor("dask").sites())
        trace_many(5, executor="dask")
        ex = named_executor("dask")
        assert len(new_sites(ex, held)) <= 1 and ex.sites()
        clusters = {id(named_executor("dask").client)}
        trace_many(3, executor="dask")
        clusters.add(id(named_executor("dask").client))
        assert len(clusters) == 1 and named_executor("dask") is ex
    finally:
        named_executor("dask").close()
