"""Vectorized chains of a logistic regression, by width: the two layouts of a batch of
parameter sets on ``ThreadExecutor()`` against plain NumPyro's batch, on this stack:

    python -m benchmarks.sets_forms [ROWS [WIDTHS [SETS]]]    # 200000 4,8,20,40,80 4

``inside``: the sets inside the blocks (``analysis.SETS_EACH_WIDTH`` 0); ``each``: one set
at a time (``SETS_EACH_WIDTH`` 1); ``rule``: which of the two a site picks by itself on
this stack (a third, identical program is not timed: in one process a repeat of a
program measured up to a quarter apart from its first copy). Per
gradient of every set, parameters traced, in one compiled loop (``routes.LOOP``),
medians of interleaved rounds, float32."""

from __future__ import annotations

import sys

import jax
import numpy as np

import parallel_backend as pb
from parallel_backend import analysis
from parallel_backend.routes import LOOP

from .gradients import compiled, time_variants
from .likelihoods import logistic, parameter_sets


def main(argv=None) -> None:
    args = list(argv or sys.argv[1:])
    rows = int(args[0]) if args else 200_000
    widths = [int(w) for w in args[1].split(",")] if len(args) > 1 else [4, 8, 20, 40, 80]
    sets = int(args[2]) if len(args) > 2 else 4
    print(f"jax {jax.__version__}, logistic regression, {rows:,} rows, {sets} sets, "
          f"ThreadExecutor(), ratio to plain (SETS_EACH_WIDTH here: {analysis.SETS_EACH_WIDTH})")
    for width in widths:
        _width(rows, width, sets)


def _width(rows: int, width: int, sets: int) -> None:
    fn, data, params = logistic(rows, np.dtype("float32"), n_features=width)
    params = parameter_sets(params, sets)

    def timed(f):
        return compiled(jax.vmap(jax.value_and_grad(f, argnums=(0, 1))), LOOP)

    variants = {"plain": (timed(lambda *p: fn(data, *p).sum()), None)}
    for name, knob in (("inside", 0), ("each", 1)):
        ex = pb.ThreadExecutor()
        f = timed(lambda *p, ex=ex: pb.reduce_sum(fn, data, *p, executor=ex))
        keep = analysis.SETS_EACH_WIDTH
        analysis.SETS_EACH_WIDTH = knob
        try:
            jax.block_until_ready(f(*params))  # the site, and its layout, made now
        finally:
            analysis.SETS_EACH_WIDTH = keep
        variants[name] = (f, ex)
    with pb.SerialExecutor() as ex:  # the rule's pick, untimed
        jax.block_until_ready(timed(lambda *p: pb.reduce_sum(fn, data, *p, executor=ex))(*params))
        rule = ex.stats()["sites"][0]["sets"]
    try:
        med = time_variants(variants, params, 7, LOOP)
    finally:
        for _, ex in list(variants.values())[1:]:
            ex.close()
    print(f"  {width:3d} features: plain {med['plain'] * 1e3:7.3f} ms  "
          + "  ".join(f"{k} {med['plain'] / med[k]:.2f}x" for k in ("inside", "each"))
          + f"  (rule: {rule})", flush=True)


if __name__ == "__main__":
    main()
