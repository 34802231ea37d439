"""The linear-regression problem that the NUTS, sampling, dask and device tests share,
written once: its data, its pointwise log-likelihood, and the model both through
``pb.factor`` and as plain NumPyro. A plain module (no fixtures), so that the device
script, which runs outside pytest, imports it as the tests do.

    y_i ~ Normal(alpha + beta * x_i, sigma),  alpha, beta ~ Normal(0, 5),  sigma ~ HalfNormal(2)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist

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
