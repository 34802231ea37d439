"""A hidden Markov model over many independent sequences, 4 vectorized chains.

    python examples/hmm.py                                    # 50,000 sequences of 100
    python examples/hmm.py --sequences 500 --length 20 --warmup 100 --samples 100

Each row of ``data`` is one sequence; ``fn`` runs the forward algorithm over it and
returns its log-likelihood, so ``pb.factor`` splits the sequences over the executor's
workers. The state means are ordered (a first mean and positive gaps) so that the
chains cannot swap labels.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist

import parallel_backend as pb


def make_data(sequences: int, length: int, states: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    off = 0.1 / max(states - 1, 1)
    trans = np.full((states, states), off) + np.eye(states) * (0.9 - off)
    means = np.linspace(-2.0, 2.0, states)
    z = np.zeros((sequences, length), dtype=int)
    z[:, 0] = rng.integers(0, states, sequences)
    for t in range(1, length):
        cum = np.cumsum(trans[z[:, t - 1]], axis=1)
        z[:, t] = (rng.random((sequences, 1)) < cum).argmax(axis=1)
    obs = means[z] + 0.7 * rng.normal(size=(sequences, length))
    return jnp.asarray(obs, jnp.float32)


def forward(obs, trans, means, sigma):
    """Log-likelihood of each sequence (row) by the forward algorithm."""
    states = means.shape[0]
    log_trans = jnp.log(trans)

    def emit(y_t):  # (rows,) -> (rows, states)
        return dist.Normal(means, sigma).log_prob(y_t[:, None])

    def step(alpha, y_t):
        alpha = jax.scipy.special.logsumexp(alpha[:, :, None] + log_trans, axis=1)
        return alpha + emit(y_t), None

    alpha0 = emit(obs[:, 0]) - jnp.log(float(states))
    alpha, _ = jax.lax.scan(step, alpha0, obs[:, 1:].T)
    return jax.scipy.special.logsumexp(alpha, axis=-1)


def model(obs, states):
    # each row of the transition matrix on the simplex; sticky a priori
    concentration = jnp.ones((states, states)) + 4.0 * jnp.eye(states)
    trans = numpyro.sample("trans", dist.Dirichlet(concentration))
    first = numpyro.sample("first_mean", dist.Normal(-2.0, 2.0))
    gaps = numpyro.sample("gaps", dist.HalfNormal(3.0).expand([states - 1]))
    means = numpyro.deterministic("means", first + jnp.concatenate([jnp.zeros(1), jnp.cumsum(gaps)]))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    pb.factor("obs", forward, obs, trans, means, sigma)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequences", type=int, default=50_000)
    p.add_argument("--length", type=int, default=100)
    p.add_argument("--states", type=int, default=3)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--samples", type=int, default=500)
    p.add_argument("--chains", type=int, default=4)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    obs = make_data(args.sequences, args.length, args.states, args.seed)
    print(f"HMM: {args.sequences:,} sequences of length {args.length}, {args.states} states, "
          f"{args.chains} vectorized chains")
    values = args.chains * args.samples * args.sequences
    with pb.ThreadExecutor(args.workers) as ex:
        idata = pb.sample(model, obs, args.states, num_warmup=args.warmup,
                          num_samples=args.samples, num_chains=args.chains, seed=args.seed,
                          executor=ex, arviz_kwargs={"log_likelihood": values <= 50_000_000,
                                                     "factor_data": False})
    a = idata.attrs
    print(f"warmup {a['warmup_seconds']:.1f} s, sampling {a['sampling_seconds']:.1f} s on "
          f"{a['executor']} ({a['workers']} workers), {a['gradient_evaluations']} evaluations")

    import arviz as az

    print(az.summary(idata, var_names=["means", "sigma"]))
    return idata


if __name__ == "__main__":
    main()
