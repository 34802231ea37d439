"""Per gradient: NumPyro's own distributions summed over many rows, as plain NumPyro (a
plate and an observed site), as ``pb.factor`` of the same pointwise function and as
``pb.observe``, on ``SerialExecutor()`` and ``ThreadExecutor()``.

Each variant is ``value_and_grad`` of ``numpyro.infer.util.log_density`` of its model
with the parameters as traced arguments, ``--loop`` evaluations in one compiled loop
(as a sampler evaluates them), timed in interleaved rounds; ratios are plain's time over
the variant's (> 1: faster than plain).

    python benchmarks/bench_observe.py --rows 200000
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def problems(n, dtype):
    import jax.numpy as jnp
    import numpy as np
    import numpyro.distributions as dist

    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, 4)).astype(dtype) / 2
    eta = X @ np.linspace(-0.5, 0.5, 4).astype(dtype)
    mu = np.exp(1.0 + eta)
    out = {
        "NegativeBinomial2": (lambda X, b, s: dist.NegativeBinomial2(jnp.exp(1.0 + X @ b), s),
                              rng.negative_binomial(5, 5 / (5 + mu)).astype(dtype)),
        "Bernoulli": (lambda X, b, s: dist.Bernoulli(logits=X @ b * s),
                      (rng.random(n) < 1 / (1 + np.exp(-eta))).astype(dtype)),
        "StudentT": (lambda X, b, s: dist.StudentT(4.0, X @ b, s),
                     (eta + rng.standard_t(4, size=n)).astype(dtype)),
    }
    return jnp.asarray(X), {k: (f, jnp.asarray(y)) for k, (f, y) in out.items()}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--loop", type=int, default=4)
    args = ap.parse_args(argv)

    import jax

    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    import numpyro
    import numpyro.distributions as dist
    from numpyro.infer.util import log_density

    import parallel_backend as pb
    from parallel_backend.dispatch import in_a_loop
    from timing import interleaved_medians

    dtype = np.dtype(args.dtype)
    X, cases = problems(args.rows, dtype)
    params = (jnp.asarray(np.linspace(-0.4, 0.4, 4), dtype), jnp.asarray(3.0, dtype))
    cores = len(os.sched_getaffinity(0))
    for name, (dist_fn, y) in cases.items():
        def plain(b, s):
            with numpyro.plate("rows", X.shape[0]):
                numpyro.sample("y", dist_fn(X, b, s), obs=y)

        def factor(b, s, ex):
            pb.factor("y", lambda rows, b, s: dist_fn(rows["X"], b, s).log_prob(rows["y"]),
                      {"X": X, "y": y}, b, s, executor=ex)

        def observe(b, s, ex):
            pb.observe("y", dist_fn, X, b, s, obs=y, executor=ex)

        def timed(model, **kw):
            f = jax.value_and_grad(lambda b, s: log_density(model, (b, s), kw, {})[0],
                                   argnums=(0, 1))
            return in_a_loop(f, args.loop)

        executors = {"serial": pb.SerialExecutor(), "thread": pb.ThreadExecutor()}
        variants = {"plain": timed(plain)}
        for label, ex in executors.items():
            variants[f"factor_{label}"] = timed(factor, ex=ex)
            variants[f"observe_{label}"] = timed(observe, ex=ex)
        med = {k: v / args.loop for k, v in
               interleaved_medians(variants, params, args.rounds, warmup=4).items()}
        base = med["plain"]
        print(f"{name:18s} N={args.rows:,} {args.dtype} cores={cores} plain={base * 1e3:.2f}ms "
              + " ".join(f"{k}={base / v:.2f}x" for k, v in med.items() if k != "plain"),
              flush=True)
        for ex in executors.values():
            ex.close()


if __name__ == "__main__":
    main()
