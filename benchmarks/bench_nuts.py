"""NUTS wall time, warmup included: plain NumPyro against pb.factor on each executor.

Same model, data and seed for every variant; 1 chain and 4 vectorized chains.
Reports the median of ``--repeats`` runs and the ratio to plain (> 1: faster).

    python benchmarks/bench_nuts.py --dtype float32
    python benchmarks/bench_nuts.py --variants plain,thread,device,device_host --cpu-devices 2

``device`` is ``DeviceExecutor()`` and ``device_host`` ``DeviceExecutor(dispatch="host")``
over every device of the process; with ``--cpu-devices N`` the script forces N host
CPU devices (set before JAX starts), and every variant, plain included, runs in that
process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def make_model(name, n, dtype, executor):
    import numpyro
    import numpyro.distributions as dist

    import parallel_backend as pb
    from likelihoods import logistic, negbin

    make = {"negbin": negbin, "logistic": logistic}[name]
    fn, data, params = make(n, dtype)
    d = data["X"].shape[1]

    def model():
        alpha = numpyro.sample("alpha", dist.Normal(0.0, 2.0))
        beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([d]))
        extra = ()
        if name == "negbin":
            extra = (numpyro.sample("log_phi", dist.Normal(1.5, 1.0)),)
        if executor is None:
            numpyro.factor("y", fn(data, alpha, beta, *extra).sum())
        else:
            pb.factor("y", fn, data, alpha, beta, *extra, executor=executor)

    return model


def run_one(name, n, dtype, variant, chains, warmup, samples, seed):
    import jax
    from numpyro.infer import MCMC, NUTS

    import parallel_backend as pb

    executor = {"plain": lambda: None, "serial": pb.SerialExecutor, "thread": pb.ThreadExecutor,
                "thread_host": lambda: pb.ThreadExecutor(dispatch="host"),
                "device": pb.DeviceExecutor,
                "device_host": lambda: pb.DeviceExecutor(dispatch="host")}[variant]()
    model = make_model(name, n, dtype, executor)
    mcmc = MCMC(NUTS(model), num_warmup=warmup, num_samples=samples, num_chains=chains,
                chain_method="vectorized", progress_bar=False)
    t0 = time.perf_counter()
    mcmc.run(jax.random.PRNGKey(seed), extra_fields=("num_steps",))
    jax.block_until_ready(mcmc.get_samples())
    seconds = time.perf_counter() - t0
    stats = executor.stats() if executor is not None else {}
    if executor is not None:
        executor.close()
    grads = int(mcmc.get_extra_fields()["num_steps"].sum())
    return seconds, grads, stats


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--models", default="negbin,logistic")
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--chains", default="1,4")
    ap.add_argument("--variants", default="plain,serial,thread,thread_host")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu-devices", type=int, default=None,
                    help="force this many host CPU devices (for the device variants)")
    args = ap.parse_args(argv)

    if args.cpu_devices:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count="
                                   f"{args.cpu_devices}").strip()
    import jax

    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    import numpy as np

    cores = len(os.sched_getaffinity(0))
    for name in args.models.split(","):
        for chains in map(int, args.chains.split(",")):
            times = {v: [] for v in args.variants.split(",")}
            info = {}
            for rep in range(args.repeats):
                for v in times:  # interleaved, so drift hits every variant alike
                    s, grads, stats = run_one(name, args.rows, np.dtype(args.dtype), v, chains,
                                              args.warmup, args.samples, seed=rep)
                    times[v].append(s)
                    info[v] = dict(grads=grads, sites=stats.get("sites"))
            med = {k: float(np.median(v)) for k, v in times.items()}
            base = med.get("plain")
            ratios = " ".join(f"{k}={base / v:.2f}x" for k, v in med.items() if base and k != "plain")
            print(f"{name:9s} N={args.rows:,} {args.dtype} chains={chains} cores={cores} "
                  f"plain={base:.1f}s {ratios}  "
                  + " ".join(f"{k}={v:.1f}s" for k, v in med.items()), flush=True)
            if args.json:
                with open(args.json, "a") as fh:
                    fh.write(json.dumps(dict(model=name, n=args.rows, dtype=args.dtype, chains=chains,
                                             cores=cores, devices=len(jax.devices()), seconds=med,
                                             info=info)) + "\n")


if __name__ == "__main__":
    main()
