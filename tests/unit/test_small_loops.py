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
from parallel_backend.guards import fence
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


def filtered(rows, a, b, s):  # a local-level filter per row: 12 steps of a scan
    ys = jnp.stack([rows["y"] + k * 0.1 * rows["x"] for k in range(12)])
    q, r = jnp.exp(a) * 0.1 + 0.01, s * s

    def step(c, yt):
        m, p, ll = c
        p = p + q
        e, v = yt - m - b, p + r
        return (m + p / v * e, (1 - p / v) * p, ll - 0.5 * (jnp.log(v) + e * e / v)), None

    n = rows["y"].shape[0]
    return jax.lax.scan(step, (jnp.zeros(n), jnp.ones(n), jnp.zeros(n)), ys)[0][2]


@pytest.mark.parametrize("fn", [running, filtered])
@pytest.mark.parametrize("rows", [130, 400])
def test_a_step_on_the_gradient_rounds_alike_on_every_route(fn, rows, assert_identical):
    """The caller's arithmetic on a gradient (a descent's ``p + 1e-4 * g``, a leapfrog
    step) is not fused into the in-graph evaluation: on jax 0.10 it was, and contracted
    to an FMA after a host callback but not after the graph (one block, 130 or 400 rows:
    the points parted at the third step). ``tasks.fence`` keeps both routes' results
    opaque to XLA."""
    data = regression_data(rows)
    start = jnp.asarray([0.35, 0.15, 0.9], jnp.float32)

    def descent(executor):
        def grad(p):
            return jax.grad(lambda p: pb.reduce_sum(fn, data, p[0], p[1], p[2],
                                                    executor=executor))(p)

        return np.asarray(jax.jit(lambda p: jax.lax.fori_loop(
            0, 16, lambda i, p: p + 1e-4 * grad(p), p))(start))

    with pb.SerialExecutor() as graph:
        want = descent(graph)
    for workers in (2, 3):
        with pb.ThreadExecutor(workers, dispatch="host") as host:
            assert_identical(descent(host), want)


def test_a_fence_changes_no_bit():
    x = jnp.asarray([1.5, -0.0, np.inf, np.nan, -3.25], jnp.float32)
    got = jax.jit(lambda t: fence(t))((x, jnp.arange(3), x[::-1]))
    for a, b in zip(got, (x, jnp.arange(3), x[::-1])):
        assert np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
    # Leaves without elements pass, first or not; nothing to fence passes as it is.
    empty = (jnp.zeros((0,)), x)
    assert jax.tree.map(np.shape, jax.jit(fence)(empty)) == ((0,), (5,))
    assert fence(()) == ()


@pytest.mark.parametrize("fn", [running, filtered])
def test_vectorized_chains_step_alike_on_every_route(fn, assert_identical):
    """As above with the sets mapped (NumPyro's vectorized chains): a fence under
    ``vmap`` stays a conditional over the batch; mapped as a ``select`` it let XLA fuse
    the step into the in-graph evaluation (jax 0.10 and 0.12, from the second step)."""
    data = regression_data(130)
    starts = jnp.asarray([[0.35, 0.15, 0.9], [0.2, 0.4, 1.1], [0.5, 0.1, 0.7],
                          [0.3, 0.3, 1.3]], jnp.float32)

    def steps(executor):
        def grad(p):
            return jax.grad(lambda p: pb.reduce_sum(fn, data, p[0], p[1], p[2],
                                                    executor=executor))(p)

        def walk(p):
            return jax.lax.scan(lambda p, _: (p + 1e-4 * grad(p), grad(p)), p, None,
                                length=4)[1]

        return np.asarray(jax.jit(jax.vmap(walk))(starts))

    with pb.SerialExecutor() as graph:
        want = steps(graph)
    with pb.ThreadExecutor(2, dispatch="host") as host:
        assert_identical(steps(host), want)
    x = jnp.asarray([[1.5, -0.0], [np.inf, np.nan]], jnp.float32)
    assert np.array_equal(np.asarray(jax.vmap(fence)(x)).view(np.uint32),
                          np.asarray(x).view(np.uint32))
