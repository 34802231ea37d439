"""``pb.observe`` against the same model written the NumPyro way (a plate and an observed
site), on every kind of executor: log-density and gradients, predictive draws, pointwise
log-likelihood, SVI, initialisation and handlers; then the errors, and
``pb.sample(posterior_predictive=True)`` on the installed ArviZ."""

from __future__ import annotations

import sys
import warnings

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro import handlers
from numpyro.infer import (
    MCMC,
    NUTS,
    SVI,
    Predictive,
    Trace_ELBO,
    TraceMeanField_ELBO,
    init_to_median,
    init_to_sample,
)
from numpyro.infer.autoguide import AutoNormal
from numpyro.infer.util import initialize_model, log_density

import parallel_backend as pb
from helpers import run_groups

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # dask workers: by value

N, D = 600, 3
BLOCK_ROWS = 64


def data(dtype=jnp.float64, n=N, seed=0):
    rng = np.random.default_rng(seed)
    X = jnp.asarray(rng.normal(size=(n, D)), dtype)
    logits = X @ jnp.asarray([0.8, -0.5, 0.3], dtype)
    y = jnp.asarray(rng.random(n) < 1 / (1 + np.exp(-np.asarray(logits))), dtype)
    return X, y


def bernoulli(X, b, a):
    return dist.Bernoulli(logits=a + X @ b)


def plain(X, y=None):
    a = numpyro.sample("a", dist.Normal(0.0, 2.0))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
    with numpyro.plate("rows", X.shape[0]):
        numpyro.sample("y", bernoulli(X, b, a), obs=y)


def parallel(X, y=None, executor=None):
    a = numpyro.sample("a", dist.Normal(0.0, 2.0))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
    pb.observe("y", bernoulli, X, b, a, obs=y, executor=executor, block_rows=BLOCK_ROWS)


def _device():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one CPU device in this process: it warns
        return pb.DeviceExecutor(devices=jax.devices()[:1], dispatch="host")


def _dask():
    pytest.importorskip("distributed")
    from distributed import LocalCluster

    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                           host="127.0.0.1", dashboard_address=None)
    ex = pb.DaskExecutor(address=cluster.scheduler_address, dispatch="host")
    ex._test_cluster = cluster  # closed with the executor below
    return ex


EXECUTORS = {"serial": lambda: pb.SerialExecutor(), "thread": lambda: pb.ThreadExecutor(
    2, dispatch="host"), "device": _device, "dask": _dask}


@pytest.fixture(scope="module", params=list(EXECUTORS))
def executor(request):
    ex = EXECUTORS[request.param]()
    yield ex
    ex.close()
    cluster = getattr(ex, "_test_cluster", None)
    if cluster is not None:
        cluster.close()


PARAMS = {"a": 0.2, "b": [0.5, -0.3, 0.1]}


def params(dtype=jnp.float64):
    return {k: jnp.asarray(v, dtype) for k, v in PARAMS.items()}


# -- equal to the plain model, on every executor -----------------------------------------


def test_log_density_and_gradients_equal_plain(executor, x64):
    X, y = data()

    def ld(model, kwargs):
        return lambda p: log_density(model, (X, y), kwargs, p)[0]

    want = jax.value_and_grad(ld(plain, {}))(params())
    for f in (jax.value_and_grad(ld(parallel, {"executor": executor})),
              jax.jit(jax.value_and_grad(ld(parallel, {"executor": executor})))):
        got = f(params())
        np.testing.assert_allclose(got[0], want[0], rtol=1e-10, atol=1e-10)
        for k in PARAMS:
            np.testing.assert_allclose(got[1][k], want[1][k], rtol=1e-10, atol=1e-10)
    # it ran on the executor: the serial reference in the graph, the others on their workers
    assert executor.stats()["sites"] and (executor.name == "serial"
                                          or executor.stats()["host_calls"] >= 2)


def factor_rows(rows, b, a):
    return bernoulli(rows[0], b, a).log_prob(rows[1])


def traffic(kind, executor, n):
    """Bytes sent and received per jitted gradient of the model with its likelihood as
    ``kind`` over ``n`` rows, after the data went out (the first gradient)."""
    X, y = data(n=n)

    def model(X, y):
        a = numpyro.sample("a", dist.Normal(0.0, 2.0))
        b = numpyro.sample("b", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
        if kind == "observe":
            pb.observe("y", bernoulli, X, b, a, obs=y, executor=executor, block_rows=2_000)
        else:
            pb.factor("y", factor_rows, (X, y), b, a, executor=executor, block_rows=2_000)

    grad = jax.jit(jax.grad(lambda p: log_density(model, (X, y), {}, p)[0]))
    jax.block_until_ready(grad(params()))
    before = executor.stats()
    for step in range(3):
        jax.block_until_ready(grad({k: v + 0.01 * step for k, v in params().items()}))
    after = executor.stats()
    assert after["host_calls"] - before["host_calls"] == 3
    return tuple((after[k] - before[k]) / 3 for k in ("bytes_sent", "bytes_received"))


@pytest.mark.parametrize("executor", ["thread", "device", "dask"], indirect=True)
@pytest.mark.parametrize("n", [4_000, 40_000])
def test_a_gradient_sends_parameters_and_receives_partials_as_pb_factor(executor, x64, n):
    """What a gradient costs on the wire (or across the host callback) after the data:
    ``pb.observe``'s bytes both ways are ``pb.factor``'s on the same rows, parameters out
    and per-block partials back, not a value per row (``SerialExecutor()`` keeps the site
    in the caller's program: nothing crosses)."""
    observe, factor = traffic("observe", executor, n), traffic("factor", executor, n)
    assert observe == factor, (observe, factor)
    sent, received = observe
    assert 0 < sent < 2048 and 0 < received < 2048, observe  # 4 bytes a row: 16,000+
    X, _ = data()
    samples = {"a": jnp.linspace(-1, 1, 4), "b": jnp.ones((4, D)) * 0.2}
    key = jax.random.PRNGKey(3)
    want = Predictive(plain, samples)(key, X)["y"]
    got = Predictive(parallel, samples)(key, X, executor=executor)["y"]
    assert got.shape == (4, N) and np.array_equal(got, want)
    prior_want = Predictive(plain, num_samples=5)(key, X)
    prior_got = Predictive(parallel, num_samples=5)(key, X, executor=executor)
    for k in ("a", "b", "y"):
        assert np.array_equal(prior_got[k], prior_want[k]), k


def test_log_likelihood_equals_numpyros(executor, x64):
    X, y = data()
    samples = {"a": jnp.linspace(-1, 1, 6), "b": jnp.linspace(-1, 1, 18).reshape(6, D)}
    want = numpyro.infer.log_likelihood(plain, samples, X, y)["y"]
    got = pb.log_likelihood(parallel, samples, X, y, executor=executor)
    assert set(got) == {"y"} and got["y"].shape == want.shape == (6, N)
    np.testing.assert_allclose(got["y"], want, rtol=1e-12, atol=1e-12)
    grouped = {k: v.reshape((2, 3) + v.shape[1:]) for k, v in samples.items()}
    by_chain = pb.log_likelihood(parallel, grouped, X, y, executor=executor)["y"]
    assert by_chain.shape == (2, 3, N)
    np.testing.assert_array_equal(by_chain.reshape(6, N), got["y"])


@pytest.mark.slow
@pytest.mark.parametrize("elbo", [Trace_ELBO, TraceMeanField_ELBO])
def test_svi_losses_equal_plain(executor, x64, elbo):
    X, y = data()

    def losses(model, **kw):
        guide = AutoNormal(model)
        svi = SVI(model, guide, numpyro.optim.Adam(0.05), elbo())
        return svi.run(jax.random.PRNGKey(0), 100, X, y, progress_bar=False, **kw).losses

    np.testing.assert_allclose(losses(parallel, executor=executor), losses(plain),
                               rtol=1e-9, atol=1e-9)


# -- the rest of NumPyro ------------------------------------------------------------------


@pytest.mark.parametrize("strategy", [init_to_median, init_to_sample])
def test_initialisation_equal_plain(x64, strategy):
    X, y = data()
    key = jax.random.PRNGKey(1)
    with pb.ThreadExecutor(2, dispatch="host") as ex:
        got = initialize_model(key, parallel, model_args=(X, y), model_kwargs={"executor": ex},
                               init_strategy=strategy)
    want = initialize_model(key, plain, model_args=(X, y), init_strategy=strategy)
    for k in PARAMS:
        np.testing.assert_array_equal(got.param_info.z[k], want.param_info.z[k])
    np.testing.assert_allclose(got.param_info.potential_energy,
                               want.param_info.potential_energy, rtol=1e-10)
    for k in PARAMS:
        np.testing.assert_allclose(got.param_info.z_grad[k], want.param_info.z_grad[k],
                                   rtol=1e-10, atol=1e-10)


def test_handlers_equal_plain(x64):
    X, y = data()
    p = params()
    mask = jnp.arange(N) % 3 != 0
    cases = {
        "seed+substitute": lambda m: handlers.substitute(handlers.seed(m, 0), data=p),
        "condition": lambda m: handlers.condition(handlers.seed(m, 0), data=p),
        "scale": lambda m: handlers.scale(handlers.substitute(handlers.seed(m, 0), data=p), 0.25),
        "mask rows": lambda m: handlers.mask(handlers.substitute(handlers.seed(m, 0), data=p),
                                             mask=mask),
        "mask off": lambda m: handlers.mask(handlers.substitute(handlers.seed(m, 0), data=p),
                                            mask=False),
    }

    def total(wrap, model, **kw):
        def f(b):
            tr = handlers.trace(wrap(handlers.substitute(model, data={"b": b}))).get_trace(
                X, y, **kw)
            site = tr["y"]
            lp = site["fn"].log_prob(site["value"])
            if site.get("scale") is not None:
                lp = site["scale"] * lp
            return jnp.sum(lp)
        return jax.value_and_grad(f)(p["b"])

    with pb.ThreadExecutor(2, dispatch="host") as ex:
        for label, wrap in cases.items():
            got, want = total(wrap, parallel, executor=ex), total(wrap, plain)
            np.testing.assert_allclose(got[0], want[0], rtol=1e-10, err_msg=label)
            np.testing.assert_allclose(got[1], want[1], rtol=1e-10, atol=1e-12, err_msg=label)


def test_nuts_draws_match_plain_and_the_site_is_observed(x64):
    X, y = data()
    with pb.ThreadExecutor(2) as ex:
        def draws(model, **kw):
            mcmc = MCMC(NUTS(model), num_warmup=100, num_samples=100, progress_bar=False)
            mcmc.run(jax.random.PRNGKey(0), X, y, **kw)
            return mcmc.get_samples()

        got, want = draws(parallel, executor=ex), draws(plain)
    for k in PARAMS:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-8)
    tr = handlers.trace(handlers.seed(parallel, 0)).get_trace(X, y)
    assert tr["y"]["is_observed"] and tr["y"]["value"] is y


# -- errors --------------------------------------------------------------------------------


def test_errors_name_the_site_the_argument_and_the_shapes():
    X, y = data(jnp.float32)

    def trace(model):
        return handlers.trace(handlers.seed(model, 0)).get_trace()

    with pytest.raises(ValueError, match=r"'y'.*dist_fn.*batch shape.*600.*\(3,\)"):
        trace(lambda: pb.observe("y", lambda X: dist.Normal(X[0], 1.0), X, obs=y))
    with pytest.raises(ValueError, match=r"'y'.*obs.*leading size 600.*\(599,\)"):
        trace(lambda: pb.observe("y", lambda X: dist.Normal(X[:, 0], 1.0), X, obs=y[:-1]))
    with pytest.raises(TypeError, match=r"'counts'.*obs.*int32.*continuous"):
        trace(lambda: pb.observe("counts", lambda X: dist.Normal(X[:, 0], 1.0), X,
                                 obs=jnp.ones(N, jnp.int32)))
    with pytest.raises(TypeError, match=r"'y'.*NumPyro distribution"):
        trace(lambda: pb.observe("y", lambda X: X[:, 0], X, obs=y))
    with pytest.raises(ValueError, match=r"'y'.*obs shape \(600, 2\)"):
        trace(lambda: pb.observe("y", lambda X: dist.Normal(X[:, 0], 1.0), X,
                                 obs=jnp.ones((N, 2))))
    # a discrete distribution takes integer and float observations alike
    trace(lambda: pb.observe("k", lambda X: dist.Poisson(jnp.exp(X[:, 0])), X,
                             obs=jnp.ones(N, jnp.int32)))


# -- pb.sample ------------------------------------------------------------------------------


@pytest.mark.slow
def test_sample_with_posterior_predictive(tmp_path):
    az = pytest.importorskip("arviz")
    X, y = data(jnp.float32, n=400)
    kw = {"num_warmup": 60, "num_samples": 40, "num_chains": 2, "seed": 1, "progress_bar": False,
          "posterior_predictive": True}
    with pb.ThreadExecutor(2) as ex:
        run = pb.sample(parallel, X, y, executor=ex, **kw)
        groups = run_groups(run)
        assert {"posterior_predictive", "observed_data", "log_likelihood"} <= set(groups)
        pp, obs = groups["posterior_predictive"]["y"], groups["observed_data"]["y"]
        assert pp.dims == ("chain", "draw") + obs.dims and pp.shape == (2, 40, 400)
        np.testing.assert_array_equal(obs.values, np.asarray(y))
        assert groups["log_likelihood"]["y"].dims == ("chain", "draw") + obs.dims
        # the same draws as NumPyro's Predictive of the plain model with the same key
        post = {k: groups["posterior"][k].values.reshape((80,) + groups["posterior"][k].shape[2:])
                for k in PARAMS}
        assert set(np.unique(pp.values)) <= {0.0, 1.0}
        assert abs(float(pp.values.mean()) - float(np.asarray(y).mean())) < 0.05
        # a checkpointed run, run again from its file, and a plain observed site too
        path = str(tmp_path / "run.nc")
        first = pb.sample(parallel, X, y, executor=ex, checkpoint=path, checkpoint_every=20, **kw)
        np.testing.assert_array_equal(
            run_groups(first)["posterior_predictive"]["y"].values, pp.values)
        plain_run = pb.sample(plain, X, y, executor=ex, **kw)
        assert run_groups(plain_run)["posterior_predictive"]["y"].shape == (2, 40, 400)
    import matplotlib

    matplotlib.use("Agg")
    (az.plot_ppc if hasattr(az, "plot_ppc") else az.plot_ppc_dist)(run)
    assert post["b"].shape == (80, D)


KILLED_CHILD = """
import os, signal, sys, threading, time
sys.path[:0] = [{here!r}, {tests!r}]
import jax.numpy as jnp
import parallel_backend as pb
from parallel_backend.plugins.arviz.io import read_groups
from test_observe import PREDICTIVE_RUN, data, parallel

path = sys.argv[1]

def watch():  # SIGKILL this process once a checkpoint past iteration 30 is on disk
    while True:
        try:
            if sum(read_groups(path)[0].get("iteration", [0])) >= 30:
                os.kill(os.getpid(), signal.SIGKILL)
        except Exception:
            pass
        time.sleep(0.002)

threading.Thread(target=watch, daemon=True).start()
X, y = data(jnp.float32, n=400)
pb.sample(parallel, X, y, executor=pb.SerialExecutor(), checkpoint=path, checkpoint_every=10,
          **PREDICTIVE_RUN)
print("finished without being killed", flush=True)
"""
PREDICTIVE_RUN = {"num_warmup": 30, "num_samples": 30, "num_chains": 1, "seed": 2,
                  "progress_bar": False, "posterior_predictive": True}


@pytest.mark.slow
def test_a_resumed_run_gets_the_same_posterior_predictive(tmp_path):
    """Killed (SIGKILL) mid-run, resumed on threads: the posterior predictive draws of
    the uninterrupted run, bit for bit."""
    import os
    import signal
    import subprocess

    pytest.importorskip("arviz")
    here = os.path.dirname(os.path.abspath(__file__))
    path = tmp_path / "run.nc"
    code = KILLED_CHILD.format(here=here, tests=os.path.dirname(here))
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, check=False,
                          text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    X, y = data(jnp.float32, n=400)
    with pb.ThreadExecutor(2, dispatch="host") as ex:
        resumed = pb.sample(parallel, X, y, executor=ex, checkpoint=str(path),
                            checkpoint_every=10, **PREDICTIVE_RUN)
    assert resumed.attrs["resume_count"] == 1
    with pb.SerialExecutor() as ex:
        whole = pb.sample(parallel, X, y, executor=ex, **PREDICTIVE_RUN)
    got = run_groups(resumed)["posterior_predictive"]["y"].values
    want = run_groups(whole)["posterior_predictive"]["y"].values
    assert got.shape == (1, 30, 400) and np.array_equal(got, want)
