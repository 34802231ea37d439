"""A hierarchical regression whose group effects are per-row parameters in ``data``.

    python examples/hierarchical.py                       # 200,000 rows, 100 groups
    python examples/hierarchical.py --rows 5000 --groups 20 --warmup 200 --samples 200

The group effects ``theta[group]`` are gathered to one value per row in the model and
passed inside ``data``: ``reduce_sum`` slices them with the rows and returns their
gradient row by row, so the sampler sees exact gradients for every ``theta``. The
pointwise log-likelihood (``idata.log_likelihood``) recomputes ``theta[group]`` for
each draw; ``az.loo`` then works as usual.
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist

import parallel_backend as pb


def make_data(rows: int, groups: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    group = rng.integers(0, groups, rows)
    x = rng.normal(size=rows)
    theta = 0.7 * rng.normal(size=groups)
    y = 1.0 + 0.5 * x + theta[group] + 0.8 * rng.normal(size=rows)
    return (jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32),
            jnp.asarray(group, jnp.int32))


def likelihood(rows, mu, beta, sigma):
    """The distribution of each row's ``y``; ``rows["effect"]`` is a parameter per row."""
    return dist.Normal(mu + beta * rows["x"] + rows["effect"], sigma)


def model(x, y, group, groups):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    beta = numpyro.sample("beta", dist.Normal(0.0, 2.0))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    z = numpyro.sample("z", dist.Normal(0.0, 1.0).expand([groups]))
    theta = numpyro.deterministic("theta", tau * z)  # non-centred
    pb.observe("y", likelihood, {"x": x, "effect": theta[group]}, mu, beta, sigma, obs=y)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--groups", type=int, default=100)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--samples", type=int, default=500)
    p.add_argument("--chains", type=int, default=4)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    x, y, group = make_data(args.rows, args.groups, args.seed)
    print(f"hierarchical regression: {args.rows:,} rows in {args.groups} groups, "
          f"{args.chains} chains")
    values = args.chains * args.samples * args.rows
    with pb.ThreadExecutor(args.workers) as ex:
        idata = pb.sample(model, x, y, group, args.groups, num_warmup=args.warmup,
                          num_samples=args.samples, num_chains=args.chains, seed=args.seed,
                          executor=ex, arviz_kwargs={"log_likelihood": values <= 50_000_000})
    a = idata.attrs
    print(f"warmup {a['warmup_seconds']:.1f} s, sampling {a['sampling_seconds']:.1f} s on "
          f"{a['executor']} ({a['workers']} workers)")

    import arviz as az

    print(az.summary(idata, var_names=["mu", "beta", "tau", "sigma"]))
    if hasattr(idata, "log_likelihood"):
        print(az.loo(idata))
    return idata


if __name__ == "__main__":
    main()
