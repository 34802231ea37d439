"""``pb.observe`` and ``pb.factor`` inside plates, subsampling, ``handlers.scale`` and
``handlers.mask`` against the plain model written with ``numpyro.sample(..., obs=)``
(``numpyro.factor``) in the same plates: log-density and gradients on the serial, thread
and dask executors, minibatch SVI, HMCECS, predictive draws and the pointwise
log-likelihood; and the named error of a plate that cannot be honoured."""

from __future__ import annotations

import contextlib
import functools
import re
import sys

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro import handlers
from numpyro.infer import HMCECS, MCMC, NUTS, SVI, Predictive, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal
from numpyro.infer.util import log_density

import parallel_backend as pb
from parallel_backend.plugins.numpyro import unobserved

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # dask workers: by value

N, D, B = 300, 3, 64  # rows, features, subsample size
G, R, RB = 6, 40, 16  # groups, rows per group, rows per group in a subsample
BLOCK_ROWS = 32
TRUE_B = [1.0, -2.0, 0.5]


def regression(X, b, s):
    return dist.Normal(X @ b, s)


def grouped(rows, b, s):  # rows = (X (G, R, D), alpha (G, 1)): batch shape (G, R)
    X, alpha = rows
    return dist.Normal(alpha + X @ b, s)


def regression_rows(X, b, s):  # for pb.factor / numpyro.factor: one value per row
    return -0.5 * ((X[:, 0] - X[:, 1:] @ b) / s) ** 2 - jnp.log(s)


# -- the two ways of writing each site --------------------------------------------------


class Plain:
    """The site written the NumPyro way."""

    def observe(self, name, fn, data, *shared, obs):
        return numpyro.sample(name, fn(data, *shared), obs=obs)

    def factor(self, name, fn, data, *shared):
        return numpyro.factor(name, fn(data, *shared))


class Parallel:
    """The same site through ``pb.observe`` / ``pb.factor`` on ``executor``."""

    def __init__(self, executor):
        self.executor = executor

    def observe(self, name, fn, data, *shared, obs):
        return pb.observe(name, fn, data, *shared, obs=obs, executor=self.executor,
                          block_rows=BLOCK_ROWS)

    def factor(self, name, fn, data, *shared):
        return pb.factor(name, fn, data, *shared, executor=self.executor,
                         block_rows=BLOCK_ROWS)


def latents():
    b = numpyro.sample("b", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    return b, s


def row_mask(n):
    return jnp.arange(n) % 3 != 0


def model(site, case, X, y):
    """One model per ``case``; ``site`` is :class:`Plain` or :class:`Parallel`."""
    b, s = latents()
    if case == "plate":
        with numpyro.plate("rows", N):
            site.observe("y", regression, X, b, s, obs=y)
    elif case == "subsample":
        with numpyro.plate("rows", N, subsample_size=B) as idx:
            site.observe("y", regression, X[idx], b, s, obs=y[idx])
    elif case == "scale":
        with numpyro.plate("rows", N), handlers.scale(scale=0.3):
            site.observe("y", regression, X, b, s, obs=y)
    elif case == "mask rows":
        with numpyro.plate("rows", N), handlers.mask(mask=row_mask(N)):
            site.observe("y", regression, X, b, s, obs=y)
    elif case == "mask outside the plate":
        with handlers.mask(mask=row_mask(N)), numpyro.plate("rows", N):
            site.observe("y", regression, X, b, s, obs=y)
    elif case == "mask off":
        with numpyro.plate("rows", N), handlers.mask(mask=False):
            site.observe("y", regression, X, b, s, obs=y)
    elif case == "mask scalar":  # a traced scalar
        with numpyro.plate("rows", N), handlers.mask(mask=s > 0.5):
            site.observe("y", regression, X, b, s, obs=y)
    elif case == "subsample scale mask":
        with (numpyro.plate("rows", N, subsample_size=B) as idx, handlers.scale(scale=0.5),
              handlers.mask(mask=row_mask(N)[idx])):
            site.observe("y", regression, X[idx], b, s, obs=y[idx])
    elif case in ("groups", "groups subsample"):
        # The rows of the pb site are the groups (dim -2); each has R observations (dim -1).
        Xg, yg = X[: G * R].reshape(G, R, D), y[: G * R].reshape(G, R)
        with numpyro.plate("groups", G, dim=-2):
            alpha = numpyro.sample("alpha", dist.Normal(0.0, 1.0))
            sub = RB if case == "groups subsample" else None
            with numpyro.plate("obs", R, subsample_size=sub, dim=-1) as idx:
                site.observe("y", grouped, (Xg[:, idx], alpha), b, s, obs=yg[:, idx])
    elif case == "factor plate":
        with numpyro.plate("rows", N):
            site.factor("y", regression_rows, jnp.concatenate([y[:, None], X], 1), b, s)
    elif case == "factor subsample mask":
        with (numpyro.plate("rows", N, subsample_size=B) as idx,
              handlers.mask(mask=row_mask(N)[idx]), handlers.scale(scale=2.0)):
            site.factor("y", regression_rows, jnp.concatenate([y[idx, None], X[idx]], 1), b, s)
    else:
        raise AssertionError(case)


CASES = ["plate", "subsample", "scale", "mask rows", "mask outside the plate", "mask off",
         "mask scalar", "subsample scale mask", "groups", "groups subsample", "factor plate",
         "factor subsample mask"]


def make_data(dtype):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(N, D))
    y = X @ np.asarray(TRUE_B) + rng.normal(size=N)
    return jnp.asarray(X, dtype), jnp.asarray(y, dtype)


def params(case, dtype):
    p = {"b": jnp.asarray([0.8, -1.7, 0.3], dtype), "s": jnp.asarray(1.3, dtype)}
    if case.startswith("groups"):
        p["alpha"] = jnp.linspace(-1.0, 1.0, G, dtype=dtype)[:, None]
    return p


def value_and_grad(site, case, X, y, p):
    seeded = handlers.seed(lambda X, y: model(site, case, X, y), rng_seed=7)
    return jax.jit(jax.value_and_grad(lambda p: log_density(seeded, (X, y), {}, p)[0]))(p)


@functools.cache
def plain_value_and_grad(case, dtype):
    return value_and_grad(Plain(), case, *make_data(dtype), params(case, dtype))


def assert_equal_plain(executor, case, dtype):
    rtol = 1e-8 if dtype == np.float64 else 1e-4
    want = plain_value_and_grad(case, np.dtype(dtype))
    got = value_and_grad(Parallel(executor), case, *make_data(dtype), params(case, dtype))
    assert got[0].dtype == want[0].dtype == dtype
    np.testing.assert_allclose(got[0], want[0], rtol=rtol, err_msg=f"{case}: log-density")
    for k, g in want[1].items():
        np.testing.assert_allclose(got[1][k], g, rtol=rtol, atol=rtol * float(jnp.abs(g).max()),
                                   err_msg=f"{case}: gradient of {k}")
    return want


# -- executors ----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["serial", "thread2"])
def executor(request):
    ex = pb.SerialExecutor() if request.param == "serial" else pb.ThreadExecutor(2)
    with ex:
        yield ex


@pytest.fixture(scope="module")
def dask_executor():
    pytest.importorskip("distributed")
    from distributed import Client, LocalCluster

    with (LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                       dashboard_address=None) as cluster,
          Client(cluster) as client, pb.DaskExecutor(client=client, dispatch="host") as ex):
        yield ex


# -- log-density and gradients equal the plain model's -------------------------------------


#: Every case on the serial executor in float64; in float32 and on threads, the cases whose
#: rows reach the executor differently (subsampled rows are traced, masks are boolean row
#: leaves, per-group parameters get row gradients) or whose scale is not 1 (the sum's
#: rounding is then scaled). Each combination compiles two programs: the file stays short.
COMBOS = ([("serial", "float64", c) for c in CASES]
          + [("serial", "float32", c) for c in ("plate", "subsample", "subsample scale mask",
                                                "groups subsample", "factor subsample mask")]
          + [("thread2", "float32", c) for c in ("plate", "subsample", "mask rows", "mask scalar",
                                                 "groups subsample", "factor subsample mask")]
          + [("thread2", "float64", c) for c in ("plate", "subsample scale mask", "groups",
                                                 "factor plate")])


@pytest.mark.slow
@pytest.mark.parametrize(("executor", "precision", "case"), COMBOS,
                         indirect=["executor", "precision"])
def test_log_density_and_gradient_equal_plain(executor, precision, case):
    want = assert_equal_plain(executor, case, precision)
    if case == "mask off":
        assert float(jnp.abs(want[1]["s"])) > 0  # the prior of s still counts
    if "subsample" in case:  # the subsample's scale applies (N / B or R / RB), once
        scale = R / RB if case.startswith("groups") else N / B
        assert scale > 1


@pytest.mark.dask
@pytest.mark.parametrize("case", ["plate", "subsample", "groups subsample"])
def test_log_density_and_gradient_equal_plain_on_dask(dask_executor, precision, case):
    assert_equal_plain(dask_executor, case, precision)
    assert dask_executor.stats()["host_calls"] > 0  # it ran on the workers


def test_subsample_scale_is_the_plates_not_the_rows(executor, x64):
    """With subsampling the site's log-density is N / B times the subsample's sum: not N
    times (the plate broadcasting the sum), not once."""
    X, y = make_data(np.float64)
    p = params("subsample", np.float64)
    seeded = handlers.seed(lambda: model(Parallel(executor), "subsample", X, y), rng_seed=7)
    tr = handlers.trace(handlers.substitute(seeded, data=p)).get_trace()
    idx = tr["rows"]["value"]
    rows_sum = regression(X[idx], p["b"], p["s"]).log_prob(y[idx]).sum()
    site = tr["y"]
    assert site["scale"] == N / B and site["fn"].batch_shape == (B,)
    np.testing.assert_allclose(jnp.sum(site["scale"] * site["fn"].log_prob(site["value"])),
                               N / B * rows_sum, rtol=1e-12)


# -- inference ---------------------------------------------------------------------------


def svi_fit(site):
    m = lambda X, y: model(site, "subsample", X, y)
    svi = SVI(m, AutoNormal(m), numpyro.optim.Adam(0.02), Trace_ELBO())
    return svi.run(jax.random.PRNGKey(0), 200, *make_data(np.float32), progress_bar=False)


plain_svi_fit = functools.cache(lambda: svi_fit(Plain()))


@pytest.mark.slow
def test_minibatch_svi_ends_where_plain_does(executor):
    want, got = plain_svi_fit(), svi_fit(Parallel(executor))
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-3)
    for k, v in want.params.items():
        np.testing.assert_allclose(got.params[k], v, rtol=1e-3, atol=1e-3, err_msg=k)
    # the fit learned the data at their scale (N rows), not B times it
    assert abs(float(got.losses[-50:].mean()) - float(want.losses[-50:].mean())) < 1.0


@pytest.mark.slow
def test_hmcecs_posterior_equals_plain(x64):
    """In float64 the chains follow plain's draw for draw (in float32 they part after a
    while, and HMCECS's sticky subsample chains then differ by more than their sds)."""
    X, y = make_data(np.float64)

    def run(site):
        m = lambda X, y: model(site, "subsample", X, y)
        mcmc = MCMC(HMCECS(NUTS(m), num_blocks=4), num_warmup=50, num_samples=150,
                    progress_bar=False)
        mcmc.run(jax.random.PRNGKey(1), X, y)
        return mcmc.get_samples()

    with pb.ThreadExecutor(2) as ex:
        got = run(Parallel(ex))
    want = run(Plain())
    for k in ("b", "s"):
        sd_want, sd_got = np.std(want[k], 0), np.std(got[k], 0)
        ratio = sd_got / sd_want
        assert np.all((ratio > 0.7) & (ratio < 1.4)), (k, sd_got, sd_want)
        np.testing.assert_array_less(np.abs(np.mean(got[k], 0) - np.mean(want[k], 0)),
                                     0.5 * sd_want, err_msg=k)


# -- predictive draws and the pointwise log-likelihood -------------------------------------


def test_predictive_and_log_likelihood_inside_plates(executor, x64):
    X, y = make_data(np.float64)
    samples = {"b": jnp.linspace(0.5, 1.5, 4)[:, None] * jnp.asarray(TRUE_B),
               "s": jnp.linspace(0.8, 1.2, 4)}
    key = jax.random.PRNGKey(5)
    plain = lambda X, y, case="plate": model(Plain(), case, X, y)
    par = lambda X, y, case="plate": model(Parallel(executor), case, X, y)
    want = Predictive(plain, samples)(key, X, None)["y"]
    for got in (Predictive(par, samples)(key, X, None)["y"],  # obs=None in the plate
                Predictive(unobserved(par), samples)(key, X, y)["y"]):  # obs given, drawn
        assert got.shape == (4, N)
        np.testing.assert_array_equal(got, want)
    for case in ("plate", "scale", "mask rows"):
        want = numpyro.infer.log_likelihood(plain, samples, X, y, case=case)["y"]
        got = pb.log_likelihood(par, samples, X, y, case=case)["y"]
        assert got.shape == want.shape == (4, N)
        np.testing.assert_allclose(got, want, rtol=1e-12, err_msg=case)
    grouped_samples = samples | {"alpha": jnp.zeros((4, G, 1))}
    want = numpyro.infer.log_likelihood(plain, grouped_samples, X, y, case="groups")["y"]
    got = pb.log_likelihood(par, grouped_samples, X, y, case="groups")["y"]
    # the site's rows are the groups, each of R observations: every observation keeps its
    # own value, as for the plain site (API.md section 4: the site's batch dims)
    assert got.shape == want.shape == (4, G, R)
    np.testing.assert_allclose(got, want, rtol=1e-12)


# -- plates that cannot be honoured ----------------------------------------------------------


def trace_of(fn):
    return handlers.trace(handlers.seed(fn, rng_seed=0)).get_trace()


@pytest.mark.parametrize("kind", ["observe", "factor"])
def test_a_plate_that_cannot_be_honoured_is_named(kind):
    X, y = make_data(np.float32)
    b, s = jnp.asarray(TRUE_B), jnp.asarray(1.0)
    Xy = jnp.concatenate([y[:, None], X], 1)

    def site():
        if kind == "observe":
            pb.observe("y", regression, X, b, s, obs=y)
        else:
            pb.factor("y", regression_rows, Xy, b, s)

    def in_plates(*plates):  # (name, size, kwargs): made inside the seeded trace
        def fn():
            with contextlib.ExitStack() as stack:
                for name, size, kw in plates:
                    stack.enter_context(numpyro.plate(name, size, **kw))
                site()
        return fn

    bad = {
        # a size that is neither the rows' nor 1 at their dim
        "plate 'five' (size 5 at dim -1)": in_plates(("five", 5, {})),
        # subsampled, but given all the rows
        "plate 'rows' (size 64 at dim -1)": in_plates(("rows", N, {"subsample_size": B})),
        # an outer plate left of the site's batch dims would repeat its rows
        "plate 'groups' (size 4 at dim -2)": in_plates(("groups", 4, {"dim": -2}),
                                                       ("rows", N, {})),
    }
    for words, fn in bad.items():
        with pytest.raises(ValueError, match=rf"pb\.{kind} site 'y': {re.escape(words)}") as info:
            trace_of(fn)
        assert f"batch shape ({N},)" in str(info.value)
    # a plate of size 1 anywhere, and the rows' plate at their dim, are fine
    trace_of(in_plates(("one", 1, {"dim": -2}), ("rows", N, {})))
    if kind == "factor":  # one sum; an observe site's rows take one weight each
        with pytest.raises(ValueError, match=rf"pb\.factor site 'y': a scale of shape \({N},\)"):
            trace_of(lambda: handlers.scale(site, scale=jnp.full(N, 2.0))())
    with pytest.raises(ValueError, match=rf"pb\.{kind} site.*a mask of shape \(5,\)"):
        trace_of(lambda: handlers.mask(site, mask=jnp.ones(5, bool))())
