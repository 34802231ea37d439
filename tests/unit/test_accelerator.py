"""On an accelerator (JAX's default backend a GPU or a TPU) a site's graph route evaluates
plain NumPyro's program, and ``dispatch="auto"`` keeps every site in the graph: one
kernel over every row, which a block loop or a callback to host threads only slows.

No accelerator is needed: the backend JAX reports is what decides, so these tests
report a GPU and check the programs on the CPU (what they compute, and that every
executor computes the same bits). What the rule gains on a real GPU is measured in
docs/performance.md."""

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
def test_the_graph_is_plains_program_on_every_executor(gpu, fn):
    x = DATA[fn]
    params = (jnp.float32(0.2), jnp.float32(-0.1))
    want = jax.jit(jax.value_and_grad(lambda m, s: fn(x, m, s).sum(), argnums=(0, 1)))(*params)
    results = []
    for make in (pb.SerialExecutor, lambda: pb.ThreadExecutor(2)):
        with make() as ex:
            f = jax.jit(jax.value_and_grad(lambda m, s: pb.reduce_sum(fn, x, m, s, executor=ex),
                                           argnums=(0, 1)))
            results.append(f(*params))
            (site,) = ex.stats()["sites"]
            assert site["dispatch"] == "graph", site  # auto: no host threads (the CPU's
            assert ex.stats()["host_calls"] == 0      # rule takes them for the looped site)
            (state,) = ex.sites()
            assert not state.traces, state.traces  # no block program: plain's
    for got in results:
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=2e-5)
    leaves = [np.asarray(v) for v in jax.tree.leaves(results[0])]
    assert all(np.array_equal(a, b) for a, b in zip(leaves, jax.tree.leaves(results[1])))


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
