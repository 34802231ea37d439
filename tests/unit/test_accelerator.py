"""On an accelerator (JAX's default backend a GPU or a TPU) a site's graph route evaluates
plain NumPyro's program, and ``dispatch="auto"`` keeps every site in the graph: one
kernel over every row, which a block loop or a callback to host threads only slows.

No accelerator is needed: the backend JAX reports is what decides, so these tests
report a GPU and check the programs on the CPU (what they compute: on one device, plain's
bits on every executor). What the rule gains on a real GPU is measured in
docs/performance.md."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallel_backend as pb


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


def loglik(x, mu, log_sigma):
    return -0.5 * ((x - mu) / jnp.exp(log_sigma)) ** 2 - log_sigma


def scanned(x, mu, log_sigma):  # a scan per row: looped, on the host threads on a CPU
    def step(c, xt):
        c = 0.5 * c + mu
        return c, -0.5 * ((xt - c) / jnp.exp(log_sigma)) ** 2 - log_sigma

    return jax.lax.scan(step, jnp.zeros(x.shape[0]), x.T)[1].sum(0)


DATA = {loglik: np.random.default_rng(0).normal(size=20_000).astype(np.float32),
        scanned: np.random.default_rng(1).normal(size=(4_000, 8)).astype(np.float32)}


@pytest.mark.parametrize("fn", [loglik, scanned], ids=["batched", "looped"])
def test_the_graph_is_plains_program_on_every_executor(gpu, fn, assert_identical):
    """Value and gradient on each executor are the bits of plain's own jitted program:
    the site evaluates that program, not blocks of it summed in block order (as the host
    route does, whose last bits differ)."""
    x = DATA[fn]
    params = (jnp.float32(0.2), jnp.float32(-0.1))
    want = jax.jit(jax.value_and_grad(lambda m, s: fn(x, m, s).sum(), argnums=(0, 1)))(*params)
    for make in (pb.SerialExecutor, lambda: pb.ThreadExecutor(2)):
        with make() as ex:
            f = jax.jit(jax.value_and_grad(lambda m, s: pb.reduce_sum(fn, x, m, s, executor=ex),
                                           argnums=(0, 1)))
            got = f(*params)
            (site,) = ex.stats()["sites"]
            assert site["dispatch"] == "graph", site  # auto: no host threads (the CPU's
            assert ex.stats()["host_calls"] == 0      # rule takes them for the looped site)
            (state,) = ex.sites()
            assert not state.traces, state.traces  # no block program: plain's
        assert_identical(got, want)


def test_vectorized_chains_and_second_derivatives_on_the_plain_program(gpu):
    x = DATA[loglik]
    sets = jnp.stack([jnp.linspace(-0.2, 0.2, 3), jnp.linspace(-0.1, 0.1, 3)], 1)
    plain = lambda p: loglik(x, p[0], p[1]).sum()
    with pb.SerialExecutor() as ex:
        f = lambda p: pb.reduce_sum(loglik, x, p[0], p[1], executor=ex)
        np.testing.assert_allclose(jax.jit(jax.vmap(jax.grad(f)))(sets),
                                   jax.vmap(jax.grad(plain))(sets), rtol=2e-5)
        np.testing.assert_allclose(jax.jit(jax.hessian(f))(sets[0]),
                                   jax.hessian(plain)(sets[0]), rtol=2e-5)


def test_the_rule_reads_the_backend(monkeypatch):
    from parallel_backend.blocks import accelerator

    assert not accelerator()  # these tests run on the CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert accelerator()


# -- several accelerators: the rows shared, each device running plain's program -----------

#: Set in the subprocess that has two forced host CPU devices (the count is fixed when JAX
#: starts).
FORCED = "PARALLEL_BACKEND_TEST_FORCED_DEVICES"


def per_row(d, mu, log_sigma):  # a per-row parameter u beside the data x
    x, u = d
    return loglik(x - u, mu, log_sigma)


def test_rows_shared_over_devices_each_runs_plains_program(gpu):
    """On several accelerators ``DeviceExecutor()`` (``auto``) splits the rows into one
    contiguous share per device, and each device runs plain's program on its share in one
    ``shard_map``: no block program, no callback; ``dispatch="graph"`` does the same.
    Values and derivatives, eager and jitted, are plain's to rounding (each device sums
    its own rows)."""
    import warnings

    if not os.environ.get(FORCED):
        pytest.skip(f"runs in the subprocess of test_on_two_forced_devices ({FORCED})")
    assert jax.device_count() == 2
    rng = np.random.default_rng(2)
    n = 10_007  # 11 blocks of 1,000 (the last of 7 rows): 6 blocks on one device, 5 on the other
    x = rng.normal(size=n).astype(np.float32)
    u = jnp.asarray(rng.normal(scale=0.1, size=n).astype(np.float32))
    params = (jnp.float32(0.3), u, jnp.float32(-0.2))

    def plain(mu, u, s):
        return loglik(x - u, mu, s).sum()

    want = jax.jit(jax.value_and_grad(plain, argnums=(0, 1, 2)))(*params)
    for dispatch in ("auto", "graph"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # forced CPU devices reported as GPUs: it warns
            ex = pb.DeviceExecutor(dispatch=dispatch)
        with ex:
            def site(mu, u, s, ex=ex):
                return pb.reduce_sum(per_row, (x, u), mu, s, executor=ex, block_rows=1_000)

            got = jax.jit(jax.value_and_grad(site, argnums=(0, 1, 2)))(*params)
            eager = jax.value_and_grad(site, argnums=(0, 1, 2))(*params)
            (state,) = ex.sites()
            assert not state.traces, state.traces  # no block program: plain's
            (entry,) = ex.stats()["sites"]
            assert entry["dispatch"] == "graph" and entry["devices"] == 2, entry
            assert entry["chunk_rows"] == [6_000] and ex.stats()["host_calls"] == 0
            for result in (got, eager):
                for a, b in zip(jax.tree.leaves(result), jax.tree.leaves(want)):
                    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)

            sets = jnp.stack([jnp.linspace(-0.2, 0.2, 3), jnp.linspace(-0.1, 0.1, 3)], 1)
            np.testing.assert_allclose(
                jax.jit(jax.vmap(jax.grad(lambda p: site(p[0], u, p[1]))))(sets),
                jax.vmap(jax.grad(lambda p: plain(p[0], u, p[1])))(sets), rtol=2e-5)
            np.testing.assert_allclose(
                jax.jit(jax.hessian(lambda p: site(p[0], u, p[1])))(sets[0]),
                jax.hessian(lambda p: plain(p[0], u, p[1]))(sets[0]), rtol=2e-4)
        assert "device.rows" not in state.placed  # closed: the shares' buffers freed


@pytest.mark.slow  # a subprocess that compiles the test above again
def test_on_two_forced_devices():
    """The test above in a subprocess with two forced host CPU devices."""
    import re

    import helpers

    if os.environ.get(FORCED):
        pytest.skip("this is that subprocess")
    proc = helpers.pytest_on_forced_devices(__file__, "shared_over_devices", FORCED, 2)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(r"\b1 passed", proc.stdout), proc.stdout[-2000:]
