"""A mixture in NUTS: a ``logsumexp`` over three components within each row, whose blocks
the package loops (``analysis.detect_form``), against the plain NumPyro model.

Real ``numpyro.infer.MCMC``/``NUTS`` runs on 3,000 rows with the default blocks: the
posterior matches plain NumPyro's, and the draws on threads, in the graph and through
the host callback, are the bits of ``SerialExecutor``'s host route.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.diagnostics import effective_sample_size
from numpyro.infer import MCMC, NUTS

import parallel_backend as pb
from parallel_backend.blocks import YNN_REDUCE

#: Slow: NUTS runs of the looped mixture; tests/unit/test_blocks.py keeps its form and bits in
#: the default run.
pytestmark = pytest.mark.slow

N = 3000
MEANS = np.array([-3.0, 0.0, 3.0])
SITES = ("weights", "sigma")


def make_data(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    z = rng.choice(3, size=N, p=[0.2, 0.5, 0.3])
    return (MEANS[z] + 0.8 * rng.normal(size=N)).astype(np.float32)


def loglik(y, log_w, sigma):
    comp = log_w + dist.Normal(jnp.asarray(MEANS, y.dtype), sigma).log_prob(y[:, None])
    return jax.nn.logsumexp(comp, axis=-1)


def priors():
    weights = numpyro.sample("weights", dist.Dirichlet(jnp.ones(3)))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    return jnp.log(weights), sigma


def pb_model(y):
    log_w, sigma = priors()
    pb.factor("y", loglik, y, log_w, sigma)


def plain_model(y):
    log_w, sigma = priors()
    numpyro.factor("y", jnp.sum(loglik(jnp.asarray(y), log_w, sigma)))


def run(model, y, executor=None):
    mcmc = MCMC(NUTS(model), num_warmup=200, num_samples=200, progress_bar=False)
    if executor is None:
        mcmc.run(jax.random.key(1), y)
    else:
        with pb.use_executor(executor):
            mcmc.run(jax.random.key(1), y)
    return {k: np.asarray(v) for k, v in mcmc.get_samples().items()}


@pytest.fixture(scope="module")
def draws(row_loops):
    y = make_data()
    out = {"plain": run(plain_model, y)}
    with pb.SerialExecutor(dispatch="host") as serial, pb.ThreadExecutor(2) as auto, \
            pb.ThreadExecutor(2, dispatch="host") as host:
        for name, ex in [("serial-host", serial), ("thread", auto), ("thread-host", host)]:
            out[name] = run(pb_model, y, ex)
            (site,) = ex.stats()["sites"]
            out[name + "-site"] = site
    return out


def test_the_mixture_loops_its_blocks_and_stays_in_the_graph(draws):
    for name in ("serial-host", "thread", "thread-host"):
        site = draws[name + "-site"]
        assert site["form"] == "looped" and site["block_rows"] * 3 < YNN_REDUCE, site
    assert draws["thread-site"]["dispatch"] == "graph"
    assert draws["serial-host-site"]["dispatch"] == draws["thread-host-site"]["dispatch"] == "host"


def test_posterior_matches_plain_numpyro(draws):
    """Means within 5 Monte Carlo standard errors, standard deviations within a third."""
    for site in SITES:
        a, b = draws["thread"][site], draws["plain"][site]
        sd = np.sqrt(0.5 * (a.var(0) + b.var(0)))
        se = sd * np.sqrt(1.0 / effective_sample_size(a[None]) + 1.0 / effective_sample_size(b[None]))
        assert np.all(np.abs(a.mean(0) - b.mean(0)) < 5 * se), (site, a.mean(0), b.mean(0), se)
        assert np.all((0.75 < a.std(0) / b.std(0)) & (a.std(0) / b.std(0) < 1.33)), site
    np.testing.assert_allclose(draws["thread"]["weights"].mean(0), [0.2, 0.5, 0.3], atol=0.05)


def test_draws_identical_across_executors_and_routes(draws):
    """The graph (threads, ``auto``) and two threads through the host callback draw the
    bits of one thread through it (``SerialExecutor``'s host route)."""
    for name in ("thread", "thread-host"):
        for site in SITES:
            np.testing.assert_array_equal(draws[name][site], draws["serial-host"][site],
                                          err_msg=(name, site))
