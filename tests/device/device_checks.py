"""Checks of ``DeviceExecutor`` on several forced host CPU devices, run as a script.

The device count is fixed when JAX starts, so ``test_device.py`` runs this file in a
subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` and reads the
JSON it prints: one entry per check, each with what was compared. Importing this
module (pytest's doctest collection does) runs nothing.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/device/device_checks.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: Rows per block in every check: N = 1000 gives 15 full blocks and a tail of 40,
#: so devices get uneven shares, padded slots and the tail.
N, BLOCK_ROWS, BATCH = 1000, 64, 4


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


def run(n_devices: int, nuts_runs=("one_chain", "parallel")) -> dict:
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

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # several devices: no warning expected
        dev = pb.DeviceExecutor()
    serial = pb.SerialExecutor()
    for name, p in problems().items():
        vg = lambda f: jax.value_and_grad(f, argnums=(0, 1))  # noqa: E731
        got = jax.jit(vg(p.split(dev, block_rows=BLOCK_ROWS)))(*p.args)
        ref = jax.jit(vg(p.split(serial, block_rows=BLOCK_ROWS)))(*p.args)
        exact = jax.jit(vg(p.unsplit()))(*p.args)
        bt = p.batch(BATCH)
        got_v = jax.jit(jax.vmap(vg(p.split(dev, block_rows=BLOCK_ROWS))))(*bt)
        ref_v = jax.jit(jax.vmap(vg(p.split(serial, block_rows=BLOCK_ROWS))))(*bt)
        exact_v = jax.jit(jax.vmap(vg(p.unsplit())))(*bt)
        res[name] = dict(identical=identical(got, ref), rel_err=max_rel(got, exact),
                         vmap_identical=identical(got_v, ref_v), vmap_rel_err=max_rel(got_v, exact_v),
                         eager_identical=identical(vg(p.split(dev, block_rows=BLOCK_ROWS))(*p.args),
                                                   ref))
    res["stats"] = {k: v for k, v in dev.stats().items() if k != "sites"}
    res["layout"] = [dev.layout(s).blocks_on(d) for s in list(dev._sites.values())[:1]
                     for d in range(n_devices)]

    # Stats of one value-and-gradient evaluation, counted exactly.
    with pb.DeviceExecutor() as ex:
        p = problems()["random_effects"]
        f = jax.jit(jax.value_and_grad(p.split(ex, block_rows=BLOCK_ROWS), argnums=(0, 1)))
        for _ in range(3):
            jax.block_until_ready(f(*p.args))
        res["stats_3_calls"] = {k: v for k, v in ex.stats().items() if k != "sites"}
    res["closed_repr"] = repr(ex)
    res["nuts"] = nuts(pb, jax, jnp, np, n_devices, nuts_runs)
    return res


def nuts(pb, jax, jnp, np, n_devices, which):
    """Short NUTS runs: DeviceExecutor against SerialExecutor, same seed."""
    import numpyro
    import numpyro.distributions as dist
    from numpyro.infer import MCMC, NUTS

    rng = np.random.default_rng(1)
    x = rng.normal(size=N)
    data = {"x": jnp.asarray(x), "y": jnp.asarray(0.5 + 1.2 * x + 0.8 * rng.normal(size=N))}

    def loglik(rows, alpha, beta, sigma):
        return dist.Normal(alpha + beta * rows["x"], sigma).log_prob(rows["y"])

    def model(data):
        alpha = numpyro.sample("alpha", dist.Normal(0.0, 5.0))
        beta = numpyro.sample("beta", dist.Normal(0.0, 5.0))
        sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
        pb.factor("y", loglik, data, alpha, beta, sigma, block_rows=BLOCK_ROWS)

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
        with pb.DeviceExecutor() as dev:
            got = draws(dev, chains, method)
            calls = dev.stats()["calls"]
        ref = draws(pb.SerialExecutor(), chains, method)
        out[label] = dict(identical=all(np.array_equal(got[k], ref[k]) for k in ref),
                          max_abs_diff=max(float(np.max(np.abs(got[k] - ref[k]))) for k in ref),
                          calls=calls, mean_beta=float(got["beta"].mean()))
    return out


if __name__ == "__main__":
    nuts_runs = tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 and sys.argv[2] else ()
    print(json.dumps(run(int(sys.argv[1]), nuts_runs)))
