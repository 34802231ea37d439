"""Two NumPyro fits in one process never hang.

NumPyro's initialisation runs the model eagerly, and with it ``reduce_sum`` on the host
route: the host callback's program in flight on XLA's CPU device, the callback waiting
for chunk programs that the executor's threads launch on the same device. Evaluated op
by op, the ops after the callback queued behind it, and after a first fit (a 200,000-row
mixture) the chunk programs of the second (an HMM) waited for a slot of the device's
in-flight limit forever, on jax 0.10 and 0.12, where the first fit's draws were still
in flight (not read before the second fit). The fits run in a subprocess with a
timeout, so that a hang fails the test instead of the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent("""
    import jax, numpy as np, numpyro, numpyro.distributions as dist
    from numpyro.infer import MCMC, NUTS
    import parallel_backend as pb
    from benchmarks.likelihoods import LIKELIHOODS

    fits = []
    for name in ("mixture_200k", "hmm_1k"):
        make, n = LIKELIHOODS[name]
        fn, data, params = make(n, np.float32)

        def model():
            ps = [numpyro.sample(f"p{i}", dist.Normal(0, 1).expand(np.shape(p))
                                 .to_event(np.ndim(p))) for i, p in enumerate(params)]
            pb.factor("ll", fn, data, *ps, executor=ex)

        with pb.ThreadExecutor() as ex:
            mcmc = MCMC(NUTS(model, max_tree_depth=4), num_warmup=20, num_samples=20,
                        progress_bar=False)
            mcmc.run(jax.random.PRNGKey(0))  # its draws not waited for: still in flight
            print(name, ex.stats()["sites"][0]["dispatch"], flush=True)
        fits.append(mcmc)

    for mcmc in fits:
        assert np.all(np.isfinite(np.asarray(mcmc.get_samples()["p0"])))
""")


@pytest.mark.slow
def test_a_second_fit_in_the_same_process_finishes():
    # A hang raises subprocess.TimeoutExpired (the child is killed): it never waits.
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line.split()[0] for line in done.stdout.splitlines()] == ["mixture_200k", "hmm_1k"]



QUEUED = textwrap.dedent("""
    import distributed, jax, jax.numpy as jnp, numpy as np
    import parallel_backend as pb
    from parallel_backend import guards
    from benchmarks.likelihoods import LIKELIHOODS

    guards.STALL_SECONDS, guards.PROBE_SECONDS = float(STALL), 2.0
    fn, data, params = LIKELIHOODS["hmm_1k"][0](1_000, np.float32)
    x = jnp.ones(1_000_000, np.float32)
    slow = jax.jit(lambda x: jax.lax.fori_loop(0, 100, lambda i, x: jnp.sin(x) + 0.5, x)
                   .sum() * 0.0)
    with EXECUTOR as ex:
        f = jax.jit(lambda *q: pb.reduce_sum(fn, data, *q, executor=ex))
        want = np.float32(f(*params))
        for _ in range(40):
            want = want + np.float32(1)
        v = f(*[q + slow(x) for q in params])  # its parameters still being computed
        outs = []
        for _ in range(40):  # queued on v before it is ready: every slot of XLA's device
            v = v + 1.0
            outs.append(v)
        try:
            print("value", float(outs[-1]) == float(want), flush=True)
        except Exception as e:
            # the caller's queue, not fn's failure: never a ChunkError blaming fn
            print("error", "InFlightLimit" in str(e) and "raised by fn" not in str(e),
                  flush=True)
        v = f(*params)  # the executor and the device still work afterwards
        print("after", float(v) + 40 == float(want), flush=True)
""")


@pytest.mark.parametrize("executor", [
    'pb.ThreadExecutor(2, dispatch="host")', 'pb.SerialExecutor(dispatch="host")',
    # workers in this process: they share XLA's device with the caller
    ('pb.DaskExecutor(client=distributed.Client(processes=False, n_workers=1, '
     'threads_per_worker=2, dashboard_address=None), dispatch="host")')],
    ids=["thread", "serial", "dask-in-process"])
@pytest.mark.slow
def test_operations_queued_on_a_pending_result_end_in_an_error_not_a_hang(executor):
    """The caller's program waits for its parameters; 40 operations queued on its result
    take every place XLA's CPU device keeps for programs in flight, so the chunk programs
    its host callback waits for could never start (it hung here on every executor; a
    dask cluster's worker threads in this process share XLA's device). The callback sees
    that no chunk finishes and no program can start, and raises ``InFlightLimit`` (not a
    ``ChunkError`` that blames ``fn``, from a dask worker either): an
    error within seconds, the right value where XLA admitted the chunks after all, and
    the executor works afterwards."""
    script = "STALL = 0.5\n" + QUEUED.replace("EXECUTOR", executor)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT,
                          capture_output=True, text=True, timeout=150, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.split()
    assert lines in (["error", "True", "after", "True"], ["value", "True", "after", "True"]), \
        done.stdout + done.stderr[-3000:]


STALLED = textwrap.dedent("""
    import time
    import distributed, jax, jax.numpy as jnp, numpy as np
    import parallel_backend as pb

    def block(x):  # the chunk holding the last rows does not come back
        if np.any(x >= 990.0):
            time.sleep(3600)
        return x

    def fn(x, m):
        y = jax.pure_callback(block, jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                              vmap_method="expand_dims")
        return -(y - m) ** 2

    x = jnp.arange(1000.0)
    ex = EXECUTOR
    f = jax.jit(jax.value_and_grad(lambda m: pb.reduce_sum(fn, x, m, executor=ex,
                                                           block_rows=100)))
    t0 = time.perf_counter()
    try:
        f(1.0)
        print("value", flush=True)
    except Exception as e:  # under jit the callback's error arrives wrapped: its text
        text = str(e)
        print("stalled", "EvaluationStalled" in text and "1000) still running" in text
              and "stall_timeout" in text, round(time.perf_counter() - t0), flush=True)
    g = jax.jit(lambda m: pb.reduce_sum(lambda x, m: -(x - m) ** 2, x, m, executor=ex))
    print("after", float(g(1.0)) == float(-((x - 1.0) ** 2).sum()), flush=True)
    t0 = time.perf_counter()
    ex.close()
    print("closed", round(time.perf_counter() - t0), flush=True)
""")


@pytest.mark.parametrize("executor", [
    'pb.ThreadExecutor(2, dispatch="host", stall_timeout=3)',
    'pb.SerialExecutor(dispatch="host", stall_timeout=3)',
    ('pb.DaskExecutor(client=distributed.Client(processes=False, n_workers=1, '
     'threads_per_worker=2, dashboard_address=None), dispatch="host", stall_timeout=3)')],
    ids=["thread", "serial", "dask-in-process"])
def test_a_stalled_chunk_ends_in_a_named_error_and_nothing_waits_for_it(executor):
    """A chunk whose program never returns (here a callback in ``fn`` that waits forever):
    the evaluation raises ``EvaluationStalled`` naming the chunk's rows and the setting,
    within the executor's ``stall_timeout`` (3 s here; 300 by default) and the stall
    probe's seconds; the executor evaluates other sites afterwards on new threads,
    ``close()`` returns at once and the interpreter exits, the stuck thread left
    behind."""
    script = STALLED.replace("EXECUTOR", executor)
    t0 = __import__("time").perf_counter()
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.split("\n")
    stalled = lines[0].split()
    assert stalled[:2] == ["stalled", "True"] and int(stalled[2]) <= 30, done.stdout
    assert lines[1] == "after True" and lines[2].split()[0] == "closed", done.stdout
    assert int(lines[2].split()[1]) <= 15, done.stdout
    assert __import__("time").perf_counter() - t0 < 110
