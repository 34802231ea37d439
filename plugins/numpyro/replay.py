"""Replaying a NumPyro model for bookkeeping, and the names the NumPyro and ArviZ plugins share.

This module owns :func:`quietly` (``reduce_sum`` calls traced inside go to a private
executor that counts nothing, so a model replayed to find its sites or shapes never
shows in the caller's executor or its stats), :func:`trace_model` (a seeded, and
optionally substituted, trace of a model), :func:`factor_sites` (the ``pb.factor``
sites of a trace) and :data:`HMC_EXTRA_FIELDS`. Imports numpyro and the core's
public names.
"""

from __future__ import annotations

import contextlib

from numpyro import handlers

import parallel_backend as pb

__all__ = ["quietly", "trace_model", "factor_sites", "HMC_EXTRA_FIELDS", "INFER_KEY"]

#: Key of a factor site's ``infer`` dict under which the reduce_sum inputs are kept.
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


def factor_sites(trace) -> dict:
    """The ``pb.factor`` sites of a NumPyro trace: ``{name: info}`` with ``fn``, ``data``,
    ``shared``, ``executor``, ``grainsize`` and ``block_rows``."""
    return {name: site["infer"][INFER_KEY] for name, site in trace.items()
            if site["type"] == "sample" and INFER_KEY in site.get("infer", {})}
