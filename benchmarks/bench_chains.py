"""Vectorized chains against sequential chains on the same executor (``pb.sample``).

For each chain method: total wall time for all chains (warmup and compilation
included) and effective samples per second (the smallest bulk ESS over the
parameters, divided by that wall time). One JSON line per run.

    flock /tmp/pb-bench.lock python benchmarks/bench_chains.py --model negbin --rows 100000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def make_model(name, n, dtype):
    import numpyro
    import numpyro.distributions as dist

    import parallel_backend as pb
    from likelihoods import logistic, negbin

    fn, data, _ = {"negbin": negbin, "logistic": logistic}[name](n, dtype)
    d = data["X"].shape[1]

    def model():
        alpha = numpyro.sample("alpha", dist.Normal(0.0, 2.0))
        beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([d]))
        extra = (numpyro.sample("log_phi", dist.Normal(1.5, 1.0)),) if name == "negbin" else ()
        pb.factor("y", fn, data, alpha, beta, *extra)

    return model


def run_one(model, chain_method, args, executor):
    import arviz as az

    import parallel_backend as pb

    calls0 = executor.stats()["calls"]
    t0 = time.perf_counter()
    idata = pb.sample(model, num_warmup=args.warmup, num_samples=args.samples,
                      num_chains=args.chains, chain_method=chain_method, seed=args.seed,
                      executor=executor, progress_bar=False,
                      arviz_kwargs={"log_likelihood": False, "factor_data": False})
    seconds = time.perf_counter() - t0
    ess = az.ess(idata, method="bulk")
    min_ess = float(min(float(ess[v].min()) for v in ess.data_vars))
    return {"chain_method": chain_method, "seconds": round(seconds, 2),
            "warmup_seconds": round(idata.attrs["warmup_seconds"], 2),
            "sampling_seconds": round(idata.attrs["sampling_seconds"], 2),
            "min_ess_bulk": round(min_ess, 1), "ess_per_second": round(min_ess / seconds, 2),
            "evaluations": executor.stats()["calls"] - calls0}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["negbin", "logistic"], default="negbin")
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--chains", type=int, default=4)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--dispatch", default="auto", choices=["auto", "host", "graph"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="append JSON lines here")
    args = p.parse_args(argv)

    import jax

    import parallel_backend as pb

    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    model = make_model(args.model, args.rows, args.dtype)
    rows = []
    with pb.ThreadExecutor(args.workers, dispatch=args.dispatch) as ex:
        for method in ("vectorized", "sequential"):
            r = run_one(model, method, args, ex)
            r.update(model=args.model, rows=args.rows, dtype=args.dtype, chains=args.chains,
                     warmup=args.warmup, samples=args.samples, workers=ex.workers,
                     dispatch=args.dispatch)
            rows.append(r)
            print(json.dumps(r), flush=True)
    vec, seq = rows
    print(f"vectorized/sequential: wall time {vec['seconds'] / seq['seconds']:.2f}x, "
          f"ESS/s {vec['ess_per_second'] / seq['ess_per_second']:.2f}x")
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
