"""The timing that ``pb.profile`` and the benchmark harness (``python -m benchmarks``) share.

This module owns how a variant is warmed up (compiled, its chunker settled), how several
variants are timed (interleaved rounds, so that drift on a shared machine hits them
alike, reported as medians), and how a sampler's run is timed without its compilation
and warmup (:class:`StampedKernel`, a host timestamp after every transition). What is
timed (a model's potential, a likelihood's value and gradient in a compiled loop, a NUTS
run) is the caller's. Imports jax, numpy and numpyro's ``MCMCKernel``; nothing of the
package, so the harness can import it before it has chosen the executors to time.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from numpyro.infer.mcmc import MCMCKernel

__all__ = [
    "MAX_ROUNDS",
    "MAX_WARMUP",
    "ROUNDS",
    "TIME_BUDGET",
    "StampedKernel",
    "call",
    "medians",
    "settled",
    "time_interleaved",
    "warm_up",
]

#: Timed rounds (each variant once per round). ``pb.profile`` adds rounds to fast
#: models, up to MAX_ROUNDS or until every variant has run TIME_BUDGET seconds in all,
#: so that a few slow calls (another process taking the cores) do not decide the median.
ROUNDS = 7
MAX_ROUNDS = 61
TIME_BUDGET = 0.25
#: Most warm-up calls spent waiting for a chunker to settle.
MAX_WARMUP = 30


def call(f, *args):
    """``f(*args)``, waited for: what one timed call is."""
    return jax.block_until_ready(f(*args))


def settled(executor) -> bool:
    """Whether every site ``executor`` evaluated has settled its chunk sizes (``True``
    for ``None``, plain NumPyro, and for sites with a fixed grainsize)."""
    if executor is None:
        return True
    return all(s.get("settled") is not False for s in executor.stats()["sites"])


def warm_up(f, args=(), executor=None, calls: int = 2, most: int = MAX_WARMUP):
    """Call ``f(*args)`` ``calls`` times (the first compiles), then until ``executor``'s
    chunker has settled, at most ``most`` calls in all. Returns the first output."""
    first = call(f, *args)
    done = 1
    while done < calls or (done < most and not settled(executor)):
        call(f, *args)
        done += 1
    return first


def time_interleaved(fns, args=(), rounds: int = ROUNDS, max_rounds: int | None = None,
                     budget: float = 0.0) -> list:
    """Seconds of every timed call of each ``f(*args)`` in ``fns``, in order.

    Every round calls each function once, in turn. After ``rounds`` rounds, rounds go on
    while some function has run less than ``budget`` seconds in all, up to
    ``max_rounds``. Warm the functions up first (:func:`warm_up`): the first call of a
    jitted function compiles.

    Examples
    --------
    >>> times = time_interleaved([lambda x: x + 1, lambda x: x * 2], (1.0,), rounds=3)
    >>> [len(t) for t in times]
    [3, 3]
    """
    max_rounds = rounds if max_rounds is None else max(rounds, max_rounds)
    times = [[] for _ in fns]
    done = 0
    while done < rounds or (done < max_rounds and min(sum(t) for t in times) < budget):
        for f, t in zip(fns, times):
            t0 = time.perf_counter()
            call(f, *args)
            t.append(time.perf_counter() - t0)
        done += 1
    return times


def medians(times) -> list:
    """The median of each list of seconds."""
    return [float(np.median(t)) for t in times]


class StampedKernel(MCMCKernel):
    """``kernel`` that records the host time at the end of every transition (NUTS or
    HMC: the state has ``i``, ``num_steps`` and ``potential_energy``), so that a run's
    sampling phase can be timed without its compilation and warmup."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.stamps = []  # (iteration, leapfrog steps, seconds)

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        return self.kernel.init(rng_key, num_warmup, init_params, model_args, model_kwargs)

    def sample(self, state, model_args, model_kwargs):
        new = self.kernel.sample(state, model_args, model_kwargs)
        # The potential energy depends on the whole transition: the callback runs after it.
        jax.debug.callback(self._stamp, new.i, new.num_steps, new.potential_energy)
        return new

    def _stamp(self, i, steps, _):
        # Vectorized chains: one evaluation carries every chain, as many as the longest needs.
        self.stamps.append((int(np.max(i)), int(np.max(steps)), time.perf_counter()))

    def after(self, num_warmup: int) -> tuple:
        """``(seconds, gradients, draws)`` of the transitions after the first
        ``num_warmup``, timed from the end of the last warmup transition. Under
        vectorized chains ``gradients`` counts evaluations (each carries every chain:
        per transition, the leapfrog steps of the longest chain). One chain's run (or
        vectorized chains): the stamps of several sequential chains interleave."""
        jax.effects_barrier()
        stamps = sorted(self.stamps)
        start = next(t for i, _, t in stamps if i == num_warmup)
        timed = [(steps, t) for i, steps, t in stamps if i > num_warmup]
        return timed[-1][1] - start, sum(steps for steps, _ in timed), len(timed)

    def postprocess_fn(self, model_args, model_kwargs):
        return self.kernel.postprocess_fn(model_args, model_kwargs)

    @property
    def sample_field(self):
        return self.kernel.sample_field

    @property
    def model(self):
        return self.kernel.model
