"""Value and gradient of one likelihood for ``--sets`` parameter sets under ``vmap`` (as
vectorized chains evaluate it), plain against ``reduce_sum`` in the graph
(``SerialExecutor()``) and on the threads (``ThreadExecutor(dispatch="host")``).

Each timed call runs 4 evaluations in one compiled loop; medians of interleaved rounds,
ratios to plain (> 1: faster than plain).

    python benchmarks/bench_sets.py --likelihood hmm --rows 3000 --sets 4
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--likelihood", default="hmm", help="a maker of likelihoods.MAKERS")
    ap.add_argument("--rows", type=int, default=3000)
    ap.add_argument("--sets", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import parallel_backend as pb
    from likelihoods import MAKERS
    from parallel_backend.blocks import cpu_count
    from parallel_backend.dispatch import LOOP, in_a_loop

    fn, data, shared = MAKERS[args.likelihood](args.rows, np.float32)
    sets = tuple(jnp.stack([s * (1 + 0.01 * k) for k in range(args.sets)]).astype(s.dtype)
                 for s in shared)
    argnums = tuple(range(len(shared)))

    def timed(loglik):
        return in_a_loop(jax.vmap(jax.value_and_grad(loglik, argnums=argnums)))

    resident = jax.tree.map(jnp.asarray, data)
    with pb.SerialExecutor() as serial, pb.ThreadExecutor(dispatch="host") as threads:
        variants = {
            "plain": timed(lambda *p: fn(resident, *p).sum()),
            "serial": timed(lambda *p: pb.reduce_sum(fn, data, *p, executor=serial)),
            "thread_host": timed(lambda *p: pb.reduce_sum(fn, data, *p, executor=threads)),
        }
        for f in variants.values():
            jax.block_until_ready(f(*sets))
        seconds = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, f in variants.items():
                t0 = time.perf_counter()
                jax.block_until_ready(f(*sets))
                seconds[name].append((time.perf_counter() - t0) / LOOP)
    plain = np.median(seconds["plain"])
    line = " ".join(f"{name}={plain / np.median(s):.2f}x" for name, s in seconds.items())
    print(f"{args.likelihood} N={args.rows:,} sets={args.sets} cores={cpu_count()} "
          f"plain={plain * 1e3:.1f}ms {line}")


if __name__ == "__main__":
    main()
