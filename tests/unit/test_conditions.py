"""Conditions on the data alone (a support check, a mask) that hold in every row, or in
none, are read as constants by every route, so that XLA may drop a ``where`` as it does
for plain NumPyro. Checked here: which equations are conditions, which are constant on
given data, that a row breaking the condition still counts, and that the graph and
another chunking give the bits of ``SerialExecutor``'s host route."""

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
import pytest

import parallel_backend as pb
from parallel_backend.analysis import conditions, constant_conditions, split_known
from parallel_backend.spec import Program


def checked(y, mu):
    """A Poisson log-density behind a support check, as NumPyro's ``validate_args`` adds."""
    lp = y * jnp.log(mu) - mu - jax.scipy.special.gammaln(y + 1.0)
    return jnp.where((y >= 0) & (y % 1 == 0), lp, -jnp.inf)


def closed_of(fn, y, *params):
    return jax.make_jaxpr(fn)(y, *params)


def test_a_support_check_is_a_condition_and_a_parameter_test_is_not():
    y = jnp.arange(8.0)
    closed = closed_of(checked, y, 2.0)
    found = conditions(closed, 1)
    assert [closed.jaxpr.eqns[i].primitive.name for i in found] == ["and"]
    # A test of the parameter (or of data and parameter) is computed per call.
    assert conditions(closed_of(lambda y, m: jnp.where(y > m, y, m), y, 2.0), 1) == ()


@pytest.mark.parametrize("y, value", [
    (np.arange(40.0), True),                # a count everywhere
    (np.full(40, -1.0), False),             # nowhere
    (np.r_[np.arange(39.0), 0.5], None),    # all but one row: not constant
])
def test_a_condition_is_constant_only_where_every_block_agrees(y, value):
    closed = closed_of(checked, jnp.zeros(10), 2.0)
    got = constant_conditions(closed, 1, [y.reshape(4, 10)])
    assert [v for _, _, v in got] == ([] if value is None else [value])


def test_a_condition_from_another_trace_is_refused():
    closed = closed_of(checked, jnp.zeros(10), 2.0)
    (i, _, value), = constant_conditions(closed, 1, [np.arange(40.0).reshape(4, 10)])
    with pytest.raises(RuntimeError, match="another program"):
        split_known(closed, 1, 0, ((i, "mul", value),))


def _nb2(X, b, s):
    return dist.NegativeBinomial2(jnp.exp(0.5 + X @ b), s)


@pytest.mark.filterwarnings("ignore:Out-of-support values")
@pytest.mark.parametrize("broken", [False, True], ids=["counts", "one-row-not-a-count"])
def test_routes_and_chunkings_give_the_bits_of_the_host_route(broken, assert_identical,
                                                              assert_close):
    n, rows = 6_000, 500
    rng = np.random.default_rng(1)
    X = rng.normal(size=(n, 3)).astype(np.float32) / 2
    y = rng.poisson(2.0, size=n).astype(np.float32)
    if broken:
        y[4321] = 1.5  # not a count: the log-density is -inf, as in plain NumPyro
    data = {"X": X, "y": y}

    def fn(d, b, s):
        return _nb2(d["X"], b, s).log_prob(d["y"])

    params = (jnp.asarray([0.1, -0.2, 0.3], jnp.float32), jnp.float32(4.0))

    def run(executor, **kw):
        f = jax.value_and_grad(
            lambda *p: pb.reduce_sum(fn, data, *p, executor=executor, block_rows=rows, **kw),
            argnums=(0, 1))
        return jax.tree.map(np.asarray, jax.jit(f)(*params))

    with pb.SerialExecutor(dispatch="host") as host:
        want = run(host)
    with pb.SerialExecutor() as graph:
        assert_identical(run(graph), want)
        (state,) = graph._states.values()
        assert [v for _, _, v in state.spec.constants] == ([] if broken else [True])
    with pb.ThreadExecutor(2, dispatch="host") as threads:  # chunks of 3 blocks
        assert_identical(run(threads, grainsize=3 * rows), want)
    plain = jax.jit(jax.value_and_grad(lambda *p: fn(data, *p).sum(), argnums=(0, 1)))(*params)
    if broken:
        assert want[0] == -np.inf and plain[0] == -np.inf
    else:
        assert_close(want, jax.tree.map(np.asarray, plain), 1e-4)


def test_a_spec_with_constants_rebuilds_the_same_program_elsewhere():
    y = np.arange(2_000.0, dtype=np.float32) % 7
    with pb.SerialExecutor() as ex:
        jax.jit(lambda m: pb.reduce_sum(checked, y, m, executor=ex, block_rows=250))(2.0)
        (state,) = ex._states.values()
    spec = cloudpickle.loads(cloudpickle.dumps(state.spec))
    assert spec.constants and spec.constants == state.spec.constants
    program = Program(spec)
    assert [value for _, value in program.split.constants] == [True]
    assert program.split.hoisted


def test_conditions_are_read_from_the_rows_the_site_keeps():
    # The site keeps a copy of a NumPy leaf; its conditions must come from that copy,
    # not from the user's array, which may change while the site is made (here: fn,
    # traced again when the site is made, mends the one row outside the support).
    y = np.r_[np.arange(49.0), 0.5].astype(np.float32)  # not a count: -inf in plain
    traces = []

    def fn(rows, mu):
        if traces:
            y[-1] = 1.0
        traces.append(1)
        return checked(rows, mu)

    with pb.SerialExecutor() as ex:
        got = float(pb.reduce_sum(fn, y, jnp.float32(2.0), executor=ex))
    assert len(traces) > 1 and y[-1] == 1.0  # the change did happen after the copy
    assert got == -np.inf  # the rows the site keeps: one is outside the support
