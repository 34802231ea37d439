"""Logistic regression on many rows: plain NumPyro against ``pb.sample`` on threads.

    python examples/logistic_regression.py                 # 1,000,000 rows
    python examples/logistic_regression.py --rows 20000 --warmup 200 --samples 200

Both fits use the same data, seed, NUTS settings and vectorized chains; the script
prints both wall times (compilation included), the speedup of pb over plain NumPyro
(above 1: faster), and a posterior summary. On a machine with few cores plain NumPyro
is often as fast: XLA already threads its large matrix product (see
docs/performance.md).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS

import parallel_backend as pb


def make_data(rows: int, features: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(rows, features)).astype(np.float32)
    beta = np.linspace(-1.0, 1.0, features)
    y = (rng.random(rows) < 1.0 / (1.0 + np.exp(-(X @ beta + 0.5)))).astype(np.int32)
    return jnp.asarray(X), jnp.asarray(y)


def likelihood(X, alpha, beta):
    """The distribution of the rows of ``X`` (a batch of Bernoullis, one per row)."""
    return dist.Bernoulli(logits=alpha + X @ beta)


def priors(features):
    alpha = numpyro.sample("alpha", dist.Normal(0.0, 2.0))
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([features]))
    return alpha, beta


def pb_model(X, y=None):
    """``pb.observe`` where plain NumPyro has a plate and an observed site."""
    alpha, beta = priors(X.shape[1])
    pb.observe("y", likelihood, X, alpha, beta, obs=y)


def plain_model(X, y=None):
    alpha, beta = priors(X.shape[1])
    with numpyro.plate("rows", X.shape[0]):
        numpyro.sample("y", likelihood(X, alpha, beta), obs=y)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--features", type=int, default=5)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--samples", type=int, default=500)
    p.add_argument("--chains", type=int, default=4)
    p.add_argument("--workers", type=int, default=None, help="threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plain", action="store_true", help="skip the plain NumPyro fit")
    args = p.parse_args(argv)

    X, y = make_data(args.rows, args.features, args.seed)
    print(f"logistic regression: {args.rows:,} rows, {args.features} features, "
          f"{args.chains} chains x ({args.warmup} warmup + {args.samples} draws)")

    plain_seconds = None
    if not args.no_plain:
        mcmc = MCMC(NUTS(plain_model), num_warmup=args.warmup, num_samples=args.samples,
                    num_chains=args.chains, chain_method="vectorized", progress_bar=False)
        t0 = time.perf_counter()
        mcmc.run(jax.random.PRNGKey(args.seed), X, y)
        jax.block_until_ready(mcmc.get_samples())
        plain_seconds = time.perf_counter() - t0
        print(f"plain NumPyro: {plain_seconds:.1f} s")

    # The pointwise log-likelihood group holds chains x draws x rows values: skip it
    # when that would be large (LOO on a million rows is rarely what one wants).
    values = args.chains * args.samples * args.rows
    with pb.ThreadExecutor(args.workers) as ex:
        idata = pb.sample(pb_model, X, y, num_warmup=args.warmup, num_samples=args.samples,
                          num_chains=args.chains, seed=args.seed, executor=ex,
                          arviz_kwargs={"log_likelihood": values <= 50_000_000,
                                        "factor_data": False})
    a = idata.attrs
    pb_seconds = a["warmup_seconds"] + a["sampling_seconds"]
    print(f"pb.sample on {a['executor']} executor ({a['workers']} workers, chunks of "
          f"{a['chunk_rows']} rows): {pb_seconds:.1f} s")
    if plain_seconds is not None:
        print(f"speedup over plain NumPyro: {plain_seconds / pb_seconds:.2f}x")

    import arviz as az

    print(az.summary(idata, var_names=["alpha", "beta"]))
    return idata


if __name__ == "__main__":
    main()
