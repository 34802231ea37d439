"""Second derivatives of a site: plain JAX, in the caller's program, on the executor.

``python benchmarks/second_order.py [--repeats 7]`` times ``jax.hessian`` (every
tangent at once) and one Hessian-vector product (``jax.jvp`` of ``jax.grad``) of the HMM
and the logistic likelihood of ``benchmarks/likelihoods.py`` in float64, jitted, medians
of ``repeats`` runs after a warm-up, all in one process:

* ``plain``: the unsplit sum, ``fn(data, *params).sum()``;
* ``in-graph``: ``pb.reduce_sum`` on ``ThreadExecutor(2, dispatch="graph")``: the
  Hessian-vector products by JAX's autodiff of the blocked sum inside the caller's
  program (what every route did before they ran on the executor);
* ``executor``: ``pb.reduce_sum`` on ``ThreadExecutor(2, dispatch="host")`` (and
  ``SerialExecutor(dispatch="host")``, the same tasks on one thread): per-block
  Hessian-vector products as chunk tasks, one host callback for all tangents;
* ``auto``: ``ThreadExecutor(2)`` as a user gets it (the route its default rule picks;
  second derivatives follow the site's route).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np

import parallel_backend as pb

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import likelihoods

CASES = {"hmm": (likelihoods.hmm, 4_000), "logistic": (likelihoods.logistic, 100_000)}


def compiled(f, params, tangent):
    """The jitted Hessian and Hessian-vector product of ``f(*params)``, warmed up."""
    hess = jax.jit(jax.hessian(lambda p: f(*p)))
    hvp = jax.jit(lambda p, t: jax.jvp(jax.grad(lambda q: f(*q)), (p,), (t,))[1])
    jax.block_until_ready((hess(params), hvp(params, tangent)))
    return hess, hvp


def seconds(f, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - t0


def measure(name: str, repeats: int) -> list[str]:
    make, n = CASES[name]
    fn, data, params = make(n, np.float64)
    data = jax.tree.map(np.asarray, data)
    tangent = tuple(jnp.ones_like(p) * 0.1 for p in params)
    executors = {"in-graph, thread(2)": pb.ThreadExecutor(2, dispatch="graph"),
                 "executor, serial": pb.SerialExecutor(dispatch="host"),
                 "executor, thread(2)": pb.ThreadExecutor(2, dispatch="host"),
                 "auto, thread(2)": pb.ThreadExecutor(2)}
    programs = {"plain": compiled(lambda *p: fn(data, *p).sum(), params, tangent)}
    for label, ex in executors.items():
        programs[label] = compiled(lambda *p, ex=ex: pb.reduce_sum(fn, data, *p, executor=ex),
                                   params, tangent)
    want = programs["plain"][0](params)
    for label, (hess, _) in programs.items():
        err = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-300))
                  for a, b in zip(jax.tree.leaves(hess(params)), jax.tree.leaves(want)))
        assert err < 1e-8, (label, err)
    times = {label: ([], []) for label in programs}
    for _ in range(repeats):  # interleaved rounds: the machine's load hits every variant
        for label, (hess, hvp) in programs.items():
            times[label][0].append(seconds(hess, params))
            times[label][1].append(seconds(hvp, params, tangent))
    routes = {"auto, thread(2)": executors["auto, thread(2)"].sites()[0].decision.name}
    for ex in executors.values():
        ex.close()
    n_params = sum(int(np.size(p)) for p in params)
    out = [(f"{name}: {n} rows, {n_params} parameters, float64; medians of {repeats} "
           "interleaved rounds (ms)"),
           f"  {'':26s} {'hessian':>9s} {'one HVP':>9s} {'hessian: in-graph / this':>25s}"]
    graph = statistics.median(times["in-graph, thread(2)"][0])
    for label, (h, v) in times.items():
        h, v = statistics.median(h), statistics.median(v)
        if label in routes:
            label = f"{label} -> {routes[label]}"
        out.append(f"  {label:26s} {h * 1e3:9.1f} {v * 1e3:9.1f} {graph / h:24.2f}x")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    args = parser.parse_args()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}, jax {jax.__version__}, "
          f"parallel_backend {pb.__version__}")
    for name in args.cases:
        print("\n".join(measure(name, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
