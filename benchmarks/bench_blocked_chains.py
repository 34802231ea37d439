"""Why do four vectorized chains of an elementwise likelihood lose inside NUTS?

A reproducer without NumPyro: ``C`` chains (``vmap``) each run a ``while_loop`` of
leapfrog-like steps that stops per chain (as NUTS's tree building under vectorized chains
does), each step one value and gradient of the negative-binomial likelihood of
``likelihoods.py`` (200,000 rows, float32, data closed over). ``--chains 1`` is still a
``vmap`` (of one set), which NumPyro's single chain is not. It times, per gradient:

* ``plain``: ``value_and_grad`` of ``fn(data, *p).sum()``, as NumPyro differentiates;
* ``pb``: ``value_and_grad`` of ``pb.reduce_sum`` on a ``SerialExecutor`` (``--executor
  thread``: ``ThreadExecutor()``);
* ``hand``: no package code: the rows cut by hand into blocks of ``--block-rows``, the
  block sums under ``vmap`` plus the remainder, added by ``tree_sum``, differentiated by
  JAX. If ``hand`` loses as ``pb`` does, the loss comes from the blocks, not the package;
* ``hand vg``: the same blocks, but each block's value and gradient under ``vmap`` and
  both added by ``tree_sum`` (the package's form: per-block gradients, summed in block
  order, are what makes them the same bits on every executor).

    python benchmarks/bench_blocked_chains.py --block-rows 2048,8192 [--chains 1] [--no-matmul]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import parallel_backend as pb
from likelihoods import negbin
from parallel_backend.blocks import tree_sum
from timing import interleaved_medians


def leapfrogs(value_and_grad):
    """``vmap`` over chains of a per-chain ``while_loop`` of ``n`` steps."""
    def run(p, m, n):
        def body(c):
            p, m, acc, i = c
            v, g = value_and_grad(p)
            m = jax.tree.map(lambda a, b: a - 1e-4 * b, m, g)
            p = jax.tree.map(lambda a, b: a + 1e-4 * b, p, m)
            return p, m, acc + v, i + 1
        return jax.lax.while_loop(lambda c: c[3] < n, body, (p, m, 0.0, 0))
    return jax.jit(jax.vmap(run))


def cut(data, block_rows):
    """``(full, tail)``: the rows as blocks of ``block_rows`` (a leading block axis) and
    the rows left over."""
    n = jax.tree.leaves(data)[0].shape[0]
    nf = n // block_rows
    full = jax.tree.map(lambda x: x[:nf * block_rows].reshape((nf, block_rows) + x.shape[1:]),
                        data)
    return full, jax.tree.map(lambda x: x[nf * block_rows:], data)


def hand_blocks(fn, data, block_rows):
    """The sum of block sums, for JAX to differentiate."""
    full, tail = cut(data, block_rows)
    return lambda p: tree_sum(jax.vmap(lambda d: fn(d, *p).sum())(full)) + fn(tail, *p).sum()


def hand_block_grads(fn, data, block_rows):
    """``value_and_grad`` from per-block values and gradients, each added by ``tree_sum``."""
    full, tail = cut(data, block_rows)

    def block_vg(d, p):
        return jax.value_and_grad(lambda q: fn(d, *q).sum())(p)

    def vg(p):
        v, g = jax.vmap(block_vg, (0, None))(full, p)
        vt, gt = block_vg(tail, p)
        return tree_sum(v) + vt, jax.tree.map(lambda a, b: tree_sum(a) + b, g, gt)
    return vg


def without_matmul(fn):
    """``fn`` with ``X @ beta`` written as a sum of elementwise products (the same
    likelihood; does the per-block form's cost come from a batched contraction?)."""
    def elementwise(data, alpha, beta, log_phi):
        x = data["X"]
        xb = sum(x[:, j] * beta[j] for j in range(x.shape[1]))
        return fn({"X": xb[:, None], "y": data["y"]}, alpha, jnp.ones(1, xb.dtype), log_phi)
    return elementwise


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--chains", type=int, default=4)
    ap.add_argument("--steps", type=int, default=50, help="steps of the longest chain")
    ap.add_argument("--block-rows", default="8192", help="comma list, for the hand blocks")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--executor", default="serial", choices=["serial", "thread"],
                    help="the executor of the pb variant")
    ap.add_argument("--no-matmul", action="store_true",
                    help="write the linear predictor as elementwise products")
    args = ap.parse_args(argv)

    fn, data, params = negbin(args.rows, np.float32)
    data = jax.tree.map(jnp.asarray, data)
    if args.no_matmul:
        fn = without_matmul(fn)
    executor = {"serial": pb.SerialExecutor, "thread": pb.ThreadExecutor}[args.executor]()
    runs = {"plain": leapfrogs(jax.value_and_grad(lambda p: fn(data, *p).sum())),
            "pb": leapfrogs(jax.value_and_grad(
                lambda p: pb.reduce_sum(fn, data, *p, executor=executor)))}
    sizes = [int(b) for b in args.block_rows.split(",")]
    runs.update({f"hand {b}": leapfrogs(jax.value_and_grad(hand_blocks(fn, data, b)))
                 for b in sizes})
    runs.update({f"hand vg {b}": leapfrogs(hand_block_grads(fn, data, b)) for b in sizes})
    c = args.chains
    p = jax.tree.map(lambda x: jnp.stack([x + 0.01 * k for k in range(c)]), params)
    m = jax.tree.map(jnp.zeros_like, p)
    n = jnp.array([args.steps - 3 * k for k in range(c)])
    times = interleaved_medians(runs, (p, m, n), args.rounds, warmup=1)
    print(f"negbin{' (no matmul)' * args.no_matmul} {args.rows:,} rows float32, {c} chains "
          f"in a vmapped while_loop of up to {args.steps} steps; ms per gradient step "
          f"(medians of {args.rounds})")
    for k, t in times.items():
        print(f"{k:>15}: {t / args.steps * 1e3:7.2f} ms  {times['plain'] / t:5.2f}x plain")
    executor.close()


if __name__ == "__main__":
    main()
