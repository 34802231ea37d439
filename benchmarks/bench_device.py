"""Time one value-and-gradient evaluation: plain NumPyro against ``DeviceExecutor``.

Plain is ``jit(value_and_grad)`` of ``fn(data, *params).sum()`` on the default
device; ``serial`` is ``SerialExecutor()`` (the same block loop on one device).
Over every device of the process: ``device`` is ``DeviceExecutor()`` (``"auto"``:
measures, once, the in-place loop against the host device map), ``device_host``
is ``dispatch="host"`` (one callback, a one-device program per device) and
``device_graph`` is ``dispatch="graph"`` (the ``shard_map``, no callback).
``plain_nocse`` and ``device_graph_nocse`` are plain and graph compiled with XLA's
common-subexpression pass off (``compiler_options``, for this jit only): what
``XLA_FLAGS=--xla_disable_hlo_passes=cse``, which makes graph mode bitwise, costs.
On a CPU the devices are forced host devices, so the flag must be set before JAX
starts; this script sets it from ``--cpu-devices`` when it is not already in
``XLA_FLAGS``. Variants are timed in interleaved rounds and reported as medians
and as ratios to plain (> 1: faster than plain).

    python benchmarks/bench_device.py --cpu-devices 2 --dtype float64
    python benchmarks/bench_device.py --likelihoods hmm_50k,hmm_500k --dtype float32  # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--likelihoods", default="logistic_1M,negbin_1M,hmm_50k,logistic_1k",
                    help="names from likelihoods.py, plus hmm_500k")
    ap.add_argument("--cpu-devices", type=int, default=2,
                    help="forced host devices when no accelerator is used")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every N by this")
    ap.add_argument("--json", default=None, help="append results as JSON lines here")
    args = ap.parse_args(argv)

    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count="
                                   f"{args.cpu_devices}").strip()

    import jax

    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    import numpy as np

    import parallel_backend as pb
    from likelihoods import LIKELIHOODS, hmm
    from timing import interleaved_medians

    known = dict(LIKELIHOODS, hmm_500k=(hmm, 500_000))
    dtype = np.dtype(args.dtype)
    devices = jax.devices()
    platform = devices[0].platform
    kind = devices[0].device_kind
    for name in args.likelihoods.split(","):
        make, n = known[name]
        n = max(1, int(n * args.scale))
        fn, data, params = make(n, dtype)
        data = jax.device_put(data, devices[0])
        argnums = tuple(range(len(params)))
        no_cse = {"xla_disable_hlo_passes": "cse"}
        plain = jax.value_and_grad(lambda *p: fn(data, *p).sum(), argnums=argnums)
        variants = {"plain": jax.jit(plain),
                    "plain_nocse": jax.jit(plain, compiler_options=no_cse)}
        executors = {"serial": pb.SerialExecutor(), "device": pb.DeviceExecutor(),
                     "device_host": pb.DeviceExecutor(dispatch="host"),
                     "device_graph": pb.DeviceExecutor(dispatch="graph")}
        for key, ex in executors.items():
            variants[key] = jax.jit(jax.value_and_grad(
                lambda *p, ex=ex: pb.reduce_sum(fn, data, *p, executor=ex), argnums=argnums))
        variants["device_graph_nocse"] = jax.jit(jax.value_and_grad(
            lambda *p, ex=executors["device_graph"]: pb.reduce_sum(fn, data, *p, executor=ex),
            argnums=argnums), compiler_options=no_cse)
        med = interleaved_medians(variants, params, args.rounds, warmup=3)
        base = med["plain"]
        row = dict(likelihood=name, n=n, dtype=args.dtype, platform=platform, device_kind=kind,
                   devices=len(devices), cores=len(os.sched_getaffinity(0)), seconds=med,
                   ratios={k: base / v for k, v in med.items() if k != "plain"},
                   sites=executors["device"].stats()["sites"])
        ratios = " ".join(f"{k}={base / v:.2f}x" for k, v in med.items() if k != "plain")
        print(f"{name:12s} N={n:>9,} {args.dtype} {platform}x{len(devices)} "
              f"plain={base * 1e3:.3f}ms {ratios}  "
              + " ".join(f"{k}={v * 1e3:.3f}ms" for k, v in med.items()), flush=True)
        if args.json:
            with open(args.json, "a") as fh:
                fh.write(json.dumps(row) + "\n")
        for ex in executors.values():
            ex.close()


if __name__ == "__main__":
    main()
