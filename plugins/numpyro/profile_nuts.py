"""Milliseconds per gradient inside a short NUTS run, for ``pb.profile``.

One isolated value-and-gradient may not predict NUTS: inside the sampler the
log-density is one step of a larger compiled program (a tree of leapfrog steps, a
batch of chains), and an executor's host callback and XLA's own threads meet
different neighbours there. So ``pb.profile`` also runs NUTS briefly, in plain
NumPyro and on the executor it would recommend, and recommends from both figures.
This module owns that run. Imports jax, numpy, numpyro and the core's public names.
"""

from __future__ import annotations

import contextlib
import time
from typing import NamedTuple

import jax
import numpy as np
from numpyro.infer import MCMC, NUTS
from numpyro.infer.mcmc import MCMCKernel

import parallel_backend as pb

from .profile_timing import swap_factors

__all__ = ["NutsTiming", "StampedKernel", "nuts_ms_per_gradient", "nuts_iterations",
           "MAX_TREE_DEPTH"]

#: Trees of at most 2**4 - 1 = 15 leapfrog steps: the run measures the cost of a
#: gradient inside the sampler, not how well NUTS adapts.
MAX_TREE_DEPTH = 4
#: Seconds the timed part of one run should take (about), and its bounds in draws.
SECONDS = 3.0
MIN_DRAWS, MAX_DRAWS = 10, 50


class NutsTiming(NamedTuple):
    """One short NUTS run.

    Attributes
    ----------
    ms_per_gradient : float
        Wall time of the timed draws (compiled by then) over their leapfrog steps.
    draws : int
        Draws timed (after as many draws that compiled and warmed up).
    gradients : int
        Leapfrog steps (gradient evaluations) in the timed draws.
    """

    ms_per_gradient: float
    draws: int
    gradients: int


def nuts_iterations(seconds_per_gradient: float) -> int:
    """Draws to time so that the run takes about :data:`SECONDS` at trees of half the
    maximum size."""
    steps = 2 ** (MAX_TREE_DEPTH - 1)
    n = int(SECONDS / max(seconds_per_gradient * steps, 1e-9))
    return max(MIN_DRAWS, min(MAX_DRAWS, n))


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
        per transition, the leapfrog steps of the longest chain)."""
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


def nuts_ms_per_gradient(model, model_args, model_kwargs, executor, draws: int,
                         seed: int = 0, chains: int = 1) -> NutsTiming:
    """Milliseconds per gradient of ``model`` in a short NUTS run, with every
    ``pb.factor`` site summed by plain NumPyro (``executor=None``) or by ``reduce_sum``
    on ``executor``.

    One run of ``draws`` warmup iterations (compilation, step-size adaptation) and
    ``draws`` draws; the draws are timed from the end of the last warmup iteration,
    with a host timestamp after every transition, so compilation is not counted.
    ``chains > 1``: that many vectorized chains, each gradient evaluation carrying all
    of them.
    """
    kernel = StampedKernel(NUTS(swap_factors(model, executor), max_tree_depth=MAX_TREE_DEPTH))
    mcmc = MCMC(kernel, num_warmup=draws, num_samples=draws, num_chains=chains,
                chain_method="vectorized", progress_bar=False)
    # The site's own reduce_sum (whose value the swap drops) is traced on the same
    # executor, not on the process-wide default (plain NumPyro: the caller's choice).
    with pb.use_executor(executor) if executor is not None else contextlib.nullcontext():
        mcmc.run(jax.random.PRNGKey(seed), *model_args, **model_kwargs)
        jax.block_until_ready(mcmc.last_state)
    seconds, gradients, timed = kernel.after(draws)
    return NutsTiming(seconds / max(gradients, 1) * 1e3, timed, gradients)
