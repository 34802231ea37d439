"""The compatibility table of NumPyro's inference (``docs/compatibility.md``): one test
per row, each comparing a model whose likelihood is a ``pb.observe`` (or ``pb.factor``)
site with the same model written the NumPyro way, run with the same seed.

The model: a linear regression with three features, ``y ~ Normal(X @ b + a, s)`` over
``N`` rows. Where a kernel is deterministic given equal log-densities (every MCMC kernel
here, with float64: the chunked sum differs from the plain one by round-off only), the
draws are compared near-exactly; in float32 NUTS's trajectories part after a while, and
the posterior means and standard deviations are compared instead. SVI compares losses
and fitted parameters; the rest compares values, gradients and draws.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import warnings
from functools import partial

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro import handlers
from numpyro.infer import (
    AIES,
    ESS,
    HMC,
    HMCECS,
    MCMC,
    NUTS,
    SA,
    SVI,
    BarkerMH,
    DiscreteHMCGibbs,
    MixedHMC,
    Predictive,
    Trace_ELBO,
    TraceMeanField_ELBO,
    init_to_median,
    init_to_sample,
    init_to_uniform,
)
from numpyro.infer.autoguide import (
    AutoDelta,
    AutoLaplaceApproximation,
    AutoMultivariateNormal,
    AutoNormal,
)
from numpyro.infer.reparam import LocScaleReparam
from numpyro.infer.util import initialize_model, log_density

import parallel_backend as pb

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # dask workers: by value

N, D = 300, 3
TRUE = {"a": 0.4, "b": [1.0, -0.5, 0.3], "s": 0.7}
#: Rows per chunk of the parallel sites: several chunks, summed in a fixed order.
GRAINSIZE = 50
#: The discrete latent ``z`` shifts the intercept by this much: less than the posterior
#: sd of ``a`` (about 0.04), so that moves of ``z`` are accepted.
SHIFT = 0.02
DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "docs", "compatibility.md")


def make_data(n=N, seed=0):
    """``(X, y)`` in the current default float (float64 under x64)."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, D))
    y = X @ TRUE["b"] + TRUE["a"] + TRUE["s"] * rng.normal(size=n)
    dtype = jnp.result_type(float)
    return jnp.asarray(X, dtype), jnp.asarray(y, dtype)


def params(**extra):
    """Constrained values of the latents (the truth), in the current default float."""
    dtype = jnp.result_type(float)
    return {k: jnp.asarray(v, dtype) for k, v in {**TRUE, **extra}.items()}


# -- the model, written three ways ---------------------------------------------------------


def regression(X, y=None, *, kind="plain", plate=False, subsample_size=None, discrete=False,
               mask=None, scale=None, executor=None):
    """The regression with its likelihood as ``kind``: ``"plain"`` (``numpyro.sample``
    in a plate over the rows), ``"observe"`` (``pb.observe``) or ``"factor"``
    (``pb.factor``). ``plate=True`` (or a ``subsample_size``) puts ``pb.observe`` inside
    that plate too; ``mask`` and ``scale`` wrap the likelihood statement in
    ``handlers.mask`` / ``handlers.scale``; ``discrete`` adds a Bernoulli latent ``z``.
    The plain model ignores ``executor`` (so that every call reads the same)."""
    a = numpyro.sample("a", dist.Normal(0.0, 2.0))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    if discrete:
        a = a + SHIFT * numpyro.sample("z", dist.Bernoulli(0.5))
    with contextlib.ExitStack() as stack:
        if kind == "plain" or plate or subsample_size is not None:
            stack.enter_context(numpyro.plate("rows", X.shape[0], subsample_size=subsample_size))
            X = numpyro.subsample(X, event_dim=1)
            y = None if y is None else numpyro.subsample(y, event_dim=0)
        if mask is not None:
            stack.enter_context(handlers.mask(mask=mask))
        if scale is not None:
            stack.enter_context(handlers.scale(scale=scale))
        if kind == "plain":
            numpyro.sample("y", dist.Normal(X @ b + a, s), obs=y)
        elif kind == "observe":
            pb.observe("y", lambda X, b, a, s: dist.Normal(X @ b + a, s), X, b, a, s, obs=y,
                       executor=executor, grainsize=GRAINSIZE)
        elif kind == "factor":
            pb.factor("y", lambda rows, b, a, s: dist.Normal(rows[0] @ b + a, s).log_prob(rows[1]),
                      (X, y), b, a, s, executor=executor, grainsize=GRAINSIZE)
        else:
            raise ValueError(f"unknown kind {kind!r}")


plain = partial(regression, kind="plain")
observed = partial(regression, kind="observe")
factored = partial(regression, kind="factor")

# -- executors -----------------------------------------------------------------------------


def _dask():
    pytest.importorskip("distributed")
    from distributed import LocalCluster

    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                           dashboard_address=":0")
    ex = pb.DaskExecutor(address=cluster.scheduler_address, dispatch="host")
    ex._test_cluster = cluster  # closed with the executor
    return ex


def _device():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one CPU device in this process: it warns
        return pb.DeviceExecutor(devices=jax.devices()[:1], dispatch="host")


#: "thread" evaluates the chunks on two threads through the host callback: with the default
#: dispatch ("auto") a model this small runs in the caller's graph, the program "serial" runs.
#: "device" is the device map's host route on this process's one device.
MAKERS = {"serial": pb.SerialExecutor, "thread": lambda: pb.ThreadExecutor(2, dispatch="host"),
          "device": _device, "dask": _dask}
#: The rows that are cheap run on both executors; DASK adds a real cluster for a
#: representative subset. Each MCMC or SVI run compiles its own program (a few seconds
#: each), so most of those rows run on threads by default and on the serial executor with
#: ``-m slow`` (THREAD). Tests with rows of their own (``table``) list each row once: the
#: rows in the default run first, then those that run with ``-m slow``.
EXECUTORS = ["serial", "thread"]
DASK = EXECUTORS + [pytest.param("dask", marks=pytest.mark.dask)]
THREAD = [pytest.param("serial", marks=pytest.mark.slow), "thread"]
THREAD_DASK = THREAD + [pytest.param("dask", marks=pytest.mark.dask)]


def table(default, slow=()):
    """The rows of a test, each a tuple of its parameters' values with the executor last:
    those of ``default`` in the default run, those of ``slow`` not among them with
    ``-m slow``; a "dask" row is marked ``dask`` too. Each row holds its promise once."""
    rows = [(tuple(v), ()) for v in default]
    rows += [(tuple(v), (pytest.mark.slow,)) for v in slow if tuple(v) not in set(default)]
    return [pytest.param(*v, marks=marks + ((pytest.mark.dask,) if v[-1] == "dask" else ()),
                         id="-".join(v)) for v, marks in rows]


@pytest.fixture(scope="module")
def _executors():
    made = {}
    yield made
    for ex in made.values():
        ex.close()
        cluster = getattr(ex, "_test_cluster", None)
        if cluster is not None:
            cluster.close()


@pytest.fixture(params=EXECUTORS)
def executor(request, _executors):
    """One executor per kind for the whole module (a dask cluster starts once)."""
    if request.param not in _executors:
        _executors[request.param] = MAKERS[request.param]()
    return _executors[request.param]


# -- comparisons ---------------------------------------------------------------------------


_PLAIN: dict = {}


def plain_once(key, compute):
    """The plain model's result for ``key`` (and the precision), computed once per module:
    every executor's run compares with the same plain run."""
    key = (key, bool(jax.config.jax_enable_x64))
    if key not in _PLAIN:
        _PLAIN[key] = compute()
    return _PLAIN[key]


def run_mcmc(kernel, model, *args, warmup=50, samples=50, chains=1, chain_method="sequential",
             seed=0, **kwargs):
    mcmc = MCMC(kernel(model), num_warmup=warmup, num_samples=samples, num_chains=chains,
                chain_method=chain_method, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(seed), *args, **kwargs)
    return {k: np.asarray(v) for k, v in mcmc.get_samples().items()}


def assert_same_draws(got, want, rtol=1e-6):
    """Near-exact: float64 draws of a kernel that is deterministic given equal
    log-densities. The chunked sum differs from the plain one by round-off, which each
    iteration amplifies; after a few hundred iterations a difference can flip an
    accept/reject or tree-doubling decision and the two chains part. Hence short runs
    (``run_mcmc``'s default 50 + 50)."""
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].shape == want[k].shape, k
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=rtol, err_msg=k)


def assert_same_posterior(got, want, mean_sds=0.25, sd_rtol=0.2):
    """Two runs of the same posterior: means within ``mean_sds`` posterior sds, sds
    within ``sd_rtol`` (a posterior too narrow or too wide fails the second)."""
    assert got.keys() == want.keys()
    for k in want:
        g, w = got[k].reshape(len(got[k]), -1), want[k].reshape(len(want[k]), -1)
        sd = w.std(axis=0)
        np.testing.assert_array_less(np.abs(g.mean(axis=0) - w.mean(axis=0)), mean_sds * sd,
                                     err_msg=f"{k}: means")
        np.testing.assert_allclose(g.std(axis=0), sd, rtol=sd_rtol, err_msg=f"{k}: sds")


def log_joint(model, X, y, p, **kwargs):
    """Value and gradient (in the constrained values ``p``) of the model's log-density."""
    return jax.value_and_grad(lambda p: log_density(model, (X, y), kwargs, p)[0])(p)


def assert_close_tree(got, want, rtol):
    """Leafwise ``allclose``; the absolute slack is ``rtol`` times the leaf's largest entry."""
    got_leaves, got_def = jax.tree_util.tree_flatten_with_path(got)
    want_leaves, want_def = jax.tree.flatten(want)
    assert got_def == want_def, f"tree structures differ: {got_def} vs {want_def}"
    for (path, g), w in zip(got_leaves, want_leaves):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (jax.tree_util.keystr(path), g, w)
        scale = float(np.max(np.abs(w), initial=0.0))
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale,
                                   err_msg=jax.tree_util.keystr(path))


def rtol_of_precision():
    """Log-densities: 1e-4 relative in float32, round-off in float64."""
    return 1e-10 if jax.config.jax_enable_x64 else 1e-4


# -- MCMC ------------------------------------------------------------------------------------

#: Kernels that are deterministic given equal log-densities: with float64 and the same seed
#: they draw the plain model's draws.
KERNELS = {
    "NUTS": NUTS,
    "HMC": lambda m: HMC(m, trajectory_length=1.0),
    "SA": SA,
    "BarkerMH": BarkerMH,
}


@pytest.mark.parametrize("executor", table([("serial",)], [("thread",), ("dask",)]),
                         indirect=True)
def test_nuts_float64_draws_equal_plain(executor, x64):
    X, y = make_data()
    want = plain_once("NUTS", lambda: run_mcmc(NUTS, plain, X, y))
    before = executor.stats()["host_calls"]
    got = run_mcmc(NUTS, observed, X, y, executor=executor)
    assert_same_draws(got, want)
    # the rows were evaluated on the executor's workers (the serial reference: in the graph)
    assert executor.name == "serial" or executor.stats()["host_calls"] > before


def test_nuts_float32_posterior_equals_plain(executor):
    X, y = make_data()
    kw = {"warmup": 200, "samples": 1000}
    want = plain_once("NUTS long", lambda: run_mcmc(NUTS, plain, X, y, **kw))
    got = run_mcmc(NUTS, observed, X, y, executor=executor, **kw)
    assert got["b"].dtype == np.float32
    assert_same_posterior(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("executor", THREAD, indirect=True)
def test_nuts_factor_float64_draws_equal_plain(executor, x64):
    X, y = make_data()
    want = plain_once("NUTS", lambda: run_mcmc(NUTS, plain, X, y))
    assert_same_draws(run_mcmc(NUTS, factored, X, y, executor=executor), want)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", [k for k in KERNELS if k != "NUTS"])
@pytest.mark.parametrize("executor", THREAD, indirect=True)
def test_mcmc_kernel_draws_equal_plain(kernel, executor, x64):
    X, y = make_data()
    want = plain_once(kernel, lambda: run_mcmc(KERNELS[kernel], plain, X, y))
    got = run_mcmc(KERNELS[kernel], observed, X, y, executor=executor)
    assert_same_draws(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("executor", THREAD_DASK, indirect=True)
def test_hmcecs_subsample_draws_equal_plain(executor, x64):
    X, y = make_data()
    kernel = partial(HMCECS, num_blocks=4)
    inner = lambda m: kernel(NUTS(m))
    want = plain_once("HMCECS", lambda: run_mcmc(inner, plain, X, y, subsample_size=100))
    got = run_mcmc(inner, observed, X, y, subsample_size=100, executor=executor)
    assert_same_draws(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("executor", THREAD, indirect=True)
def test_hmcecs_taylor_proxy_draws_equal_plain(executor, x64):
    """With ``proxy=HMCECS.taylor_proxy(...)``, which reads the site's log-density row by
    row (a pb.observe site gives it per row): the plain model's draws."""
    X, y = make_data()
    proxy = HMCECS.taylor_proxy(params())
    inner = lambda m: HMCECS(NUTS(m), num_blocks=4, proxy=proxy)
    got = run_mcmc(inner, observed, X, y, subsample_size=100, executor=executor)
    want = plain_once("HMCECS taylor", lambda: run_mcmc(inner, plain, X, y, subsample_size=100))
    assert_same_draws(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["DiscreteHMCGibbs", "MixedHMC"])
@pytest.mark.parametrize("executor", THREAD, indirect=True)
def test_discrete_latent_draws_equal_plain(kernel, executor, x64):
    X, y = make_data()
    make = {"DiscreteHMCGibbs": lambda m: DiscreteHMCGibbs(NUTS(m)),
            "MixedHMC": lambda m: MixedHMC(HMC(m, trajectory_length=1.0),
                                           num_discrete_updates=10)}[kernel]
    want = plain_once(kernel, lambda: run_mcmc(make, plain, X, y, discrete=True))
    got = run_mcmc(make, observed, X, y, discrete=True, executor=executor)
    assert 0 < want["z"].mean() < 1  # z moved
    assert_same_draws(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["AIES", "ESS"])
@pytest.mark.parametrize("executor", THREAD, indirect=True)
def test_ensemble_draws_equal_plain(kernel, executor, x64):
    X, y = make_data()
    make = {"AIES": AIES, "ESS": ESS}[kernel]
    kw = {"chains": 10, "chain_method": "vectorized"}
    want = plain_once(kernel, lambda: run_mcmc(make, plain, X, y, **kw))
    got = run_mcmc(make, observed, X, y, executor=executor, **kw)
    assert_same_draws(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("chain_method", ["sequential", "vectorized", "parallel"])
@pytest.mark.parametrize("executor", THREAD, indirect=True)
def test_chain_methods_draws_equal_plain(chain_method, executor, x64):
    """``parallel`` on one CPU device: NumPyro warns and draws the chains sequentially."""
    X, y = make_data()
    kw = {"chains": 2, "chain_method": chain_method}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "There are not enough devices")
        want = plain_once(chain_method, lambda: run_mcmc(NUTS, plain, X, y, **kw))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run_mcmc(NUTS, observed, X, y, executor=executor, **kw)
    fallback = [w for w in caught if "not enough devices" in str(w.message)]
    if chain_method == "parallel" and jax.local_device_count() < 2:
        assert len(fallback) == 1, [str(w.message) for w in caught]
    assert got["b"].shape == (100, D)
    assert_same_draws(got, want)


PMAP_CHILD = """
import sys
sys.path.insert(0, {here!r})
import jax, numpy as np
jax.config.update("jax_enable_x64", True)
from numpyro.infer import NUTS
import parallel_backend as pb
from test_compat import make_data, observed, plain, run_mcmc, assert_same_draws
assert jax.local_device_count() == 2
X, y = make_data()
kw = dict(chains=2, chain_method="parallel")
want = run_mcmc(NUTS, plain, X, y, **kw)
for ex in (pb.SerialExecutor(), pb.ThreadExecutor(2, dispatch="host")):
    with ex:
        assert_same_draws(run_mcmc(NUTS, observed, X, y, executor=ex, **kw), want)
        assert ex.stats()["host_calls"] == 0, ex.stats()
print("ok")
"""


@pytest.mark.slow
def test_chain_method_parallel_on_two_devices_draws_equal_plain():
    """``parallel`` with two (forced) CPU devices: NumPyro's ``pmap`` of the chains. The
    sites stay in the graph even where the executor's ``dispatch`` is ``"host"``
    (``routes.route_of``): on an XLA pool of two threads (``NPROC=2``), two devices'
    callbacks at once held both, and with jax 0.10 their chunk programs never started."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", NPROC="2")
    proc = subprocess.run([sys.executable, "-c", PMAP_CHILD.format(here=here)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


# -- SVI ---------------------------------------------------------------------------------------

GUIDES = {"AutoNormal": AutoNormal, "AutoDelta": AutoDelta,
          "AutoMultivariateNormal": AutoMultivariateNormal}


ELBOS = {"Trace_ELBO": Trace_ELBO, "TraceMeanField_ELBO": TraceMeanField_ELBO}


def run_svi(guide, model, X, y, steps=200, elbo="Trace_ELBO", **kwargs):
    g = guide(model)
    svi = SVI(model, g, numpyro.optim.Adam(0.05), ELBOS[elbo]())
    result = svi.run(jax.random.PRNGKey(0), steps, X, y, progress_bar=False, **kwargs)
    return g, result


def assert_same_fit(got, want):
    f64 = jax.config.jax_enable_x64
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-9 if f64 else 1e-4)
    assert_close_tree(got.params, want.params, rtol=1e-8 if f64 else 1e-3)


@pytest.mark.slow
@pytest.mark.parametrize(("guide", "elbo", "precision", "executor"), table([], [
    *[("AutoNormal", "Trace_ELBO", "float32", ex) for ex in EXECUTORS],
    *[("AutoNormal", elbo, "float64", ex) for elbo in ELBOS
      for ex in ("serial", "thread", "device", "dask")],
    *[(guide, "Trace_ELBO", "float64", ex) for guide in ("AutoDelta", "AutoMultivariateNormal")
      for ex in EXECUTORS]]), indirect=["precision", "executor"])
def test_svi_autoguide_fit_equals_plain(guide, elbo, executor, precision):
    X, y = make_data()
    key = guide if elbo == "Trace_ELBO" else (guide, elbo)
    _, want = plain_once(key, lambda: run_svi(GUIDES[guide], plain, X, y, elbo=elbo))
    _, got = run_svi(GUIDES[guide], observed, X, y, elbo=elbo, executor=executor)
    assert_same_fit(got, want)


@pytest.mark.parametrize("executor", THREAD, indirect=True)
def test_svi_factor_fit_equals_plain(executor, x64):
    X, y = make_data()
    _, want = plain_once("AutoNormal", lambda: run_svi(AutoNormal, plain, X, y))
    _, got = run_svi(AutoNormal, factored, X, y, executor=executor)
    assert_same_fit(got, want)


@pytest.mark.slow
def test_svi_laplace_approximation_equals_plain(executor, x64):
    """``AutoLaplaceApproximation.get_posterior`` takes ``jax.hessian`` of the
    log-density: forward-mode through the site."""
    X, y = make_data()
    g_want, want = plain_once("Laplace", lambda: run_svi(AutoLaplaceApproximation, plain, X, y))
    g_got, got = run_svi(AutoLaplaceApproximation, observed, X, y, executor=executor)
    assert_same_fit(got, want)
    post_want, post_got = g_want.get_posterior(want.params), g_got.get_posterior(got.params)
    np.testing.assert_allclose(post_got.loc, post_want.loc, rtol=1e-8)
    np.testing.assert_allclose(post_got.covariance_matrix, post_want.covariance_matrix,
                               rtol=1e-6, atol=1e-10)
    key = jax.random.PRNGKey(1)
    draws_want = g_want.sample_posterior(key, want.params, sample_shape=(500,))
    draws_got = g_got.sample_posterior(key, got.params, sample_shape=(500,))
    assert_same_draws({k: np.asarray(v) for k, v in draws_got.items()},
                      {k: np.asarray(v) for k, v in draws_want.items()})


@pytest.mark.slow
@pytest.mark.parametrize("executor", THREAD_DASK, indirect=True)
def test_svi_minibatch_fit_equals_plain(executor, x64):
    X, y = make_data()
    _, want = plain_once("minibatch", lambda: run_svi(AutoNormal, plain, X, y, subsample_size=64))
    _, got = run_svi(AutoNormal, observed, X, y, subsample_size=64, executor=executor)
    assert_same_fit(got, want)


# -- predictive, log-likelihood, initialisation, log_density ------------------------------------


def posterior_draws(n=8):
    dtype = jnp.result_type(float)
    lin = jnp.linspace(0.8, 1.2, n, dtype=dtype)
    return {"a": TRUE["a"] * lin, "b": lin[:, None] * jnp.asarray(TRUE["b"], dtype),
            "s": TRUE["s"] * lin}


@pytest.mark.parametrize(("precision", "executor"), table(
    [("float64", "thread"), ("float64", "device"), ("float64", "dask")],
    [(p, ex) for p in ("float64", "float32") for ex in EXECUTORS]),
    indirect=True)
def test_predictive_draws_equal_plain(executor, precision):
    X, _ = make_data()
    key = jax.random.PRNGKey(3)
    want = Predictive(plain, posterior_draws())(key, X)["y"]
    got = Predictive(observed, posterior_draws())(key, X, executor=executor)["y"]
    assert got.shape == (8, N) and np.array_equal(got, want)
    prior_want = Predictive(plain, num_samples=5)(key, X)
    prior_got = Predictive(observed, num_samples=5)(key, X, executor=executor)
    for k in ("a", "b", "s", "y"):
        assert np.array_equal(prior_got[k], prior_want[k]), k


@pytest.mark.parametrize(("model", "precision", "executor"), table(
    [("observe", "float64", ex) for ex in ("serial", "thread", "device", "dask")],
    [(m, p, ex) for m in ("observe", "factor") for p in ("float64", "float32")
     for ex in ("serial", "thread", "dask")]),
    indirect=["precision", "executor"])
def test_pb_log_likelihood_equals_numpyros(model, executor, precision):
    """Shape (draws, rows), and (chains, draws, rows) for draws grouped by chain."""
    X, y = make_data()
    m = {"observe": observed, "factor": factored}[model]
    want = numpyro.infer.log_likelihood(plain, posterior_draws(), X, y)["y"]
    got = pb.log_likelihood(m, posterior_draws(), X, y, executor=executor)
    assert set(got) == {"y"} and got["y"].shape == want.shape == (8, N)
    np.testing.assert_allclose(got["y"], want, rtol=rtol_of_precision(), atol=1e-6)
    by_chain = {k: v.reshape((2, 4) + v.shape[1:]) for k, v in posterior_draws().items()}
    grouped = pb.log_likelihood(m, by_chain, X, y, executor=executor)["y"]
    assert grouped.shape == (2, 4, N)
    np.testing.assert_allclose(grouped.reshape(8, N), want, rtol=rtol_of_precision(), atol=1e-6)


@pytest.mark.slow
def test_numpyro_log_likelihood_is_pointwise(executor, precision):
    """``numpyro.infer.log_likelihood`` (what ArviZ's ``from_numpyro`` calls) gives the plain
    model's values per row, shape (draws, rows), for a ``pb.observe`` site; a ``pb.factor``
    site is one term per draw, as ``numpyro.factor`` is."""
    X, y = make_data()
    want = numpyro.infer.log_likelihood(plain, posterior_draws(), X, y)["y"]
    got = numpyro.infer.log_likelihood(observed, posterior_draws(), X, y, executor=executor)
    assert got["y"].shape == want.shape == (8, N)
    np.testing.assert_allclose(got["y"], want, rtol=rtol_of_precision(), atol=1e-6)
    by_chain = {k: v.reshape((2, 4) + v.shape[1:]) for k, v in posterior_draws().items()}
    got2 = numpyro.infer.log_likelihood(observed, by_chain, X, y, executor=executor,
                                        batch_ndims=2)["y"]
    np.testing.assert_array_equal(np.reshape(got2, (8, N)), got["y"])
    summed = numpyro.infer.log_likelihood(factored, posterior_draws(), X, y, executor=executor)
    np.testing.assert_allclose(summed["y"], want.sum(-1), rtol=rtol_of_precision())
    mask = np.arange(N) % 3 != 0  # masked rows give zero, as in the plain model
    want_m = numpyro.infer.log_likelihood(plain, posterior_draws(), X, y, mask=mask)["y"]
    got_m = numpyro.infer.log_likelihood(observed, posterior_draws(), X, y, mask=mask,
                                         executor=executor)["y"]
    assert got_m.shape == want_m.shape == (8, N) and not np.any(got_m[:, ~mask])
    np.testing.assert_allclose(got_m, want_m, rtol=rtol_of_precision(), atol=1e-6)


def test_log_density_still_sums_after_log_likelihood(executor, precision):
    """The pointwise answer is for ``log_likelihood`` alone: ``log_density`` of the same
    model (and its gradient) is still the parallel sum, equal to the plain model's."""
    X, y = make_data()
    draw = {k: v[0] for k, v in posterior_draws().items()}
    numpyro.infer.log_likelihood(observed, posterior_draws(), X, y, executor=executor)
    got = log_density(observed, (X, y), {"executor": executor}, draw)[0]
    want = log_density(plain, (X, y), {}, draw)[0]
    assert jnp.shape(got) == ()
    np.testing.assert_allclose(got, want, rtol=rtol_of_precision())


@pytest.mark.slow
def test_arviz_from_numpyro_of_a_pb_observe_model(executor):
    """ArviZ's own ``from_numpyro`` reads the log-likelihood through
    ``numpyro.infer.log_likelihood``: for a ``pb.observe`` site it gets the plain model's
    values per row (chain, draw, rows), and LOO runs on them."""
    az = pytest.importorskip("arviz")
    from helpers import loo_elpd, run_groups

    X, y = make_data()
    mcmc = MCMC(NUTS(observed, max_tree_depth=3), num_warmup=30, num_samples=50, num_chains=2,
                chain_method="sequential", progress_bar=False)
    mcmc.run(jax.random.PRNGKey(2), X, y, executor=executor)
    run = az.from_numpyro(mcmc, log_likelihood=True)
    got = run_groups(run)["log_likelihood"]["y"]
    want = numpyro.infer.log_likelihood(plain, mcmc.get_samples(group_by_chain=True), X, y,
                                        batch_ndims=2)["y"]
    assert got.shape == want.shape == (2, 50, N)
    np.testing.assert_allclose(got.values, want, rtol=rtol_of_precision(), atol=1e-6)
    elpd, n = loo_elpd(run, "y")
    assert n == N and np.isfinite(elpd)


STRATEGIES = {"init_to_uniform": init_to_uniform, "init_to_median": init_to_median,
              "init_to_sample": init_to_sample}


@pytest.mark.parametrize(("strategy", "precision", "executor"), table(
    [("init_to_uniform", p, ex) for p in ("float64", "float32") for ex in EXECUTORS]
    + [(strategy, "float64", "thread") for strategy in ("init_to_median", "init_to_sample")]),
    indirect=["precision", "executor"])
def test_initialize_model_equals_plain(strategy, executor, precision):
    X, y = make_data()
    key = jax.random.PRNGKey(1)
    init = STRATEGIES[strategy]
    got = initialize_model(key, observed, model_args=(X, y), model_kwargs={"executor": executor},
                           init_strategy=init)
    want = initialize_model(key, plain, model_args=(X, y), init_strategy=init)
    rtol = rtol_of_precision()
    assert_close_tree(got.param_info.z, want.param_info.z, rtol=0)
    np.testing.assert_allclose(got.param_info.potential_energy, want.param_info.potential_energy,
                               rtol=rtol)
    assert_close_tree(got.param_info.z_grad, want.param_info.z_grad, rtol=rtol)


@pytest.mark.parametrize(("model", "precision", "executor"), table(
    [("observe", "float64", ex) for ex in ("serial", "thread", "device", "dask")],
    [(m, p, ex) for m in ("observe", "observe-in-plate", "factor")
     for p in ("float64", "float32") for ex in EXECUTORS]),
    indirect=["precision", "executor"])
def test_log_density_equals_plain(model, executor, precision):
    X, y = make_data()
    kw = {"observe": {}, "observe-in-plate": {"plate": True}, "factor": {}}[model]
    m = factored if model == "factor" else observed
    before = executor.stats()["host_calls"]
    for f in (log_joint, jax.jit(log_joint, static_argnums=0)):
        got = f(partial(m, executor=executor, **kw), X, y, params())
        want = log_joint(plain, X, y, params())
        assert_close_tree(got, want, rtol=rtol_of_precision())
    # the rows were evaluated on the executor's workers (the serial reference: in the graph)
    assert executor.name == "serial" or executor.stats()["host_calls"] >= before + 2


# -- handlers ----------------------------------------------------------------------------------

ROW_MASK = np.arange(N) % 3 != 0
ROW_SCALE = np.linspace(0.5, 2.0, N)
#: Handler cases: keyword arguments of ``regression`` (around the likelihood statement),
#: or a wrapper of the whole model.
HANDLERS = {
    "scale": {"scale": 0.25},
    "mask per row": {"mask": ROW_MASK},
    "mask False": {"mask": False},
    "mask True": {"mask": True},
    "scale whole model": lambda m: handlers.scale(m, scale=0.25),
    "block": lambda m: handlers.block(m, hide=["y"]),
}


@pytest.mark.parametrize(("model", "case", "precision", "executor"), table(
    [("observe", case, "float64", "thread") for case in ("scale", "mask per row", "mask False")],
    [(model, case, p, ex) for model in ("observe", "observe-in-plate", "factor")
     for case in HANDLERS for p in ("float64", "float32") for ex in EXECUTORS
     # a pb.factor site has no rows to mask (a factor, as numpyro.factor's)
     if not (model == "factor" and case == "mask per row")]),
    indirect=["precision", "executor"])
def test_handler_log_density_equals_plain(case, model, executor, precision):
    X, y = make_data()
    how = HANDLERS[case]
    kw = {"plate": True} if model == "observe-in-plate" else {}
    m = partial(factored if model == "factor" else observed, executor=executor, **kw)
    if callable(how):
        got_model, want_model = how(m), how(plain)
    else:
        got_model, want_model = partial(m, **how), partial(plain, **how)
    got = log_joint(got_model, X, y, params())
    want = log_joint(want_model, X, y, params())
    assert_close_tree(got, want, rtol=rtol_of_precision())


@pytest.mark.parametrize("executor", DASK, indirect=True)
@pytest.mark.parametrize("model", ["observe", "observe-in-plate"])
def test_scale_per_row_equals_plain(model, executor, precision):
    """``handlers.scale`` with one weight per row: the observe site's log_prob is per row,
    so NumPyro weights the rows as it weights the plain site's."""
    X, y = make_data()
    scale = jnp.asarray(ROW_SCALE, jnp.result_type(float))
    want = log_joint(partial(plain, scale=scale), X, y, params())
    m = partial(observed, executor=executor, plate=model == "observe-in-plate", scale=scale)
    assert_close_tree(log_joint(m, X, y, params()), want, rtol=rtol_of_precision())


def test_scale_per_row_on_a_factor_raises(executor):
    """A pb.factor site's log-density is one sum, which one weight per row cannot
    multiply: the error says so and what to use instead."""
    X, y = make_data()
    scale = jnp.asarray(ROW_SCALE, jnp.result_type(float))
    m = partial(factored, executor=executor, scale=scale)
    with pytest.raises(ValueError, match=r"'y'.*scale of shape \(300,\).*use pb.observe"):
        log_joint(m, X, y, params())


def test_condition_and_substitute_equal_plain(executor, precision):
    X, y = make_data()
    p = params()
    for wrap in (lambda m: handlers.condition(m, data={"a": p["a"]}),
                 lambda m: handlers.substitute(m, data={"s": p["s"]})):
        got = log_joint(wrap(partial(observed, executor=executor)), X, y, p)
        want = log_joint(wrap(plain), X, y, p)
        assert_close_tree(got, want, rtol=rtol_of_precision())
    # the conditioned latent is an observed site now
    tr = handlers.trace(handlers.seed(handlers.condition(observed, data={"a": p["a"]}), 0)
                        ).get_trace(X, y, executor=executor)
    assert tr["a"]["is_observed"] and tr["y"]["is_observed"] and tr["y"]["value"] is y


def test_block_hides_the_site(executor):
    X, y = make_data()
    tr = handlers.trace(handlers.seed(handlers.block(observed, hide=["y"]), 0)).get_trace(
        X, y, executor=executor)
    assert "y" not in tr and {"a", "b", "s"} <= set(tr)


@pytest.mark.slow
@pytest.mark.parametrize("executor", THREAD, indirect=True)
def test_reparam_loc_scale_nuts_draws_equal_plain(executor, x64):
    X, y = make_data()
    config = {"a": LocScaleReparam(centered=0)}
    want = plain_once("reparam", lambda: run_mcmc(NUTS, handlers.reparam(plain, config=config),
                                                  X, y))
    got = run_mcmc(NUTS, handlers.reparam(observed, config=config), X, y, executor=executor)
    assert "a_decentered" in got
    assert_same_draws(got, want)


# -- the docs table ------------------------------------------------------------------------------


def test_the_docs_table_names_every_test_here():
    with open(DOCS, encoding="utf-8") as fh:
        page = fh.read()
    with open(__file__, encoding="utf-8") as fh:
        here = set(re.findall(r"^def (test_\w+)", fh.read(), flags=re.MULTILINE))
    named = set(re.findall(r"`(test_\w+)", page))
    assert here - {"test_the_docs_table_names_every_test_here"} <= named, here - named
    assert named <= here, named - here
