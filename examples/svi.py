"""Variational inference on many rows: ``pb.observe`` inside NumPyro's SVI, on threads.

    python examples/svi.py                       # 500,000 rows, 2,000 steps
    python examples/svi.py --rows 20000 --steps 300

A logistic regression with a random intercept per group, fitted with an ``AutoNormal``
guide and ``Trace_ELBO``: once as plain NumPyro (a plate and an observed site) and once
with ``pb.observe`` on a ``ThreadExecutor``. SVI differentiates the model's log-density as
NUTS does, so each step's gradient is evaluated in parallel chunks; the losses of the two
fits are the same to round-off. The script prints both wall times (compilation included),
their ratio, the last losses and the fitted coefficients.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal

import parallel_backend as pb


def make_data(rows: int, features: int, groups: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(rows, features)).astype(np.float32)
    group = rng.integers(0, groups, rows).astype(np.int32)
    effect = 0.5 * rng.normal(size=groups)
    beta = np.linspace(-1.0, 1.0, features)
    p = 1.0 / (1.0 + np.exp(-(X @ beta + effect[group])))
    y = (rng.random(rows) < p).astype(np.float32)
    return jnp.asarray(X), jnp.asarray(group), jnp.asarray(y)


def priors(features, groups):
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([features]).to_event(1))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    z = numpyro.sample("z", dist.Normal(0.0, 1.0).expand([groups]).to_event(1))
    return beta, tau * z


def likelihood(rows, beta, effect):
    return dist.Bernoulli(logits=rows["X"] @ beta + effect[rows["group"]])


def plain_model(X, group, groups, y=None):
    beta, effect = priors(X.shape[1], groups)
    with numpyro.plate("rows", X.shape[0]):
        numpyro.sample("y", likelihood({"X": X, "group": group}, beta, effect), obs=y)


def pb_model(X, group, groups, y=None):
    beta, effect = priors(X.shape[1], groups)
    pb.observe("y", likelihood, {"X": X, "group": group}, beta, effect, obs=y)


def fit(model, steps, *args, **kwargs):
    svi = SVI(model, AutoNormal(model), numpyro.optim.Adam(0.01), Trace_ELBO())
    t0 = time.perf_counter()
    result = svi.run(jax.random.PRNGKey(0), steps, *args, progress_bar=False, **kwargs)
    jax.block_until_ready(result.params)
    return result, time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=500_000)
    p.add_argument("--features", type=int, default=8)
    p.add_argument("--groups", type=int, default=50)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--workers", type=int, default=None, help="threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    X, group, y = make_data(args.rows, args.features, args.groups, args.seed)
    print(f"SVI, logistic regression with group intercepts: {args.rows:,} rows, "
          f"{args.features} features, {args.groups} groups, {args.steps} steps")
    plain, plain_s = fit(plain_model, args.steps, X, group, args.groups, y)
    print(f"plain NumPyro: {plain_s:.1f} s, last loss {float(plain.losses[-1]):.2f}")
    with pb.ThreadExecutor(args.workers) as ex, pb.use_executor(ex):
        ours, ours_s = fit(pb_model, args.steps, X, group, args.groups, y)
        stats = ex.stats()
    print(f"pb.observe on a thread executor ({stats['workers']} workers): {ours_s:.1f} s, "
          f"last loss {float(ours.losses[-1]):.2f}")
    print(f"speedup over plain NumPyro: {plain_s / ours_s:.2f}x")
    gap = float(jnp.max(jnp.abs(ours.losses - plain.losses) / jnp.abs(plain.losses)))
    print(f"largest relative difference of the losses: {gap:.1e}")
    beta = ours.params["beta_auto_loc"]
    print("beta (guide means):", np.round(np.asarray(beta), 2))
    return ours, plain


if __name__ == "__main__":
    main()
