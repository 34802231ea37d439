"""Every read of NumPyro's private attributes, in one place.

NumPyro keeps some facts that a run needs afterwards only as private attributes, with
no public accessor. Each use is a small function here with the reason it has no public
replacement; ``tests/unit/test_internals.py`` fails, naming the NumPyro version,
when a release changes one of them (tested on numpyro 0.22.0, with jax 0.10.2 on Python
3.11 and jax 0.12.0.1 on Python 3.12). ``docs/layout.rst`` lists them. Imports nothing
but the standard library (NumPyro only inside the functions that read it).
"""

from __future__ import annotations

__all__ = ["BUILT_AT_INIT", "handler_stack", "kernel_function", "kernel_settings",
           "max_tree_depth", "mcmc_arguments"]

#: Attributes of NumPyro's HMC that ``init`` builds from the model: not settings.
BUILT_AT_INIT = frozenset({"_model", "_potential_fn", "_init_fn", "_sample_fn",
                           "_potential_fn_gen", "_postprocess_fn", "_inv_transforms",
                           "_dynamic_support"})


def mcmc_arguments(mcmc) -> tuple[tuple, dict]:
    """The model arguments of the last ``MCMC.run``: kept only as ``MCMC._args`` and
    ``MCMC._kwargs`` (ArviZ's ``from_numpyro`` reads them the same way)."""
    return tuple(mcmc._args), dict(mcmc._kwargs)


def kernel_settings(kernel) -> dict:
    """A kernel's constructor settings (``target_accept_prob``, ``max_tree_depth``...),
    named without the leading underscore: NumPyro's HMC and NUTS store every argument
    as a private attribute and offer no ``get_params``, so a checkpoint's fingerprint
    reads ``vars(kernel)``, without what ``init`` builds from the model."""
    return {k.lstrip("_"): v for k, v in sorted(vars(kernel).items()) if k not in BUILT_AT_INIT}


def max_tree_depth(kernel):
    """NUTS's ``max_tree_depth`` (an int, or a pair for warmup and sampling; ``None`` for
    other kernels): stored only as ``_max_tree_depth``. ArviZ 1.x marks
    ``reached_max_tree_depth`` from it."""
    return getattr(kernel, "_max_tree_depth", None)


def kernel_function(kernel):
    """What a kernel samples: its model (public ``kernel.model``) or, for a kernel made
    from a potential function, that function (kept only as ``_potential_fn``); ``None``
    for anything else."""
    if getattr(kernel, "model", None) is not None:
        return kernel.model
    return getattr(kernel, "_potential_fn", None)


def handler_stack() -> list:
    """The effect handlers active now, outermost first: kept only as
    ``numpyro.primitives._PYRO_STACK`` (the stack ``apply_stack`` runs). A site that must
    know which plates enclose it before they process it (to name a plate it cannot
    honour) or whether an estimator reads it row by row reads it here."""
    import numpyro.primitives

    return list(numpyro.primitives._PYRO_STACK)
