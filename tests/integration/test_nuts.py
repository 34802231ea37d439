"""NUTS end to end: ``pb.factor`` in a NumPyro model against the plain NumPyro model.

Real ``numpyro.infer.MCMC``/``NUTS`` runs, kept short (200 warmup, 200 draws, a
linear regression on 1000 rows in 8 blocks). Runs are cached per module, so each
configuration is sampled once and several tests read it.
"""

import contextlib

import jax
import numpy as np
import pytest
from numpyro.diagnostics import effective_sample_size
from numpyro.infer import MCMC, NUTS
from numpyro.infer.util import log_density

import parallel_backend as pb
from helpers import plain_regression_model, regression_data, regression_model

N = 1000
BLOCK_ROWS = 128
NUM_WARMUP = NUM_SAMPLES = 200
SITES = ("alpha", "beta", "sigma")


def make_data(seed: int = 0) -> dict:
    return regression_data(N, seed)


def pb_model(data):
    regression_model(data, block_rows=BLOCK_ROWS)


plain_model = plain_regression_model


EXECUTORS = {
    "serial": lambda: pb.SerialExecutor(count_calls=True),
    "thread2-host": lambda: pb.ThreadExecutor(2, dispatch="host"),
}


class Runs:
    """Sampled MCMC runs, one per configuration, and the executors that ran them."""

    def __init__(self):
        self.data = make_data()
        self.executors = {}
        self._runs = {}

    def executor(self, name):
        if name not in self.executors:
            self.executors[name] = EXECUTORS[name]()
        return self.executors[name]

    def get(self, executor=None, chain_method="sequential", seed=0, repeat=0):
        """Draws ``{site: (chains, draws)}``; ``executor=None`` means the plain model."""
        key = (executor, chain_method, seed, repeat)
        if key not in self._runs:
            model = plain_model if executor is None else pb_model
            chains = 2 if chain_method == "vectorized" else 1
            mcmc = MCMC(NUTS(model), num_warmup=NUM_WARMUP, num_samples=NUM_SAMPLES,
                        num_chains=chains, chain_method=chain_method, progress_bar=False)
            context = (contextlib.nullcontext() if executor is None
                       else pb.use_executor(self.executor(executor)))
            with context:
                mcmc.run(jax.random.key(seed), self.data)
            samples = mcmc.get_samples(group_by_chain=True)
            self._runs[key] = {k: np.asarray(v) for k, v in samples.items()}
        return self._runs[key]

    def close(self):
        for ex in self.executors.values():
            ex.close()


@pytest.fixture(scope="module")
def runs():
    assert not jax.config.jax_enable_x64
    r = Runs()
    yield r
    r.close()


# -- the posterior ---------------------------------------------------------------------------


def test_log_density_equals_plain_model(runs):
    """At posterior draws the joint log-density of the pb.factor model is the plain one's."""
    draws = runs.get("serial")
    with pb.use_executor(runs.executor("thread2-host")):
        for i in range(0, NUM_SAMPLES, 40):
            params = {k: draws[k][0, i] for k in SITES}
            got, trace = log_density(pb_model, (runs.data,), {}, params)
            want, _ = log_density(plain_model, (runs.data,), {}, params)
            np.testing.assert_allclose(got, want, rtol=1e-5)
            assert trace["y"]["type"] == "sample"


def assert_same_posterior(ours, plain):
    """Means within 5 Monte Carlo standard errors; standard deviations within a third."""
    for site in SITES:
        a, b = ours[site], plain[site]
        sd = np.sqrt(0.5 * (a.var() + b.var()))
        se = sd * np.sqrt(1.0 / effective_sample_size(a) + 1.0 / effective_sample_size(b))
        assert abs(a.mean() - b.mean()) < 5 * se, (site, a.mean(), b.mean(), se)
        assert 0.75 < a.std() / b.std() < 1.33, (site, a.std(), b.std())


@pytest.mark.parametrize("executor", list(EXECUTORS))
def test_posterior_matches_plain_numpyro(runs, executor):
    assert_same_posterior(runs.get(executor), runs.get(None))
    assert runs.executor(executor).stats()["calls"] > NUM_WARMUP + NUM_SAMPLES


# -- reproducibility ---------------------------------------------------------------------------


def test_same_seed_same_draws(runs):
    """Twice on one executor, whose adaptive chunker may pick other chunks the second
    time (``grainsize=None``): the draws are the same bits."""
    first = runs.get("thread2-host", seed=0)
    again = runs.get("thread2-host", seed=0, repeat=1)
    for site in SITES:
        np.testing.assert_array_equal(first[site], again[site])
        assert np.unique(first[site]).size > NUM_SAMPLES // 2  # the chain moved


@pytest.mark.parametrize("chain_method", ["sequential", "vectorized"])
def test_draws_identical_across_executors(runs, chain_method):
    serial = runs.get("serial", chain_method=chain_method)
    threads = runs.get("thread2-host", chain_method=chain_method)
    for site in SITES:
        np.testing.assert_array_equal(threads[site], serial[site], err_msg=site)


def test_vectorized_chains_on_threads(runs):
    draws = runs.get("thread2-host", chain_method="vectorized")
    for site in SITES:
        assert draws[site].shape == (2, NUM_SAMPLES)
        assert not np.array_equal(draws[site][0], draws[site][1])
    assert_same_posterior(draws, runs.get(None))
    stats = runs.executor("thread2-host").stats()
    assert stats["host_calls"] == stats["calls"] > 0
