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


def test_a_second_fit_in_the_same_process_finishes():
    # A hang raises subprocess.TimeoutExpired (the child is killed): it never waits.
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line.split()[0] for line in done.stdout.splitlines()] == ["mixture_200k", "hmm_1k"]

