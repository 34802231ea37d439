"""End to end: NUTS (or fixed-step HMC) wall time, warmup and compilation included.

Every variant samples the same model, data and seed through ``numpyro.infer.MCMC``: a
likelihood of :mod:`.likelihoods` with a Normal prior (sd 0.5) around the true value of
each parameter, summed by plain NumPyro (``numpyro.factor``) or by ``pb.factor`` on one
executor. Variants run in interleaved repeats (so drift hits all alike) and the record
gives the median wall time. With vectorized chains, ``info`` also has the milliseconds
per gradient of the sampling phase, timed from the end of warmup by the host timestamps
of ``profile.StampedKernel`` (the timing ``pb.profile``'s NUTS check uses): its
wall time over its gradient evaluations (each carries every chain). ``plain_1core`` is
plain NumPyro in a child process pinned to one core (``taskset -c 0``), the reference
of parallel efficiency. With ``--fresh`` every run is a new process: in one process the
later runs find the small programs of eager operations compiled by the earlier ones, and
a short fit's wall time is mostly compilation.

``--kernel hmc`` runs HMC with a fixed ``--num-steps`` leapfrog steps per transition
(step size and mass matrix adapted in warmup): every variant then evaluates the same
number of gradients, so milliseconds per gradient compare the evaluations alone, without
NUTS's trees (whose lengths differ once the variants' draws part in the last bits).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np

from . import records
from .gradients import ROOT, parse_likelihoods, pick

__all__ = ["VARIANTS", "make_model", "nuts", "run_one"]

VARIANTS = ("plain", "serial", "thread", "thread_host", "device", "device_host", "plain_1core")


def make_model(make, n, dtype, executor, data_as_args=False):
    """``(model, args)`` for the likelihood ``make(n, dtype)``: one model for plain
    (``executor=None``) and for every executor. With ``data_as_args`` the data is the
    model's argument (``MCMC.run(key, data)``, traced inside the sampler), else the model
    closes over it."""
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist

    import parallel_backend as pb

    fn, data, params = make(n, dtype)

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


def _executor(variant):
    import parallel_backend as pb

    return {"plain": lambda: None, "serial": pb.SerialExecutor, "thread": pb.ThreadExecutor,
            "thread_host": lambda: pb.ThreadExecutor(dispatch="host"),
            "device": lambda: pb.DeviceExecutor(),
            "device_host": lambda: pb.DeviceExecutor(dispatch="host")}[variant]()


def run_one(spec: dict, variant: str, seed: int) -> dict:
    """One run: ``{"seconds", "ms_per_grad", "grads", "route"}``; ``ms_per_grad`` is
    ``None`` unless the chains are vectorized."""
    import jax
    from numpyro.infer import HMC, MCMC, NUTS

    from parallel_backend.plugins.numpyro.profile import StampedKernel

    if variant == "plain_1core":
        return _pinned(spec, seed)
    (_, make, n), = parse_likelihoods(spec["likelihood"])
    executor = _executor(variant)
    model, args = make_model(make, n, np.dtype(spec["dtype"]), executor, spec["data_as_args"])
    # trajectory_length=None: with both set, NumPyro adapts no step size (its warning).
    inner = (HMC(model, num_steps=spec["num_steps"], trajectory_length=None)
             if spec["kernel"] == "hmc"
             else NUTS(model, max_tree_depth=spec["max_tree_depth"]))
    stamped = StampedKernel(inner)
    mcmc = MCMC(stamped, num_warmup=spec["warmup"], num_samples=spec["samples"],
                num_chains=spec["chains"], chain_method=spec["chain_method"],
                progress_bar=False)
    try:
        t0 = time.perf_counter()
        mcmc.run(jax.random.PRNGKey(seed), *args, extra_fields=("num_steps",))
        jax.block_until_ready(mcmc.get_samples())
        seconds = time.perf_counter() - t0
        grads = int(mcmc.get_extra_fields()["num_steps"].sum())
        ms = None
        if spec["chain_method"] == "vectorized" or spec["chains"] == 1:
            sampling, steps, _ = stamped.after(spec["warmup"])
            ms = sampling / max(steps, 1) * 1e3
        route = ("/".join(sorted({str(s.get("dispatch")) for s in executor.stats()["sites"]}))
                 if executor is not None else None)
    finally:
        if executor is not None:
            executor.close()
    return {"seconds": seconds, "ms_per_grad": ms, "grads": grads, "route": route}


def _pinned(spec, seed) -> dict:
    return _child(spec, "plain", seed, ["taskset", "-c", "0"])


def _child(spec, variant, seed, prefix=()) -> dict:
    """:func:`run_one` in a new process (nothing compiled before it, as a user's first
    fit), run by ``prefix`` (``taskset``...)."""
    cmd = [*prefix, sys.executable, "-m", "benchmarks", "nuts", "--one",
           json.dumps([spec, variant, seed])]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    if done.returncode:
        raise SystemExit(f"nuts: the {variant} child failed:\n" + done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def nuts(args, env) -> list:
    """The ``nuts`` subcommand: records of every likelihood, chain count and variant."""
    wanted = pick(VARIANTS, args.variants)
    out = []
    for item in (t for t in args.likelihoods.split(",") if t.strip()):
        (model, _, n), = parse_likelihoods(item)
        for chains in (int(c) for c in str(args.chains).split(",")):
            spec = {"likelihood": item, "dtype": args.dtype, "chains": chains,
                    "chain_method": args.chain_method, "warmup": args.warmup,
                    "samples": args.samples, "kernel": args.kernel,
                    "num_steps": args.num_steps, "max_tree_depth": args.max_tree_depth,
                    "data_as_args": args.data_as_args, "fresh": args.fresh}
            runs = {v: [] for v in wanted}
            for rep in range(args.repeats):
                for v in wanted:  # interleaved, so drift hits every variant alike
                    runs[v].append(_child(spec, v, rep) if args.fresh and v != "plain_1core"
                                   else run_one(spec, v, seed=rep))
            out += _records(env, model, n, spec, runs, args.repeats)
            plain = out[-len(wanted)]
            text = " ".join(f"{r['variant']}={r['ratio']:.2f}x" for r in out[-len(wanted):]
                            if r["variant"] != "plain")
            print(f"{model:9s} rows={n:,} {args.dtype} chains={chains} "
                  f"plain={plain['seconds']:.1f}s wall: {text}", flush=True)
    return out


def _records(env, model, n, spec, runs, repeats) -> list:
    wall = {v: float(np.median([r["seconds"] for r in rs])) for v, rs in runs.items()}
    per_grad = {v: (float(np.median([r["ms_per_grad"] for r in rs]))
                    if all(r["ms_per_grad"] is not None for r in rs) else None)
                for v, rs in runs.items()}
    settings = {k: spec.get(k) for k in ("chains", "chain_method", "warmup", "samples",
                                         "kernel", "data_as_args", "fresh")}
    settings["kernel"] = (f"hmc, {spec['num_steps']} steps" if spec["kernel"] == "hmc"
                          else f"nuts, max_tree_depth {spec['max_tree_depth']}")
    out = []
    for v, rs in runs.items():
        ms, base = per_grad[v], per_grad.get("plain")
        info = {"ms_per_grad": ms, "grads": rs[-1]["grads"], "route": rs[-1]["route"],
                "ratio_per_grad": base / ms if ms and base else None}
        out.append(records.record(env, "nuts", model, n, spec["dtype"], v, wall[v],
                                  wall.get("plain"), repeats, settings, info))
    return out
