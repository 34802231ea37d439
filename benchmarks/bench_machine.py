"""The machine's own ceiling: how much work K cores do at once, with no backend in the way.

Runs the same single-threaded XLA loop (an elementwise ``scan`` that XLA keeps on one
core) in 1, 2, ... K processes started together, and reports the throughput of K
processes over one's (ideal: K). A speedup of the backend over plain NumPyro on this
machine cannot beat that figure; on a virtual machine whose cores share a physical core
or a power budget it can be well under K.

    python benchmarks/bench_machine.py
    python benchmarks/bench_machine.py --processes 1,2 --json benchmarks/results/machine.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def child(start: float, calls: int, steps: int) -> None:
    """Compile, wait for ``start`` (wall clock, shared by every process), time ``calls``
    calls; print the median seconds per call."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    @jax.jit
    def work(x):
        def body(c, _):
            return jnp.tanh(c * 1.01 + 0.1) * 0.5 + c * 0.4, None

        return jax.lax.scan(body, x, None, length=steps)[0].sum()

    x = np.random.default_rng(os.getpid()).standard_normal(4096).astype(np.float32)
    float(work(x))
    time.sleep(max(start - time.time(), 0.0))
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        float(work(x + np.float32(i)))
        times.append(time.perf_counter() - t0)
    print(float(np.median(times)))


def together(k: int, calls: int, steps: int, lead: float = 15.0) -> list:
    """Median seconds per call of each of ``k`` processes run at once."""
    start = time.time() + lead
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child",
                               json.dumps([start, calls, steps])],
                              stdout=subprocess.PIPE, text=True) for _ in range(k)]
    out = []
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=600)
            if p.returncode:
                raise RuntimeError(f"bench_machine: a child process exited with {p.returncode}")
            out.append(float(stdout.strip().splitlines()[-1]))
    finally:  # a failed or hung child leaves none of the others running
        for p in procs:
            p.kill()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    cores = len(os.sched_getaffinity(0))
    ap.add_argument("--processes", default=",".join(str(k) for k in range(1, cores + 1)),
                    help="comma list of process counts to run together")
    ap.add_argument("--calls", type=int, default=20, help="timed calls per process")
    ap.add_argument("--steps", type=int, default=30000, help="scan steps per call")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(*json.loads(args.child))
        return
    import numpy as np

    counts = [int(k) for k in args.processes.split(",")]
    per_call = {k: [] for k in counts}
    for _ in range(args.repeats):  # interleaved, so drift hits every count alike
        for k in counts:
            per_call[k].append(float(np.median(together(k, args.calls, args.steps))))
    base = float(np.median(per_call[counts[0]])) / counts[0] if counts[0] == 1 else None
    rows = {}
    for k in counts:
        t = float(np.median(per_call[k]))
        rows[k] = dict(seconds_per_call=t, throughput=(k * base / t) if base else None)
        text = f"throughput {k * base / t:.2f}x one process (ideal {k}x)" if base else ""
        print(f"processes={k} cores={cores} {t * 1e3:.1f} ms per call {text}", flush=True)
    if args.json:
        with open(args.json, "a") as fh:
            fh.write(json.dumps(dict(cores=cores, steps=args.steps, calls=args.calls,
                                     repeats=args.repeats, processes=rows)) + "\n")


if __name__ == "__main__":
    main()
