"""``pb.profile``: time one gradient of a model's log-density in plain NumPyro and on
each executor, and say which to use.

This module owns :func:`profile`, its report (:class:`ProfileReport`, rows of
:class:`ProfileRow`) and the handler that swaps the ``pb.factor`` sites of a model
for plain ``numpyro.factor`` sites or for ``reduce_sum`` on a given executor. It
imports numpyro, jax and the core's public names; pandas, matplotlib and the dask
and device plugins only when asked for.

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

import math
import os
import time
from typing import NamedTuple

import jax
import numpy as np
import numpyro
from numpyro.primitives import Messenger

import parallel_backend as pb
from parallel_backend.extend import row_bytes

from .factor import INFER_KEY, reduce_sum_sites

__all__ = ["profile", "profile_command", "ProfileReport", "ProfileRow"]

#: An executor must beat plain NumPyro by this factor to be recommended.
MARGIN = 1.1
#: Timed rounds (each variant once per round); the report gives medians. Fast models
#: get more rounds, up to MAX_ROUNDS or until every variant has run TIME_BUDGET
#: seconds in all, so that a few slow calls (another process taking the cores) do
#: not decide the median.
ROUNDS = 7
MAX_ROUNDS = 61
TIME_BUDGET = 0.25
#: Most warm-up calls spent waiting for a chunker to settle.
MAX_WARMUP = 30


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
        Per ``pb.factor`` site: ``name``, ``rows`` (N) and ``block_rows``.
    recommendation : str
        One sentence: the executor and grainsize to use, or to stay with plain
        NumPyro. An executor is recommended only when it beats plain NumPyro by
        ``MARGIN`` (10%) both in the median and in the fastest timed round.
    best : ProfileRow or None
        The recommended row; ``None`` when plain NumPyro is recommended.
    samples : dict
        Per variant (by ``executor`` label): the seconds of every timed round, in
        order, whose median is the row's ``seconds``.
    """

    def __init__(self, rows, sites, recommendation, best, samples=None):
        self.rows = list(rows)
        self.samples = samples or {}
        self.sites = list(sites)
        self.recommendation = recommendation
        self.best = best

    def to_dataframe(self):
        """The rows as a ``pandas.DataFrame``, one row per variant."""
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError('ProfileReport.to_dataframe needs pandas: '
                              'pip install "parallel-backend[plot]"') from e
        return pd.DataFrame([r._asdict() for r in self.rows])

    def plot(self, ax=None):
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
        return "\n".join([f"pb.profile: one value-and-gradient evaluation ({sites})", *lines,
                          f"recommendation: {self.recommendation}"])

    __str__ = __repr__


def _fmt(x, spec):
    return "-" if x is None else spec.format(x)


# -- swapping the pb.factor sites -------------------------------------------------------


class _swap_factors(Messenger):
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
        info = (msg.get("infer") or {}).get(INFER_KEY)
        if msg["type"] != "sample" or info is None:
            return
        fn, data, shared = info["fn"], info["data"], info["shared"]
        if self.executor is None:
            value = fn(data, *shared).sum()
        else:
            value = pb.reduce_sum(fn, data, *shared, executor=self.executor,
                                  grainsize=info["grainsize"], block_rows=info["block_rows"])
        msg["fn"] = numpyro.distributions.Unit(value)


# -- the executors to profile ------------------------------------------------------------


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _worker_counts(cores: int) -> list[int]:
    counts = sorted({1 << k for k in range(int(math.log2(max(cores, 1))) + 1)} | {cores})
    return [c for c in counts if c <= cores]


def _local_executors():
    """(label, executor) of every executor available here, in order."""
    out = [("SerialExecutor()", pb.SerialExecutor())]
    cores = _cores()
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


def _executors(executors):
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


# -- timing -------------------------------------------------------------------------------


def _gradient_fn(model, model_args, model_kwargs, executor):
    """jit(value_and_grad(potential energy)) with the pb.factor sites swapped."""
    swapped = _swap_factors(model, executor)

    def potential(z):
        return numpyro.infer.util.potential_energy(swapped, model_args, model_kwargs, z)

    return jax.jit(jax.value_and_grad(potential))


def _call(f, z):
    return jax.block_until_ready(f(z))


def _settled(executor) -> bool:
    return all(s["settled"] is not False for s in executor.stats()["sites"])


def _snapshot(executor):
    s = executor.stats()
    return s["seconds_in_workers"], s["host_calls"], s["chunks"]


def _identical(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(x, y, equal_nan=True)
        for x, y in zip(la, lb))


def _initial_params(model, model_args, model_kwargs):
    """Unconstrained values of the latent sites, drawn as NUTS would initialise them."""
    handlers = numpyro.handlers
    init = numpyro.infer.initialization.init_to_uniform
    seeded = handlers.substitute(handlers.seed(model, 0), substitute_fn=init)
    trace = handlers.trace(seeded).get_trace(*model_args, **model_kwargs)
    latent = {name: site["value"] for name, site in trace.items()
              if site["type"] == "sample" and not site["is_observed"]
              and not site["infer"].get("is_auxiliary")}
    return numpyro.infer.util.unconstrain_fn(model, model_args, model_kwargs, latent)


def profile(model, *model_args, executors=None, **model_kwargs):
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
    'stay with plain NumPyro: no executor was 1.1x faster per gradient evaluation'
    """
    targets = _executors(executors)
    scratch = pb.SerialExecutor(count_calls=False)
    try:
        return _profile(model, model_args, model_kwargs, targets, scratch)
    finally:
        scratch.close()
        for _, ex, owned in targets:
            if owned:
                ex.close()


def _profile(model, model_args, model_kwargs, targets, scratch):
    handlers = numpyro.handlers
    with pb.use_executor(scratch):
        trace = handlers.trace(handlers.seed(model, 0)).get_trace(*model_args, **model_kwargs)
        sites = reduce_sum_sites(trace)
        if not sites:
            raise ValueError(
                "profile: the model has no pb.factor site, so there is nothing to parallelize. "
                "Write the likelihood as pb.factor(name, fn, data, *params) with a pointwise "
                "fn (instead of numpyro.sample(name, dist, obs=data)).")
        z = _initial_params(model, model_args, model_kwargs)

    variants = [("plain NumPyro", None, scratch)] + [(label, ex, ex) for label, ex, _ in targets]
    fns, outputs = [], []
    for label, ex, ctx in variants:
        # use_executor: the site's own reduce_sum (whose value the swap drops) is traced on
        # the same executor, not on the process-wide default.
        with pb.use_executor(ctx):
            f = _gradient_fn(model, model_args, model_kwargs, ex)
            out = _call(f, z)
            _call(f, z)
            for _ in range(MAX_WARMUP):
                if ex is None or _settled(ex):
                    break
                _call(f, z)
        fns.append(f)
        outputs.append(out)

    before = [_snapshot(ex) if ex is not None else None for _, ex, _ in variants]
    times = [[] for _ in variants]
    rounds = 0
    while rounds < ROUNDS or (rounds < MAX_ROUNDS
                              and min(sum(t) for t in times) < TIME_BUDGET):
        for i, f in enumerate(fns):
            t0 = time.perf_counter()
            _call(f, z)
            times[i].append(time.perf_counter() - t0)
        rounds += 1
    after = [_snapshot(ex) if ex is not None else None for _, ex, _ in variants]
    seconds = [float(np.median(t)) for t in times]

    reference = next((outputs[i] for i, (_, ex, _) in enumerate(variants)
                      if isinstance(ex, pb.SerialExecutor)), None)
    one_worker = next((seconds[i] for i, (_, ex, _) in enumerate(variants)
                       if isinstance(ex, pb.ThreadExecutor) and ex.workers == 1
                       and ex.dispatch == "host"), None)
    serial = next((seconds[i] for i, (_, ex, _) in enumerate(variants)
                   if isinstance(ex, pb.SerialExecutor) and ex.dispatch == "graph"), None)
    plain = seconds[0]
    rows = [ProfileRow("plain NumPyro", "plain", 1, "-", plain, 1.0, None, None, (), None)]
    for i, (label, ex, _) in enumerate(variants[1:], start=1):
        stats = ex.stats()
        site_stats = stats["sites"]
        dispatch = "/".join(sorted({str(s["dispatch"]) for s in site_stats})) or "-"
        busy = after[i][0] - before[i][0]
        host_calls = after[i][1] - before[i][1]
        chunks = after[i][2] - before[i][2]
        overhead = None
        if host_calls > 0:
            # Chunks per gradient evaluation bound how many workers could be busy at once.
            used = min(ex.workers, max(1, round(chunks / rounds)))
            overhead = max(0.0, 1.0 - busy / rounds / (used * seconds[i]))
        efficiency = None
        if one_worker is not None and host_calls > 0:
            efficiency = one_worker / (ex.workers * seconds[i])
        elif (serial is not None and ex.workers > 1 and dispatch == "graph"
              and ex.name != "thread" and ex.dispatch == "graph"):
            # A shard_map splits the in-graph loop: its one-worker case is SerialExecutor.
            efficiency = serial / (ex.workers * seconds[i])
        identical = None if reference is None else _identical(outputs[i], reference)
        rows.append(ProfileRow(label, ex.name, ex.workers, dispatch, seconds[i],
                               plain / seconds[i], efficiency, overhead,
                               tuple(stats["chunk_rows"]), identical))

    site_info = []
    for name, info in sites.items():
        leaves = jax.tree.leaves(info["data"])
        n = int(np.shape(leaves[0])[0]) if leaves else 0
        plan = pb.plan_blocks(n, info["block_rows"], row_bytes=row_bytes(leaves))
        site_info.append(dict(name=name, rows=n, block_rows=plan.block_rows,
                              grainsize=info["grainsize"]))
    samples = {row.executor: list(t) for row, t in zip(rows, times)}
    recommendation, best = _recommend(rows, site_info, samples)
    return ProfileReport(rows, site_info, recommendation, best, samples)


def _recommend(rows, sites, samples):
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


def profile_command(script=None, n_rows: int = 200_000, float64: bool = False) -> ProfileReport:
    """What ``parallel-backend profile [script.py]`` runs.

    Without ``script``, profiles the demo model (a negative-binomial regression on
    ``n_rows`` synthetic rows). With ``script``, runs that file (not as
    ``__main__``) and profiles its ``model`` with its ``model_args`` (a tuple,
    default empty) and ``model_kwargs`` (a dict, default empty).
    """
    import runpy

    if float64:
        jax.config.update("jax_enable_x64", True)
    if script is None:
        from parallel_backend.demo import make_data, parallel_model

        X, y, _ = make_data(n_rows, dtype=np.float64 if float64 else np.float32)
        return profile(parallel_model, X, y)
    if not os.path.isfile(script):
        raise FileNotFoundError(f"profile: no such script {script!r}")
    namespace = runpy.run_path(script, run_name="__parallel_backend_profile__")
    model = namespace.get("model")
    if not callable(model):
        raise ValueError(f"profile: {script} must define a callable `model` (a NumPyro model "
                         "with pb.factor sites), and `model_args` / `model_kwargs` for its "
                         "arguments")
    args = namespace.get("model_args", ())
    kwargs = namespace.get("model_kwargs", {})
    if not isinstance(args, (tuple, list)) or not isinstance(kwargs, dict):
        raise TypeError(f"profile: in {script}, model_args must be a tuple and model_kwargs a "
                        f"dict, got {type(args).__name__} and {type(kwargs).__name__}")
    return profile(model, *args, **kwargs)
