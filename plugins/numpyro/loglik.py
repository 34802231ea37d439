"""Pointwise log-likelihoods of ``pb.factor`` sites at posterior draws.

This module owns the recomputation behind the ``log_likelihood`` group: the model
is replayed with posterior draws substituted (NumPyro handlers, ``vmap`` over a
chunk of draws), which gives each ``pb.factor`` site's ``data`` and ``shared`` per
draw; then ``fn`` is evaluated on row chunks of them, on an executor
(:meth:`Executor.map`). Leaves that do not depend on the draws are found from the
replay's jaxpr and kept once, not once per draw. It imports jax, numpy, numpyro and
the core's public names; never ArviZ.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import parallel_backend as pb

from .display import Bar
from .replay import factor_sites, quietly, trace_model

__all__ = ["LogLikPlan", "default_chunks", "log_likelihood", "pointwise_log_likelihood"]

LOGGER = logging.getLogger("parallel_backend.log_likelihood")

#: Draws x rows evaluated per task, by default (float32: 1 MiB of output per task).
TASK_VALUES = 2 ** 18
#: Draws x rows of replayed, draw-dependent row data held at once, by default.
REPLAY_VALUES = 2 ** 22


class LogLikPlan(NamedTuple):
    """How the pointwise log-likelihood was computed.

    Attributes
    ----------
    chunk_draws : int
        Draws replayed (and evaluated) together.
    chunk_rows : int
        Rows per task; a task evaluates ``chunk_draws x chunk_rows`` values.
    tasks : int
        Tasks handed to the executors in all.
    """

    chunk_draws: int
    chunk_rows: int
    tasks: int


def log_likelihood(model: Callable[..., Any], samples: dict[str, Any], *model_args: Any,
                   executor: pb.Executor | str | None = None, progress_bar: bool = True,
                   **model_kwargs: Any) -> dict[str, np.ndarray]:
    """Pointwise log-likelihood of every ``pb.factor``, ``pb.observe`` and observed site.

    The counterpart of ``numpyro.infer.log_likelihood``, with its keys and shapes: the
    rows of ``pb.factor`` and ``pb.observe`` sites are evaluated in parallel chunks on
    the executor, other observed sites as NumPyro evaluates them.

    Parameters
    ----------
    model : callable
        The NumPyro model.
    samples : dict
        Draws ``{site: array}`` with leading axes ``(draws,)``, or ``(chains, draws)``
        (``mcmc.get_samples(group_by_chain=True)``): which, is read from the model's sites.
    *model_args, **model_kwargs
        The model's arguments (with the observations).
    executor : Executor or str, optional
        Who evaluates the rows; default: each site's own ``executor=``, else the
        innermost ``use_executor``, else the default executor.
    progress_bar : bool
        Show progress over the draws (on stderr: a bar in a terminal or Jupyter, else a
        line at each tenth; see ``plugins/numpyro/display.py``).

    Returns
    -------
    dict
        ``{site: np.ndarray}`` with the draws' axes (``(draws,)`` or ``(chains, draws)``),
        then ``(N,)`` per ``pb.factor`` site and the distribution's batch shape (the rows
        first) per ``pb.observe`` and other observed site: the values and shapes
        ``numpyro.infer.log_likelihood`` gives for the plain model.

    Examples
    --------
    >>> import jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import parallel_backend as pb
    >>> def model(x, y=None):
    ...     b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    ...     pb.observe("y", lambda x, b: dist.Normal(b * x, 1.0), x, b, obs=y)
    >>> x = jnp.linspace(-1.0, 1.0, 5)
    >>> pb.log_likelihood(model, {"b": jnp.zeros((2, 3))}, x, 0.5 * x)["y"].shape
    (2, 3, 5)
    """
    if not isinstance(samples, dict) or not samples:
        raise ValueError("log_likelihood: samples must be a non-empty dict {site: draws}, got "
                         f"{type(samples).__name__}")
    samples = {k: jnp.asarray(v) for k, v in samples.items()}
    lead = _batch_dims(model, samples, model_args, model_kwargs)
    shape = tuple(jnp.shape(next(iter(samples.values())))[:lead])
    flat = {k: jnp.reshape(v, (-1,) + tuple(jnp.shape(v)[lead:])) for k, v in samples.items()}
    n_draws = int(np.prod(shape, dtype=np.int64))
    with Bar(n_draws, "pb.log_likelihood", LOGGER, enabled=progress_bar, unit="draw") as bar:
        values, _ = pointwise_log_likelihood(model, flat, *model_args, executor=executor,
                                             progress=bar, **model_kwargs)
    return {k: np.reshape(v, shape + v.shape[1:]) for k, v in values.items()}


def _batch_dims(model, samples, model_args, model_kwargs) -> int:
    """How many leading axes of ``samples`` are draws (1, or 2 for chains and draws):
    a sample's dimensions beyond its site's in one trace of the model."""
    with quietly():
        trace = trace_model(model, model_args, model_kwargs)
    for name, value in samples.items():
        if name in trace:
            extra = jnp.ndim(value) - jnp.ndim(trace[name]["value"])
            if extra not in (1, 2):
                raise ValueError(f"log_likelihood: samples[{name!r}] has shape "
                                 f"{jnp.shape(value)} but the site has shape "
                                 f"{jnp.shape(trace[name]['value'])}: expected 1 (draws) or 2 "
                                 f"(chains, draws) leading axes")
            return int(extra)
    raise ValueError(f"log_likelihood: none of the samples {sorted(samples)} is a site of the "
                     f"model ({sorted(trace)})")


def default_chunks(n_draws: int, n_rows: int) -> tuple[int, int]:
    """``(chunk_draws, chunk_rows)`` from the sizes alone (never from the executor,
    so every executor computes the same shapes, hence the same bits)."""
    chunk_draws = max(1, min(n_draws, REPLAY_VALUES // max(n_rows, 1)))
    chunk_rows = max(1, min(n_rows, TASK_VALUES // chunk_draws)) if n_rows else 1
    return chunk_draws, chunk_rows


def pointwise_log_likelihood(model, samples: dict, *model_args, executor=None, chunk_draws=None,
                             chunk_rows=None, observed=True, progress=None, **model_kwargs):
    """Log-likelihood of every row of every ``pb.factor`` site, at every draw.

    Parameters
    ----------
    model : callable
        The NumPyro model that was sampled.
    samples : dict
        Posterior draws ``{site: array}``, every array with the same leading
        draw axis ``D`` (flatten chains first).
    *model_args, **model_kwargs
        The model's arguments, as given to ``MCMC.run``.
    executor : Executor or str, optional
        Who evaluates the row chunks; default: each site's own ``executor=``, else
        the innermost ``use_executor``, else the default executor. Executors made
        here from a name are closed before returning.
    chunk_draws, chunk_rows : int, optional
        Draws replayed together and rows per task. The defaults depend only on
        ``D`` and the site's rows; at most ``chunk_draws x N`` replayed row data
        and one ``chunk_draws x chunk_rows`` block per task exist at once,
        besides the result.
    observed : bool
        Also return ``log_prob`` of the model's ordinary observed sites.
    progress : optional
        Told each chunk of draws done (``progress.update(draws)``: a ``Bar`` of
        ``plugins/numpyro/display.py``).

    Returns
    -------
    values : dict
        ``{site: np.ndarray}`` of shape ``(D, N)`` for ``pb.factor`` sites and
        ``(D, *batch_shape)`` for ``pb.observe`` (the rows first) and observed sites.
    plans : dict
        ``{site: LogLikPlan}`` for the ``pb.factor`` sites.

    Examples
    --------
    >>> import jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import parallel_backend as pb
    >>> from parallel_backend.plugins.numpyro import pointwise_log_likelihood
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    ...     pb.factor("y", lambda y, mu: dist.Normal(mu, 1.0).log_prob(y), y, mu)
    >>> values, plans = pointwise_log_likelihood(model, {"mu": jnp.array([0.0, 1.0])},
    ...                                          jnp.array([0.0, 2.0, 4.0]))
    >>> values["y"].shape, plans["y"].chunk_rows
    ((2, 3), 3)
    """
    leaves = jax.tree.leaves(samples)
    if not leaves:
        raise ValueError("pointwise_log_likelihood: samples is empty; pass the posterior draws")
    n_draws = int(np.shape(leaves[0])[0])
    samples = jax.tree.map(jnp.asarray, samples)
    # Resolved before the private executor of the replay becomes the innermost one.
    outer = pb.executors.resolve_executor() if executor is None else None
    with contextlib.ExitStack() as owned, quietly():
        replay = _Replay(model, model_args, model_kwargs, observed,
                         jax.tree.map(lambda x: x[0], samples))
        names = replay.names
        chunks = {name: _chunk_sizes(n_draws, replay.sizes[name], chunk_draws, chunk_rows)
                  for name in names}
        # One replay chunk size for all sites: the smallest asked for.
        cd_all = min([c[0] for c in chunks.values()] or [min(chunk_draws or n_draws, n_draws)])
        evaluators = {name: replay.evaluator(name, chunks[name][1]) for name in names}
        executors = {name: _site_executor(executor, replay.static[name].executor, outer, owned)
                     for name in names}
        values = {name: np.empty((n_draws,) + shape, dtype)
                  for name, (shape, dtype) in replay.observed_shapes().items()}
        tasks = dict.fromkeys(names, 0)
        for d0 in range(0, n_draws, cd_all):
            d1 = min(d0 + cd_all, n_draws)
            # Pad the last draw chunk to full size: one compiled shape, the same bits.
            idx = np.minimum(np.arange(d0, d0 + cd_all), n_draws - 1)
            dep_vals = replay.draw_leaves(jax.tree.map(lambda x, i=idx: x[i], samples))
            for name, v in replay.observed_values(dep_vals, cd_all).items():
                values[name][d0:d1] = np.asarray(v)[: d1 - d0]
            for name in names:
                cr = chunks[name][1]
                starts = list(range(0, replay.sizes[name], cr))
                task = _Task(evaluators[name], replay.site_leaves(name, dep_vals))
                parts = executors[name].map(task, starts)
                tasks[name] += len(starts)
                if name not in values:  # the rows, then a pb.observe site's later batch dims
                    values[name] = np.empty((n_draws, replay.sizes[name]) + parts[0].shape[2:],
                                            parts[0].dtype)
                for r0, part in zip(starts, parts):
                    r1 = min(r0 + cr, replay.sizes[name])
                    values[name][d0:d1, r0:r1] = part[: d1 - d0, : r1 - r0]
            del dep_vals
            if progress is not None:
                progress.update(d1 - d0)
    plans = {name: LogLikPlan(cd_all, chunks[name][1], tasks[name]) for name in names}
    return values, plans


def _chunk_sizes(n_draws, n_rows, chunk_draws, chunk_rows) -> tuple[int, int]:
    cd, cr = default_chunks(n_draws, n_rows)
    return min(chunk_draws or cd, n_draws), max(1, min(chunk_rows or cr, n_rows))


def _site_executor(given, site_executor, outer, owned):
    """The executor that evaluates a site's rows: ``given``, else the site's own, else the
    caller's; one made here from a name is closed with ``owned``."""
    choice = given if given is not None else site_executor
    if choice is None:
        return outer
    ex = pb.executors.resolve_executor(choice)
    if isinstance(choice, str):
        owned.enter_context(ex)
    return ex


class _Static(NamedTuple):
    """A ``pb.factor`` site as the replay sees it."""

    fn: object
    treedef: object  # of (data, shared)
    n_data: int
    executor: object


class _Replay:
    """The model replayed at posterior draws: every ``pb.factor`` site's ``(data, shared)``
    leaves, and the ``log_prob`` of observed sites.

    The model is traced once (a jaxpr); the leaves that do not depend on the draws are
    computed once (``const``), the others for a chunk of draws at a time
    (:meth:`draw_leaves`, one jitted ``vmap`` of the model)."""

    def __init__(self, model, model_args, model_kwargs, observed, first_draw):
        self.static: dict = {}

        def replay(draw):
            trace = trace_model(model, model_args, model_kwargs, params=draw)
            sites = factor_sites(trace)
            out = {}
            for name, info in sites.items():
                flat, treedef = jax.tree.flatten((info["data"], info["shared"]))
                self.static[name] = _Static(info.get("values", info["fn"]), treedef,
                                            len(jax.tree.leaves(info["data"])), info["executor"])
                out[name] = flat
            obs = {}
            if observed:
                obs = {name: site["fn"].log_prob(site["value"]) for name, site in trace.items()
                       if site["type"] == "sample" and site["is_observed"] and name not in sites
                       and not site.get("infer", {}).get("is_auxiliary", False)}
            return out, obs

        closed, shapes = jax.make_jaxpr(replay, return_shape=True)(first_draw)
        self.depends = _depends_on_inputs(closed)
        self.flat_shapes, out_tree = jax.tree.flatten(shapes)
        self.slots = jax.tree.unflatten(out_tree, list(range(len(self.flat_shapes))))
        dep_idx = [i for i, d in enumerate(self.depends) if d]
        self.dep_pos = {i: k for k, i in enumerate(dep_idx)}
        consts = jax.jit(lambda d: [x for x, dep in zip(jax.tree.leaves(replay(d)), self.depends)
                                    if not dep])(first_draw)
        it = iter(consts)
        self.const = {i: next(it) for i, d in enumerate(self.depends) if not d}

        def dependent(d):  # the model traced once, not once per leaf
            leaves = jax.tree.leaves(replay(d))
            return [leaves[i] for i in dep_idx]

        self.draw_leaves = jax.jit(jax.vmap(dependent))
        self.names = list(self.static)
        self.sizes = {}
        for name in self.names:
            if not self.static[name].n_data:
                raise ValueError(f"pb.factor site {name!r} has no data leaves")
            self.sizes[name] = int(self.flat_shapes[self.slots[0][name][0]].shape[0])

    def _leaf(self, i, dep_vals, n_draws=None):
        if self.depends[i]:
            return dep_vals[self.dep_pos[i]]
        if n_draws is None:
            return self.const[i]
        return jnp.broadcast_to(self.const[i], (n_draws,) + tuple(self.const[i].shape))

    def site_leaves(self, name, dep_vals) -> list:
        """A site's flat ``(data, shared)`` leaves: per draw where they depend on it."""
        return [self._leaf(i, dep_vals) for i in self.slots[0][name]]

    def observed_shapes(self) -> dict:
        return {name: (tuple(self.flat_shapes[i].shape), self.flat_shapes[i].dtype)
                for name, i in self.slots[1].items()}

    def observed_values(self, dep_vals, n_draws) -> dict:
        return {name: self._leaf(i, dep_vals, n_draws) for name, i in self.slots[1].items()}

    def evaluator(self, name, chunk_rows):
        ids = self.slots[0][name]
        return _Evaluator(self.static[name], tuple(bool(self.depends[i]) for i in ids),
                          self.sizes[name], chunk_rows)


class _Evaluator:
    """``f(leaves, r0) -> (draws, chunk_rows)`` for one site; jitted on first use.

    Holds only the static description, so it pickles (cloudpickle) to processes in
    other executors; the compiled function is rebuilt there, never shipped.
    """

    def __init__(self, static, batched, n_rows, chunk_rows):
        self.fn, self.treedef, self.n_data = static.fn, static.treedef, static.n_data
        self.batched = tuple(batched)
        self.n_rows, self.chunk_rows = int(n_rows), int(chunk_rows)
        self._jitted = None

    def __getstate__(self):
        return {**self.__dict__, "_jitted": None}

    def _build(self):
        fn, treedef, n_data, batched = self.fn, self.treedef, self.n_data, self.batched
        n_rows, chunk_rows = self.n_rows, self.chunk_rows
        in_axes = [0 if b else None for b in batched]

        def per_draw(*leaves):
            data, shared = jax.tree.unflatten(treedef, list(leaves))
            return jnp.asarray(fn(data, *shared))

        @jax.jit
        def evaluate(leaves, r0):
            rows = jnp.minimum(r0 + jnp.arange(chunk_rows), n_rows - 1)
            cut = [jnp.take(x, rows, axis=1 if b else 0) if k < n_data else x
                   for k, (x, b) in enumerate(zip(leaves, batched))]
            if not any(batched):  # no leaf varies by draw: one row of values for every draw
                return per_draw(*cut)[None]
            return jax.vmap(per_draw, in_axes=in_axes)(*cut)

        return evaluate

    def __call__(self, leaves, r0):
        if self._jitted is None:
            self._jitted = self._build()
        out = self._jitted(leaves, np.int32(r0))
        if out.ndim < 2 or out.shape[1] != self.chunk_rows:
            raise ValueError(f"log-likelihood: fn must return one value per row, shape "
                             f"({self.chunk_rows},) (or, for pb.observe, its distribution's "
                             f"batch shape, the rows first); got {out.shape[1:]}")
        return out


class _Task:
    """``task(r0)``: one draw chunk x one row chunk, as a numpy array (picklable)."""

    def __init__(self, evaluate, leaves):
        self.evaluate = evaluate
        self.leaves = list(leaves)

    def __call__(self, r0):
        return np.asarray(self.evaluate(self.leaves, r0))


def _depends_on_inputs(closed) -> list[bool]:
    """For each output of a closed jaxpr: does it depend on the inputs?"""
    jaxpr = closed.jaxpr
    dep = {id(v) for v in jaxpr.invars}
    for eqn in jaxpr.eqns:
        if any(id(v) in dep for v in eqn.invars):
            dep.update(id(v) for v in eqn.outvars)
    return [id(v) in dep for v in jaxpr.outvars]
