"""A finished NumPyro run as plain data: what a conversion to ArviZ needs from it.

:func:`run_record` reads a ``numpyro.infer.MCMC`` (after ``run``) or the run
``pb.sample`` makes (:class:`~.driver.Run`) into a :class:`RunRecord`, so that the
ArviZ plugin never reads a NumPyro object itself. Imports jax, numpy and numpyro.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from .driver import Run
from .internals import mcmc_arguments, max_tree_depth

__all__ = ["RunRecord", "run_record"]


class RunRecord(NamedTuple):
    """A finished run.

    Attributes
    ----------
    model : callable or None
        The model (``None`` for a kernel built from a potential function).
    model_args, model_kwargs : tuple, dict
        The arguments the model was run with.
    samples : pytree
        The draws of every latent and deterministic site, leaves ``(chains, draws, ...)``
        (a dict by site for a model).
    stats : dict
        The collected sampler fields (``potential_energy``, ``num_steps``, ...), each
        ``(chains, draws)``; fields that are not arrays are left out.
    num_chains, num_draws : int
    max_tree_depth : int, tuple or None
        NUTS's limit on tree depth (``None`` for other kernels).
    """

    model: Any
    model_args: tuple
    model_kwargs: dict
    samples: Any
    stats: dict
    num_chains: int
    num_draws: int
    max_tree_depth: Any


def run_record(run, model=None, model_args=None, model_kwargs=None) -> RunRecord:
    """The :class:`RunRecord` of ``run`` (an ``MCMC`` after ``run()``, or ``pb.sample``'s
    run); ``model``, ``model_args`` and ``model_kwargs`` override what the run says.

    Raises
    ------
    TypeError
        ``run`` is neither.
    """
    if isinstance(run, Run):
        args, kwargs = run.model_args, run.model_kwargs
    elif hasattr(run, "get_samples") and hasattr(run, "sampler"):
        args, kwargs = mcmc_arguments(run)
    else:
        raise TypeError("to_arviz: expected a numpyro.infer.MCMC that has run (or the run of "
                        f"pb.sample), got {type(run).__name__}")
    kernel = run.sampler
    samples = jax.device_get(run.get_samples(group_by_chain=True))
    stats = {k: np.asarray(v) for k, v in jax.device_get(
        run.get_extra_fields(group_by_chain=True)).items() if hasattr(v, "shape")}
    first = np.shape(jax.tree.leaves(samples)[0])
    return RunRecord(
        model=model if model is not None else getattr(kernel, "model", None),
        model_args=tuple(args if model_args is None else model_args),
        model_kwargs=dict(kwargs if model_kwargs is None else model_kwargs),
        samples=samples, stats=stats, num_chains=int(first[0]), num_draws=int(first[1]),
        max_tree_depth=max_tree_depth(kernel))
