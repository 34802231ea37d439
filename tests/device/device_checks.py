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

#: Rows per block in every check: N = 1000 gives 15 full blocks and a tail of 40,
#: so devices get uneven shares, padded slots and the tail.
N, BLOCK_ROWS, BATCH = 1000, 64, 4


def problems(jnp, jax, np):
    """name -> (fn, data, row_params, params, constrain): as tests/conftest.py's."""
    rng = np.random.default_rng(0)
    out = {}

    group = rng.integers(0, 5, size=N).astype(np.int32)
    y = rng.normal(size=N) + np.linspace(-1, 1, 5)[group]

    def re_loglik(d, p):
        mean = p["mu"] + p["tau"][d["group"]] + d["u"]
        return (-0.5 * ((d["y"] - mean) / p["sigma"]) ** 2 - jnp.log(p["sigma"])
                - 0.5 * d["u"] ** 2)

    def re_constrain(p):
        return ({"mu": p["mu"], "tau": p["tau"], "sigma": jnp.exp(p["log_sigma"])},)

    out["random_effects"] = (
        re_loglik, {"y": jnp.asarray(y), "group": jnp.asarray(group)},
        {"u": jnp.asarray(0.1 * rng.normal(size=N))},
        {"mu": jnp.asarray(0.2), "tau": jnp.linspace(-0.5, 0.5, 5), "log_sigma": jnp.asarray(-0.1)},
        re_constrain)

    X = rng.normal(size=(N, 3))
    lab = (rng.random(N) < 1 / (1 + np.exp(-(X @ [1.0, -2.0, 0.5])))).astype(np.int32)

    def logistic(d, beta, b0):
        eta = d["X"] @ beta + b0
        return jnp.where(d["y"] == 1, jax.nn.log_sigmoid(eta), jax.nn.log_sigmoid(-eta))

    out["logistic"] = (logistic, {"X": jnp.asarray(X), "y": jnp.asarray(lab)}, {},
                       (jnp.asarray([0.8, -1.5, 0.2]), jnp.asarray(0.1)), lambda p: p)

    obs = np.linspace(-2, 2, 3)[rng.integers(0, 3, size=(N, 6))] + rng.normal(size=(N, 6))

    def hmm(y, logits, mu, log_sigma):
        log_trans = jax.nn.log_softmax(logits, axis=-1)

        def emit(y_t):
            z = (y_t[:, None] - mu) / jnp.exp(log_sigma)
            return -0.5 * z * z - log_sigma

        def step(alpha, y_t):
            alpha = jax.scipy.special.logsumexp(alpha[:, :, None] + log_trans, axis=1)
            return alpha + emit(y_t), None

        alpha, _ = jax.lax.scan(step, emit(y[:, 0]) - jnp.log(3.0), y[:, 1:].T)
        return jax.scipy.special.logsumexp(alpha, axis=-1)

    out["hmm"] = (hmm, jnp.asarray(obs), {}, (2.0 * jnp.eye(3), jnp.linspace(-1.8, 1.8, 3),
                                              jnp.asarray(0.1)), lambda p: p)
    return out


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

    def split(p, ex):
        fn, data, _, _, constrain = p

        def f(row_params, params):
            return pb.reduce_sum(fn, {**data, **row_params} if row_params else data,
                                 *constrain(params), executor=ex, block_rows=BLOCK_ROWS)
        return f

    def unsplit(p):
        fn, data, _, _, constrain = p

        def f(row_params, params):
            return fn({**data, **row_params} if row_params else data, *constrain(params)).sum()
        return f

    def batch(p):
        scales = jnp.linspace(0.5, 1.5, BATCH)
        return jax.tree.map(lambda x: jnp.stack([x * s for s in scales]), (p[2], p[3]))

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # several devices: no warning expected
        dev = pb.DeviceExecutor()
    serial = pb.SerialExecutor()
    for name, p in problems(jnp, jax, np).items():
        vg = lambda f: jax.value_and_grad(f, argnums=(0, 1))  # noqa: E731
        got = jax.jit(vg(split(p, dev)))(p[2], p[3])
        ref = jax.jit(vg(split(p, serial)))(p[2], p[3])
        exact = jax.jit(vg(unsplit(p)))(p[2], p[3])
        bt = batch(p)
        got_v = jax.jit(jax.vmap(vg(split(p, dev))))(*bt)
        ref_v = jax.jit(jax.vmap(vg(split(p, serial))))(*bt)
        exact_v = jax.jit(jax.vmap(vg(unsplit(p))))(*bt)
        res[name] = dict(identical=identical(got, ref), rel_err=max_rel(got, exact),
                         vmap_identical=identical(got_v, ref_v), vmap_rel_err=max_rel(got_v, exact_v),
                         eager_identical=identical(vg(split(p, dev))(p[2], p[3]), ref))
    res["stats"] = {k: v for k, v in dev.stats().items() if k != "sites"}
    res["site_chunk_rows"] = [s["chunk_rows"] for s in dev.stats()["sites"]]
    res["layout"] = [dev.layout(s).blocks_on(d) for s in list(dev._sites.values())[:1]
                     for d in range(n_devices)]

    # Stats of one value-and-gradient evaluation, counted exactly.
    with pb.DeviceExecutor() as ex:
        fn, data, rp, params, constrain = problems(jnp, jax, np)["random_effects"]
        f = jax.jit(jax.value_and_grad(split((fn, data, rp, params, constrain), ex), argnums=(0, 1)))
        for _ in range(3):
            jax.block_until_ready(f(rp, params))
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
