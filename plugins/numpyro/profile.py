"""``pb.profile``: time one gradient of a model's log-density in plain NumPyro and on
each executor, check the fastest inside a short NUTS run, and say which to use.

This module owns :func:`profile`, end to end: the variants it times (every ``pb.factor``
and ``pb.observe`` site swapped for plain NumPyro's sum or for ``reduce_sum`` on an
executor), the executors profiled by default, how a variant is warmed up and timed
(interleaved rounds, medians; shared with the benchmark harness, ``python -m
benchmarks``), the short NUTS run that checks the fastest inside the sampler, and the
report (:class:`ProfileReport`). Imports jax, numpy, numpyro and the core's public names;
the dask and device plugins only when asked for; pandas and matplotlib only for
``ProfileReport.to_dataframe`` and ``ProfileReport.plot``.

How a model is measured: the ``pb.factor`` and observed ``pb.observe`` sites are found
in a trace; the unconstrained initial parameters are drawn with ``init_to_uniform`` and
mapped by ``unconstrain_fn`` (no compilation, unlike ``initialize_model``); then, per
variant, ``jit(value_and_grad(potential_energy))`` of the model is built with every such
site's log-density replaced (``fn(data, *shared).sum()`` or the site's own distribution
for plain NumPyro, ``reduce_sum(..., executor=ex)`` otherwise). Each variant is
warmed up until it has compiled and its adaptive chunker has settled, and then all
variants are timed in interleaved rounds (so that a noisy neighbour hurts them
alike); the report gives medians.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro.infer import MCMC, NUTS
from numpyro.infer.mcmc import MCMCKernel
from numpyro.primitives import Messenger

import parallel_backend as pb
from parallel_backend.extend import cpu_count, largest, row_bytes, shares

from .display import Bar
from .replay import factor_sites, quietly, site_distribution, site_inputs, trace_model

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes

__all__ = [
    "MARGIN",
    "MAX_ROUNDS",
    "MAX_WARMUP",
    "ROUNDS",
    "TIME_BUDGET",
    "NutsTiming",
    "ProfileReport",
    "ProfileRow",
    "StampedKernel",
    "draw_evaluation",
    "gradient_fn",
    "initial_params",
    "medians",
    "nuts_ms_per_gradient",
    "profile",
    "swap_factors",
    "time_interleaved",
    "warm_up",
]

LOGGER = logging.getLogger("parallel_backend.profile")

#: An executor must beat plain NumPyro by this factor to be recommended.
MARGIN = 1.1


def profile(model: Callable[..., Any], *model_args: Any,
            executors: Sequence[Any] | Mapping[str, Any] | None = None, nuts: bool = True,
            chains: int = 1, progress_bar: bool = True,
            **model_kwargs: Any) -> ProfileReport:
    """Time one gradient of ``model``'s log-density in plain NumPyro and on each executor.

    Finds the model's ``pb.factor`` and observed ``pb.observe`` sites and builds, per
    variant, the jitted value and gradient of the potential energy (what NUTS evaluates
    once per leapfrog step): with every such site evaluated in plain NumPyro
    (``fn(data, *shared).sum()`` for ``pb.factor``, ``dist_fn(data, *shared)`` for
    ``pb.observe``), and with ``reduce_sum`` on each executor. Each
    variant is warmed up until compiled and until its chunker settled, then all
    are timed in interleaved rounds. Takes seconds for models whose gradient takes
    milliseconds; most of it is compilation.

    Parameters
    ----------
    model : callable
        A NumPyro model with at least one ``pb.factor`` site or observed ``pb.observe``
        site (``pb.observe(name, dist_fn, data, *shared, obs=y)``, the drop-in for
        ``numpyro.sample(name, dist, obs=y)`` in a plate over the rows).
    *model_args, **model_kwargs
        Passed to ``model``, as to ``pb.sample``.
    executors : list, optional
        What to profile besides plain NumPyro. ``None``: every executor available
        here: ``SerialExecutor()``, ``ThreadExecutor(w, dispatch="host")`` for
        ``w`` = 1, 2, 4, ... up to all cores, ``ThreadExecutor()`` (automatic
        dispatch), and ``DeviceExecutor(dispatch="host")`` and ``DeviceExecutor()``
        when JAX sees several devices. A list
        may hold executors (kept open), executor names, ``distributed.Client``
        objects (profiled as ``DaskExecutor(client=...)``) and ``"local"`` (the
        defaults above); a dict maps labels to such entries. Executors made here
        are closed before returning.
    nuts : bool
        When an executor beats plain NumPyro per isolated gradient, also run NUTS
        briefly (trees of at most 15 steps, a few seconds each) in plain NumPyro and on
        that executor, report milliseconds per gradient inside the sampler
        (``report.nuts``), and recommend the executor only if it wins there too.
    chains : int
        Vectorized chains to measure (``pb.sample``'s default ``chain_method``): each
        evaluation carries ``chains`` parameter sets under ``vmap`` (initial values
        drawn with seeds ``0 .. chains - 1``), and the NUTS runs sample that many
        vectorized chains. Vectorized chains can rank the executors differently from
        one chain (``docs/performance.md``): profile with the chains you will run.
    progress_bar : bool
        Show progress over the steps (compiling each variant, the timed rounds, the
        NUTS runs) on stderr: a bar in a terminal or Jupyter, else a line per step.

    Returns
    -------
    ProfileReport
        ``repr`` is a table; ``.rows``, ``.recommendation``, ``.best``,
        ``.to_dataframe()``, ``.plot()``.

    Raises
    ------
    ValueError
        The model has no ``pb.factor`` or observed ``pb.observe`` site (its likelihood
        is a plain ``numpyro.sample(..., obs=...)``: write it with ``pb.observe``).
    TypeError
        An entry of ``executors`` is not an executor, a name or a dask client.

    Examples
    --------
    >>> import jax.numpy as jnp, numpy as np, numpyro, numpyro.distributions as dist
    >>> import parallel_backend as pb
    >>> def loglik(y, mu):
    ...     return dist.Normal(mu, 1.0).log_prob(y)
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    ...     pb.factor("y", loglik, y, mu)
    >>> y = jnp.asarray(np.random.default_rng(0).normal(size=100))
    >>> report = pb.profile(model, y, executors=[pb.SerialExecutor()])
    >>> [r.executor for r in report.rows]
    ['plain NumPyro', "SerialExecutor(workers=1, dispatch='graph')"]
    >>> report.recommendation
    'stay with plain NumPyro: one block per pb.factor site (100 rows), nothing to split'
    """
    if isinstance(chains, bool) or not isinstance(chains, (int, np.integer)) or chains < 1:
        raise ValueError(f"profile: chains must be a positive int, got {chains!r}")
    targets = executors_to_profile(executors)
    try:
        steps = len(targets) + 2 + (2 if nuts else 0)
        with Bar(steps, "pb.profile", LOGGER, enabled=progress_bar, unit="step") as bar:
            return _profile(model, model_args, model_kwargs, targets, nuts, int(chains), bar)
    finally:
        for _, ex, owned in targets:
            if owned:
                ex.close()


def _profile(model, model_args, model_kwargs, targets, nuts=True, chains=1, bar=None):
    def step(what):
        if bar is not None:
            bar.update(1, what)

    with quietly():
        sites = factor_sites(trace_model(model, model_args, model_kwargs))
        if not sites:
            raise ValueError(
                "profile: the model has no pb.factor or pb.observe site, so there is nothing "
                "to parallelize. Write the likelihood with pb.observe(name, dist_fn, data, "
                "*params, obs=y), the drop-in for numpyro.sample(name, dist, obs=y) in a plate "
                "over the rows (dist_fn(data, *params) returns that distribution), or as "
                "pb.factor(name, fn, data, *params) with a fn that returns one log-density "
                "per row.")
        z = initial_params(model, model_args, model_kwargs, chains)

    variants = []
    with quietly() as scratch:
        for _, ex, _ in [(None, None, None)] + targets:
            # use_executor: the site's own reduce_sum (whose value the swap drops) is traced
            # on the same executor, not on the process-wide default.
            with pb.use_executor(ex or scratch):
                variants.append((gradient_fn(model, model_args, model_kwargs, ex, chains), ex))
            step(f"built {_label(ex) if ex is not None else 'plain NumPyro'}")
        timed = _time(variants, z)
        step("compiled and timed")
    labels = ["plain NumPyro"] + [label for label, _, _ in targets]
    rows = _rows(labels, [ex for _, ex in variants], timed)
    site_info = _site_info(sites, [ex for _, ex in variants[1:]])
    samples = {row.executor: list(t) for row, t in zip(rows, timed.times)}
    recommendation, best = _recommend(rows, site_info, samples)
    # The last host evaluations of each executor, chunk by chunk (from the timed rounds).
    timelines = {row.executor: ex.timeline.last() for row, (_, ex) in zip(rows[1:], variants[1:])
                 if ex.timeline.last()}
    in_nuts = None
    if nuts and best is not None:
        ex = variants[rows.index(best)][1]
        draws = nuts_iterations(rows[0].seconds)
        with quietly():
            plain = nuts_ms_per_gradient(model, model_args, model_kwargs, None, draws,
                                         chains=chains)
        step("NUTS in plain NumPyro")
        on_ex = nuts_ms_per_gradient(model, model_args, model_kwargs, ex, draws, chains=chains)
        step(f"NUTS on {best.executor}")
        in_nuts = {"plain NumPyro": plain, best.executor: on_ex}
        recommendation, best = _check_in_nuts(recommendation, best, plain, on_ex)
    return ProfileReport(rows, site_info, recommendation, best, samples, in_nuts, chains,
                         timelines)


def _check_in_nuts(recommendation, best, plain, on_ex):
    """The recommendation after the short NUTS runs: kept (with the figure) only when
    the executor beats plain NumPyro by the margin inside NUTS too."""
    ratio = plain.ms_per_gradient / on_ex.ms_per_gradient
    if ratio < MARGIN:
        return (f"stay with plain NumPyro: {best.executor} was {best.speedup:.2f}x faster per "
                f"isolated gradient evaluation but {ratio:.2f}x inside NUTS "
                f"({on_ex.ms_per_gradient:.2f} against {plain.ms_per_gradient:.2f} ms per "
                "gradient)"), None
    return f"{recommendation}, {ratio:.2f}x inside a short NUTS run", best


def _rows(labels, executors, timed) -> list:
    """A :class:`ProfileRow` per variant: speed, parallel efficiency, overhead, bits."""
    seconds = timed.seconds
    reference = next((timed.outputs[i] for i, ex in enumerate(executors)
                      if isinstance(ex, pb.SerialExecutor)), None)
    one_worker = next((seconds[i] for i, ex in enumerate(executors)
                       if isinstance(ex, pb.ThreadExecutor) and ex.workers == 1
                       and ex.dispatch == "host"), None)
    serial = next((seconds[i] for i, ex in enumerate(executors)
                   if isinstance(ex, pb.SerialExecutor) and ex.dispatch == "graph"), None)
    plain = seconds[0]
    rows = [ProfileRow(labels[0], "plain", 1, "-", plain, 1.0, None, None, (), None)]
    for i, ex in enumerate(executors[1:], start=1):
        stats = ex.stats()
        dispatch = "/".join(sorted({str(s["dispatch"]) for s in stats["sites"]})) or "-"
        overhead = efficiency = None
        if timed.host_calls[i] > 0:
            # Chunks per gradient evaluation bound how many workers could be busy at once.
            used = min(ex.workers, max(1, round(timed.chunks[i] / timed.rounds)))
            overhead = max(0.0, 1.0 - timed.busy[i] / timed.rounds / (used * seconds[i]))
            if one_worker is not None:
                efficiency = one_worker / (ex.workers * seconds[i])
        elif (serial is not None and ex.workers > 1 and dispatch == "graph"
              and ex.name != "thread" and ex.dispatch == "graph"):
            # A shard_map splits the in-graph blocks: its one-worker case is SerialExecutor.
            efficiency = serial / (ex.workers * seconds[i])
        same = None if reference is None else identical(timed.outputs[i], reference)
        rows.append(ProfileRow(labels[i], ex.name, ex.workers, dispatch, seconds[i],
                               plain / seconds[i], efficiency, overhead,
                               tuple(stats["chunk_rows"]), same))
    return rows


def _site_info(sites, executors) -> list:
    """Per ``pb.factor`` site: its rows and the block size the executors used."""
    used: dict[int, int] = {}
    for ex in executors:
        for s in ex.stats()["sites"]:
            used.setdefault(s["rows"], s["block_rows"])
    info = []
    for name, site in sites.items():
        leaves = jax.tree.leaves(site["data"])
        n = int(np.shape(leaves[0])[0]) if leaves else 0
        block_rows = used.get(n) or pb.plan_blocks(n, site["block_rows"],
                                                   row_bytes=row_bytes(leaves)).block_rows
        info.append({"name": name, "rows": n, "block_rows": block_rows,
                     "grainsize": site["grainsize"]})
    return info


def _recommend(rows, sites, samples):
    if sites and all(s["rows"] <= s["block_rows"] for s in sites):
        # One block per site: every executor runs plain NumPyro's work in one piece, so a
        # timed difference is noise (a "win" at 100 rows was seen under load).
        sizes = ", ".join(f"{s['rows']:,}" for s in sites)
        return (f"stay with plain NumPyro: one block per pb.factor site ({sizes} rows), "
                "nothing to split"), None
    candidates = [r for r in rows[1:] if r.identical is not False]
    best = min(candidates, key=lambda r: r.seconds, default=None)
    # Faster by the margin in the median and in the fastest round too: on a busy machine
    # plain NumPyro's XLA thread pool can lose most rounds to other processes, which
    # says nothing about the model.
    fastest = {label: min(t) for label, t in samples.items()}
    if best is None or best.speedup < MARGIN or (
            fastest[rows[0].executor] / fastest[best.executor] < MARGIN):
        return (f"stay with plain NumPyro: no executor was {MARGIN:.1f}x faster per gradient "
                "evaluation"), None
    grains = {s["grainsize"] for s in sites}
    if grains == {None}:
        if best.dispatch == "host" and best.chunk_rows:
            chunks = ", ".join(f"{c:,}" for c in best.chunk_rows)
            grain = f"grainsize=None (the chunker settled at {chunks} rows per chunk)"
        else:
            grain = "grainsize=None"
    else:
        grain = "the model's grainsize (" + ", ".join(str(g) for g in sorted(
            grains, key=lambda g: (g is None, g or 0))) + ")"
    text = (f"use {best.executor} with {grain}: {best.speedup:.2f}x faster than plain "
            "NumPyro per gradient evaluation")
    hosts = [r for r in candidates if r.dispatch == "host"]
    if best.dispatch == "graph" and hosts:
        # Where chunks on workers cannot beat the blocks in the caller's program, say so.
        host = min(hosts, key=lambda r: r.seconds)
        text += (f"; chunks on workers add nothing here ({host.executor}: "
                 f"{host.speedup:.2f}x), so the site stays in the graph")
    return text, best


# -- the variants -----------------------------------------------------------------------


class swap_factors(Messenger):
    """Replace the log-density of every ``pb.factor`` and ``pb.observe`` site.

    ``executor=None`` makes it plain NumPyro (``fn(data, *shared).sum()``, as
    ``numpyro.factor`` would add; the site's own distribution ``dist_fn(data, *shared)``
    for an observed site); an executor makes it ``reduce_sum`` (``reduce_rows`` for an
    observed site) on that executor, with the site's own ``grainsize`` and ``block_rows``.
    The site's original value is then unused, and XLA drops it from the compiled program.
    """

    def __init__(self, fn=None, executor=None):
        self.executor = executor
        super().__init__(fn)

    def process_message(self, msg):
        info = site_inputs(msg)
        if info is None:
            return
        if info["kind"] == "observe":
            site = site_distribution(msg["fn"])
            if self.executor is not None:
                msg["fn"] = site._replace(executor=self.executor)
            elif site.row_mask is None:
                msg["fn"] = site.full()
            else:
                msg["fn"] = site.full().mask(site.row_mask)
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


# -- timing -------------------------------------------------------------------------------


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
    times: list[list[float]] = [[] for _ in fns]
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


# -- the report -------------------------------------------------------------------------


class ProfileRow(NamedTuple):
    """One variant's measurement.

    Attributes
    ----------
    executor : str
        Label: ``"plain NumPyro"`` or the executor with its settings.
    kind : str
        ``"plain"`` or the executor's registered name (``"serial"``, ``"thread"``,
        ``"dask"``, ``"device"``).
    workers : int
        Tasks that can run at once (1 for plain NumPyro).
    dispatch : str
        Where the block loop ran: ``"graph"`` (inside the XLA program), ``"host"``
        (chunks on the executor's workers), ``"-"`` for plain NumPyro.
    seconds : float
        Median seconds of one value-and-gradient evaluation of the log-density.
    speedup : float
        Plain NumPyro's seconds divided by ``seconds``: above 1 is faster than plain.
    efficiency : float or None
        Parallel efficiency: seconds of the one-worker thread executor (host
        dispatch) divided by ``workers * seconds`` for executors whose chunks ran on
        workers; for a ``shard_map`` (``DeviceExecutor(dispatch="graph")``),
        ``SerialExecutor``'s seconds divided by
        ``workers * seconds``; ``None`` where it does not apply.
    overhead : float or None
        Share of the workers' time not spent evaluating chunks (task dispatch,
        callbacks, idle workers): ``1 - busy / (workers_used * seconds)``; ``None``
        where no chunk ran on workers (graph dispatch, plain NumPyro).
    chunk_rows : tuple of int
        Rows per chunk at which the executor ran (the settled chunker's choice, or
        the model's ``grainsize``); empty for plain NumPyro.
    identical : bool or None
        Whether value and gradient are bitwise equal to ``SerialExecutor``'s
        (``None`` for plain NumPyro, whose arithmetic is not blocked).
    """

    executor: str
    kind: str
    workers: int
    dispatch: str
    seconds: float
    speedup: float
    efficiency: float | None
    overhead: float | None
    chunk_rows: tuple
    identical: bool | None


class ProfileReport:
    """What :func:`parallel_backend.profile` measured, and its recommendation.

    ``repr(report)`` is a table; ``to_dataframe()`` and ``plot()`` need pandas and
    matplotlib.

    Attributes
    ----------
    rows : list of ProfileRow
        Plain NumPyro first, then each executor in the order profiled.
    sites : list of dict
        Per ``pb.factor`` or ``pb.observe`` site: ``name``, ``rows`` (N) and ``block_rows``.
    recommendation : str
        One sentence: the executor and grainsize to use, or to stay with plain
        NumPyro. An executor is recommended only when it beats plain NumPyro by
        ``MARGIN`` (10%) both in the median and in the fastest timed round.
    best : ProfileRow or None
        The recommended row; ``None`` when plain NumPyro is recommended.
    samples : dict
        Per variant (by ``executor`` label): the seconds of every timed round, in
        order, whose median is the row's ``seconds``.
    nuts : dict or None
        When an executor beat plain NumPyro per isolated gradient: the short NUTS runs
        that checked it, ``{label: NutsTiming}`` for plain NumPyro and that executor
        (milliseconds per gradient inside the sampler); ``None`` otherwise.
    chains : int
        Vectorized chains each evaluation carried (``profile(..., chains=)``).
    timelines : dict
        Per executor whose chunks ran on its workers (by ``executor`` label): its last
        host evaluations (``timeline.EvaluationSpan``: when each
        chunk started and ended, on which worker), from the timed rounds. See
        :meth:`ProfileReport.losses` and :meth:`ProfileReport.plot_timeline`.
    """

    def __init__(self, rows, sites, recommendation, best, samples=None, nuts=None, chains=1,
                 timelines=None):
        self.timelines = dict(timelines or {})
        self.rows = list(rows)
        self.chains = chains
        self.nuts = nuts
        self.samples = samples or {}
        self.sites = list(sites)
        self.recommendation = recommendation
        self.best = best

    def to_dataframe(self) -> pd.DataFrame:
        """The rows as a ``pandas.DataFrame``, one row per variant."""
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError('ProfileReport.to_dataframe needs pandas: '
                              'pip install "parallel-backend[plot]"') from e
        return pd.DataFrame([r._asdict() for r in self.rows])

    def _row(self, executor: str | None) -> ProfileRow:
        """The row of ``executor`` (a label), or the recommended one, or the fastest."""
        if executor is not None:
            for r in self.rows:
                if r.executor == executor:
                    return r
            raise ValueError(f"ProfileReport: no executor {executor!r}; profiled: "
                             f"{[r.executor for r in self.rows]}")
        candidates = [r for r in self.rows if r.kind != "plain"]
        if not candidates:
            raise ValueError("ProfileReport: no executor was profiled")
        with_timeline = [r for r in candidates if r.executor in self.timelines]
        if self.best is not None and (self.best in with_timeline or not with_timeline):
            return self.best
        return min(with_timeline or candidates, key=lambda r: r.seconds)

    def losses(self, executor: str | None = None) -> dict[str, float] | None:
        """Where ``executor``'s workers' time went per gradient, as shares of
        ``workers * seconds``: ``chunks`` (their own compute) and each of
        ``timeline.LOSSES`` (dispatch, load imbalance, assembly,
        idle workers, the caller's program around the callback), over its timed host
        evaluations; ``None`` where its chunks did not run on workers (the graph).
        ``executor``: a row's label (default: the recommended one, else the fastest
        with chunks on workers)."""
        row = self._row(executor)
        spans = self.timelines.get(row.executor)
        if not spans:
            return None
        # The caller's program is known where one site makes each gradient.
        per = row.seconds if len(self.sites) == 1 and self.chains == 1 else None
        return shares(spans, row.workers, per)

    def plot_timeline(self, executor: str | None = None, ax: Axes | None = None) -> Axes:
        """One gradient evaluation of ``executor`` (default as in :meth:`ProfileReport.losses`) as a
        timeline: a row per worker with its chunks as bars (the gaps are idle time), the
        host callback's span, and the caller's own program after it (to the measured
        seconds per gradient); a graph-route evaluation is one bar. The title names
        the largest loss. Returns the axes (needs matplotlib)."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError('ProfileReport.plot_timeline needs matplotlib: '
                              'pip install "parallel-backend[plot]"') from e
        row = self._row(executor)
        spans = self.timelines.get(row.executor)
        if not spans:
            ms = 1e3
            if ax is None:
                _, ax = plt.subplots(figsize=(8, 1.6))
            ax.barh(["XLA program"], [row.seconds * ms], left=0, color="tab:gray")
            ax.set_xlabel("ms")
            ax.set_title(f"{row.executor}: every block inside the caller's program "
                         f"(one evaluation, {row.seconds * ms:.2f} ms)", fontsize=9)
            return ax
        return draw_evaluation(spans[-1], row.executor, row.workers, row.seconds,
                               self.losses(row.executor), ax)

    def plot(self, ax: Axes | None = None) -> Axes:
        """A bar chart of speedup over plain NumPyro per variant; returns the axes."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError('ProfileReport.plot needs matplotlib: '
                              'pip install "parallel-backend[plot]"') from e
        if ax is None:
            _, ax = plt.subplots(figsize=(7, 0.45 * len(self.rows) + 1.2))
        labels = [r.executor for r in self.rows]
        speedups = [r.speedup for r in self.rows]
        colors = ["tab:gray" if r.kind == "plain" else
                  "tab:green" if r is self.best else "tab:blue" for r in self.rows]
        ax.barh(labels, speedups, color=colors)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.invert_yaxis()
        ax.set_xlabel("speedup over plain NumPyro (per gradient evaluation)")
        ax.set_title(self.recommendation, fontsize=9, wrap=True)
        return ax

    def __repr__(self) -> str:
        head = ["executor", "workers", "dispatch", "ms/grad", "speedup", "efficiency",
                "overhead", "chunk rows", "= serial"]
        table = [head]
        for r in self.rows:
            table.append([
                r.executor, str(r.workers), r.dispatch, f"{r.seconds * 1e3:.3f}",
                f"{r.speedup:.2f}x", _fmt(r.efficiency, "{:.2f}"), _fmt(r.overhead, "{:.0%}"),
                ",".join(f"{c:,}" for c in r.chunk_rows) or "-",
                {None: "-", True: "yes", False: "NO"}[r.identical]])
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                           for i, (c, w) in enumerate(zip(row, widths))) for row in table]
        lines.insert(1, "  ".join("-" * w for w in widths))
        sites = "; ".join(f"{s['name']}: {s['rows']:,} rows in blocks of {s['block_rows']:,}"
                          for s in self.sites)
        nuts = []
        if self.nuts:
            nuts = ["inside NUTS (" + ", ".join(
                f"{label}: {t.ms_per_gradient:.3f} ms/grad over {t.gradients} gradients"
                for label, t in self.nuts.items()) + ")"]
        what = ("one value-and-gradient evaluation" if self.chains == 1 else
                f"one value-and-gradient evaluation of {self.chains} vectorized chains")
        where = []
        if self.timelines:
            row = self._row(None)
            share = self.losses(row.executor)
            if share is not None:
                worst, part = largest(share)
                where = [(f"where {row.executor}'s workers' time went: chunks "
                          f"{share['chunks']:.0%}, largest loss {worst} {part:.0%} "
                          f"(report.losses(), report.plot_timeline())")]
        return "\n".join([f"pb.profile: {what} ({sites})", *lines, *where,
                          *nuts, f"recommendation: {self.recommendation}"])

    __str__ = __repr__


def draw_evaluation(span, label: str, workers: int, seconds: float, share: dict | None,
                    ax: Axes | None = None) -> Axes:
    """One host evaluation (an :class:`~parallel_backend.timeline.EvaluationSpan`) as
    :meth:`ProfileReport.plot_timeline` draws it: the callback's span and, to ``seconds``
    per gradient, the caller's program after it; a row per worker with its chunks as bars;
    the title names ``share``'s largest loss (:func:`~parallel_backend.timeline.shares`).
    ``label`` names the executor, ``workers`` its worker count. Needs matplotlib."""
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    ms = 1e3
    names = sorted({c.worker for c in span.chunks})
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.45 * (len(names) + 2) + 1.2))
    labels = ["callback"] + [_worker_label(w) for w in names]
    ax.barh(labels[0], span.wall * ms, left=0, color="tab:gray")
    if seconds > span.wall:
        ax.barh(labels[0], (seconds - span.wall) * ms, left=span.wall * ms,
                color="white", edgecolor="tab:gray", hatch="//", label="the caller's program")
    for row, worker in enumerate(names, start=1):
        for c in span.chunks:
            if c.worker == worker:
                ax.barh(labels[row], (c.end - c.start) * ms, left=(c.start - span.start) * ms,
                        color="tab:blue", edgecolor="white")
                ax.annotate(f"{c.first}+{c.blocks}",
                            ((c.start - span.start + (c.end - c.start) / 2) * ms, row),
                            ha="center", va="center", fontsize=7, color="white")
    ax.invert_yaxis()
    ax.set_xlabel("ms from the callback's start (blocks as first+count)")
    share = share or {}
    worst, part = largest(share)
    ax.set_title(f"{label}: chunks {share.get('chunks', 0):.0%} of {workers} workers' time; "
                 f"largest loss: {worst} ({part:.0%})", fontsize=9)
    if isinstance(ax.figure, Figure):
        ax.figure.tight_layout()
    return ax


def _worker_label(worker: str) -> str:
    """A timeline row's name: a thread of the pool (``"thread 0"``) or a dask worker's
    address as it is."""
    name = worker.split("/")[-1]
    for prefix in ("parallel_backend-tasks-", "parallel_backend-"):
        if name.startswith(prefix):
            return "thread " + name[len(prefix):]
    return worker if worker.startswith(("tcp://", "tls://", "inproc://")) else name


def _fmt(x, spec):
    return "-" if x is None else spec.format(x)
