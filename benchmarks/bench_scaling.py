"""Thread scaling: one value-and-gradient on ``ThreadExecutor(w, dispatch="host")`` for
w = 1..cores, against plain NumPyro pinned to the first w cores, each in its own
process (``taskset -c 0-(w-1)``, so XLA's thread pool has w threads as well).

Efficiency at w workers is (plain on one core) / (threads on w) / w: 1.0 is perfect
scaling against the one-core reference.

    python benchmarks/bench_scaling.py --likelihoods hmm_5k,newton_200k --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def child(name, dtype, workers, rounds):
    """Medians of plain and of the threads, in this (pinned) process."""
    import jax
    import numpy as np

    if dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    import parallel_backend as pb
    from likelihoods import LIKELIHOODS
    from timing import interleaved_medians

    make, n = LIKELIHOODS[name]
    fn, data, params = make(n, np.dtype(dtype))
    argnums = tuple(range(len(params)))
    ex = pb.ThreadExecutor(workers, dispatch="host")
    variants = {
        "plain": jax.jit(jax.value_and_grad(lambda *p: fn(data, *p).sum(), argnums=argnums)),
        "threads": jax.jit(jax.value_and_grad(
            lambda *p: pb.reduce_sum(fn, data, *p, executor=ex), argnums=argnums)),
    }
    med = interleaved_medians(variants, params, rounds, warmup=6)
    ex.close()
    return dict(likelihood=name, n=n, dtype=dtype, workers=workers, seconds=med)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--likelihoods", default="hmm_5k,newton_200k,gp_10k,negbin_1M")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--max-workers", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--workers", default=None,
                    help="comma list of worker counts to run (default: 1..max-workers)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        name, dtype, workers, rounds = json.loads(args.child)
        print(json.dumps(child(name, dtype, workers, rounds)))
        return
    cores = sorted(os.sched_getaffinity(0))[:args.max_workers]
    for name in args.likelihoods.split(","):
        rows = []
        counts = (range(1, len(cores) + 1) if args.workers is None
                  else [int(w) for w in args.workers.split(",") if int(w) <= len(cores)])
        for w in counts:
            pin = ",".join(map(str, cores[:w]))
            cmd = ["taskset", "-c", pin, sys.executable, os.path.abspath(__file__), "--child",
                   json.dumps([name, args.dtype, w, args.rounds])]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
        one = rows[0]["seconds"]["plain"]
        for r in rows:
            w, s = r["workers"], r["seconds"]
            r["speedup_vs_1core_plain"] = one / s["threads"]
            r["efficiency"] = one / s["threads"] / w
            print(f"{name:12s} {args.dtype} workers={w} plain({w} cores)={s['plain'] * 1e3:.2f}ms "
                  f"threads={s['threads'] * 1e3:.2f}ms vs 1-core plain {one / s['threads']:.2f}x "
                  f"efficiency {r['efficiency']:.2f}; plain's own scaling {one / s['plain']:.2f}x",
                  flush=True)
            if args.json:
                with open(args.json, "a") as fh:
                    fh.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
