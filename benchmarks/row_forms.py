"""The two forms of a reduction within rows (a mixture's ``logsumexp``), in the graph on
``SerialExecutor()``, against plain NumPyro, on the cores this process may use:

    taskset -c 0-3 python -m benchmarks.row_forms mixture_200k,mixture:1000000

``looped`` forces blocks that loop (``analysis.ROW_REDUCE_LOOP_THREADS`` lifted), ``batched``
one batch of blocks (``analysis.ROW_REDUCE_LOOP_ROWS`` lifted); per gradient, parameters
traced, in one compiled loop (``routes.LOOP``), medians of interleaved rounds."""

from __future__ import annotations

import os
import sys

import jax
import numpy as np

import parallel_backend as pb
from parallel_backend import analysis
from parallel_backend.routes import LOOP

from .gradients import compiled, parse_likelihoods, time_variants


def main(argv=None) -> None:
    names = (argv or sys.argv[1:] or ["mixture_200k"])[0]
    for model, make, n in parse_likelihoods(names):
        _one(model, make, n)


def _one(model, make, n) -> None:
    fn, data, params = make(n, np.dtype("float32"))
    argnums = tuple(range(len(params)))

    def timed(f):
        return compiled(jax.value_and_grad(f, argnums=argnums), LOOP)

    variants, executors = {"plain": (timed(lambda *p: fn(data, *p).sum()), None)}, []
    for name, knob in (("looped", "ROW_REDUCE_LOOP_THREADS"), ("batched", "ROW_REDUCE_LOOP_ROWS")):
        ex = pb.SerialExecutor()
        executors.append(ex)
        f = timed(lambda *p, ex=ex: pb.reduce_sum(fn, data, *p, executor=ex))
        keep = getattr(analysis, knob)
        setattr(analysis, knob, 1 << 30)
        try:
            jax.block_until_ready(f(*params))  # the site, and its form, made now
        finally:
            setattr(analysis, knob, keep)
        variants[name] = (f, ex)
    med = time_variants(variants, params, 5, LOOP)
    made = [s["form"] for ex in executors for s in ex.stats()["sites"]]
    print(f"cores={len(os.sched_getaffinity(0))} {model} {n:,} plain {med['plain'] * 1e3:.3f} ms "
          + " ".join(f"{k}={med['plain'] / v:.2f}x" for k, v in med.items() if k != "plain")
          + f" forms={made}", flush=True)
    for ex in executors:
        ex.close()


if __name__ == "__main__":
    main()
