"""The linear-regression problem that the NUTS, sampling, dask and device tests share,
written once: its data, its pointwise log-likelihood, and the model both through
``pb.factor`` and as plain NumPyro; and a dask cluster started with the command line
(:func:`cli_cluster`) for the dask and checkpoint tests. A plain module (no fixtures),
so that the device script, which runs outside pytest, imports it as the tests do.

    y_i ~ Normal(alpha + beta * x_i, sigma),  alpha, beta ~ Normal(0, 5),  sigma ~ HalfNormal(2)
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS

import parallel_backend as pb


def regression_data(n: int, seed: int = 0, dtype=jnp.float32) -> dict:
    """``{"x", "y"}`` of ``n`` rows drawn with alpha = 0.5, beta = 1.2, sigma = 0.8;
    ``dtype=None`` keeps JAX's default float (float64 under x64)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n)
    y = 0.5 + 1.2 * x + 0.8 * rng.normal(size=n)
    return {"x": jnp.asarray(x, dtype), "y": jnp.asarray(y, dtype)}


def regression_loglik(rows, alpha, beta, sigma):
    """Pointwise log-likelihood of each row."""
    return dist.Normal(alpha + beta * rows["x"], sigma).log_prob(rows["y"])


def regression_priors():
    alpha = numpyro.sample("alpha", dist.Normal(0.0, 5.0))
    beta = numpyro.sample("beta", dist.Normal(0.0, 5.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    return alpha, beta, sigma


def regression_model(data, executor=None, block_rows=64):
    """The model with its likelihood as one ``pb.factor`` site named ``"y"``."""
    alpha, beta, sigma = regression_priors()
    pb.factor("y", regression_loglik, data, alpha, beta, sigma, executor=executor,
              block_rows=block_rows)


def plain_regression_model(data):
    """The same model in plain NumPyro (an observed ``"y"`` site)."""
    alpha, beta, sigma = regression_priors()
    numpyro.sample("y", dist.Normal(alpha + beta * data["x"], sigma), obs=data["y"])


def run_nuts(model, executor, data, *, warmup: int, samples: int, seed: int = 0,
             between=None) -> dict:
    """One chain of NumPyro's NUTS on ``model(data, executor)``: its draws as NumPy arrays.
    With ``between`` the chain stops after warmup, calls ``between()`` and samples on from
    there, as ``MCMC.run`` would have drawn (the same draws: a test may change the cluster
    in between)."""
    mcmc = MCMC(NUTS(model), num_warmup=warmup, num_samples=samples, progress_bar=False)
    key = jax.random.PRNGKey(seed)
    if between is None:
        mcmc.run(key, data, executor)
    else:
        mcmc.warmup(key, data, executor)
        between()
        mcmc.run(mcmc.post_warmup_state.rng_key, data, executor)
    return {k: np.asarray(v) for k, v in mcmc.get_samples().items()}


def group_loglik(rows, log_ls):
    """A Gaussian process per group (row): a batched Cholesky and triangular solve, the
    LAPACK kernels that block a thread of XLA's CPU pool (the deadlock tests' likelihood;
    rows ``{"t": (N, m), "y": (N, m)}``)."""
    t, y = rows["t"], rows["y"]
    d2 = (t[:, :, None] - t[:, None, :]) ** 2
    K = jnp.exp(-0.5 * d2 * jnp.exp(-2 * log_ls)) + 0.1 * jnp.eye(t.shape[1])
    L = jnp.linalg.cholesky(K)
    r = jax.scipy.linalg.solve_triangular(L, y[..., None], lower=True)[..., 0]
    return -0.5 * jnp.sum(r * r, -1) - jnp.sum(jnp.log(jnp.diagonal(L, axis1=-2, axis2=-1)), -1)


def split_value_and_grad(fn, executor, x, block_rows: int):
    """A new jitted value and gradient in ``mu`` of ``pb.reduce_sum(fn, x, mu)``: a new
    function, so JAX's own jit cache (keyed by the function object) does not answer."""
    return jax.jit(jax.value_and_grad(
        lambda mu: pb.reduce_sum(fn, x, mu, executor=executor, block_rows=block_rows)))


def plain_value_and_grad(fn, x):
    """Plain JAX's value and gradient in ``mu`` of ``jnp.sum(fn(x, mu))``."""
    return jax.jit(jax.value_and_grad(lambda mu: jnp.sum(fn(x, mu))))


def pytest_on_forced_devices(path, select: str, flag: str, devices: int = 2, *extra: str):
    """Run the tests of ``path`` that ``-k select`` picks in a subprocess whose JAX has
    ``devices`` forced host CPU devices (the count is fixed when JAX starts), with the
    environment variable ``flag`` set there; returns the finished process."""
    from pathlib import Path

    env = dict(os.environ, JAX_PLATFORMS="cpu", **{flag: str(devices)})
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                        + f" --xla_force_host_platform_device_count={devices}").strip()
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q",
         *extra, "-o", "addopts=--strict-markers --import-mode=importlib", str(path),
         "-k", select],
        env=env, cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=900,
        check=False)


@contextlib.contextmanager
def local_client(workers: int = 2):
    """A client of a real dask ``LocalCluster`` of ``workers`` one-thread worker processes on
    127.0.0.1 (skips the test where distributed is not installed)."""
    import pytest

    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                  host="127.0.0.1", dashboard_address=None) as cluster, \
            distributed.Client(cluster) as c:
        yield c


@contextlib.contextmanager
def cli_cluster(folder, workers: int = 2):
    """A scheduler and ``workers`` workers (one thread, no nanny: a killed worker stays
    dead) started with the dask command line on 127.0.0.1; yields ``(address, procs)``
    with the scheduler first. Every process is gone when the block ends."""
    from distributed import Client

    sched_file = os.path.join(folder, f"scheduler-{time.monotonic_ns()}.json")
    dask = [os.path.join(os.path.dirname(sys.executable), "dask")]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs = [subprocess.Popen(dask + ["scheduler", "--host", "127.0.0.1", "--port", "0",
                                      "--no-dashboard", "--scheduler-file", sched_file], **quiet)]
    try:
        address = _scheduler_address(sched_file, procs[0], time.time() + 60)
        for _ in range(workers):
            procs.append(subprocess.Popen(
                dask + ["worker", address, "--nthreads", "1", "--no-dashboard", "--no-nanny",
                        "--host", "127.0.0.1"], **quiet))
        with Client(address, timeout=60) as c:  # every worker up before the block starts
            c.wait_for_workers(workers, timeout=60)
        yield address, procs
    finally:
        for p in procs[1:]:
            p.kill()
        procs[0].terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _scheduler_address(path, scheduler, deadline):
    """The address the scheduler wrote to ``path``, once the file holds all of it: the
    scheduler creates the file before it writes it (CI once read it empty)."""
    while True:
        try:
            with open(path) as f:
                return json.load(f)["address"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            if scheduler.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"dask scheduler (exit code {scheduler.poll()}) wrote no "
                                   f"address to {path} within 60 s") from None
            time.sleep(0.1)


# -- runs in ArviZ's format, under either major ---------------------------------------------


def run_groups(run) -> dict:
    """``{group: xarray.Dataset}`` of a run (``xarray.DataTree`` or ``arviz.InferenceData``)."""
    from parallel_backend.plugins.arviz.container import parts

    return parts(run)[0]


def from_draws(**groups):
    """``arviz.from_dict`` of ``{group: {var: (chain, draw, ...) array}}`` for the
    installed ArviZ (its signature differs between the majors)."""
    import arviz as az

    from parallel_backend.plugins.arviz import DATATREE

    return az.from_dict(groups) if DATATREE else az.from_dict(**groups)


def loo_elpd(run, var_name: str) -> tuple[float, int]:
    """``(elpd_loo, number of data points)`` of ``arviz.loo`` under either major."""
    import arviz as az

    out = az.loo(run, var_name=var_name, pointwise=True)
    return float(getattr(out, "elpd", getattr(out, "elpd_loo", float("nan")))), out.n_data_points


def scan_loglik(rows, a):
    """A ``scan`` over each row's values (rows ``(N, steps)``): the looped form, whose
    blocks the host route runs as chunks on workers."""

    def step(c, x):
        c = jnp.tanh(a * c + x)
        return c, c * x

    _, ys = jax.lax.scan(step, jnp.zeros(rows.shape[0], rows.dtype), rows.T)
    return jnp.sum(ys, axis=0)
