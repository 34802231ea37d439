"""Bitwise reproducibility: the value and every gradient are the same bits whichever
executor, worker count or chunk size evaluated them.

The reference is the in-graph ``SerialExecutor()``. The problem has per-row
parameters inside ``data`` and a scale that is ``exp`` of an unconstrained parameter,
computed in the caller's graph as a NumPyro model does it: the in-graph path must not
let XLA fuse or simplify across the ``reduce_sum`` boundary.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallel_backend as pb
from parallel_backend import analysis
from parallel_backend.blocks import xla_threads

N = 1000
#: 16 blocks: 15 of 64 rows and a tail of 40.
BLOCK_ROWS = 64
GRAINSIZES = {
    "one-block": BLOCK_ROWS,
    "three-blocks": 3 * BLOCK_ROWS,
    "all-rows": N,
    "adaptive": None,
}
BATCH = 4


def evaluate(problem, executor, grainsize, batched=False):
    """Jitted value and gradients, over ``BATCH`` parameter sets when ``batched``."""
    f = jax.value_and_grad(problem.split(executor, block_rows=BLOCK_ROWS, grainsize=grainsize),
                           argnums=(0, 1))
    if batched:
        return jax.jit(jax.vmap(f))(*problem.batch(BATCH))
    return jax.jit(f)(*problem.args)


_references: dict = {}


@pytest.fixture
def reference(precision, make_problem):
    """``reference(batched, name)``: the in-graph serial result, computed once per precision."""

    def get(batched: bool, name: str = "random_effects"):
        key = (precision, batched, name)
        if key not in _references:
            with pb.SerialExecutor() as serial:
                out = evaluate(make_problem(name, n=N), serial, None, batched)
            _references[key] = jax.tree.map(np.asarray, out)
        return _references[key]

    return get


def check(problem, executor, grainsize, expected, batched, assert_identical):
    # The adaptive chunker changes its chunks after measuring: call it a few times.
    for call in range(1 if grainsize else 3):
        got = evaluate(problem, executor, grainsize, batched)
        try:
            assert_identical(got, expected)
        except AssertionError as e:
            raise AssertionError(f"call {call}: {e}") from e


#: Every grainsize on two threads; each other executor with one of them.
CASES = [("thread2-host", g) for g in GRAINSIZES] + [
    ("serial-host", "three-blocks"),
    ("thread1-host", "adaptive"),
    ("thread4-host", "one-block"),
]


@pytest.mark.parametrize("executor, grainsize", [
    pytest.param(e, g, id=f"{e}-{g}") for e, g in CASES], indirect=["executor"])
def test_bitwise_identical_to_serial(executor, make_problem, reference, assert_identical,
                                     grainsize):
    problem = make_problem("random_effects", n=N)
    check(problem, executor, GRAINSIZES[grainsize], reference(False), False, assert_identical)


@pytest.mark.parametrize("executor, grainsize", [
    pytest.param(e, g, id=f"{e}-{g}")
    for e, g in [("serial-host", "one-block"), ("thread4-host", "adaptive")]],
    indirect=["executor"])
def test_bitwise_identical_to_serial_under_vmap(executor, make_problem, reference,
                                                assert_identical, grainsize):
    problem = make_problem("random_effects", n=N)
    check(problem, executor, GRAINSIZES[grainsize], reference(True), True, assert_identical)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["logistic", "negbin", "hmm", "newton", "mixture"])
def test_bitwise_identical_across_likelihoods(fresh_executor, make_problem, reference,
                                              assert_identical, name):
    problem, executor = make_problem(name, n=N), fresh_executor("thread2-host")
    for grainsize in ["three-blocks", "adaptive"]:
        check(problem, executor, GRAINSIZES[grainsize], reference(False, name), False,
              assert_identical)


@pytest.mark.parametrize("name, form", [("hmm", "looped"), ("newton", "batched"),
                                        ("negbin", "batched"), ("mixture", "looped")])
def test_evaluation_form_follows_fn(fresh_executor, make_problem, name, form):
    """A ``scan`` (whose gradient keeps every step's residuals) or a reduction of a few
    elements within each row (a mixture's ``logsumexp``) runs one block at a time; a
    ``while_loop`` alone or elementwise work runs as one batch of blocks."""
    if name == "mixture" and xla_threads() > analysis.ROW_REDUCE_LOOP_THREADS:
        form = "batched"  # many threads: the batch spreads the reduction (see analysis)
    problem, executor = make_problem(name, n=N), fresh_executor("serial")
    evaluate(problem, executor, None)
    (site,) = executor.stats()["sites"]
    assert site["form"] == form


def each_set_alone(problem, args, got, assert_identical, sets=BATCH):
    """Each set of the batch ``got`` (at ``args``) is the bits it gets alone, in the graph."""
    with pb.SerialExecutor() as serial:
        f = jax.jit(jax.value_and_grad(problem.split(serial, block_rows=BLOCK_ROWS),
                                       argnums=(0, 1)))
        for i in range(sets):
            alone = f(*jax.tree.map(lambda x, i=i: x[i], args))
            assert_identical(jax.tree.map(lambda x, i=i: x[i], got), alone)


@pytest.mark.parametrize("executor", ["serial", "thread2-host"])
def test_looped_site_under_vmap_is_each_set_unbatched(fresh_executor, make_problem,
                                                       assert_identical, executor):
    """Under ``vmap`` (vectorized chains) a looped site evaluates one parameter set at a
    time, in the graph and on the host: each set gets the bits it gets alone."""
    problem = make_problem("hmm", n=N)
    args = problem.batch(BATCH)
    got = evaluate(problem, fresh_executor(executor), None, batched=True)
    each_set_alone(problem, args, got, assert_identical)


@pytest.mark.parametrize("sets", [6, 9])
@pytest.mark.parametrize("executor", ["serial", "thread2-host"])
def test_sets_one_at_a_time_run_in_steps_each_set_alone(fresh_executor, make_problem,
                                                        assert_identical, executor, sets):
    """Sets one at a time run ``SETS_AT_ONCE`` (4) to a loop step, unrolled: a batch of 6 (one
    step and the 2 left) or 9 (a loop of two steps and the 1 left) still gives each set,
    in order, the bits it gets alone, in the graph and on the host."""
    problem = make_problem("hmm", n=N)
    args = problem.batch(sets)
    f = jax.value_and_grad(problem.split(fresh_executor(executor), block_rows=BLOCK_ROWS),
                           argnums=(0, 1))
    got = jax.jit(jax.vmap(f))(*args)
    each_set_alone(problem, args, got, assert_identical, sets)


@pytest.mark.parametrize("executor", ["serial", "thread2-host"])
def test_looped_site_under_vmap_counts_one_call_of_every_set(fresh_executor, make_problem,
                                                             executor):
    """Evaluated one set at a time, a batch still counts as one call of ``BATCH`` sets, in
    the graph (the counter) and on the host (the callback), as a batched site's does."""
    problem, ex = make_problem("hmm", n=N), fresh_executor(executor)
    evaluate(problem, ex, None, batched=True)
    stats = ex.stats()
    assert (stats["calls"], stats["rows"]) == (1, BATCH * N)


def nested(problem, executor, grainsize):
    """Value and gradients under two ``vmap`` levels: the row parameters batched on the
    outer level (2 sets), the shared parameters on the inner one (``BATCH`` sets)."""
    f = jax.value_and_grad(problem.split(executor, block_rows=BLOCK_ROWS, grainsize=grainsize),
                           argnums=(0, 1))
    rows, _ = problem.batch(2)
    _, params = problem.batch(BATCH)
    return jax.jit(jax.vmap(jax.vmap(f, in_axes=(None, 0)), in_axes=(0, None)))(rows, params)


@pytest.mark.parametrize("executor", ["serial-host", "thread2-host"])
def test_batched_site_under_nested_vmap_is_bitwise_the_graphs(x64, fresh_executor, make_problem,
                                                              assert_identical, assert_close,
                                                              executor):
    """A batched site lays a batch of sets out the same way on every route (the sets inside
    the blocks); a second ``vmap`` level joins the same batch, in the graph as in the host
    path (which flattens every level into one), so the bits agree there too."""
    problem = make_problem("random_effects", n=N)
    with pb.SerialExecutor() as serial:
        expected = nested(problem, serial, None)
    assert_identical(nested(problem, fresh_executor(executor), GRAINSIZES["three-blocks"]),
                     expected)
    exact = jax.value_and_grad(problem.unsplit(), argnums=(0, 1))
    rows, _ = problem.batch(2)
    _, params = problem.batch(BATCH)
    assert_close(expected, jax.jit(jax.vmap(jax.vmap(exact, in_axes=(None, 0)),
                                            in_axes=(0, None)))(rows, params), rtol=1e-10)


@pytest.mark.parametrize("executor", ["serial", "thread2-host"])
def test_wide_regression_under_vmap_is_each_set_unbatched(monkeypatch, fresh_executor,
                                                          make_problem, assert_identical,
                                                          assert_close, executor):
    """A batched site that contracts each row with a parameter over
    ``analysis.SETS_EACH_WIDTH`` or more elements (set here to the problem's 3 features; on
    jax 0.10, 8) evaluates a batch of sets one at a time, in the graph and on the host:
    each set gets the bits it gets alone, and the batch still counts as one call."""
    monkeypatch.setattr(analysis, "SETS_EACH_WIDTH", 3)
    problem, ex = make_problem("logistic", n=N), fresh_executor(executor)
    args = problem.batch(BATCH)
    got = evaluate(problem, ex, None, batched=True)
    (site,) = ex.stats()["sites"]
    assert (site["form"], site["sets"]) == ("batched", "each")
    assert (ex.stats()["calls"], ex.stats()["rows"]) == (1, BATCH * N)
    exact = jax.jit(jax.vmap(jax.value_and_grad(problem.unsplit(), argnums=(0, 1))))(*args)
    assert_close(got, exact, rtol=1e-5)
    each_set_alone(problem, args, got, assert_identical)


@pytest.mark.parametrize("width, sets", [(3, "each"), (4, "inside"), (0, "inside")])
def test_sets_inside_the_blocks_unless_rows_contract_wide(monkeypatch, fresh_executor,
                                                          make_problem, width, sets):
    """The layout of a batch of sets follows ``fn``: the problem's rows contract with
    ``beta`` over 3 features, so a width of 3 runs them one by one; 4 or 0 (never, as
    on jax 0.12) keeps them inside the blocks."""
    monkeypatch.setattr(analysis, "SETS_EACH_WIDTH", width)
    problem, ex = make_problem("logistic", n=N), fresh_executor("serial")
    evaluate(problem, ex, None, batched=True)
    (site,) = ex.stats()["sites"]
    assert site["sets"] == sets


def test_wide_regression_under_nested_vmap_is_bitwise_the_graphs(monkeypatch, fresh_executor,
                                                                 make_problem, assert_identical):
    """One set at a time under two ``vmap`` levels (``beta`` batched on the outer one, the
    intercept on the inner): the host path's bits are the graph's."""
    monkeypatch.setattr(analysis, "SETS_EACH_WIDTH", 3)
    problem = make_problem("logistic", n=N)
    betas, intercepts = problem.batch(2)[1][0], problem.batch(BATCH)[1][1]

    def run(executor, grainsize):
        split = problem.split(executor, block_rows=BLOCK_ROWS, grainsize=grainsize)
        f = jax.value_and_grad(lambda b, c: split({}, (b, c)), argnums=(0, 1))
        return jax.jit(jax.vmap(jax.vmap(f, in_axes=(None, 0)), in_axes=(0, None)))(
            betas, intercepts)

    with pb.SerialExecutor() as serial:
        expected = run(serial, None)
        assert serial.stats()["sites"][0]["sets"] == "each"
    assert expected[0].shape == (2, BATCH)
    assert_identical(run(fresh_executor("thread2-host"), GRAINSIZES["three-blocks"]), expected)


def _wide_with_row_params(n: int = N):
    """``X @ beta`` over 3 features plus a per-row effect ``u`` (a traced data leaf)."""
    rng = np.random.default_rng(1)
    X = jnp.asarray(rng.normal(size=(n, 3)), jnp.result_type(float))
    y = X @ jnp.asarray([0.5, -1.0, 0.25]) + jnp.asarray(rng.normal(size=n))

    def loglik(d, beta):
        return -0.5 * (d["y"] - d["X"] @ beta - d["u"]) ** 2 - 0.5 * d["u"] ** 2

    def f(u, beta, executor):
        return pb.reduce_sum(loglik, {"X": X, "y": y, "u": u}, beta, executor=executor,
                             block_rows=BLOCK_ROWS)

    us = jnp.stack([0.1 * k * jnp.asarray(rng.normal(size=n)) for k in range(BATCH)])
    betas = jnp.stack([jnp.asarray([0.4, -0.9, 0.2]) * (1 + 0.1 * k) for k in range(BATCH)])
    return f, us, betas


@pytest.mark.parametrize("executor", ["serial", "thread2-host", "thread2"])
def test_wide_regression_with_row_parameters_each_set_alone(monkeypatch, fresh_executor,
                                                            assert_identical, executor):
    """One set at a time with per-row parameters batched too and a padded last block
    (1,000 rows in blocks of 64): each set's value and gradients are its bits alone."""
    monkeypatch.setattr(analysis, "SETS_EACH_WIDTH", 3)
    f, us, betas = _wide_with_row_params()
    ex = fresh_executor(executor)
    vg = jax.value_and_grad(f, argnums=(0, 1))
    got = jax.jit(jax.vmap(lambda u, b: vg(u, b, ex)))(us, betas)
    assert ex.stats()["sites"][0]["sets"] == "each"
    with pb.SerialExecutor() as serial:
        alone = jax.jit(lambda u, b: vg(u, b, serial))
        for i in range(BATCH):
            assert_identical(jax.tree.map(lambda x, i=i: x[i], got), alone(us[i], betas[i]))
