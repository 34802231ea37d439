"""A finished NumPyro run as plain data: what a conversion to ArviZ needs from it.

:func:`run_record` reads a ``numpyro.infer.MCMC`` (after ``run``) or the run
``pb.sample`` makes (:class:`Run`) into a :class:`RunRecord`, so that the ArviZ plugin
never reads a NumPyro object itself. Imports jax, numpy and :mod:`.internals`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from .internals import max_tree_depth, mcmc_arguments

__all__ = ["Run", "RunRecord", "run_record"]


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


class Run:
    """A finished run made without ``MCMC`` (``pb.sample``'s), with ``MCMC``'s accessors
    for its draws.

    Parameters
    ----------
    kernel : MCMCKernel
    fields : tuple of str
        The collected fields, sample field first.
    buffers : tuple
        One array tree per field, each leaf ``(chains, draws, ...)``.
    last_state : pytree
        Every chain's final state, stacked on a leading chain axis.
    model_args, model_kwargs : tuple, dict
    """

    thinning = 1

    def __init__(self, kernel, fields, buffers, last_state, model_args, model_kwargs):
        self.sampler = kernel
        self.fields = tuple(fields)
        self.values = dict(zip(self.fields, buffers))
        self.last_state = last_state
        self.model_args, self.model_kwargs = tuple(model_args), dict(model_kwargs)
        first = jax.tree.leaves(buffers[0])[0]
        self.num_chains, self.num_samples = int(first.shape[0]), int(first.shape[1])

    def _get(self, value, group_by_chain):
        if group_by_chain:
            return value
        return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), value)

    def get_samples(self, group_by_chain: bool = False):
        return self._get(self.values[self.fields[0]], group_by_chain)

    def get_extra_fields(self, group_by_chain: bool = False) -> dict:
        return {k: self._get(v, group_by_chain) for k, v in self.values.items()
                if k != self.fields[0]}


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
