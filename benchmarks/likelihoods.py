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


def newton(n_rows: int, dtype, seed: int = 0):
    """A per-row iterative solve: the mean ``u_i`` of row ``i`` is the root of
    ``u + theta * sinh(u) = a + b * x_i``, found by Newton steps in a ``while_loop``
    until every row's step is below tolerance (rows need 3 to 9 steps), and
    differentiated implicitly (``lax.custom_root``), as ODE and steady-state models are.
    ``y_i ~ Normal(u_i, sigma)``."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n_rows) * 2.0
    u_true = _solve_np(1.0 + 1.5 * x, 0.8)
    y = (u_true + 0.3 * rng.normal(size=n_rows)).astype(dtype)
    tol = 1e-5 if np.dtype(dtype) == np.float32 else 1e-10

    def fn(data, a, b, log_theta, log_sigma):
        theta = jnp.exp(log_theta)
        rhs = a + b * data["x"]

        def f(u):
            return u + theta * jnp.sinh(u) - rhs

        def solve(f, u0):
            def body(c):
                u, _ = c
                step = f(u) / (1.0 + theta * jnp.cosh(u))
                return u - step, jnp.max(jnp.abs(step))

            u, _ = jax.lax.while_loop(lambda c: c[1] > tol, body,
                                      (u0, jnp.asarray(jnp.inf, u0.dtype)))
            return u

        def tangent_solve(g, r):  # g is linear and diagonal: g(v) = v * g(1)
            return r / g(jnp.ones_like(r))

        u = jax.lax.custom_root(f, jnp.arcsinh(rhs / (1.0 + theta)), solve, tangent_solve)
        sigma = jnp.exp(log_sigma)
        z = (data["y"] - u) / sigma
        return -0.5 * z * z - log_sigma - 0.5 * np.log(2 * np.pi).astype(dtype)

    return fn, {"x": x.astype(dtype), "y": y}, (
        jnp.asarray(1.0, dtype), jnp.asarray(1.5, dtype), jnp.asarray(np.log(0.8), dtype),
        jnp.asarray(np.log(0.3), dtype))


def _solve_np(rhs, theta):
    u = np.arcsinh(rhs / (1.0 + theta))
    for _ in range(50):
        u = u - (u + theta * np.sinh(u) - rhs) / (1.0 + theta * np.cosh(u))
    return u


def gp_groups(n_rows: int, dtype, m: int = 12, seed: int = 0):
    """Per-group dense work: each row is a group of ``m`` observations at its own
    inputs, with a squared-exponential Gaussian-process covariance; the group's
    log-density needs a Cholesky of its own ``m x m`` matrix."""
    rng = np.random.default_rng(seed)
    t = np.sort(rng.uniform(0, 10, size=(n_rows, m)), axis=1)
    d2 = (t[:, :, None] - t[:, None, :]) ** 2
    K = np.exp(-0.5 * d2 / 1.5 ** 2) + 0.1 * np.eye(m)
    y = (np.linalg.cholesky(K) @ rng.normal(size=(n_rows, m, 1)))[..., 0] + 0.5
    eye = np.eye(m, dtype=dtype)

    def fn(data, mu, log_amp, log_ls, log_noise):
        t, y = data["t"], data["y"]
        d2 = (t[:, :, None] - t[:, None, :]) ** 2
        K = (jnp.exp(2 * log_amp) * jnp.exp(-0.5 * d2 * jnp.exp(-2 * log_ls))
             + jnp.exp(2 * log_noise) * eye)
        L = jnp.linalg.cholesky(K)
        r = jax.scipy.linalg.solve_triangular(L, (y - mu)[..., None], lower=True)[..., 0]
        logdet = jnp.sum(jnp.log(jnp.diagonal(L, axis1=-2, axis2=-1)), axis=-1)
        return -0.5 * jnp.sum(r * r, axis=-1) - logdet - 0.5 * m * np.log(2 * np.pi).astype(dtype)

    return fn, {"t": t.astype(dtype), "y": y.astype(dtype)}, (
        jnp.asarray(0.5, dtype), jnp.asarray(0.0, dtype), jnp.asarray(np.log(1.5), dtype),
        jnp.asarray(np.log(0.3), dtype))


def mixture(n_rows: int, dtype, n_components: int = 3, seed: int = 0):
    """A Gaussian mixture per row: a small reduction (``logsumexp`` over a few
    components) inside each row."""
    rng = np.random.default_rng(seed)
    means = np.linspace(-3, 3, n_components)
    z = rng.integers(0, n_components, size=n_rows)
    y = (means[z] + rng.normal(size=n_rows)).astype(dtype)

    def fn(y, logits, mu, log_sigma):
        log_w = jax.nn.log_softmax(logits)
        z = (y[:, None] - mu) / jnp.exp(log_sigma)
        comp = -0.5 * z * z - log_sigma - 0.5 * np.log(2 * np.pi).astype(dtype)
        return logsumexp(log_w + comp, axis=-1)

    return fn, y, (jnp.zeros(n_components, dtype), jnp.asarray(means.astype(dtype)),
                   jnp.zeros(n_components, dtype))


def zip_poisson(n_rows: int, dtype, n_features: int = 4, seed: int = 0):
    """Zero-inflated Poisson regression: a two-way ``logaddexp`` for the zeros."""
    rng = np.random.default_rng(seed)
    X = (rng.normal(size=(n_rows, n_features)) / np.sqrt(n_features)).astype(dtype)
    beta = np.linspace(-0.5, 0.5, n_features).astype(dtype)
    lam = np.exp(0.5 + X @ beta)
    y = np.where(rng.uniform(size=n_rows) < 0.3, 0, rng.poisson(lam)).astype(dtype)

    def fn(data, alpha, beta, logit_psi):
        y = data["y"]
        log_lam = alpha + data["X"] @ beta
        lam = jnp.exp(log_lam)
        log_psi, log_1m = jax.nn.log_sigmoid(logit_psi), jax.nn.log_sigmoid(-logit_psi)
        pois = y * log_lam - lam - gammaln(y + 1)
        return jnp.where(y == 0, jnp.logaddexp(log_psi, log_1m - lam), log_1m + pois)

    return fn, {"X": X, "y": y}, (jnp.asarray(0.5, dtype), jnp.asarray(beta),
                                  jnp.asarray(-1.0, dtype))


def ordinal(n_rows: int, dtype, n_features: int = 4, n_classes: int = 5, seed: int = 0):
    """Ordered logistic regression: cut points, a gather of each row's two of them."""
    rng = np.random.default_rng(seed)
    X = (rng.normal(size=(n_rows, n_features)) / np.sqrt(n_features)).astype(dtype)
    beta = np.linspace(-1, 1, n_features).astype(dtype)
    cuts = np.linspace(-2, 2, n_classes - 1).astype(dtype)
    eta = X @ beta + rng.logistic(size=n_rows)
    y = np.searchsorted(cuts, eta).astype(np.int32)

    def fn(data, beta, cuts):
        eta = data["X"] @ beta
        c = jnp.concatenate([jnp.full(1, -jnp.inf, cuts.dtype), jnp.sort(cuts),
                             jnp.full(1, jnp.inf, cuts.dtype)])
        y = data["y"]
        hi, lo = c[y + 1] - eta, c[y] - eta
        # log(sigmoid(hi) - sigmoid(lo)), stable where both tails are far
        return jax.nn.log_sigmoid(hi) + jnp.log1p(-jnp.exp(lo - hi)) + jax.nn.log_sigmoid(-lo)

    return fn, {"X": X, "y": y}, (jnp.asarray(beta), jnp.asarray(cuts))


def grouped(n_rows: int, dtype, n_groups: int = 1_000, n_features: int = 4, seed: int = 0):
    """A grouped (random-intercept) regression: a gather of each row's group effect from
    a parameter vector of ``n_groups``."""
    rng = np.random.default_rng(seed)
    g = rng.integers(0, n_groups, size=n_rows).astype(np.int32)
    X = rng.normal(size=(n_rows, n_features)).astype(dtype)
    a = rng.normal(size=n_groups).astype(dtype)
    beta = np.linspace(-1, 1, n_features).astype(dtype)
    y = (a[g] + X @ beta + 0.5 * rng.normal(size=n_rows)).astype(dtype)

    def fn(data, a, beta, log_sigma):
        z = (data["y"] - a[data["g"]] - data["X"] @ beta) / jnp.exp(log_sigma)
        return -0.5 * z * z - log_sigma - 0.5 * np.log(2 * np.pi).astype(dtype)

    return fn, {"X": X, "g": g, "y": y}, (jnp.asarray(a), jnp.asarray(beta),
                                          jnp.asarray(np.log(0.5), dtype))


def local_level(n_rows: int, dtype, n_steps: int = 20, seed: int = 0):
    """A state-space filter: a local-level model per row (a Kalman filter, a ``scan``
    over ``n_steps`` time points)."""
    rng = np.random.default_rng(seed)
    level = np.cumsum(0.3 * rng.normal(size=(n_rows, n_steps)), axis=1)
    y = (level + 0.5 * rng.normal(size=level.shape)).astype(dtype)

    def fn(y, log_q, log_r):
        q, r = jnp.exp(2 * log_q), jnp.exp(2 * log_r)

        def step(carry, yt):
            m, p, ll = carry
            p = p + q
            s = p + r
            e = yt - m
            ll = ll - 0.5 * (jnp.log(2 * np.pi).astype(dtype) + jnp.log(s) + e * e / s)
            k = p / s
            return (m + k * e, (1 - k) * p, ll), None

        n = y.shape[0]
        init = (jnp.zeros(n, dtype), jnp.full(n, 10.0, dtype), jnp.zeros(n, dtype))
        (_, _, ll), _ = jax.lax.scan(step, init, y.T)
        return ll

    return fn, y, (jnp.asarray(np.log(0.3), dtype), jnp.asarray(np.log(0.5), dtype))


def parameter_sets(params, sets: int):
    """``sets`` distinct copies of ``params`` stacked on a leading axis (the ``k``-th
    scaled by ``1 + 0.01 k``), as vectorized chains hold them: no set's evaluation is
    another's."""
    return tuple(jnp.stack([p * (1 + 0.01 * k) for k in range(sets)]).astype(p.dtype)
                 for p in params)


#: name -> (maker, rows). For the HMM and the GP a row is a sequence or a group.
MAKERS = {"logistic": logistic, "negbin": negbin, "hmm": hmm, "newton": newton,
          "gp": gp_groups, "mixture": mixture, "zip": zip_poisson, "ordinal": ordinal,
          "grouped": grouped, "local_level": local_level}
SIZES = {"1k": 1_000, "10k": 10_000, "50k": 50_000, "200k": 200_000, "1M": 1_000_000}
LIKELIHOODS = {f"{name}_{tag}": (make, n) for name, make in MAKERS.items()
               for tag, n in SIZES.items()}
LIKELIHOODS["hmm_5k"] = (hmm, 5_000)
LIKELIHOODS["hmm_20k"] = (hmm, 20_000)
LIKELIHOODS["hmm_100k"] = (hmm, 100_000)
