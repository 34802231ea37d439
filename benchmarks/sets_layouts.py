"""How XLA:CPU lays out a linear predictor in blocks over parameter sets: a one-off study.

Vectorized chains evaluate a batched site as blocks (leading axis) with the parameter
sets inside (``parallel_backend.sets``). For a likelihood whose linear predictor is a
dot with a parameter vector (``X @ beta``), how the sets, the blocks and the dot are
arranged decides which dot XLA emits and in which layout the elementwise work after it
runs. This script times, in one compiled loop of value-and-gradient calls and against
plain NumPyro's form in the same run, the arrangements one can write in JAX:

* ``swap``: the dot as the likelihood writes it (``X @ beta``) or with its operands
  swapped (``dot_general(beta, X)``, parameters on the left, as XLA makes plain's after
  folding its transpose; the likelihood is the same, its ``X`` wrapped in :class:`Swapped`);
* ``outer``: the sets mapped outside the blocks, or inside them (the package's choice);
* ``bcast``: the shared parameters broadcast over the blocks (the package's choice), or not.

``--dots`` times the forward dot alone instead: batched over ``nb`` blocks with the sets
as its small free dimension (``bsf,brf->bsr``, what the package's arrangement compiles to)
against the same dot with the rows leading, for several block counts.

Not a benchmark of the package (it calls none of it): the arrangements are written out
here, the data behind an optimization barrier as the graph path has it.

    python benchmarks/sets_layouts.py --likelihood logistic --rows 200000 --sets 4
    python benchmarks/sets_layouts.py --dots
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class Swapped:
    """The data matrix of a likelihood whose predictor is ``data["X"] @ beta``: ``@`` with
    it computes ``dot_general(beta, X)`` (parameters on the left), so the likelihoods of
    ``benchmarks/likelihoods.py`` run unchanged with their dot's operands swapped."""

    def __init__(self, x):
        self.x = x

    def __matmul__(self, beta):
        from jax import lax

        return lax.dot_general(beta, self.x, (((beta.ndim - 1,), (self.x.ndim - 1,)), ((), ())))


def arrangement(fn, data, rows, swap, outer, bcast):
    """Value and gradients of every set, written out in blocks of ``rows`` rows."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    X, y = data["X"], data["y"]
    n = len(y)
    nb = -(-n // rows)
    pad = nb * rows - n
    Xb = np.concatenate([X, np.repeat(X[-1:], pad, 0)]).reshape(nb, rows, -1)
    yb = np.concatenate([y, np.repeat(y[-1:], pad, 0)]).reshape(nb, rows)

    def block(xb, yb, *p):
        def total(*p):
            return fn({"X": Swapped(xb) if swap else xb, "y": yb}, *p).sum()

        return jax.value_and_grad(total, argnums=tuple(range(len(p))))(*p)

    def f(*p):
        xb, ybb = lax.optimization_barrier((Xb, yb))
        s = p[0].shape[0]
        if outer:
            if bcast:
                pb = [jnp.broadcast_to(q[:, None], (s, nb) + q.shape[1:]) for q in p]
                out = jax.vmap(lambda *q: jax.vmap(block)(xb, ybb, *q))(*pb)
            else:
                out = jax.vmap(lambda *q: jax.vmap(lambda a, b: block(a, b, *q))(xb, ybb))(*p)
        else:
            if bcast:
                pb = [jnp.broadcast_to(q, (nb,) + q.shape) for q in p]
                out = jax.vmap(lambda a, b, *q: jax.vmap(lambda *r: block(a, b, *r))(*q))(
                    xb, ybb, *pb)
            else:
                out = jax.vmap(lambda a, b: jax.vmap(lambda *q: block(a, b, *q))(*p))(xb, ybb)
            out = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), out)
        return jax.tree.map(lambda x: x.sum(1), out)

    return f


def time_dots(rounds):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from timing import interleaved_medians

    rng = np.random.default_rng(0)
    n, f, s = 200_704, 20, 4
    X = jnp.asarray(rng.normal(size=(n, f)).astype(np.float32))
    B = jnp.asarray(rng.normal(size=(s, f)).astype(np.float32))
    print(f"jax {jax.__version__}: forward dot of {n:,} rows x {f} features, {s} sets, ms")
    forms = {"sets leading (bsf,brf->bsr)": jax.jit(lambda x, b: jnp.einsum("bsf,brf->bsr", b, x)),
             "rows leading (brf,bsf->brs)": jax.jit(lambda x, b: jnp.einsum("brf,bsf->brs", x, b))}
    for nb in (1, 2, 4, 7, 49, 196):
        args = (X.reshape(nb, n // nb, f), jnp.broadcast_to(B, (nb, s, f)) + 0)
        med = interleaved_medians(forms, args, rounds, warmup=1)
        print(f"  {nb:4d} blocks: " + "   ".join(f"{k} {v * 1e3:.3f}" for k, v in med.items()),
              flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--likelihood", default="logistic", choices=["logistic", "negbin"])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--block-rows", type=int, default=4096)
    ap.add_argument("--sets", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dots", action="store_true", help="time the forward dot alone")
    args = ap.parse_args()
    if args.dots:
        return time_dots(max(args.rounds, 30))

    import jax
    import numpy as np

    from likelihoods import MAKERS, parameter_sets
    from parallel_backend.dispatch import in_a_loop
    from timing import interleaved_medians

    fn, data, params = MAKERS[args.likelihood](args.rows, np.float32)
    sets = parameter_sets(params, args.sets)
    k = len(params)

    def plain(*p):
        return fn(data, *p).sum()

    loop = 4
    variants = {"plain": in_a_loop(jax.vmap(jax.value_and_grad(plain, argnums=tuple(range(k)))), loop)}
    for swap in (0, 1):
        for outer in (0, 1):
            for bcast in (0, 1):
                f = arrangement(fn, data, args.block_rows, swap, outer, bcast)
                variants[f"swap={swap} outer={outer} bcast={bcast}"] = in_a_loop(f, loop)
    med = interleaved_medians(variants, sets, args.rounds, warmup=3)
    print(f"jax {jax.__version__}, {args.likelihood} {args.rows:,} rows, {args.sets} sets, "
          f"blocks of {args.block_rows}: ms per value and gradient, ratio to plain")
    for key, t in med.items():
        print(f"  {key:28s} {t / loop * 1e3:7.3f} ms  {med['plain'] / t:.2f}x", flush=True)


if __name__ == "__main__":
    main()
