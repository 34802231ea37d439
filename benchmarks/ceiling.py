"""What two cores can do with a site's blocks: the measured ceiling of a host evaluation.

``python -m benchmarks.ceiling --likelihoods hmm:10000,hmm:50000 --dtype float32``

Per likelihood, in one run: plain NumPyro, ``SerialExecutor()`` (every block on one
thread, in the graph), ``ThreadExecutor()`` (its default route) and
``ThreadExecutor(dispatch="host")``, timed in interleaved rounds as ``benchmarks
gradients`` times them (value and gradient, parameters traced, every output used, in a
compiled loop), and in the same rounds the **ceiling**: two processes at once, each
evaluating half of the rows with ``SerialExecutor()`` in the whole site's blocks (the
blocks the threads run), a round of both together. The slower half's median is what two
cores give these blocks on this machine, the memory bus and the cores' shared caches
included; ``2 x Serial`` assumes they cost nothing. Prints
per gradient the ratio to plain of each, and the threads' share of the ceiling and of
``2 x Serial``; ``--out FILE`` appends records (``bench: "ceiling"``) to ``FILE``, the
threads' with their last evaluation's timeline (drawn by ``python -m benchmarks plot``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _problem(model: str, rows: int, dtype: str, half: int | None = None):
    """``(fn, data, params)`` of the catalogue's ``model`` (rows ``[0, rows/2)`` or the
    rest for ``half`` 0 or 1)."""
    from .likelihoods import MAKERS

    fn, data, params = MAKERS[model](rows, np.dtype(dtype))
    if half is not None:
        cut = rows // 2
        data = data[:cut] if half == 0 else data[cut:]
    return fn, data, params


def _gradient(fn, data, executor, block_rows=None):
    import jax

    import parallel_backend as pb
    from parallel_backend.routes import LOOP, in_a_loop

    if executor is None:
        def total(*params):
            return fn(data, *params).sum()
    else:
        def total(*params):
            return pb.reduce_sum(fn, data, *params, executor=executor, block_rows=block_rows)
    return in_a_loop(jax.value_and_grad(total, argnums=tuple(range(3))), LOOP)


def child(spec: dict) -> None:
    """One half of the rows on ``SerialExecutor()``: compiled, says ``ready``, then one
    timed round per ``go`` line on stdin (prints its seconds per evaluation), until stdin
    says anything else or closes."""
    import jax

    import parallel_backend as pb
    from parallel_backend.plugins.numpyro.profile import warm_up
    from parallel_backend.routes import LOOP

    jax.config.update("jax_enable_x64", spec["dtype"] == "float64")
    fn, data, params = _problem(spec["model"], spec["rows"], spec["dtype"], spec["half"])
    with pb.SerialExecutor() as ex:
        f = _gradient(fn, data, ex, spec["block_rows"])  # the whole site's blocks
        warm_up(f, params, ex, calls=3)
        print("ready", flush=True)
        while sys.stdin.readline().strip() == "go":
            t0 = time.perf_counter()
            jax.block_until_ready(f(*params))
            print((time.perf_counter() - t0) / LOOP, flush=True)


class Halves:
    """The ceiling as one more timed function: two processes, each on half of the rows in
    blocks of ``block_rows`` (the whole site's); a call runs one round of both at once
    and records the slower half's seconds per evaluation (``seconds``). Timed in the same
    interleaved rounds as the in-process variants, so that all see the same machine (it
    is shared and noisy); while one runs, the others wait on a pipe."""

    def __init__(self, model: str, rows: int, dtype: str, block_rows: int) -> None:
        self.seconds: list[float] = []
        self.procs = []
        for half in (0, 1):
            spec = {"model": model, "rows": rows, "dtype": dtype, "half": half,
                    "block_rows": block_rows}
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "benchmarks.ceiling", "--child", json.dumps(spec)],
                cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for p in self.procs:
            if p.stdout.readline().strip() != "ready":
                self.close()
                raise RuntimeError("ceiling: a half did not compile")

    def __call__(self, *params) -> None:
        del params  # each half holds its own
        for p in self.procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        lines = [p.stdout.readline() for p in self.procs]
        if not all(line.strip() for line in lines):
            raise RuntimeError("ceiling: a half exited")
        self.seconds.append(max(float(line) for line in lines))

    def close(self) -> None:
        for p in self.procs:
            with contextlib.suppress(OSError):
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def measure(model: str, rows: int, dtype: str, rounds: int) -> dict:
    """Seconds per evaluation of every variant and of the ceiling, in interleaved rounds
    (the ceiling: the median over rounds of the slower half)."""
    import jax

    import parallel_backend as pb
    from parallel_backend.plugins.numpyro.profile import medians, time_interleaved, warm_up
    from parallel_backend.routes import LOOP

    jax.config.update("jax_enable_x64", dtype == "float64")
    fn, data, params = _problem(model, rows, dtype)
    executors = {"serial": pb.SerialExecutor(), "thread": pb.ThreadExecutor(),
                 "thread_host": pb.ThreadExecutor(dispatch="host")}
    halves = None
    try:
        variants = {"plain": (_gradient(fn, data, None), None)}
        variants.update({k: (_gradient(fn, data, ex), ex) for k, ex in executors.items()})
        for f, ex in variants.values():
            warm_up(f, params, ex, calls=3)
        block_rows = executors["serial"].stats()["sites"][0]["block_rows"]
        halves = Halves(model, rows, dtype, block_rows)
        times = time_interleaved([f for f, _ in variants.values()] + [halves], params,
                                 rounds=rounds)
        seconds = {k: m / LOOP for k, m in zip(variants, medians(times))}
        seconds["ceiling"] = float(np.median(halves.seconds))
        # None where the threads' default route was the graph (no host evaluation).
        span = next(reversed(executors["thread"].timeline.last()), None)
        workers = executors["thread"].workers
    finally:
        if halves is not None:
            halves.close()
        for ex in executors.values():
            ex.close()
    return seconds, span, block_rows, workers


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ceiling", description=__doc__)
    ap.add_argument("--likelihoods", default="hmm:10000,hmm:50000",
                    help="comma list of MODEL:ROWS (models of benchmarks/likelihoods.py)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default=None, help="append the records (JSON lines) here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return
    from . import records

    env = records.environment()
    out = []
    for item in args.likelihoods.split(","):
        model, rows = item.split(":")
        s, span, block_rows, workers = measure(model, int(rows), args.dtype, args.rounds)
        plain = s["plain"]
        ratio = {k: plain / v for k, v in s.items()}
        twice = 2 * ratio["serial"]
        best = max(ratio["thread"], ratio["thread_host"])
        print(f"{model} {int(rows):,} {args.dtype}: plain {plain * 1e3:.1f} ms; serial "
              f"{ratio['serial']:.2f}x, thread {ratio['thread']:.2f}x, thread_host "
              f"{ratio['thread_host']:.2f}x; ceiling (2 processes) {ratio['ceiling']:.2f}x, "
              f"2 x serial {twice:.2f}x; threads / ceiling {best / ratio['ceiling']:.2f}, "
              f"threads / (2 x serial) {best / twice:.2f}", flush=True)
        for k, v in s.items():
            info = {}
            if k == "thread" and span is not None:  # for `python -m benchmarks plot`
                info = {"block_rows": block_rows, "workers": workers,
                        "timeline": span.as_dict()}
            out.append(records.record(env, "ceiling", model, int(rows), args.dtype, k, v,
                                      plain, args.rounds, {"loop": 4}, info))
    if args.out:
        records.write(args.out, out)


if __name__ == "__main__":
    main()
