"""Sites whose likelihood calls LAPACK (Cholesky, triangular solves, eigh, slogdet, solve),
a ``while_loop`` or a host callback, with a padded last block, on every route: value and
gradient against the plain sum, and never a hang.

jaxlib 0.10 runs a LAPACK kernel on a large batch of matrices as pieces on XLA's CPU
thread pool and blocks the thread it runs on until they are done; kernels that run at once
on every pool thread then wait for each other forever (``analysis.LAPACK_POOL_WORK``). A
site keeps each of its kernels' batches small enough to run in place: its blocks run one
at a time, and ``fn`` is called on runs of at most ``spec.lapack_rows`` rows. Each case
here has a pytest timeout: a hang fails it instead of stalling the run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallel_backend as pb
from parallel_backend import analysis

N, M = 4_500, 8
#: Blocks large enough that one kernel over a block would be split over XLA's pool by
#: jaxlib 0.10 (2,000 rows of 8 x 8 solves), with a padded last block of 500 rows.
BLOCK_ROWS = 2_000


def data():
    rng = np.random.default_rng(0)
    return {"t": np.sort(rng.uniform(0, 10, size=(N, M)), axis=1),
            "y": rng.normal(size=(N, M))}


def kernel(t, log_ls):
    d2 = (t[:, :, None] - t[:, None, :]) ** 2
    return jnp.exp(-0.5 * d2 * jnp.exp(-2 * log_ls)) + 0.1 * jnp.eye(t.shape[1])


def cholesky(rows, log_ls):
    """A Gaussian process per row: a batched Cholesky and triangular solve."""
    L = jnp.linalg.cholesky(kernel(rows["t"], log_ls))
    r = jax.scipy.linalg.solve_triangular(L, rows["y"][..., None], lower=True)[..., 0]
    return -0.5 * jnp.sum(r * r, -1) - jnp.sum(jnp.log(jnp.diagonal(L, axis1=-2, axis2=-1)), -1)


def eigh(rows, log_ls):
    """The same density through an eigendecomposition."""
    w, v = jnp.linalg.eigh(kernel(rows["t"], log_ls))
    r = jnp.einsum("nij,ni->nj", v, rows["y"])
    return -0.5 * jnp.sum(r * r / w, -1) - 0.5 * jnp.sum(jnp.log(w), -1)


def slogdet_solve(rows, log_ls):
    """The same density through an LU: ``slogdet`` and ``solve``."""
    K = kernel(rows["t"], log_ls)
    _, logdet = jnp.linalg.slogdet(K)
    x = jnp.linalg.solve(K, rows["y"][..., None])[..., 0]
    return -0.5 * jnp.sum(rows["y"] * x, -1) - 0.5 * logdet


def while_loop(rows, log_ls):
    """A fixed point per row found by a ``while_loop`` (``x = cos(a * x)``), implicit in
    its derivative through ``lax.custom_root``."""
    a = jnp.exp(log_ls) * rows["t"][:, 0] / 10

    def solve(f, x0):
        def body(carry):
            x, i = carry
            return f(x), i + 1

        return jax.lax.while_loop(lambda c: c[1] < 60, body, (x0, 0))[0]

    def tangent_solve(g, y):
        return y / g(jnp.ones_like(y))

    x = jax.lax.custom_root(lambda x: x - jnp.cos(a * x), jnp.zeros_like(a),
                            lambda f, x0: solve(lambda x: x - f(x), x0), tangent_solve)
    return -0.5 * (rows["y"][:, 0] - x) ** 2


@jax.custom_jvp
def host_tanh(x):
    return jax.pure_callback(np.tanh, jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                             vmap_method="expand_dims")


@host_tanh.defjvp
def _host_tanh_jvp(primals, tangents):
    y = host_tanh(primals[0])
    return y, (1 - y * y) * tangents[0]


def callback(rows, log_ls):
    """A host callback per row (a foreign function): ``tanh`` computed by NumPy."""
    return -0.5 * (rows["y"][:, 0] - host_tanh(log_ls * rows["t"][:, 1])) ** 2


FNS = {f.__name__: f for f in (cholesky, eigh, slogdet_solve, while_loop, callback)}
EXECUTORS = {
    "serial": lambda: pb.SerialExecutor(count_calls=True),
    "thread2": lambda: pb.ThreadExecutor(2, count_calls=True),
    "serial-host": lambda: pb.SerialExecutor(dispatch="host"),
    "thread2-host": lambda: pb.ThreadExecutor(2, dispatch="host"),
}


def unsplit(f, rows):
    """The value and gradient of ``f(rows, p).sum()``, summed over runs of 100 rows: on
    jaxlib 0.10 plain JAX's own program over all rows at once can wait forever (its
    backward pass runs two batched solves at once on a pool of two threads)."""
    return jax.jit(jax.value_and_grad(lambda p: by_runs(f, rows, p)))


def by_runs(f, rows, p):
    """``f(rows, p).sum()``, one run of 100 rows at a time (``lax.map``: each solve's
    batch small enough for jaxlib 0.10 to run it in place)."""
    runs = jax.tree.map(lambda x: x.reshape((-1, 100) + x.shape[1:]), rows)
    return jax.lax.map(lambda r: f(r, p).sum(), runs).sum()


def _case(fn, name, block_rows):
    """The default run: every likelihood with the user's blocks on the threads, and the
    Cholesky on every route both ways; the slow lane the rest."""
    default = (name == "thread2-host" and block_rows == BLOCK_ROWS) or fn == "cholesky"
    return pytest.param(fn, name, block_rows, marks=() if default else pytest.mark.slow,
                        id=f"{fn}-{name}-{block_rows}")


@pytest.mark.timeout(240, method="thread")
@pytest.mark.parametrize(("fn", "name", "block_rows"),
                         [_case(f, n, b) for f in FNS for n in EXECUTORS
                          for b in (None, BLOCK_ROWS)])
def test_value_and_gradient_equal_the_plain_sum_and_never_hang(fn, name, block_rows, x64):
    rows, f = data(), FNS[fn]
    want = unsplit(f, rows)
    with EXECUTORS[name]() as ex:
        got = jax.jit(jax.value_and_grad(
            lambda p: pb.reduce_sum(f, rows, p, executor=ex, block_rows=block_rows)))
        for p in (0.1, 0.3, 0.7):  # several evaluations: a hang needs kernels at once
            np.testing.assert_allclose(got(p), want(p), rtol=1e-10, atol=1e-10)
        assert ex.stats()["chunks"] >= 3
        spec = ex.sites()[0].spec
    if fn in ("cholesky", "eigh", "slogdet_solve") and analysis.LAPACK_POOL_WORK:
        assert 0 < spec.lapack_rows < BLOCK_ROWS and spec.form == "looped", spec.lapack_rows
        if block_rows is None:
            assert spec.plan.block_rows <= spec.lapack_rows
    elif not analysis.LAPACK_POOL_WORK:
        assert spec.lapack_rows == 0


def test_the_host_route_splits_lapack_sites_over_its_threads(x64):
    """Each evaluation of a LAPACK site goes to both threads in chunks, with nothing
    that makes the chunks take turns."""
    rng = np.random.default_rng(1)
    rows = {"t": np.sort(rng.uniform(0, 10, size=(20_000, M)), axis=1),
            "y": rng.normal(size=(20_000, M))}
    with pb.ThreadExecutor(2, dispatch="host") as ex:
        f = jax.jit(jax.value_and_grad(lambda p: pb.reduce_sum(cholesky, rows, p, executor=ex)))
        jax.block_until_ready(f(0.1))
        before = ex.stats()
        for p in (0.2, 0.3, 0.4):
            np.testing.assert_allclose(f(p), unsplit(cholesky, rows)(p), rtol=1e-10)
        after = ex.stats()
    assert after["host_calls"] - before["host_calls"] == 3
    assert after["chunks"] - before["chunks"] >= 6, after  # two chunks or more each


@pytest.mark.slow
@pytest.mark.timeout(600, method="thread")
def test_nuts_with_a_lapack_site_on_threads_draws_the_plain_models_draws(x64):
    import numpyro
    import numpyro.distributions as dist
    from numpyro.infer import MCMC, NUTS

    rows = data()

    def model(executor=None):
        log_ls = numpyro.sample("log_ls", dist.Normal(0.0, 1.0))
        if executor is None:
            numpyro.factor("y", by_runs(cholesky, rows, log_ls))
        else:
            pb.factor("y", cholesky, rows, log_ls, block_rows=BLOCK_ROWS, executor=executor)

    def draws(executor=None):
        mcmc = MCMC(NUTS(model), num_warmup=30, num_samples=30, progress_bar=False)
        mcmc.run(jax.random.PRNGKey(0), executor)
        return np.asarray(mcmc.get_samples()["log_ls"])

    with pb.ThreadExecutor(2, dispatch="host") as ex:
        got = draws(ex)
        assert ex.stats()["host_calls"] > 60
    np.testing.assert_allclose(got, draws(), rtol=1e-6)
