"""What ``pb.profile`` times: the variants of a model (every ``pb.factor`` site swapped for
plain NumPyro's sum or for ``reduce_sum`` on an executor), the executors profiled by
default, their timings, and the short NUTS run that checks the fastest inside the
sampler. How a variant is warmed up and timed is :mod:`.profile_timing`'s (shared with
the benchmark harness). Imports jax, numpy, numpyro and the core's public names.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro.infer import MCMC, NUTS
from numpyro.primitives import Messenger

import parallel_backend as pb
from parallel_backend.extend import cpu_count

from .profile_timing import (
    MAX_ROUNDS,
    ROUNDS,
    TIME_BUDGET,
    StampedKernel,
    medians,
    time_interleaved,
    warm_up,
)
from .replay import site_inputs, trace_model

# -- the variants -----------------------------------------------------------------------


class swap_factors(Messenger):
    """Replace the log-density of every ``pb.factor`` site.

    ``executor=None`` makes it plain NumPyro (``fn(data, *shared).sum()``, as
    ``numpyro.factor`` would add); an executor makes it ``reduce_sum`` on that
    executor, with the site's own ``grainsize`` and ``block_rows``. The site's
    original value is then unused, and XLA drops it from the compiled program.
    """

    def __init__(self, fn=None, executor=None):
        self.executor = executor
        super().__init__(fn)

    def process_message(self, msg):
        info = site_inputs(msg)
        if info is None:
            return
        fn, data, shared = info["fn"], info["data"], info["shared"]
        if self.executor is None:
            value = fn(data, *shared).sum()
        else:
            value = pb.reduce_sum(fn, data, *shared, executor=self.executor,
                                  grainsize=info["grainsize"], block_rows=info["block_rows"])
        msg["fn"] = numpyro.distributions.Unit(value)


def gradient_fn(model, model_args, model_kwargs, executor, chains: int = 1):
    """jit(value_and_grad(potential energy)) with the pb.factor sites swapped; under
    ``vmap`` over a leading axis of parameter sets when ``chains > 1``."""
    swapped = swap_factors(model, executor)

    def potential(z):
        return numpyro.infer.util.potential_energy(swapped, model_args, model_kwargs, z)

    grad = jax.value_and_grad(potential)
    return jax.jit(jax.vmap(grad) if chains > 1 else grad)


def identical(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(x, y, equal_nan=True)
        for x, y in zip(la, lb))


def initial_params(model, model_args, model_kwargs, chains: int = 1):
    """Unconstrained values of the latent sites, drawn as NUTS would initialise them;
    with ``chains > 1``, one draw per chain (seeds ``0 .. chains - 1``) stacked on a
    leading axis, as vectorized chains hold them."""

    def one(seed):
        trace = trace_model(model, model_args, model_kwargs, seed=seed,
                            substitute_fn=numpyro.infer.initialization.init_to_uniform)
        latent = {name: site["value"] for name, site in trace.items()
                  if site["type"] == "sample" and not site["is_observed"]
                  and not site["infer"].get("is_auxiliary")}
        return numpyro.infer.util.unconstrain_fn(model, model_args, model_kwargs, latent)

    if chains == 1:
        return one(0)
    return jax.tree.map(lambda *z: jnp.stack(z), *[one(k) for k in range(chains)])


# -- the executors to profile -----------------------------------------------------------


def _worker_counts(cores: int) -> list[int]:
    counts = sorted({1 << k for k in range(int(math.log2(max(cores, 1))) + 1)} | {cores})
    return [c for c in counts if c <= cores]


def _local_executors():
    """(label, executor) of every executor available here, in order."""
    out = [("SerialExecutor()", pb.SerialExecutor())]
    cores = cpu_count()
    for w in _worker_counts(cores):
        out.append((f"ThreadExecutor({w}, dispatch='host')", pb.ThreadExecutor(w, dispatch="host")))
    if cores > 1:
        out.append((f"ThreadExecutor({cores})", pb.ThreadExecutor(cores)))
    if len(jax.devices()) > 1:
        try:
            device_cls = pb.DeviceExecutor
        except (ImportError, AttributeError):  # the device plugin is not installed
            device_cls = None
        if device_cls is not None:
            n = len(jax.devices())
            out.append((f"DeviceExecutor({n} devices, dispatch='host')", device_cls(dispatch="host")))
            out.append((f"DeviceExecutor({n} devices)", device_cls()))
    return out


def _label(ex) -> str:
    return f"{type(ex).__name__}(workers={ex.workers}, dispatch={ex.dispatch!r})"


def executors_to_profile(executors):
    """[(label, executor, owned)]: what to profile, and whether we close it afterwards."""
    if executors is None:
        return [(label, ex, True) for label, ex in _local_executors()]
    if isinstance(executors, (str, pb.Executor)) or not hasattr(executors, "__iter__"):
        executors = [executors]
    items = executors.items() if isinstance(executors, dict) else [(None, e) for e in executors]
    out = []
    for label, e in items:
        if isinstance(e, str) and e == "local":
            out += [(lb, ex, True) for lb, ex in _local_executors()]
        elif isinstance(e, pb.Executor):
            out.append((label or _label(e), e, False))
        elif isinstance(e, str):
            out.append((label or e, pb.make_executor(e), True))
        elif type(e).__module__.startswith("distributed") and type(e).__name__ == "Client":
            ex = pb.DaskExecutor(client=e)
            out.append((label or f"DaskExecutor({ex.workers} workers)", ex, True))
        else:
            raise TypeError(
                "profile: executors must be None or a list of executors, executor names "
                f"(one of {pb.known_executors()}), 'local' (the local defaults) or "
                f"distributed.Client objects; got {type(e).__name__}")
    return out


# -- timing -----------------------------------------------------------------------------


def _snapshot(executor):
    s = executor.stats()
    return s["seconds_in_workers"], s["host_calls"], s["chunks"]


class Timings:
    """What :func:`_time` measured, per variant (in the order given).

    Attributes
    ----------
    outputs : list
        Each variant's first value and gradient.
    times : list of list of float
        Seconds of every timed round.
    rounds : int
    busy, host_calls, chunks : list
        Per executor variant, what its stats grew by during the timed rounds (``None``
        for plain NumPyro).
    """

    def __init__(self, outputs, times, rounds, before, after):
        self.outputs, self.times, self.rounds = outputs, times, rounds
        self.busy, self.host_calls, self.chunks = [], [], []
        for b, a in zip(before, after):
            grew = None if b is None else tuple(x - y for x, y in zip(a, b))
            self.busy.append(None if grew is None else grew[0])
            self.host_calls.append(None if grew is None else grew[1])
            self.chunks.append(None if grew is None else grew[2])

    @property
    def seconds(self) -> list:
        return medians(self.times)


def _time(variants, z) -> Timings:
    """Warm up each ``(f, executor)`` (compiled; its chunker settled), then time them all
    in interleaved rounds at the parameters ``z``, more rounds for fast models."""
    outputs = [warm_up(f, (z,), ex) for f, ex in variants]
    before = [_snapshot(ex) if ex is not None else None for _, ex in variants]
    times = time_interleaved([f for f, _ in variants], (z,), rounds=ROUNDS,
                             max_rounds=MAX_ROUNDS, budget=TIME_BUDGET)
    after = [_snapshot(ex) if ex is not None else None for _, ex in variants]
    return Timings(outputs, times, len(times[0]), before, after)


# -- inside NUTS ------------------------------------------------------------------------


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
