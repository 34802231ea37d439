"""A call site is what it is: a model that builds its data itself (a new array at every
trace) finds the same site, prepared once, across ``MCMC.run``, ``Predictive``,
``log_likelihood`` and ``pb.to_arviz``; a site's identity comes from its function and
the content of its data, never from ``id()``."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import MCMC, NUTS, Predictive

import parallel_backend as pb
from parallel_backend.identity import digest, function_key


def loglik(rows, mu, sigma):
    return dist.Normal(mu, sigma).log_prob(rows["y"][:, 0])


def model(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    # Built here, so a new array object at every trace of the model.
    rows = {"y": jnp.asarray(y, jnp.float32)[:, None] * 1.0}
    pb.factor("y", loglik, rows, mu, sigma)


def resident(executor) -> list:
    """The executor's sites whose data was concrete when traced (held by the executor)."""
    return [s for s in executor.sites() if not any(s.spec.traced)]


@pytest.mark.slow
def test_a_model_that_builds_its_data_keeps_one_site_prepared_once():
    y = np.random.default_rng(0).normal(1.0, 2.0, size=5000)
    with pb.ThreadExecutor(2) as ex, pb.use_executor(ex):
        for seed in (0, 1):
            mcmc = MCMC(NUTS(model), num_warmup=20, num_samples=10, progress_bar=False)
            mcmc.run(jax.random.PRNGKey(seed), y)
        # (NumPyro's initialization traces the model once with the data as a traced
        # argument: that is another site, whose rows travel per evaluation.)
        (state,) = resident(ex)
        prepared = state.prepared()
        samples = mcmc.get_samples()
        Predictive(model, samples)(jax.random.PRNGKey(2), y)
        numpyro.infer.log_likelihood(model, samples, y)
        pb.to_arviz(mcmc, log_likelihood=False)
        idata = pb.sample(model, y, num_warmup=10, num_samples=5, num_chains=2,
                          progress_bar=False)
        assert resident(ex) == [state] and len(ex.sites()) <= 2
        assert state.prepared() is prepared  # prepared once, whatever traced it
        assert idata.posterior["mu"].shape == (2, 5)


def test_identity_is_content_not_address():
    a = np.arange(10.0)
    assert digest(a) == digest(a.copy()) != digest(a + 1)

    def make(data):
        def fn(x, m):
            return -0.5 * (x - m - data) ** 2
        return fn

    # Closures rebuilt over equal data are the same function; over other data, not.
    assert function_key(make(np.ones(3))) == function_key(make(np.ones(3)))
    assert function_key(make(np.ones(3))) != function_key(make(np.zeros(3)))
    with pb.SerialExecutor() as ex:
        for _ in range(3):
            x = jnp.asarray(np.linspace(-1.0, 1.0, 50))  # a new array, the same content
            jax.jit(lambda m, x=x: pb.reduce_sum(make(np.ones(1)), x, m, executor=ex))(0.1)
        assert len(ex.sites()) == 1
        jax.jit(lambda m: pb.reduce_sum(make(np.ones(1)), x + 1, m, executor=ex))(0.1)
        assert len(ex.sites()) == 2


def test_content_that_cannot_change_is_hashed_once(monkeypatch):
    """A JAX array and a read-only NumPy array are hashed once while they live; a writable
    NumPy array at every trace (it may have changed in place), and the site keeps a
    read-only copy of it, whose own digest is then made once."""
    from parallel_backend import identity

    hashed = []
    real = identity.hashlib.sha256

    def counting(*args):
        hashed.append(1)
        return real(*args)

    monkeypatch.setattr(identity.hashlib, "sha256", counting)
    fixed = np.arange(2_000.0)
    fixed.flags.writeable = False
    for x in (fixed, jnp.arange(2_000.0)):
        hashed.clear()
        first = digest(x)
        assert [digest(x) for _ in range(3)] == [first] * 3 and len(hashed) == 1
    writable = np.arange(2_000.0)
    hashed.clear()
    digest(writable), digest(writable)
    assert len(hashed) == 2
    view = fixed.view()  # read-only, but a view of a read-only array: still immutable
    assert identity.immutable(view) and not identity.immutable(writable[:5])
    kept = identity.snapshot(writable)
    assert kept is not writable and not kept.flags.writeable and identity.immutable(kept)
    assert identity.snapshot(fixed) is fixed
