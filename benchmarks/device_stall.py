"""Where ``DeviceExecutor`` waits on an accelerator: one case per process, bounded in time.

Each case runs one jitted value-and-gradient (or a plain JAX program) on
``jax.devices()[0]`` (the GPU where there is one) and prints one JSON line. Before it
starts, ``faulthandler.dump_traceback_later`` is armed: a case still running after
``--timeout`` seconds prints every Python thread's stack to stderr and exits with
status 1, so a stall says where each thread waits instead of hanging.

Cases:

* ``host_route``: the HMM on ``DeviceExecutor`` with its ``dispatch`` set to ``"host"``
  after it is made, which skips the check the executor makes when it is made: the
  route as it ran before that check (a host callback whose chunks run on the devices).
* ``host_made``: ``DeviceExecutor(dispatch="host")`` as a user makes it (warnings and
  the route it takes are printed).
* ``auto``: ``DeviceExecutor()`` as a user makes it.
* ``jax_same``: no package code: a jitted program on the device whose
  ``jax.pure_callback`` runs a jitted sum on that same device (the host route's shape).
* ``jax_inner_cpu``: the same, the callback's sum on the CPU (``ThreadExecutor``'s shape).
* ``jax_outer_cpu``: the program on the CPU, the callback's sum on the device.
* ``jax_compile_inside``: as ``jax_same``, the callback's program the HMM's value and
  gradient over one block of 250 sequences, compiled at its first call (inside the
  callback, as the host route compiles its chunk programs).
* ``jax_compiled_before``: the same program compiled (and run once) before the outer
  program starts.

    python benchmarks/device_stall.py host_route --n 50000 --timeout 60
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def jax_case(name: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    dev, cpu = jax.devices()[0], jax.devices("cpu")[0]
    outer, inner = {"jax_same": (dev, dev), "jax_inner_cpu": (dev, cpu),
                    "jax_outer_cpu": (cpu, dev)}.get(name, (dev, dev))
    inner_sum = jax.jit(lambda x: jnp.sum(x * x))
    if name in ("jax_compile_inside", "jax_compiled_before"):
        from likelihoods import hmm

        fn, obs, params = hmm(250, np.float32)
        obs, params = jax.device_put((obs, params), dev)
        vg = jax.jit(jax.value_and_grad(lambda x, *p: fn(obs, *p).sum() + x.sum()))
        inner_sum = lambda x: vg(x, *params)[0]  # noqa: E731
        if name == "jax_compiled_before":
            jax.block_until_ready(inner_sum(jnp.zeros(1000, jnp.float32)))

    def host(x):
        with jax.default_device(inner):
            return np.asarray(jax.device_get(inner_sum(jax.device_put(x, inner))))

    @jax.jit
    def program(x):
        s = jax.pure_callback(host, jax.ShapeDtypeStruct((), x.dtype), x)
        return s + jnp.sum(x)

    x = jax.device_put(np.arange(1000, dtype=np.float32), outer)
    t0 = time.perf_counter()
    value = float(program(x))
    return dict(outer=str(outer), inner=str(inner), value=value,
                seconds=time.perf_counter() - t0)


def executor_case(name: str, n: int, dtype: str) -> dict:
    import jax
    import numpy as np

    import parallel_backend as pb
    from likelihoods import hmm

    fn, data, params = hmm(n, np.dtype(dtype))
    dev = jax.devices()[0]
    data = jax.device_put(data, dev)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if name == "host_made":
            ex = pb.DeviceExecutor(dispatch="host")
        else:
            ex = pb.DeviceExecutor()
    if name == "host_route":
        ex.dispatch = "host"  # past the check made in __init__: the route as it was
    argnums = tuple(range(len(params)))
    f = jax.jit(jax.value_and_grad(lambda *p: pb.reduce_sum(fn, data, *p, executor=ex),
                                   argnums=argnums))
    t0 = time.perf_counter()
    with ex:
        value = float(jax.block_until_ready(f(*params))[0])
        first = time.perf_counter() - t0
        t1 = time.perf_counter()
        jax.block_until_ready(f(*params))
        second = time.perf_counter() - t1
        sites = ex.stats()["sites"]
    return dict(n=n, dtype=dtype, dispatch=ex.dispatch, value=value,
                first_call_seconds=first, second_call_seconds=second,
                routes=[s.get("dispatch") for s in sites],
                warnings=[str(w.message) for w in caught])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=["host_route", "host_made", "auto", "jax_same",
                                     "jax_inner_cpu", "jax_outer_cpu", "jax_compile_inside",
                                     "jax_compiled_before"])
    ap.add_argument("--n", type=int, default=50_000, help="HMM sequences")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="seconds before every thread's stack is printed and the case exits")
    args = ap.parse_args(argv)
    faulthandler.dump_traceback_later(args.timeout, exit=True)
    import jax

    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    devices = jax.devices()
    head = dict(case=args.case, xla_flags=os.environ.get("XLA_FLAGS", ""),
                platform=devices[0].platform,
                device_kind=devices[0].device_kind, devices=len(devices),
                jax=jax.__version__)
    print(json.dumps(dict(head, started=True)), flush=True)
    if args.case.startswith("jax_"):
        out = jax_case(args.case)
    else:
        out = executor_case(args.case, args.n, args.dtype)
    faulthandler.cancel_dump_traceback_later()
    print(json.dumps(dict(head, ok=True, **out)), flush=True)


if __name__ == "__main__":
    main()
