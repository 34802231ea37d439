"""Every derivative JAX users take of a ``reduce_sum``: ``jvp``, ``jacfwd``, ``jax.hessian``,
grad of grad, and ``vmap`` of them, against the same derivative of the unsplit sum.

A directional derivative is the route's gradients dotted with the tangent, so first
derivatives in forward mode are bitwise the same on every executor, as reverse-mode
gradients are; second derivatives are per-block Hessian-vector products, the same block
programs on every route (the executor's tasks on a host route, inlined in the caller's
program on the graph route), combined in block order: bitwise the same on every executor,
route, worker count and chunking (a wide regression on jax 0.10 keeps JAX's autodiff in
the graph). Third derivatives are JAX's autodiff of ``fn`` block by block, compared to
round-off.
"""

import sys
import warnings

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallel_backend as pb

#: Several blocks and a ragged tail (1000 = 3 * 256 + 232).
BLOCK_ROWS = 256
RTOL = 1e-8
#: The problems: elementwise (logistic), per-row parameters (random_effects), a
#: ``scan`` per row (hmm, the looped form).
PROBLEMS = ["logistic", "random_effects", "hmm"]

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def tangents(args, seed=1):
    """A tangent of ``args`` (float leaves only), reproducible."""
    leaves, tree = jax.tree.flatten(args)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree.unflatten(tree, [jax.random.normal(k, jnp.shape(x), jnp.result_type(x))
                                     for k, x in zip(keys, leaves)])


@pytest.mark.parametrize("name", PROBLEMS)
def test_jvp_matches_unsplit_sum(x64, executor, make_problem, assert_close, name):
    problem = make_problem(name, n=1000)
    t = tangents(problem.args)
    got = jax.jit(lambda a, t: jax.jvp(problem.split(executor, block_rows=BLOCK_ROWS), a, t))(
        problem.args, t)
    want = jax.jit(lambda a, t: jax.jvp(problem.unsplit(), a, t))(problem.args, t)
    assert_close(got, want, rtol=RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", PROBLEMS)
def test_hessian_matches_unsplit_sum(x64, executor, make_problem, assert_close, name):
    problem = make_problem(name, n=150)
    split, unsplit = problem.split(executor, block_rows=64), problem.unsplit()
    got = jax.jit(jax.hessian(split, argnums=(0, 1)))(*problem.args)
    want = jax.jit(jax.hessian(unsplit, argnums=(0, 1)))(*problem.args)
    assert_close(got, want, rtol=RTOL)
    # jacfwd of the gradient (forward over reverse) and jacrev of it (reverse over reverse)
    fwd = jax.jit(jax.jacfwd(jax.grad(split, argnums=1), argnums=1))(*problem.args)
    rev = jax.jit(jax.jacrev(jax.grad(split, argnums=1), argnums=1))(*problem.args)
    want11 = jax.jit(jax.hessian(unsplit, argnums=1))(*problem.args)
    assert_close(fwd, want11, rtol=RTOL)
    assert_close(rev, want11, rtol=RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", PROBLEMS)
def test_grad_of_grad_matches_unsplit_sum(x64, executor, make_problem, assert_close, name):
    problem = make_problem(name, n=1000)

    def grad_norm(f):
        def g(row_params, params):
            grads = jax.grad(f, argnums=(0, 1))(row_params, params)
            return sum(jnp.sum(x ** 2) for x in jax.tree.leaves(grads))
        return jax.jit(jax.grad(g, argnums=(0, 1)))

    got = grad_norm(problem.split(executor, block_rows=BLOCK_ROWS))(*problem.args)
    want = grad_norm(problem.unsplit())(*problem.args)
    assert_close(got, want, rtol=RTOL)


def test_vmap_of_hessian_vector_products(x64, executor, make_problem, assert_close):
    """A batch of parameter sets (vectorized chains), each with its Hessian-vector product."""
    problem = make_problem("logistic", n=1000)
    batch = problem.batch(3)
    t = tangents(problem.args)

    def hvp(f):
        grad = jax.grad(f, argnums=(0, 1))
        return jax.jit(jax.vmap(lambda a: jax.jvp(lambda *x: grad(*x), a, t)))

    got = hvp(problem.split(executor, block_rows=BLOCK_ROWS))(batch)
    want = hvp(problem.unsplit())(batch)
    assert_close(got, want, rtol=RTOL)


def test_forward_mode_first_derivative_is_bitwise_reproducible(x64, make_problem,
                                                                assert_identical, fresh_executor):
    """``jvp`` and ``jacfwd`` give the same bits on every executor and chunking, as ``grad``."""
    problem = make_problem("random_effects", n=1000)
    t = tangents(problem.args)
    outs = []
    for name, grainsize in [("serial", None), ("serial-host", 256), ("thread2-host", 512),
                            ("thread2-host", None)]:
        f = problem.split(fresh_executor(name), block_rows=BLOCK_ROWS, grainsize=grainsize)
        outs.append((jax.jit(lambda a, t, f=f: jax.jvp(f, a, t))(problem.args, t),
                     jax.jit(jax.jacfwd(f, argnums=1))(*problem.args),
                     jax.jit(jax.grad(f, argnums=(0, 1)))(*problem.args)))
    for out in outs[1:]:
        assert_identical(out, outs[0])
    # and the directional derivative is the reverse-mode gradient's dot with the tangent
    (_, jvp), _, grads = outs[0]
    dot = sum(jnp.vdot(g, v) for g, v in zip(jax.tree.leaves(grads), jax.tree.leaves(t)))
    np.testing.assert_allclose(jvp, dot, rtol=1e-12)


def test_second_derivatives_run_per_block(x64, make_problem):
    """The Hessian-vector product is taken block by block: ``fn`` is traced at the
    block sizes (and the tail's), never on all rows at once."""
    problem = make_problem("logistic", n=1000)
    sizes = []

    def fn(d, *shared):
        sizes.append(jax.tree.leaves(d)[0].shape[0])
        return problem.fn(d, *shared)

    f = problem._replace(fn=fn).split(pb.SerialExecutor(), block_rows=BLOCK_ROWS)
    jax.jit(jax.hessian(f, argnums=1))(*problem.args)
    assert 1000 not in sizes and set(sizes) <= {BLOCK_ROWS, 1000 - 3 * BLOCK_ROWS}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["random_effects", "hmm"])
def test_cross_and_third_derivatives_match_unsplit_sum(x64, executor, make_problem,
                                                       assert_close, name):
    """Derivatives of one argument's gradient in the other (the gradient's leaves and the
    tangent's differ), forward and reverse, and a third derivative."""
    problem = make_problem(name, n=150)
    split, unsplit = problem.split(executor, block_rows=64), problem.unsplit()

    def two(f):  # f of two arguments: the row parameters and the rest, or two parameters
        if problem.row_params:
            return f, problem.args
        first, *rest = problem.params
        return (lambda a, b: f({}, (a, *b))), (first, tuple(rest))

    (got_f, args), (want_f, _) = two(split), two(unsplit)
    for outer in (jax.jacfwd, jax.jacrev):
        got = jax.jit(outer(jax.grad(got_f, argnums=1), argnums=0))(*args)
        want = jax.jit(outer(jax.grad(want_f, argnums=1), argnums=0))(*args)
        assert_close(got, want, rtol=RTOL)
    if name == "hmm":  # the third derivative of a scan per row: slow to compile, same rule
        return
    got = jax.jit(jax.jacfwd(jax.hessian(split, argnums=1), argnums=1))(*problem.args)
    want = jax.jit(jax.jacfwd(jax.hessian(unsplit, argnums=1), argnums=1))(*problem.args)
    assert_close(got, want, rtol=RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["random_effects", "hmm"])
def test_hessian_vector_products_are_bitwise_reproducible(x64, make_problem, assert_identical,
                                                          fresh_executor, name):
    """The per-block Hessian-vector products, chunk tasks on a host route and the same
    block programs in the caller's program on the graph route, combined in block order:
    the same bits on every executor, route, worker count and chunking, batched
    (``jax.hessian``) or not, forward or reverse over reverse."""
    problem = make_problem(name, n=1000)
    t = tangents(problem.args)
    outs = []
    for ex, grainsize in [("serial", None), ("serial-host", 256), ("serial-host", None),
                          ("thread2-host", 512), ("thread2-host", None), ("thread4-host", 256)]:
        f = problem.split(fresh_executor(ex), block_rows=BLOCK_ROWS, grainsize=grainsize)
        grad = jax.grad(f, argnums=(0, 1))
        outs.append((jax.jit(jax.hessian(f, argnums=1))(*problem.args),
                     jax.jit(lambda a, t, grad=grad: jax.jvp(lambda *x: grad(*x), a, t))(
                         problem.args, t),
                     jax.jit(jax.jacrev(jax.grad(f, argnums=1), argnums=1))(*problem.args)))
    for out in outs[1:]:
        assert_identical(out, outs[0])


def test_second_derivatives_run_on_the_executor(x64, make_problem, assert_close,
                                                 assert_identical):
    """On a host route ``jax.hessian`` is one evaluation on the executor: its batch of
    tangents reaches one host callback, whose chunk tasks run the site's compiled
    Hessian-vector-product programs; ``fn`` is never traced on all rows. The graph route
    traces the same programs into the caller's, and its Hessian has the host's bits."""
    problem = make_problem("logistic", n=1000)
    sizes = []

    def fn(d, *shared):
        sizes.append(jax.tree.leaves(d)[0].shape[0])
        return problem.fn(d, *shared)

    counted = problem._replace(fn=fn)
    want = jax.jit(jax.hessian(problem.unsplit(), argnums=1))(*problem.args)
    with pb.ThreadExecutor(2, dispatch="host") as ex, pb.SerialExecutor() as graph:
        f = counted.split(ex, block_rows=BLOCK_ROWS, grainsize=2 * BLOCK_ROWS)
        before = ex.stats()["host_calls"]
        got = jax.jit(jax.hessian(f, argnums=1))(*problem.args)
        assert ex.stats()["host_calls"] - before == 1
        (site,) = ex.sites()
        assert any("hvp" in k[0] for k in site.traces)
        in_graph = jax.jit(jax.hessian(counted.split(graph, block_rows=BLOCK_ROWS),
                                       argnums=1))(*problem.args)
        (graph_site,) = graph.sites()
        assert graph.stats()["sites"][0]["dispatch"] == "graph"
        assert any("hvp" in k[0] for k in graph_site.traces)
    assert_close(got, want, rtol=RTOL)
    assert_identical(in_graph, got)
    assert 1000 not in sizes


@pytest.mark.parametrize("name", ["serial", "thread2-host"])
def test_hessian_of_a_site_that_evaluates_sets_each(monkeypatch, x64, make_problem,
                                                    fresh_executor, assert_close, name):
    """A batched site of ``sets="each"`` (a wide regression on jax 0.10; here the problem's
    3 features, as in test_reproducible) takes JAX's autodiff of the blocked sum for its
    second derivatives in the graph and the executor's products on a host route: both
    equal plain's Hessian."""
    from parallel_backend import analysis

    monkeypatch.setattr(analysis, "SETS_EACH_WIDTH", 3)
    problem = make_problem("logistic", n=1000)
    ex = fresh_executor(name)
    got = jax.jit(jax.hessian(problem.split(ex, block_rows=BLOCK_ROWS), argnums=1))(
        *problem.args)
    assert ex.stats()["sites"][0]["sets"] == "each"
    want = jax.jit(jax.hessian(problem.unsplit(), argnums=1))(*problem.args)
    assert_close(got, want, rtol=RTOL)


def test_device_executor_forward_mode(x64, make_problem, assert_close, assert_identical):
    """The device map's graph route: hessian equal to plain, jvp equal to the serial one."""
    problem = make_problem("random_effects", n=1000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one CPU device here: it warns that it maps nothing
        with pb.DeviceExecutor() as ex:
            split = problem.split(ex, block_rows=BLOCK_ROWS)
            t = tangents(problem.args)
            got = jax.jit(jax.hessian(split, argnums=1))(*problem.args)
            jvp = jax.jit(lambda a, t: jax.jvp(split, a, t))(problem.args, t)
    want = jax.jit(jax.hessian(problem.unsplit(), argnums=1))(*problem.args)
    assert_close(got, want, rtol=RTOL)
    serial = problem.split(pb.SerialExecutor(), block_rows=BLOCK_ROWS)
    assert_identical(jvp, jax.jit(lambda a, t: jax.jvp(serial, a, t))(problem.args, t))


@pytest.mark.slow
@pytest.mark.dask
def test_dask_executor_forward_mode(x64, make_problem, assert_close, assert_identical):
    """A real dask cluster (two worker processes): jvp bitwise the serial one, hessian
    computed on the workers, equal to plain and bitwise the host path's in this process."""
    distributed = pytest.importorskip("distributed")
    problem = make_problem("logistic", n=600)
    t = tangents(problem.args)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  host="127.0.0.1", dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client, \
            pb.DaskExecutor(client=client, dispatch="host") as ex:
        split = problem.split(ex, block_rows=128)
        jvp = jax.jit(lambda a, t: jax.jvp(split, a, t))(problem.args, t)
        calls = ex.stats()["host_calls"]
        hess = jax.jit(jax.hessian(split, argnums=1))(*problem.args)
        assert ex.stats()["host_calls"] == calls + 1  # the Hessian-vector products' evaluation
    serial = problem.split(pb.SerialExecutor(), block_rows=128)
    assert_identical(jvp, jax.jit(lambda a, t: jax.jvp(serial, a, t))(problem.args, t))
    assert_close(hess, jax.jit(jax.hessian(problem.unsplit(), argnums=1))(*problem.args),
                 rtol=RTOL)
    with pb.SerialExecutor(dispatch="host") as ex:  # the same bits as in this process
        here = jax.jit(jax.hessian(problem.split(ex, block_rows=128), argnums=1))(*problem.args)
    assert_identical(hess, here)


@pytest.mark.slow
def test_laplace_approximation_matches_plain_model(x64):
    """``AutoLaplaceApproximation`` (a Hessian of the model's log-density) through a
    ``pb.factor`` site: the plain model's mean and covariance."""
    import numpyro
    import numpyro.distributions as dist
    from numpyro.infer import SVI, Trace_ELBO
    from numpyro.infer.autoguide import AutoLaplaceApproximation

    rng = np.random.default_rng(0)
    X = rng.normal(size=(500, 3))
    y = X @ np.array([0.5, -1.0, 0.25]) + 0.3 + rng.normal(size=500)

    def loglik(d, b, a, s):
        x, yy = d
        return dist.Normal(x @ b + a, s).log_prob(yy)

    def model(parallel):
        b = numpyro.sample("b", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        a = numpyro.sample("a", dist.Normal(0.0, 1.0))
        s = numpyro.sample("s", dist.HalfNormal(1.0))
        if parallel:
            pb.factor("y", loglik, (X, y), b, a, s, executor=pb.ThreadExecutor(2),
                      block_rows=128)
        else:
            numpyro.factor("y", loglik((X, y), b, a, s).sum())

    fits = []
    for parallel in (False, True):
        guide = AutoLaplaceApproximation(model)
        svi = SVI(model, guide, numpyro.optim.Adam(0.05), Trace_ELBO())
        result = svi.run(jax.random.PRNGKey(0), 200, parallel, progress_bar=False)
        posterior = guide.get_posterior(result.params)
        fits.append((posterior.mean, posterior.covariance_matrix))
    (m0, c0), (m1, c1) = fits
    np.testing.assert_allclose(m1, m0, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(c1, c0, rtol=1e-6, atol=1e-10)
    assert np.all(np.linalg.eigvalsh(np.asarray(c1)) > 0)


#: Every order of three modes on the threads' host route (reverse over reverse over
#: reverse, an order that once lost a term, by default; the rest in the slow lane), and
#: that order on the graph route.
THIRD_ORDERS = [pytest.param("thread2-host", o, marks=() if o == "rrr" else pytest.mark.slow,
                             id=f"thread2-host-{o}")
                for o in ("fff", "ffr", "frf", "frr", "rff", "rfr", "rrf", "rrr")] + [
    pytest.param("serial", "rrr", marks=pytest.mark.slow, id="serial-rrr")]


@pytest.mark.parametrize(("executor", "order"), THIRD_ORDERS, indirect=["executor"])
def test_every_order_of_three_derivatives_matches_unsplit_sum(x64, executor, assert_close,
                                                              order):
    """Third derivatives in every order of forward and reverse mode, in the parameters
    and in a traced data leaf (the weights whose gradient is a pb.observe site's rows):
    a reverse pass over the Hessian-vector product, differentiated once more, keeps the
    product's dependence on the parameters (HMCECS's Taylor proxy takes the Hessian of
    the rows so)."""
    x = jnp.linspace(-1.0, 1.0, 40)
    w0 = jnp.linspace(0.5, 1.5, 40)
    t0 = jnp.array([0.7, 1.3])

    def fn(rows, t):
        x, w = rows
        return w * jnp.sin(t[0] * x) * t[1] ** 3 + w ** 2 * t[0] ** 3

    def split(w, t):
        return pb.reduce_sum(fn, (x, w), t, executor=executor, block_rows=16)

    def unsplit(w, t):
        return jnp.sum(fn((x, w), t))

    modes = {"f": jax.jacfwd, "r": jax.jacrev}
    for args in ((1, 1, 1), (0, 1, 1)):
        def third(f, args=args):
            g = f
            for m, a in zip(reversed(order), reversed(args)):
                g = modes[m](g, argnums=a)
            return g(w0, t0)

        assert_close(third(split), third(unsplit), rtol=1e-10)
