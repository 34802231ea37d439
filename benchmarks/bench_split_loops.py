"""Does XLA:CPU run independent loops of one program at the same time?

The graph path evaluates a looped site (an HMM's ``scan``) one block per iteration of one
``fori_loop``, which XLA keeps on one core. Its blocks are independent, so the loop could
be cut into ``S`` loops over consecutive runs of blocks (the same body: the same bits) if
XLA ran independent loops of one program concurrently. This times, for the HMM of
``likelihoods.py``, the value and gradient of plain's unsplit sum and of the block sum as
1, 2 and 4 independent loops, for each block size of ``--block-rows`` (does XLA thread one
wide block's scan as it threads plain's?), and reports each one's CPU time over its wall
time: a program that keeps one core busy reads about 1.0, one that keeps two busy about 2.0.

    python benchmarks/bench_split_loops.py --rows 50000 --block-rows 2000,12500
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from likelihoods import hmm


def split_loops(fn, n_blocks: int, loops: int):
    """``value_and_grad`` of the sum over blocks (leading axis of ``blocks``) of
    ``fn(block, *params).sum()``, the blocks cut into ``loops`` independent loops."""
    bounds = np.linspace(0, n_blocks, loops + 1).astype(int)

    def block_vg(block, params):
        return jax.value_and_grad(lambda p: fn(block, *p).sum())(params)

    def run(blocks, params):
        parts = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            lo, hi = int(lo), int(hi)
            values = jnp.zeros(hi - lo, blocks.dtype)
            grads = jax.tree.map(lambda x: jnp.zeros((hi - lo,) + x.shape, x.dtype), params)

            def body(i, carry, lo=lo):
                values, grads = carry
                v, g = block_vg(lax.dynamic_index_in_dim(blocks, lo + i, keepdims=False), params)
                return values.at[i].set(v), jax.tree.map(lambda a, x: a.at[i].set(x), grads, g)

            parts.append(lax.fori_loop(0, hi - lo, body, (values, grads)))
        values = jnp.concatenate([p[0] for p in parts])
        grads = jax.tree.map(lambda *a: jnp.concatenate(a), *[p[1] for p in parts])
        return values.sum(), jax.tree.map(lambda a: a.sum(0), grads)

    return jax.jit(run)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=50_000, help="HMM sequences")
    p.add_argument("--block-rows", default="2000",
                   help="comma list of block sizes (rows); the loops are timed for each")
    p.add_argument("--loops", default="1,2,4", help="comma list of loop counts")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)

    fn, obs, params = hmm(args.rows, np.float32)
    variants = {"plain": (jax.jit(lambda o, p: jax.value_and_grad(
        lambda p: fn(o, *p).sum())(p)), jnp.asarray(obs))}
    for size in map(int, args.block_rows.split(",")):
        n_blocks = args.rows // size
        if n_blocks * size != args.rows:
            raise SystemExit(f"--block-rows {size} does not divide --rows {args.rows}")
        blocks = jnp.asarray(obs.reshape(n_blocks, size, -1))
        for s in (s for s in map(int, args.loops.split(",")) if s <= n_blocks):
            variants[f"{n_blocks} x {size}, {s} loop{'s' * (s > 1)}"] = (
                split_loops(fn, n_blocks, s), blocks)
    print(f"HMM {args.rows:,} sequences, float32, {jax.device_count()} device(s); medians "
          f"of {args.rounds} calls, parameters changed every call")
    plain = None
    for name, (f, data) in variants.items():
        jax.block_until_ready(f(data, params))
        wall, cpu = [], []
        for k in range(args.rounds):
            p = jax.tree.map(lambda x: x + 1e-4 * (k + 1), params)
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(f(data, p))
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        w = statistics.median(wall)
        plain = plain or w
        print(f"{name:>24}: {w * 1e3:8.1f} ms  {plain / w:5.2f}x plain  "
              f"CPU/wall {statistics.median(c / t for c, t in zip(cpu, wall)):.2f}")


if __name__ == "__main__":
    main()
