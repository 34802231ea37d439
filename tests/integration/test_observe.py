"""``pb.observe`` beyond NumPyro's inference: what a gradient sends to the workers, the
errors, and ``pb.sample(posterior_predictive=True)`` on the installed ArviZ. How it
compares with the same model written the NumPyro way (log-density and gradients,
predictive draws, pointwise log-likelihood, SVI, initialisation, handlers, NUTS) is the
table of ``test_compat.py``, one row per promise and executor."""

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
from numpyro.infer.util import log_density

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


EXECUTORS = {"thread": lambda: pb.ThreadExecutor(2, dispatch="host"), "device": _device,
             "dask": _dask}


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


# -- what a gradient sends -------------------------------------------------------------------


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
