"""NUTS (or fixed-step HMC) wall time, warmup included: plain NumPyro against pb.factor.

Same model, data and seed for every variant; 1 chain and 4 vectorized chains.
Reports the median of ``--repeats`` runs and the ratio to plain (> 1: faster), and
milliseconds per gradient inside NUTS (the sampling phase, timed from the end of
warmup by a host timestamp after every transition: its wall time over its gradient
evaluations; with vectorized chains one evaluation carries every chain). ``plain_1core`` is
plain NumPyro in a child process pinned to one core (``taskset -c 0``): the ceiling
reference of parallel efficiency.

    python benchmarks/bench_nuts.py --dtype float32
    python benchmarks/bench_nuts.py --models hmm,newton,gp --rows 5000 --chains 1
    python benchmarks/bench_nuts.py --variants plain,thread,device,device_host --cpu-devices 2
    python benchmarks/bench_nuts.py --models negbin --chains 4 --kernel hmc --num-steps 10

``--kernel hmc`` runs HMC with a fixed number of leapfrog steps (step size and mass
matrix adapted in warmup) instead of NUTS: every variant then evaluates exactly
``--num-steps`` gradients per transition, every chain alike, so the milliseconds per
gradient compare the evaluations alone, without NUTS's trees (whose lengths differ
between variants once their draws part in the last bits).

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


def make_model(name, n, dtype, executor, data_as_args=False):
    """The likelihood ``name`` of :mod:`likelihoods` with a Normal prior (sd 0.5) around
    the true value of each parameter: one model for plain and for every executor.
    Returns ``(model, args)``: with ``data_as_args`` the model takes the data as its
    argument (``MCMC.run(key, data)``, traced inside the sampler), else it closes over it."""
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist

    import parallel_backend as pb
    from likelihoods import MAKERS

    fn, data, params = MAKERS[name](n, dtype)

    def model(data=data):
        ps = [numpyro.sample(f"p{i}", dist.Normal(jnp.asarray(p), 0.5).to_event(jnp.ndim(p)))
              for i, p in enumerate(params)]
        if executor is None:
            numpyro.factor("y", fn(data, *ps).sum())
        else:
            pb.factor("y", fn, data, *ps, executor=executor)

    if data_as_args:
        return model, (data,)
    return (lambda: model()), ()


def run_one(name, n, dtype, variant, chains, warmup, samples, seed, max_tree_depth=10,
            data_as_args=False, kernel="nuts", num_steps=10):
    """Wall seconds of warmup + sampling (compilation included), and milliseconds per
    gradient in the sampling phase. Returns ``(seconds, ms_per_grad, grads, stats)``."""
    import jax
    from numpyro.infer import HMC, MCMC, NUTS

    from parallel_backend.plugins.numpyro.profile_nuts import StampedKernel

    import parallel_backend as pb

    if variant == "plain_1core":  # the ceiling reference: plain pinned to one core
        return _pinned(name, n, dtype, chains, warmup, samples, seed, max_tree_depth,
                       data_as_args, kernel, num_steps)
    executor = {"plain": lambda: None, "serial": pb.SerialExecutor, "thread": pb.ThreadExecutor,
                "thread_host": lambda: pb.ThreadExecutor(dispatch="host"),
                "device": pb.DeviceExecutor,
                "device_host": lambda: pb.DeviceExecutor(dispatch="host")}[variant]()
    model, args = make_model(name, n, dtype, executor, data_as_args)
    inner = (HMC(model, num_steps=num_steps) if kernel == "hmc"
             else NUTS(model, max_tree_depth=max_tree_depth))
    stamped = StampedKernel(inner)
    mcmc = MCMC(stamped, num_warmup=warmup, num_samples=samples, num_chains=chains,
                chain_method="vectorized", progress_bar=False)
    t0 = time.perf_counter()
    mcmc.run(jax.random.PRNGKey(seed), *args, extra_fields=("num_steps",))
    jax.block_until_ready(mcmc.get_samples())
    seconds = time.perf_counter() - t0
    grads = int(mcmc.get_extra_fields()["num_steps"].sum())
    # The sampling phase, timed from the end of warmup by the kernel's host timestamps
    # (a second run would compile again): its wall time over its leapfrog steps.
    sampling, steps, _ = stamped.after(warmup)
    ms_per_grad = sampling / max(steps, 1) * 1e3
    stats = executor.stats() if executor is not None else {}
    if executor is not None:
        executor.close()
    return seconds, ms_per_grad, grads, stats


def _pinned(name, n, dtype, chains, warmup, samples, seed, max_tree_depth, data_as_args,
            kernel, num_steps):
    """``plain`` in a child process pinned to core 0 (``taskset``)."""
    import subprocess

    cmd = ["taskset", "-c", "0", sys.executable, os.path.abspath(__file__), "--one",
           json.dumps([name, n, np_name(dtype), "plain", chains, warmup, samples, seed,
                       max_tree_depth, data_as_args, kernel, num_steps])]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    seconds, ms, grads = json.loads(out.strip().splitlines()[-1])
    return seconds, ms, grads, {}


def np_name(dtype) -> str:
    import numpy as np

    return np.dtype(dtype).name


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--models", default="negbin,logistic,hmm")
    ap.add_argument("--rows", default="200000",
                    help="comma list of sizes (rows; sequences or groups for hmm and gp)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child of plain_1core
    ap.add_argument("--chains", default="1,4")
    ap.add_argument("--variants", default="plain,serial,thread,plain_1core")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tree-depth", type=int, default=10,
                    help="NUTS max_tree_depth for every variant (smaller: shorter runs)")
    ap.add_argument("--kernel", default="nuts", choices=["nuts", "hmc"],
                    help="hmc: fixed --num-steps leapfrog steps per transition (the same "
                         "gradient count for every variant)")
    ap.add_argument("--num-steps", type=int, default=10, help="leapfrog steps of --kernel hmc")
    ap.add_argument("--json", default=None)
    ap.add_argument("--data-as-args", action="store_true",
                    help="pass the data to MCMC.run as the model's argument (traced), "
                         "instead of closing over it")
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

    if args.one:  # one plain run, for plain_1core's child process
        (name, n, dtype, variant, chains, warmup, samples, seed, depth, as_args, kernel,
         steps) = json.loads(args.one)
        s, ms, grads, _ = run_one(name, n, np.dtype(dtype), variant, chains, warmup, samples, seed,
                                  depth, as_args, kernel, steps)
        print(json.dumps([s, ms, grads]))
        return
    cores = len(os.sched_getaffinity(0))
    for name in args.models.split(","):
        for n in map(int, args.rows.split(",")):
            for chains in map(int, args.chains.split(",")):
                bench_one(args, name, n, chains, cores)


def bench_one(args, name, n, chains, cores):
    import jax
    import numpy as np

    times = {v: [] for v in args.variants.split(",")}
    per_grad = {v: [] for v in times}
    info = {}
    for rep in range(args.repeats):
        for v in times:  # interleaved, so drift hits every variant alike
            s, ms, grads, stats = run_one(name, n, np.dtype(args.dtype), v, chains,
                                          args.warmup, args.samples, seed=rep,
                                          max_tree_depth=args.max_tree_depth,
                                          data_as_args=args.data_as_args,
                                          kernel=args.kernel, num_steps=args.num_steps)
            times[v].append(s)
            per_grad[v].append(ms)
            info[v] = dict(grads=grads, sites=stats.get("sites"))
    med = {k: float(np.median(v)) for k, v in times.items()}
    ms = {k: float(np.median(v)) for k, v in per_grad.items()}
    base, mbase = med.get("plain"), ms.get("plain")
    ratios = " ".join(f"{k}={base / v:.2f}x" for k, v in med.items() if base and k != "plain")
    gratios = " ".join(f"{k}={mbase / v:.2f}x" for k, v in ms.items() if mbase and k != "plain")
    data = "args" if args.data_as_args else "closed"
    kernel = "nuts" if args.kernel == "nuts" else f"hmc{args.num_steps}"
    print(f"{name:9s} N={n:,} {args.dtype} chains={chains} data={data} {kernel} cores={cores} "
          f"plain={base:.1f}s "
          f"wall: {ratios} | ms/grad plain={mbase:.2f}: {gratios}", flush=True)
    if args.json:
        with open(args.json, "a") as fh:
            fh.write(json.dumps(dict(model=name, n=n, dtype=args.dtype, chains=chains,
                                     warmup=args.warmup, samples=args.samples,
                                     max_tree_depth=args.max_tree_depth, data=data,
                                     kernel=kernel,
                                     cores=cores, devices=len(jax.devices()), seconds=med,
                                     ms_per_grad=ms, info=info)) + "\n")


if __name__ == "__main__":
    main()
