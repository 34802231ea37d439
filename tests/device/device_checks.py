"""Checks of ``DeviceExecutor`` on several forced host CPU devices, run as a script.

The device count is fixed when JAX starts, so ``test_device.py`` runs this file in a
subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` and reads the
JSON it prints: one entry per check, each with what was compared. Importing this
module (pytest's doctest collection does) runs nothing.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/device/device_checks.py 2 [auto,host,graph] [one_chain,vectorized,parallel,graph:one_chain] [hmm,...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: Rows per block in every check: N = 33,048 gives 16 full blocks and a padded tail of
#: 280 rows, in 4 tiles of 4 full blocks (the last with the tail), so devices get whole
#: tiles, the graph layout padded slots, and the tail.
N, BLOCK_ROWS, BATCH = 33_048, 2048, 4


def problems(n: int = N) -> dict:
    """name -> :class:`Problem` from ``tests/conftest.py`` (a script cannot take fixtures)."""
    import importlib.util

    import numpy as np

    path = Path(__file__).parent.parent / "conftest.py"
    spec = importlib.util.spec_from_file_location("parallel_backend_tests_conftest", path)
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    return {name: conftest.PROBLEMS[name](n, np.random.default_rng(0))
            for name in ("random_effects", "logistic", "hmm")}


#: What each dispatch mode is checked on: NUTS runs per mode (see :func:`nuts`).
#: A NUTS request ``label`` runs for the modes listed here; ``mode:label`` runs for that mode.
NUTS_RUNS = {"auto": ("one_chain",), "host": ("one_chain", "vectorized"), "graph": ("parallel",)}
#: The likelihoods each mode is checked on: ``auto`` keeps these small problems in
#: place (SerialExecutor's own loop), so one of them shows it.
MODE_PROBLEMS = {"auto": ("random_effects",), "host": ("random_effects", "logistic", "hmm"),
                 "graph": ("random_effects", "logistic", "hmm")}


def run(n_devices: int, modes=("auto", "host", "graph"),
        nuts_runs=("one_chain", "vectorized", "parallel"), names=None) -> dict:
    """Every check of ``modes`` on the likelihoods ``names`` (default: all three).

    Eager (un-jitted) calls are checked on ``random_effects`` only: the eager path
    does not depend on the likelihood, and each eager call compiles its own pieces.
    """
    import warnings

    import jax
    import jax.numpy as jnp
    import numpy as np

    jax.config.update("jax_enable_x64", True)
    import parallel_backend as pb

    assert len(jax.devices()) == n_devices, (jax.devices(), n_devices)
    res: dict = {"devices": len(jax.devices())}

    def leaves(t):
        return [np.asarray(x) for x in jax.tree.leaves(t)]

    def identical(a, b):
        return all(x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True)
                   for x, y in zip(leaves(a), leaves(b)))

    def max_rel(a, b):
        return max(float(np.max(np.abs(x - y), initial=0.0) / max(np.max(np.abs(y), initial=0.0), 1e-300))
                   for x, y in zip(leaves(a), leaves(b)))

    serial = pb.SerialExecutor()
    vg = lambda f: jax.value_and_grad(f, argnums=(0, 1))
    refs = {}
    chosen = {k: v for k, v in problems().items() if names is None or k in names}
    for name, p in chosen.items():
        bt = p.batch(BATCH)
        refs[name] = {
            "ref": jax.jit(vg(p.split(serial, block_rows=BLOCK_ROWS)))(*p.args),
            "exact": jax.jit(vg(p.unsplit()))(*p.args),
            "ref_v": jax.jit(jax.vmap(vg(p.split(serial, block_rows=BLOCK_ROWS))))(*bt),
            "exact_v": jax.jit(jax.vmap(vg(p.unsplit())))(*bt)}
    for mode in modes:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # several devices: no warning expected
            dev = pb.DeviceExecutor(dispatch=mode, count_calls=True)
        out = res[mode] = {}
        for name, p in chosen.items():
            if name not in MODE_PROBLEMS[mode]:
                continue
            r, bt = refs[name], p.batch(BATCH)
            f = p.split(dev, block_rows=BLOCK_ROWS)
            got = jax.jit(vg(f))(*p.args)
            got_v = jax.jit(jax.vmap(vg(f)))(*bt)
            out[name] = {"identical": identical(got, r["ref"]),
                         "rel_err": max_rel(got, r["exact"]),
                         "vmap_identical": identical(got_v, r["ref_v"]),
                         "vmap_rel_err": max_rel(got_v, r["exact_v"]),
                         "vmap_rel_to_serial": max_rel(got_v, r["ref_v"]),
                         "eager_identical": identical(vg(f)(*p.args), r["ref"])
                         if name == "random_effects" else None}
        st = dev.stats()
        out["stats"] = {k: v for k, v in st.items() if k != "sites"}
        out["site_dispatch"] = sorted({s["dispatch"] for s in st["sites"]})
        out["site_devices"] = sorted({s["devices"] for s in st["sites"]})
        out["layout"] = [dev.layout(s).blocks_on(d) for s in dev.sites()[:1]
                         for d in range(n_devices)]
        dev.close()
        out["closed_repr"] = repr(dev)

        # Stats of one value-and-gradient evaluation, counted exactly.
        with pb.DeviceExecutor(dispatch=mode, count_calls=True) as ex:
            p = problems()["random_effects"]
            f = jax.jit(jax.value_and_grad(p.split(ex, block_rows=BLOCK_ROWS), argnums=(0, 1)))
            for _ in range(3):
                jax.block_until_ready(f(*p.args))
            out["stats_3_calls"] = {k: v for k, v in ex.stats().items() if k != "sites"}
        which = [r for r in ("one_chain", "vectorized", "parallel")
                 if (r in nuts_runs and r in NUTS_RUNS[mode]) or f"{mode}:{r}" in nuts_runs]
        if which:
            out["nuts"] = nuts(pb, jax, jnp, np, n_devices, mode, which)
    return res


_SERIAL_DRAWS: dict = {}


def nuts(pb, jax, jnp, np, n_devices, mode, which):
    """Short NUTS runs: DeviceExecutor against SerialExecutor, same seed."""
    from numpyro.infer import MCMC, NUTS

    sys.path.insert(0, str(Path(__file__).parent.parent))
    from helpers import regression_data, regression_model

    data = regression_data(N, seed=1, dtype=None)

    def model(data):
        regression_model(data, block_rows=BLOCK_ROWS)

    def draws(ex, chains, method):
        with pb.use_executor(ex):
            mcmc = MCMC(NUTS(model), num_warmup=30, num_samples=30, num_chains=chains,
                        chain_method=method, progress_bar=False)
            mcmc.run(jax.random.PRNGKey(3), data)
        return {k: np.asarray(v) for k, v in mcmc.get_samples().items()}

    out = {}
    runs = {"one_chain": (1, "sequential"), "vectorized": (2, "vectorized"),
            "parallel": (n_devices, "parallel")}
    for label in which:
        chains, method = runs[label]
        with pb.DeviceExecutor(dispatch=mode, count_calls=True) as dev:
            got = draws(dev, chains, method)
            st = dev.stats()
        if label not in _SERIAL_DRAWS:  # the same for every mode: drawn once
            _SERIAL_DRAWS[label] = draws(pb.SerialExecutor(), chains, method)
        ref = _SERIAL_DRAWS[label]
        out[label] = {"identical": all(np.array_equal(got[k], ref[k]) for k in ref),
                      "max_abs_diff": max(float(np.max(np.abs(got[k] - ref[k]))) for k in ref),
                      "calls": st["calls"], "host_calls": st["host_calls"],
                      "mean_beta": float(got["beta"].mean())}
    return out


if __name__ == "__main__":
    args = sys.argv[1:] + [None] * 4
    modes = tuple(args[1].split(",")) if args[1] else ("auto", "host", "graph")
    nuts_runs = tuple(args[2].split(",")) if args[2] is not None else (
        "one_chain", "vectorized", "parallel")
    names = tuple(args[3].split(",")) if args[3] else None
    print(json.dumps(run(int(args[0]), modes, nuts_runs, names)))
