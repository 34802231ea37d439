"""Probe: a jitted host-route ``reduce_sum`` with operations queued on its result before
it is ready (XLA's CPU in-flight limit). One case per process:

    python -m benchmarks.inflight LIKELIHOOD QUEUED [--workers W] [--no-fit] [--sync]
        [--pending] [--limit SECONDS]

``--no-fit`` skips the NUTS fit (its draws left unread) made first; ``--pending`` makes
the call while its parameters are still being computed, so that its program waits and
the queued operations take XLA's places first (a hang before ``InFlightLimit``, on 2
cores); ``--sync`` turns off asynchronous dispatch. Prints the phase times, or, past
``--limit``, every thread's stack and exits 1."""

from __future__ import annotations

import argparse
import faulthandler
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("likelihood")
    p.add_argument("queued", type=int)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--no-fit", action="store_true")
    p.add_argument("--sync", action="store_true")
    p.add_argument("--pending", action="store_true",
                   help="the parameters still being computed when the call is made")
    p.add_argument("--limit", type=float, default=40.0)
    a = p.parse_args(argv)
    import jax
    if a.sync:
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    import numpy as np
    import numpyro
    import numpyro.distributions as dist
    from numpyro.infer import MCMC, NUTS

    import parallel_backend as pb
    from benchmarks.likelihoods import LIKELIHOODS

    make, n = LIKELIHOODS[a.likelihood]
    fn, data, params = make(n, np.float32)
    ex = pb.ThreadExecutor(a.workers)
    t0 = time.perf_counter()
    if not a.no_fit:
        def model():
            ps = [numpyro.sample(f"p{i}", dist.Normal(0, 1).expand(np.shape(q))
                                 .to_event(np.ndim(q))) for i, q in enumerate(params)]
            pb.factor("ll", fn, data, *ps, executor=ex)

        mcmc = MCMC(NUTS(model, max_tree_depth=4), num_warmup=20, num_samples=20,
                    progress_bar=False)
        mcmc.run(jax.random.PRNGKey(0))  # the draws not read: still in flight
    t1 = time.perf_counter()
    faulthandler.dump_traceback_later(a.limit, exit=True)  # exit status 1
    f = jax.jit(lambda *q: pb.reduce_sum(fn, data, *q, executor=ex))
    args = params
    if a.pending:  # each parameter waits for a slow product: the call's program goes async
        import jax.numpy as jnp
        x = jnp.ones(1_000_000, np.float32)
        slow = jax.jit(lambda x: jax.lax.fori_loop(0, 100, lambda i, x: jnp.sin(x) + 0.5, x)
                       .sum() * 0.0)(x)
        args = [q + slow.astype(np.asarray(q).dtype) for q in params]
    v = f(*args)
    outs = []
    for _ in range(a.queued):
        v = v + 1.0
        outs.append(v)
    t2 = time.perf_counter()
    print(f"{a.likelihood} queued={a.queued} workers={ex.workers} fit={not a.no_fit} "
          f"sync={a.sync} pending={a.pending}: fit {t1 - t0:.1f} s, queued in {t2 - t1:.2f} s", flush=True)
    r = float(outs[-1]) if outs else float(v)
    faulthandler.cancel_dump_traceback_later()
    print(f"  done {time.perf_counter() - t2:.2f} s after, value {r:.3f}, route "
          f"{ex.stats()['sites'][-1]['dispatch']}", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        sys.stdout.flush()
