"""The benchmark likelihoods: data makers and pointwise log-densities.

Each entry gives ``(fn, data, params)`` so that ``fn(data, *params)`` is the
pointwise log-density and ``fn(data, *params).sum()`` is what plain NumPyro
differentiates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import gammaln, logsumexp


def logistic(n_rows: int, dtype, n_features: int = 20, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n_rows, n_features)).astype(dtype)
    beta = (rng.normal(size=n_features) / np.sqrt(n_features)).astype(dtype)
    y = (rng.uniform(size=n_rows) < 1 / (1 + np.exp(-X @ beta))).astype(dtype)

    def fn(data, alpha, beta):
        z = alpha + data["X"] @ beta
        return data["y"] * jax.nn.log_sigmoid(z) + (1 - data["y"]) * jax.nn.log_sigmoid(-z)

    return fn, {"X": X, "y": y}, (jnp.asarray(0.1, dtype), jnp.asarray(beta))


def negbin(n_rows: int, dtype, n_features: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = (rng.normal(size=(n_rows, n_features)) / np.sqrt(n_features)).astype(dtype)
    beta = np.linspace(-0.5, 0.5, n_features).astype(dtype)
    mu = np.exp(1.0 + X @ beta)
    y = rng.negative_binomial(5.0, 5.0 / (5.0 + mu)).astype(dtype)

    def fn(data, alpha, beta, log_phi):
        phi = jnp.exp(log_phi)
        log_mu = alpha + data["X"] @ beta
        y = data["y"]
        return (gammaln(y + phi) - gammaln(phi) - gammaln(y + 1)
                + phi * (log_phi - jnp.logaddexp(log_phi, log_mu))
                + y * (log_mu - jnp.logaddexp(log_phi, log_mu)))

    return fn, {"X": X, "y": y}, (jnp.asarray(1.0, dtype), jnp.asarray(beta),
                                  jnp.asarray(np.log(5.0), dtype))


def hmm(n_rows: int, dtype, n_steps: int = 100, n_states: int = 4, seed: int = 0):
    """Forward algorithm in log space over ``n_rows`` independent sequences."""
    rng = np.random.default_rng(seed)
    means = np.linspace(-2, 2, n_states)
    states = rng.integers(0, n_states, size=(n_rows, n_steps))
    obs = (means[states] + rng.normal(size=states.shape)).astype(dtype)

    def fn(obs, logits_trans, mu, log_sigma):
        log_trans = jax.nn.log_softmax(logits_trans, axis=-1)
        sigma = jnp.exp(log_sigma)

        def emit(y):  # (rows,) -> (rows, states)
            z = (y[:, None] - mu) / sigma
            return -0.5 * z * z - log_sigma - 0.5 * np.log(2 * np.pi).astype(dtype)

        def step(alpha, y):
            alpha = logsumexp(alpha[:, :, None] + log_trans, axis=1) + emit(y)
            return alpha, None

        alpha0 = emit(obs[:, 0]) - jnp.log(float(n_states)).astype(dtype)
        alpha, _ = jax.lax.scan(step, alpha0, obs[:, 1:].T)
        return logsumexp(alpha, axis=-1)

    logits = (np.eye(n_states) * 2.0).astype(dtype)
    return fn, obs, (jnp.asarray(logits), jnp.asarray(means.astype(dtype)),
                     jnp.asarray(0.0, dtype))


LIKELIHOODS = {
    "logistic_1M": (logistic, 1_000_000),
    "negbin_1M": (negbin, 1_000_000),
    "hmm_50k": (hmm, 50_000),
    "logistic_1k": (logistic, 1_000),
}
