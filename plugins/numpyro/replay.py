"""Replaying a NumPyro model for bookkeeping, and the names the NumPyro and ArviZ plugins share.

This module owns :func:`quietly` (``reduce_sum`` calls traced inside go to a private
executor that counts nothing, so a model replayed to find its sites or shapes never
shows in the caller's executor or its stats), :func:`trace_model` (a seeded, and
optionally substituted, trace of a model), :class:`FactorUnit` (the distribution of a
``pb.factor`` site, which carries its inputs), :func:`factor_sites` (the ``pb.factor``
sites of a trace) and :data:`HMC_EXTRA_FIELDS`. Imports numpyro and the core's public
names.

A site's inputs (``fn``, ``data``, ``shared``...) travel in its distribution, a pytree
whose arrays are leaves, not in the site's ``infer`` dict: NumPyro and ArviZ keep
``infer`` as static metadata (``PytreeTrace``), where arrays and tracers break
``jax.eval_shape`` and ``scan``.
"""

from __future__ import annotations

import contextlib

from numpyro import handlers
from numpyro.distributions import Unit

import parallel_backend as pb

__all__ = ["quietly", "trace_model", "factor_sites", "site_inputs", "FactorUnit",
           "HMC_EXTRA_FIELDS", "INFER_KEY"]

#: Key of a factor site's ``infer`` dict that marks it as a ``pb.factor`` site (a flag).
INFER_KEY = "parallel_backend"
#: Fields of an HMC/NUTS state that ``pb.sample`` collects and ``pb.to_arviz`` reads
#: into ``sample_stats``.
HMC_EXTRA_FIELDS = ("potential_energy", "energy", "num_steps", "accept_prob",
                    "adapt_state.step_size", "diverging")


@contextlib.contextmanager
def quietly():
    """A block in which ``reduce_sum`` calls traced run on a private ``SerialExecutor``
    that counts nothing; yields it."""
    with pb.SerialExecutor(count_calls=False) as scratch, pb.use_executor(scratch):
        yield scratch


def trace_model(model, model_args=(), model_kwargs=None, *, params=None, substitute_fn=None,
                seed: int = 0):
    """The trace of ``model`` seeded with ``seed``, with ``params`` (a dict of site values)
    or ``substitute_fn`` substituted."""
    seeded = handlers.seed(model, rng_seed=seed)
    if params is not None:
        seeded = handlers.substitute(seeded, data=params)
    elif substitute_fn is not None:
        seeded = handlers.substitute(seeded, substitute_fn=substitute_fn)
    return handlers.trace(seeded).get_trace(*model_args, **(model_kwargs or {}))


class FactorUnit(Unit):
    """The distribution of a ``pb.factor`` site: ``numpyro.distributions.Unit`` of the
    summed log-density, carrying the ``reduce_sum`` inputs that made it (``data`` and
    ``shared`` as pytree leaves; ``fn``, ``executor``, ``grainsize`` and ``block_rows``
    as static fields)."""

    pytree_data_fields = ("data", "shared")
    pytree_aux_fields = ("fn", "executor", "grainsize", "block_rows")
    #: Marks the distribution of a parallel_backend site (``pb.observe``'s too).
    pb_site = "factor"

    def __init__(self, log_factor, fn, data, shared, executor=None, grainsize=None,
                 block_rows=None):
        self.fn, self.data, self.shared = fn, data, tuple(shared)
        self.executor, self.grainsize, self.block_rows = executor, grainsize, block_rows
        super().__init__(log_factor)

    @property
    def inputs(self) -> dict:
        """``fn``, ``data``, ``shared``, ``executor``, ``grainsize``, ``block_rows`` and
        ``kind`` (``"factor"``)."""
        return dict(fn=self.fn, data=self.data, shared=self.shared, executor=self.executor,
                    grainsize=self.grainsize, block_rows=self.block_rows, kind="factor")


def site_inputs(site):
    """The ``reduce_sum`` inputs of a ``pb.factor`` or observed ``pb.observe`` trace site
    (through any wrapper a handler put around its distribution), or ``None`` for another
    site."""
    if (site.get("type") != "sample" or not site.get("is_observed")
            or not (site.get("infer") or {}).get(INFER_KEY)):
        return None
    fn = site["fn"]
    while getattr(fn, "pb_site", None) is None and hasattr(fn, "base_dist"):
        fn = fn.base_dist
    return fn.inputs if getattr(fn, "pb_site", None) is not None else None


def factor_sites(trace) -> dict:
    """The ``pb.factor`` and observed ``pb.observe`` sites of a NumPyro trace: ``{name:
    inputs}`` with ``fn``, ``data``, ``shared``, ``executor``, ``grainsize``,
    ``block_rows`` and ``kind`` (``"factor"`` or ``"observe"``; an observe site's ``fn``
    gives each row's log-density of ``data = (data, obs)``)."""
    out = {}
    for name, site in trace.items():
        inputs = site_inputs(site)
        if inputs is not None:
            out[name] = inputs
    return out
