"""The demo: a negative-binomial regression on built-in synthetic data, fitted with
plain NumPyro and with ``pb.factor`` on a thread executor, same model and seed.

Imports numpyro (a core dependency) lazily, inside :func:`run_demo`, so the core
stays free of it at import time.
"""

from __future__ import annotations

import time

import numpy as np

__all__ = ["make_data", "run_demo"]


def make_data(n_rows: int = 200_000, n_features: int = 4, seed: int = 0, dtype=np.float32):
    """Synthetic negative-binomial regression data: ``(X, y, truth)``."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n_rows, n_features)).astype(dtype) / np.sqrt(n_features)
    beta = np.linspace(-0.5, 0.5, n_features).astype(dtype)
    alpha, phi = 1.0, 5.0
    mu = np.exp(alpha + X @ beta)
    y = rng.negative_binomial(phi, phi / (phi + mu)).astype(dtype)
    return X, y, dict(alpha=alpha, beta=beta, phi=phi)


def negbin_loglik(data, alpha, beta, phi):
    """Pointwise log-density of the negative-binomial regression."""
    import jax.numpy as jnp
    import numpyro.distributions as dist

    mu = jnp.exp(alpha + data["X"] @ beta)
    return dist.NegativeBinomial2(mu, phi).log_prob(data["y"])


def _priors(n_features):
    import numpyro
    import numpyro.distributions as dist

    alpha = numpyro.sample("alpha", dist.Normal(0.0, 2.0))
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([n_features]))
    phi = numpyro.sample("phi", dist.LogNormal(1.0, 1.0))
    return alpha, beta, phi


def plain_model(X, y):
    """The model in plain NumPyro."""
    import numpyro

    alpha, beta, phi = _priors(X.shape[1])
    numpyro.factor("y", negbin_loglik({"X": X, "y": y}, alpha, beta, phi).sum())


def parallel_model(X, y, executor=None, grainsize=None):
    """The same model with ``pb.factor``."""
    import parallel_backend as pb

    alpha, beta, phi = _priors(X.shape[1])
    pb.factor("y", negbin_loglik, {"X": X, "y": y}, alpha, beta, phi,
              executor=executor, grainsize=grainsize)


def _run(model, args, num_warmup, num_samples, seed, progress_bar):
    import jax
    from numpyro.infer import MCMC, NUTS

    mcmc = MCMC(NUTS(model), num_warmup=num_warmup, num_samples=num_samples,
                progress_bar=progress_bar)
    t0 = time.perf_counter()
    mcmc.run(jax.random.PRNGKey(seed), *args)
    jax.block_until_ready(mcmc.get_samples())
    return mcmc, time.perf_counter() - t0


def run_demo(n_rows: int = 200_000, num_warmup: int = 200, num_samples: int = 200,
             workers: int | None = None, seed: int = 0, float64: bool = False,
             progress_bar: bool = True, print_fn=print) -> dict:
    """Fit the demo model with plain NumPyro and with parallel_backend; report both.

    Returns a dict with the wall times, their ratio, the executor's stats and the
    posterior means of both fits.
    """
    import jax

    jax.config.update("jax_enable_x64", bool(float64))
    import numpyro.diagnostics

    import parallel_backend as pb

    X, y, truth = make_data(n_rows, dtype=np.float64 if float64 else np.float32)
    print_fn(f"negative-binomial regression: {n_rows:,} rows, {X.shape[1]} features, "
             f"{'float64' if float64 else 'float32'}; NUTS {num_warmup} warmup + {num_samples} draws")
    print_fn("plain NumPyro ...")
    plain, t_plain = _run(plain_model, (X, y), num_warmup, num_samples, seed, progress_bar)
    with pb.ThreadExecutor(workers) as ex:
        print_fn(f"parallel_backend, {ex!r} ...")
        fit, t_pb = _run(parallel_model, (X, y, ex), num_warmup, num_samples, seed, progress_bar)
        stats = ex.stats()
    site = stats["sites"][0] if stats["sites"] else {}
    print_fn("")
    print_fn(f"wall time, warmup included: plain NumPyro {t_plain:.1f} s, "
             f"parallel_backend {t_pb:.1f} s; speedup {t_plain / t_pb:.2f}x")
    print_fn(f"executor: thread, {stats['workers']} workers; dispatch {site.get('dispatch')}; "
             f"blocks of {site.get('block_rows')} rows; chunks of {stats['chunk_rows']} rows; "
             f"{stats['calls']} gradient evaluations")
    print_fn(f"truth: alpha={truth['alpha']}, beta={np.round(truth['beta'], 3).tolist()}, "
             f"phi={truth['phi']}")
    samples = {k: np.asarray(v)[None] for k, v in fit.get_samples().items()}
    numpyro.diagnostics.print_summary(samples, prob=0.9, group_by_chain=True)
    means_plain = {k: np.asarray(v).mean(0) for k, v in plain.get_samples().items()}
    means_pb = {k: v[0].mean(0) for k, v in samples.items()}
    return dict(seconds_plain=t_plain, seconds_parallel=t_pb, speedup=t_plain / t_pb,
                stats=stats, means_plain=means_plain, means_parallel=means_pb)
