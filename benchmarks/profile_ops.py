"""Where does an evaluation under ``vmap`` over parameter sets spend its time?

Profiles one value and gradient of a benchmark likelihood batched over ``--sets``
parameter sets (as vectorized chains evaluate it): plain NumPyro's form
(``value_and_grad`` of ``fn(data, *p).sum()``) against ``pb.reduce_sum`` on a
``SerialExecutor`` (the in-graph path), each compiled once, then ``--calls`` calls
under ``jax.profiler.trace``. Prints, per compiled operation (an XLA fusion), the
thread time summed over XLA's threads per call and the shape it produces, so that an
extra pass, a transposed layout or a slower kernel shows by name. Reads the trace
with ``jax.profiler.ProfileData``; needs nothing beyond jax. The wall time per call is
timed apart, without the profiler (medians of interleaved rounds). Thread times are read
under the profiler and from the threads it names: compare operations with each other, not
their sum with the wall time.

    python benchmarks/profile_ops.py --likelihood logistic_200k --sets 4
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def op_times(compiled, args, calls: int) -> collections.Counter:
    """Thread time (seconds per call) of each operation XLA's threads ran."""
    import jax

    jax.block_until_ready(compiled(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                jax.block_until_ready(compiled(*args))
        path = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0]
        data = jax.profiler.ProfileData.from_file(path)
    out = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):  # XLA's client and intra-op threads
                continue
            for ev in line.events:
                if re.search(r"wait|Await|Execute|Listener|^end: ", ev.name):
                    continue
                out[ev.name] += ev.duration_ns * 1e-9 / calls
    return out


def shapes(hlo_text: str) -> dict:
    """Operation name -> the shape it produces, from compiled HLO text."""
    found = {}
    for m in re.finditer(r"%([\w.\-]+) = (\S+\[[\d,]*\]\S*) ", hlo_text):
        found.setdefault(m.group(1), m.group(2))
    return found


def main(argv=None):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import parallel_backend as pb
    from likelihoods import LIKELIHOODS, parameter_sets
    from timing import interleaved_medians

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--likelihood", default="logistic_200k", choices=sorted(LIKELIHOODS))
    ap.add_argument("--sets", type=int, default=4, help="parameter sets under vmap (0: none)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--top", type=int, default=12, help="operations listed per variant")
    args = ap.parse_args(argv)

    make, n = LIKELIHOODS[args.likelihood]
    fn, data, params = make(n, np.float32)
    data = jax.tree.map(jnp.asarray, data)
    executor = pb.SerialExecutor()
    variants = {
        "plain": jax.value_and_grad(lambda p: fn(data, *p).sum()),
        "pb": jax.value_and_grad(lambda p: pb.reduce_sum(fn, data, *p, executor=executor)),
    }
    if args.sets:
        params = parameter_sets(params, args.sets)
        variants = {k: jax.vmap(v) for k, v in variants.items()}
    print(f"{args.likelihood} float32, {args.sets or 'no'} sets under vmap; thread time per "
          f"call summed over XLA's threads ({args.calls} calls; wall: isolated calls)")
    compiled = {name: jax.jit(f).lower(params).compile() for name, f in variants.items()}
    wall = interleaved_medians(compiled, (params,), rounds=args.calls, warmup=1)
    for name, c in compiled.items():
        times = op_times(c, (params,), args.calls)
        out = shapes(c.as_text())
        total = sum(times.values())
        print(f"\n{name}: {wall[name] * 1e3:.2f} ms wall ({wall['plain'] / wall[name]:.2f}x "
              f"plain), {total * 1e3:.2f} ms of thread time per call")
        for op, t in times.most_common(args.top):
            print(f"  {t * 1e3:8.3f} ms  {op:28s} {out.get(op, '')}")
    executor.close()


if __name__ == "__main__":
    main()
