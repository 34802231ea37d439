"""``pb.profile``: time one gradient of a model's log-density in plain NumPyro and on
each executor, check the fastest inside a short NUTS run, and say which to use.

This module owns :func:`profile` and its recommendation; the variants it times (every
``pb.factor`` site swapped for plain NumPyro's sum or for ``reduce_sum`` on an
executor), the executors profiled by default and the short NUTS run are
:mod:`.profile_variants`'s, the report :mod:`.profile_report`'s, and how a variant is
warmed up and timed :mod:`.profile_timing`'s, which the benchmark harness
(``python -m benchmarks``) shares. Imports jax, numpy, numpyro and the core's public
names; the dask and device plugins only when asked for; pandas and matplotlib only for
``ProfileReport.to_dataframe`` and ``ProfileReport.plot``.

How a model is measured: the ``pb.factor`` sites are found in a trace; the
unconstrained initial parameters are drawn with ``init_to_uniform`` and mapped by
``unconstrain_fn`` (no compilation, unlike ``initialize_model``);
then, per variant, ``jit(value_and_grad(potential_energy))`` of the model is built
with every ``pb.factor`` site's log-density replaced (``fn(data, *shared).sum()``
for plain NumPyro, ``reduce_sum(..., executor=ex)`` otherwise). Each variant is
warmed up until it has compiled and its adaptive chunker has settled, and then all
variants are timed in interleaved rounds (so that a noisy neighbour hurts them
alike); the report gives medians.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

import parallel_backend as pb
from parallel_backend.extend import row_bytes

from .profile_report import ProfileReport, ProfileRow
from .profile_variants import (
    NutsTiming,
    _time,
    executors_to_profile,
    gradient_fn,
    identical,
    initial_params,
    nuts_iterations,
    nuts_ms_per_gradient,
    swap_factors,
)
from .replay import factor_sites, quietly, trace_model

__all__ = [
    "MARGIN",
    "NutsTiming",
    "ProfileReport",
    "ProfileRow",
    "gradient_fn",
    "initial_params",
    "nuts_ms_per_gradient",
    "profile",
    "swap_factors",
]

#: An executor must beat plain NumPyro by this factor to be recommended.
MARGIN = 1.1


def profile(model: Callable[..., Any], *model_args: Any,
            executors: Sequence[Any] | Mapping[str, Any] | None = None, nuts: bool = True,
            chains: int = 1, **model_kwargs: Any) -> ProfileReport:
    """Time one gradient of ``model``'s log-density in plain NumPyro and on each executor.

    Finds the model's ``pb.factor`` sites and builds, per variant, the jitted value
    and gradient of the potential energy (what NUTS evaluates once per leapfrog
    step): with every ``pb.factor`` site summed in plain NumPyro
    (``fn(data, *shared).sum()``), and with ``reduce_sum`` on each executor. Each
    variant is warmed up until compiled and until its chunker settled, then all
    are timed in interleaved rounds. Takes seconds for models whose gradient takes
    milliseconds; most of it is compilation.

    Parameters
    ----------
    model : callable
        A NumPyro model with at least one ``pb.factor`` site.
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

    Returns
    -------
    ProfileReport
        ``repr`` is a table; ``.rows``, ``.recommendation``, ``.best``,
        ``.to_dataframe()``, ``.plot()``.

    Raises
    ------
    ValueError
        The model has no ``pb.factor`` site.
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
        return _profile(model, model_args, model_kwargs, targets, nuts, int(chains))
    finally:
        for _, ex, owned in targets:
            if owned:
                ex.close()


def _profile(model, model_args, model_kwargs, targets, nuts=True, chains=1):
    with quietly():
        sites = factor_sites(trace_model(model, model_args, model_kwargs))
        if not sites:
            raise ValueError(
                "profile: the model has no pb.factor site, so there is nothing to parallelize. "
                "Write the likelihood as pb.factor(name, fn, data, *params) with a pointwise "
                "fn (instead of numpyro.sample(name, dist, obs=data)).")
        z = initial_params(model, model_args, model_kwargs, chains)

    variants = []
    with quietly() as scratch:
        for _, ex, _ in [(None, None, None)] + targets:
            # use_executor: the site's own reduce_sum (whose value the swap drops) is traced
            # on the same executor, not on the process-wide default.
            with pb.use_executor(ex or scratch):
                variants.append((gradient_fn(model, model_args, model_kwargs, ex, chains), ex))
        timed = _time(variants, z)
    labels = ["plain NumPyro"] + [label for label, _, _ in targets]
    rows = _rows(labels, [ex for _, ex in variants], timed)
    site_info = _site_info(sites, [ex for _, ex in variants[1:]])
    samples = {row.executor: list(t) for row, t in zip(rows, timed.times)}
    recommendation, best = _recommend(rows, site_info, samples)
    in_nuts = None
    if nuts and best is not None:
        ex = variants[rows.index(best)][1]
        draws = nuts_iterations(rows[0].seconds)
        with quietly():
            plain = nuts_ms_per_gradient(model, model_args, model_kwargs, None, draws,
                                         chains=chains)
        on_ex = nuts_ms_per_gradient(model, model_args, model_kwargs, ex, draws, chains=chains)
        in_nuts = {"plain NumPyro": plain, best.executor: on_ex}
        recommendation, best = _check_in_nuts(recommendation, best, plain, on_ex)
    return ProfileReport(rows, site_info, recommendation, best, samples, in_nuts, chains)


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
    used = {}
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
    return (f"use {best.executor} with {grain}: {best.speedup:.2f}x faster than plain "
            "NumPyro per gradient evaluation"), best
