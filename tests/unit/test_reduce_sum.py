"""``reduce_sum`` equals the unsplit sum ``fn(data, *shared).sum()``, value and gradients.

Every test runs on the in-graph reference (``SerialExecutor()``), the host path run
serially, and the host path on two threads (the ``executor`` fixture). Gradients are
taken with respect to the per-row parameters inside ``data`` and the shared
parameters, and compared with ``jax.value_and_grad`` of the plain sum.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallel_backend as pb

#: Small blocks: many blocks (and a ragged tail, 1000 = 3 * 256 + 232) with little data.
BLOCK_ROWS = 256
RTOL64 = 1e-10
RTOL32 = 2e-4


def value_and_grads(f, args):
    """Value and gradients with respect to both arguments, jitted (one compile, not one per op)."""
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(*args)


@pytest.mark.parametrize("name", ["logistic", "normal_array", "random_effects", "poisson_nested",
                                  "negbin", "hmm", "newton"])
def test_value_and_grad_match_unsplit_sum(x64, executor, make_problem, assert_close, name):
    problem = make_problem(name)
    got = value_and_grads(problem.split(executor, block_rows=BLOCK_ROWS), problem.args)
    want = value_and_grads(problem.unsplit(), problem.args)
    assert_close(got, want, rtol=RTOL64)
    assert executor.stats()["calls"] == 1


@pytest.mark.parametrize("name", ["logistic", "random_effects"])
def test_float32_matches_unsplit_sum(executor, make_problem, assert_close, name):
    assert not jax.config.jax_enable_x64
    problem = make_problem(name)
    got = value_and_grads(problem.split(executor, block_rows=BLOCK_ROWS), problem.args)
    want = value_and_grads(problem.unsplit(), problem.args)
    assert got[0].dtype == jnp.float32
    assert_close(got, want, rtol=RTOL32)


@pytest.mark.parametrize("n, block_rows", [
    pytest.param(1, None, id="one-row-fewer-than-workers"),
    pytest.param(3, 1, id="three-one-row-blocks"),
    pytest.param(1000, 256, id="ragged-tail"),
    pytest.param(1024, 256, id="whole-blocks"),
])
def test_row_counts(x64, executor, make_problem, assert_close, n, block_rows):
    problem = make_problem("random_effects", n=n)
    got = value_and_grads(problem.split(executor, block_rows=block_rows), problem.args)
    want = value_and_grads(problem.unsplit(), problem.args)
    assert got[1][0]["u"].shape == (n,)
    assert_close(got, want, rtol=RTOL64)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_no_rows_gives_zero(x64, executor, make_problem, jit):
    problem = make_problem("random_effects", n=0)
    f = jax.value_and_grad(problem.split(executor), argnums=(0, 1))
    value, (g_rows, g_params) = (jax.jit(f) if jit else f)(*problem.args)
    assert value.shape == () and float(value) == 0.0
    assert g_rows["u"].shape == (0,)
    for g in jax.tree.leaves(g_params):
        assert not np.any(np.asarray(g))


def test_integer_data_leaves_traced_under_jit(x64, executor, make_problem, assert_close):
    """Data passed as a jit argument is traced, its int leaves included."""
    problem = make_problem("random_effects")

    def split(data, params):
        return pb.reduce_sum(problem.fn, data, *problem.constrain(params), executor=executor,
                             block_rows=BLOCK_ROWS)

    def unsplit(data, params):
        return problem.fn(data, *problem.constrain(params)).sum()

    data = problem.rows(problem.row_params)
    got = jax.jit(jax.value_and_grad(split, argnums=1))(data, problem.params)
    want = jax.value_and_grad(unsplit, argnums=1)(data, problem.params)
    assert_close(got, want, rtol=RTOL64)


@pytest.mark.parametrize("dispatch", ["host", "graph"])
def test_eager_calls_compile_once_and_match_jit(assert_identical, dispatch):
    """Called eagerly on the host route, ``reduce_sum`` and its ``jax.grad`` are one
    program each per site, compiled at the first call and reused by the next (new
    parameters, new arrays); on the graph route the blocks' program takes the data as
    its argument and no program around it is kept (it would hold the data). Either way
    the same bits as the same calls under ``jit``."""
    x = np.random.default_rng(0).normal(size=(3_001, 2)).astype(np.float32)

    def fn(rows, mu):
        return -0.5 * jnp.sum((rows - mu) ** 2, axis=1)

    with pb.ThreadExecutor(2, dispatch=dispatch) as ex:
        def split(mu):
            return pb.reduce_sum(fn, x, mu, executor=ex, block_rows=BLOCK_ROWS)

        mus = [jnp.float32(m) for m in (0.1, 0.2, 0.3)]
        eager = [split(m) for m in mus]
        eager_vg = [jax.value_and_grad(split)(m) for m in mus]
        (state,) = ex.sites()
        assert sorted(state.eager) == ([("host", (None, "grad")), ("host", (None, "value"))]
                                       if dispatch == "host" else [])
        programs = list(state.eager.values())
        jitted, jitted_vg = jax.jit(split), jax.jit(jax.value_and_grad(split))
        for m, v, vg in zip(mus, eager, eager_vg):
            assert_identical(v, jitted(m))
            assert_identical(vg, jitted_vg(m))
        assert list(state.eager.values()) == programs  # jit's calls made none
        assert len({float(v) for v in eager}) == 3
        assert len({float(g) for _, g in eager_vg}) == 3


# -- under JAX transformations ------------------------------------------------------------

BATCH = 4

TRANSFORMS = {
    "jit": lambda f: jax.jit(f),
    "grad": lambda f: jax.grad(f, argnums=(0, 1)),
    "vmap": lambda f: jax.vmap(f),
    "jit_vmap_grad": lambda f: jax.jit(jax.vmap(jax.grad(f, argnums=(0, 1)))),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_transformations(x64, executor, make_problem, assert_close, transform):
    problem = make_problem("random_effects")
    args = problem.batch(BATCH) if "vmap" in transform else problem.args
    got = TRANSFORMS[transform](problem.split(executor, block_rows=BLOCK_ROWS))(*args)
    want = TRANSFORMS[transform](problem.unsplit())(*args)
    if "vmap" in transform:
        assert jax.tree.leaves(got)[0].shape[0] == BATCH
    assert_close(got, want, rtol=RTOL64)


def test_vmap_one_call_per_batch(executor, make_problem):
    """A vmapped batch of parameter sets is one evaluation, not one per member."""
    problem = make_problem("random_effects")
    f = jax.jit(jax.vmap(jax.value_and_grad(problem.split(executor, block_rows=BLOCK_ROWS),
                                            argnums=(0, 1))))
    jax.block_until_ready(f(*problem.batch(BATCH)))
    stats = executor.stats()
    assert stats["calls"] == 1
    assert stats["rows"] == problem.n_rows * BATCH
