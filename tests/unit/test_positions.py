"""Data read only as positions (group numbers, class labels, masks) is shown to XLA on
the in-graph route, so that the index pairs of a gather's batched transpose are folded
at compile time; everything else stays hidden. Either way the bits are the host
route's: checked here on models with such data, against every route and chunking."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallel_backend as pb
from conftest import _benchmark_likelihoods
from parallel_backend.analysis import index_leaves


def positions(fn, *args):
    """``index_leaves`` of ``fn``'s jaxpr for its first argument's leaves."""
    closed = jax.make_jaxpr(fn)(*args)
    n = len(jax.tree.leaves(args[0]))
    return index_leaves(closed, range(n))


def test_an_index_into_a_parameter_is_a_position():
    g, x = jnp.arange(10, dtype=jnp.int32) % 3, jnp.ones(10)
    assert positions(lambda d, a: a[d[0]] * d[1], (g, x), jnp.ones(3)) == (True, False)


def test_a_label_compared_or_a_mask_in_where_is_a_position():
    y, m = jnp.arange(10, dtype=jnp.int32) % 2, jnp.arange(10) < 5

    def fn(d, eta):
        v = jnp.where(d[0] == 1, jax.nn.log_sigmoid(eta), jax.nn.log_sigmoid(-eta))
        return jnp.where(d[1], v, 0.0)

    assert positions(fn, (y, m), jnp.ones(10)) == (True, True)


def test_an_index_through_a_nested_jit_is_a_position():
    g = jnp.arange(10, dtype=jnp.int32) % 3
    take = jax.jit(lambda a, i: jnp.take(a, i + 0))
    assert positions(lambda d, a: take(a, d), g, jnp.ones(3)) == (True,)


@pytest.mark.parametrize("use", [
    lambda k, a: k * a[0],                                  # a count, multiplied
    lambda k, a: jax.scipy.special.gammaln(k + 1.0) + a[0],  # converted to a float
    lambda k, a: a[k] + k,                                   # a position and a number
    lambda k, a: jnp.cumsum(k) * a[0],                       # not known to be exact
], ids=["multiplied", "converted", "both", "unknown-primitive"])
def test_an_integer_read_as_a_number_stays_hidden(use):
    k = jnp.arange(10, dtype=jnp.int32) % 3
    assert positions(use, k, jnp.ones(3)) == (False,)


def test_float_data_is_never_a_position():
    y = jnp.arange(10.0)
    assert positions(lambda y, a: a[0] * y, y, jnp.ones(3)) == (False,)


def _problem(name, n):
    lk = _benchmark_likelihoods()
    dtype = np.dtype(jnp.result_type(float))
    if name == "grouped":
        return lk.grouped(n, dtype, n_groups=50)
    if name == "ordinal":
        return lk.ordinal(n, dtype)
    rng = np.random.default_rng(0)
    y = rng.poisson(3.0, size=n).astype(np.int32)

    def counts(k, log_rate):  # int counts read as numbers: stay hidden
        return k * log_rate - jnp.exp(log_rate) - jax.scipy.special.gammaln(k + 1.0)

    return counts, y, (jnp.asarray(np.log(3.0), dtype),)


@pytest.mark.parametrize("name", ["grouped", "ordinal", "counts"])
def test_routes_and_chunkings_give_the_bits_of_the_graph(name, assert_identical, assert_close):
    n, rows = 20_000, 1_000
    fn, data, params = _problem(name, n)
    argnums = tuple(range(len(params)))

    def run(executor, **kw):
        f = jax.value_and_grad(
            lambda *p: pb.reduce_sum(fn, data, *p, executor=executor, block_rows=rows, **kw),
            argnums=argnums)
        return jax.tree.map(np.asarray, jax.jit(f)(*params))

    with pb.SerialExecutor() as graph:
        want = run(graph)
    for make, grainsize in [(lambda: pb.SerialExecutor(dispatch="host"), None),
                            (lambda: pb.ThreadExecutor(2, dispatch="host"), 3 * rows),
                            (lambda: pb.ThreadExecutor(2, dispatch="host"), None)]:
        with make() as ex:
            for _ in range(1 if grainsize else 3):  # the adaptive chunker moves its chunks
                assert_identical(run(ex, grainsize=grainsize), want)
    plain = jax.jit(jax.value_and_grad(lambda *p: fn(data, *p).sum(), argnums=argnums))(*params)
    assert_close(want, jax.tree.map(np.asarray, plain), 1e-4)


def test_the_graph_shows_positions_and_hides_values():
    """On the in-graph route the integer group numbers (positions) bypass the barrier that
    hides the data (guard ``hide``), and the float data go through it: XLA sees the first,
    not the second."""
    from parallel_backend.internals import jaxprs_in_params

    fn, data, params = _problem("grouped", 4_000)
    with pb.SerialExecutor() as graph:
        closed = jax.make_jaxpr(lambda *p: pb.reduce_sum(fn, data, *p, executor=graph,
                                                         block_rows=1_000))(*params)

    hidden = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "optimization_barrier":
                hidden.extend(v.aval for v in eqn.invars)
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    walk(closed.jaxpr)
    kinds = {str(np.asarray(x).dtype) for x in jax.tree.leaves(data)}
    assert "int32" in kinds and any(k.startswith("float") for k in kinds), kinds
    # blocks of rows (ndim 2): the groups never hidden, the values always
    rows = [a for a in hidden if a.ndim >= 2]
    assert rows and all(np.issubdtype(a.dtype, np.floating) for a in rows), hidden
