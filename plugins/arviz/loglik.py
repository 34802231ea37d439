"""Pointwise log-likelihoods of ``pb.factor`` sites at posterior draws.

This module owns the recomputation behind the ``log_likelihood`` group: the model
is replayed with posterior draws substituted (NumPyro handlers, ``vmap`` over a
chunk of draws), which gives each ``pb.factor`` site's ``data`` and ``shared`` per
draw; then ``fn`` is evaluated on row chunks of them, on an executor
(:meth:`Executor.map`). Leaves that do not depend on the draws are found from the
replay's jaxpr and kept once, not once per draw. It imports jax, numpy, numpyro,
the core's public names and the NumPyro plugin; never ArviZ.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from numpyro import handlers

import parallel_backend as pb
from parallel_backend.plugins.numpyro.factor import reduce_sum_sites

__all__ = ["pointwise_log_likelihood", "LogLikPlan", "default_chunks"]

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


def default_chunks(n_draws: int, n_rows: int) -> tuple[int, int]:
    """``(chunk_draws, chunk_rows)`` from the sizes alone (never from the executor,
    so every executor computes the same shapes, hence the same bits)."""
    chunk_draws = max(1, min(n_draws, REPLAY_VALUES // max(n_rows, 1)))
    chunk_rows = max(1, min(n_rows, TASK_VALUES // chunk_draws)) if n_rows else 1
    return chunk_draws, chunk_rows


def pointwise_log_likelihood(model, samples: dict, *model_args, executor=None, chunk_draws=None,
                             chunk_rows=None, observed=True, **model_kwargs):
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

    Returns
    -------
    values : dict
        ``{site: np.ndarray}`` of shape ``(D, N)`` for ``pb.factor`` sites and
        ``(D, *batch_shape)`` for observed sites.
    plans : dict
        ``{site: LogLikPlan}`` for the ``pb.factor`` sites.

    Examples
    --------
    >>> import jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import parallel_backend as pb
    >>> from parallel_backend.plugins.arviz.loglik import pointwise_log_likelihood
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
    first = jax.tree.map(lambda x: x[0], samples)

    static: dict = {}

    def replay(draw):
        """Every pb.factor site's flat (data, shared) leaves, and observed log_probs."""
        tr = handlers.trace(handlers.substitute(handlers.seed(model, rng_seed=0), data=draw))
        trace = tr.get_trace(*model_args, **model_kwargs)
        sites = reduce_sum_sites(trace)
        out = {}
        for name, info in sites.items():
            flat, treedef = jax.tree.flatten((info["data"], info["shared"]))
            n_data = len(jax.tree.leaves(info["data"]))
            static[name] = (info["fn"], treedef, n_data, info["executor"])
            out[name] = flat
        obs = {}
        if observed:
            obs = {name: site["fn"].log_prob(site["value"]) for name, site in trace.items()
                   if site["type"] == "sample" and site["is_observed"] and name not in sites
                   and not site.get("infer", {}).get("is_auxiliary", False)}
        return out, obs

    # Resolved before the private executor below becomes the innermost one.
    outer = pb.executors.resolve_executor() if executor is None else None
    # The replay's own reduce_sum results are unused; under jit they are dropped, and
    # a private serial executor keeps them out of the caller's executor and its stats.
    with contextlib.ExitStack() as owned, pb.SerialExecutor(count_calls=False) as scratch, \
            pb.use_executor(scratch):
        closed, shapes = jax.make_jaxpr(replay, return_shape=True)(first)
        depends = _depends_on_inputs(closed)
        flat_out, out_tree = jax.tree.flatten(shapes)
        dep_idx = [i for i, d in enumerate(depends) if d]
        # Concrete values of the leaves that do not depend on the draws.
        const_vals = jax.jit(lambda d: [x for x, dep in zip(jax.tree.leaves(replay(d)), depends)
                                        if not dep])(first)

        def replay_leaves(d):  # the model traced once, not once per leaf
            leaves = jax.tree.leaves(replay(d))
            return [leaves[i] for i in dep_idx]

        replay_dep = jax.jit(jax.vmap(replay_leaves))

        # Which flat output each site leaf is, and whether it varies by draw.
        names = list(static)
        slots = jax.tree.unflatten(out_tree, list(range(len(flat_out))))
        const_of = {}
        it = iter(const_vals)
        for i, d in enumerate(depends):
            if not d:
                const_of[i] = next(it)
        dep_pos = {i: k for k, i in enumerate(dep_idx)}

        sizes = {}
        for name in names:
            fn, treedef, n_data, _ = static[name]
            first_leaf = slots[0][name][0] if n_data else None
            if first_leaf is None:
                raise ValueError(f"pb.factor site {name!r} has no data leaves")
            sizes[name] = int(flat_out[first_leaf].shape[0])

        values = {}
        obs_slots = slots[1]
        for name, i in obs_slots.items():
            values[name] = np.empty((n_draws,) + tuple(flat_out[i].shape), flat_out[i].dtype)

        plans = {}
        chunks = {}
        for name in names:
            cd, cr = default_chunks(n_draws, sizes[name])
            cd = min(chunk_draws or cd, n_draws)
            cr = max(1, min(chunk_rows or cr, sizes[name]))
            chunks[name] = (cd, cr)
        # One replay chunk size for all sites: the smallest asked for.
        cd_all = min([c[0] for c in chunks.values()] or [min(chunk_draws or n_draws, n_draws)])
        tasks = {name: 0 for name in names}
        evaluators = {name: _Evaluator(static[name], slots[0][name], depends, sizes[name],
                                       chunks[name][1]) for name in names}
        site_executors = {}
        for name in names:
            given = executor if executor is not None else static[name][3]
            site_executors[name] = outer if given is None else pb.executors.resolve_executor(given)
            if isinstance(given, str):  # made here from a name: closed when done
                owned.enter_context(site_executors[name])

        for d0 in range(0, n_draws, cd_all):
            d1 = min(d0 + cd_all, n_draws)
            # Pad the last draw chunk to full size: one compiled shape, the same bits.
            idx = np.minimum(np.arange(d0, d0 + cd_all), n_draws - 1)
            chunk = jax.tree.map(lambda x: x[idx], samples)
            dep_vals = replay_dep(chunk)
            for name, i in obs_slots.items():
                v = dep_vals[dep_pos[i]] if depends[i] else jnp.broadcast_to(
                    const_of[i], (cd_all,) + tuple(const_of[i].shape))
                values[name][d0:d1] = np.asarray(v)[: d1 - d0]
            for name in names:
                ex = site_executors[name]
                site_leaves = [dep_vals[dep_pos[i]] if depends[i] else const_of[i]
                               for i in slots[0][name]]
                evaluate = evaluators[name]
                cr = chunks[name][1]
                starts = list(range(0, sizes[name], cr))
                parts = ex.map(_Task(evaluate, site_leaves), starts)
                tasks[name] += len(starts)
                if name not in values:
                    values[name] = np.empty((n_draws, sizes[name]), parts[0].dtype)
                for r0, part in zip(starts, parts):
                    r1 = min(r0 + cr, sizes[name])
                    values[name][d0:d1, r0:r1] = part[: d1 - d0, : r1 - r0]
            del dep_vals
        for name in names:
            plans[name] = LogLikPlan(cd_all, chunks[name][1], tasks[name])
    return values, plans


class _Evaluator:
    """``f(leaves, r0) -> (draws, chunk_rows)`` for one site; jitted on first use.

    Holds only the static description, so it pickles (cloudpickle) to processes in
    other executors; the compiled function is rebuilt there, never shipped.
    """

    def __init__(self, static, slot_ids, depends, n_rows, chunk_rows):
        self.fn, self.treedef, self.n_data, _ = static
        self.batched = tuple(bool(depends[i]) for i in slot_ids)
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
        if out.shape[-1] != self.chunk_rows:
            raise ValueError(f"log-likelihood: fn must return one value per row, shape "
                             f"({self.chunk_rows},); got {out.shape[1:]}")
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
