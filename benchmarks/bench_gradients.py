"""Time one value-and-gradient evaluation: plain NumPyro against reduce_sum.

Plain is ``value_and_grad`` of ``fn(data, *params).sum()``, the log-density
NumPyro differentiates; the others are ``value_and_grad`` of
``pb.reduce_sum(fn, data, *params)`` on each executor. Each timed call runs
``--loop`` evaluations in one compiled loop, as a sampler does (XLA then allocates
temporaries once per loop: isolated calls overstate plain's cost where they are
large, an HMM's for one), and reports the time per evaluation; ``--loop 1`` times
isolated jitted calls. Variants are timed in interleaved rounds (so drift hits all
alike) and reported as medians and as ratios to plain (> 1: faster than plain).

    python benchmarks/bench_gradients.py --dtype float32
    taskset -c 0 python benchmarks/bench_gradients.py --dtype float32 --only plain
    python benchmarks/bench_gradients.py --likelihoods hmm_20k --form batched
    python benchmarks/bench_gradients.py --likelihoods hmm_5k --scale 0.6 --sets 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


#: The floor (negbin, logistic: every size) and where XLA leaves cores idle (HMM
#: sequences, a per-row Newton solve, per-group Cholesky).
DEFAULT = [f"{m}_{s}" for m in ("negbin", "logistic") for s in ("1k", "10k", "200k", "1M")] + [
    "hmm_1k", "hmm_5k", "hmm_50k", "newton_10k", "newton_200k", "gp_10k", "gp_50k"]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--likelihoods", default=",".join(DEFAULT),
                    help="comma list of NAME_SIZE from likelihoods.LIKELIHOODS")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    ap.add_argument("--loop", type=int, default=4,
                    help="evaluations per timed call, in one compiled loop (1: isolated calls)")
    ap.add_argument("--only", default=None, help="comma list of variants to run")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every N by this")
    ap.add_argument("--json", default=None, help="append results as JSON lines here")
    ap.add_argument("--sets", type=int, default=0,
                    help="evaluate this many parameter sets at once under vmap, as "
                         "vectorized chains do (0: one set, no vmap)")
    ap.add_argument("--form", default=None, choices=["batched", "looped"],
                    help="force every site's evaluation form (to compare forms; the "
                         "package picks it from fn's jaxpr)")
    ap.add_argument("--looped-rows", type=int, default=0,
                    help="rows per block of the looped form (float32; to compare block sizes, "
                         "the package's rule is blocks.looped_blocks)")
    ap.add_argument("--dask-workers", type=int, default=0,
                    help="also time DaskExecutor on a local cluster of this many worker processes")
    args = ap.parse_args(argv)
    if args.form:
        import parallel_backend.reduce as reduce_module

        reduce_module.detect_form = lambda closed, form=args.form: form

    if args.looped_rows:
        import parallel_backend.blocks as blocks_module

        blocks_module.LOOPED_BYTES = args.looped_rows * 4
        blocks_module.LOOPED_MIN_ROWS = args.looped_rows
        blocks_module.YNN_REDUCE = 2 ** 62  # no cap from fn's reductions

    import jax

    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    import numpy as np

    import parallel_backend as pb
    from parallel_backend.dispatch import in_a_loop
    import likelihoods
    from likelihoods import LIKELIHOODS, parameter_sets
    from timing import interleaved_medians

    if args.dask_workers:
        import cloudpickle

        cloudpickle.register_pickle_by_value(likelihoods)  # workers may not find the module

    dtype = np.dtype(args.dtype)
    cores = len(os.sched_getaffinity(0))
    for name in args.likelihoods.split(","):
        make, n = LIKELIHOODS[name]
        n = max(1, int(n * args.scale))
        fn, data, params = make(n, dtype)
        argnums = tuple(range(len(params)))
        if args.sets:
            params = parameter_sets(params, args.sets)

        def timed(f):
            vg = jax.value_and_grad(f, argnums=argnums)
            vg = jax.vmap(vg) if args.sets else vg
            return jax.jit(vg) if args.loop == 1 else in_a_loop(vg, args.loop)

        variants = {"plain": timed(lambda *p: fn(data, *p).sum())}
        executors = {"serial": pb.SerialExecutor(),
                     "thread": pb.ThreadExecutor(),
                     "thread_host": pb.ThreadExecutor(dispatch="host")}
        if args.dask_workers:
            executors["dask"] = pb.DaskExecutor(n_workers=args.dask_workers)
            executors["dask_host"] = pb.DaskExecutor(client=executors["dask"].client,
                                                     dispatch="host")
        for key, ex in executors.items():
            variants[key] = timed(lambda *p, ex=ex: pb.reduce_sum(fn, data, *p, executor=ex))
        if args.only:
            variants = {k: v for k, v in variants.items() if k in args.only.split(",")}
        med = {k: v / args.loop for k, v in
               interleaved_medians(variants, params, args.rounds, warmup=6).items()}
        row = dict(likelihood=name, n=n, dtype=args.dtype, cores=cores, loop=args.loop,
                   sets=args.sets,
                   seconds=med, sites={k: ex.stats()["sites"] for k, ex in executors.items()})
        if args.dask_workers:
            s = executors["dask_host"].stats()
            row["dask"] = dict(workers=args.dask_workers, calls=s["calls"],
                               bytes_sent=s["bytes_sent"], data_bytes_sent=s["data_bytes_sent"],
                               bytes_per_call=(s["bytes_sent"] - s["data_bytes_sent"]) / max(s["calls"], 1))
            print(f"{'':12s} dask bytes per call {row['dask']['bytes_per_call']:.0f} "
                  f"(data sent once: {s['data_bytes_sent']:,} bytes)", flush=True)
        base = med.get("plain")
        ratios = " ".join(f"{k}={base / v:.2f}x" for k, v in med.items() if base and k != "plain")
        sets = f" sets={args.sets}" if args.sets else ""
        print(f"{name:12s} N={n:>9,} {args.dtype}{sets} cores={cores} plain={base * 1e3 if base else float('nan'):.3f}ms "
              f"{ratios}  " + " ".join(f"{k}={v * 1e3:.3f}ms" for k, v in med.items()), flush=True)
        if args.json:
            with open(args.json, "a") as fh:
                fh.write(json.dumps(row) + "\n")
        for ex in reversed(executors.values()):  # dask_host borrows dask's client
            ex.close()


if __name__ == "__main__":
    main()
