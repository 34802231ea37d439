"""A block evaluated in the caller's program inside a small loop (NUTS on little data, a
``scan`` over parameter sets) gives the host route's bits. XLA:CPU compiles a small
``while`` loop without a matrix product as one kernel, which rounded a where-free
likelihood's gradient differently (jax 0.12: 18 of 192 entries on 400 rows); every block
now carries a small product that keeps it out of that path (``Partials.pinned``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallel_backend as pb
from helpers import regression_data
from parallel_backend.tasks import Partials


def normal(rows, a, b, s):  # no ``where`` anywhere: nothing else keeps the loop apart
    return -0.5 * ((rows["y"] - a - b * rows["x"]) / s) ** 2 - jnp.log(jnp.sqrt(2 * jnp.pi) * s)


def running(rows, a, b, s):  # a scan per row: the looped form, its own loop over blocks
    def step(c, x):
        c = 0.5 * c + a + b * x
        return c, -0.5 * ((x - c) / s) ** 2
    xs = jnp.stack([rows["x"], rows["y"]], axis=1).T
    return jax.lax.scan(step, jnp.zeros_like(rows["x"]), xs)[1].sum(0) - 2 * jnp.log(s)


@pytest.mark.parametrize("fn", [normal, running], ids=["batched", "looped"])
@pytest.mark.parametrize("loop", ["scan", "map", "fori"])
def test_a_small_loop_over_the_graph_gives_the_host_bits(loop, fn, assert_identical):
    data = regression_data(400)
    rng = np.random.default_rng(0)
    sets = jnp.asarray(np.abs(rng.normal(size=(64, 3))).astype(np.float32) + 0.1)

    def run(executor):
        def grad(p):
            return jax.grad(lambda p: pb.reduce_sum(fn, data, p[0], p[1], p[2],
                                                    executor=executor, block_rows=64))(p)

        if loop == "scan":
            f = lambda ps: jax.lax.scan(lambda c, p: (c, grad(p)), 0.0, ps)[1]
        elif loop == "map":
            f = lambda ps: jax.lax.map(grad, ps)
        else:  # a descent: each step from the last one's gradient
            def f(ps):
                def step(i, p):
                    return p + 1e-4 * grad(p)
                return jax.lax.fori_loop(0, 64, step, ps[0])
        return np.asarray(jax.jit(f)(sets))

    with pb.SerialExecutor() as graph:
        want = run(graph)
    with pb.ThreadExecutor(2, dispatch="host") as host:
        assert_identical(run(host), want)
    # ...and the loop changed nothing: each set alone, outside any loop.
    with pb.SerialExecutor() as graph:
        one = jax.jit(jax.grad(lambda p: pb.reduce_sum(fn, data, p[0], p[1], p[2],
                                                       executor=graph, block_rows=64)))
        if loop != "fori":
            assert_identical(np.stack([np.asarray(one(p)) for p in sets]), want)


def test_pinning_changes_no_bit():
    x = jnp.asarray([1.5, -0.0, np.inf, np.nan, -3.25], jnp.float32)
    got = jax.vmap(lambda v: Partials(v, (v * 2,), (v,)).pinned())(x)
    for a, b in zip(jax.tree.leaves(got), [x, x * 2, x]):
        assert np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
