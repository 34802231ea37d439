"""``pb.sample``: NumPyro NUTS on an executor, returned as ``arviz.InferenceData``.

Warmup and sampling run as one ``MCMC.run`` (one compilation), with the progress
callback of :mod:`.progress` compiled in; it also splits the wall time between
them. The result goes through ``pb.to_arviz``, which computes the pointwise
log-likelihood on the same executor. ArviZ is imported inside :func:`sample`, so this module imports without it.
Imports jax, numpyro and the core's public names.
"""

from __future__ import annotations

import numbers

import jax
import numpy as np
from numpyro.infer import MCMC, NUTS
from numpyro.infer.hmc import HMC
from numpyro.infer.mcmc import MCMCKernel

import parallel_backend as pb
from parallel_backend.extend import check_count, resolve_executor

from .progress import Progress, ProgressKernel, terminal
from .replay import HMC_EXTRA_FIELDS

__all__ = ["sample"]

CHAIN_METHODS = ("vectorized", "parallel", "sequential")


def sample(model, *model_args, num_warmup=1000, num_samples=1000, num_chains=4,
           chain_method="vectorized", seed=0, executor=None, progress_bar=True,
           init_params=None, nuts_kwargs=None, arviz_kwargs=None, **model_kwargs):
    """Run NumPyro's NUTS on ``model`` and return ``arviz.InferenceData``.

    Every ``pb.reduce_sum``/``pb.factor`` inside the model runs on ``executor``
    (unless the site names its own). With ``chain_method="vectorized"`` the chains
    are a batch axis of every parameter: one evaluation carries all chains, and the
    executor sees chains x chunks as parallel work.

    Parameters
    ----------
    model : callable or numpyro.infer.mcmc.MCMCKernel
        A NumPyro model, or a kernel the user configured (``NUTS(model, ...)``).
    *model_args, **model_kwargs
        The model's arguments.
    num_warmup, num_samples, num_chains : int
        As for ``numpyro.infer.MCMC``.
    chain_method : {"vectorized", "parallel", "sequential"}
        As for ``numpyro.infer.MCMC``.
    seed : int or jax PRNG key
        The same seed gives the same draws, whichever executor or worker count.
    executor : Executor or str, optional
        Default: the innermost ``use_executor``, else the default executor. A name
        (``"thread"``) makes one for this call and closes it afterwards.
    progress_bar : bool
        Show a bar (only when ``sys.stdout`` is a terminal) with NumPyro's figures,
        gradient evaluations per second and the executor's worker count.
    init_params : pytree, optional
        Initial unconstrained values, as for ``MCMC.run``.
    nuts_kwargs : dict, optional
        Passed to ``NUTS`` (``target_accept_prob``, ``max_tree_depth``,
        ``dense_mass``...); not allowed with a kernel.
    arviz_kwargs : dict, optional
        Passed to :func:`parallel_backend.to_arviz` (``coords``, ``dims``,
        ``log_likelihood=False``...).

    Returns
    -------
    arviz.InferenceData
        See :func:`parallel_backend.to_arviz`; ``attrs`` also hold
        ``warmup_seconds`` and ``sampling_seconds`` (compilation included).

    Raises
    ------
    TypeError
        ``model`` is neither callable nor a kernel; a bad ``seed``.
    ValueError
        Bad counts or ``chain_method``; ``nuts_kwargs`` together with a kernel.

    Examples
    --------
    >>> import jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import parallel_backend as pb
    >>> y = jnp.linspace(-1.0, 1.0, 50)
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    ...     pb.factor("y", lambda y, mu: dist.Normal(mu, 1.0).log_prob(y), y, mu)
    >>> idata = pb.sample(model, y, num_warmup=50, num_samples=20, num_chains=2,
    ...                   progress_bar=False)
    >>> idata.posterior["mu"].shape, idata.log_likelihood["y"].shape
    ((2, 20), (2, 20, 50))
    """
    try:
        import arviz  # noqa: F401 - fail before sampling, not after
    except ImportError as e:
        raise ImportError('pb.sample returns arviz.InferenceData and needs ArviZ: '
                          'pip install "parallel-backend[arviz]"') from e

    _check_count("num_warmup", num_warmup, 0)
    _check_count("num_samples", num_samples, 1)
    _check_count("num_chains", num_chains, 1)
    if not callable(chain_method) and chain_method not in CHAIN_METHODS:
        raise ValueError(f"sample: chain_method must be one of {list(CHAIN_METHODS)}, "
                         f"got {chain_method!r}")
    if isinstance(model, MCMCKernel):
        if nuts_kwargs:
            raise ValueError("sample: nuts_kwargs apply only when model is a model function; "
                             f"configure the kernel you passed instead (got {sorted(nuts_kwargs)})")
        kernel = model
    elif callable(model):
        kernel = NUTS(model, **(nuts_kwargs or {}))
    else:
        raise TypeError("sample: model must be a NumPyro model (a callable) or an MCMCKernel "
                        f"such as NUTS(model), got {type(model).__name__}")
    key = _key(seed)

    own = isinstance(executor, str)
    ex = resolve_executor(executor)
    try:
        extra = HMC_EXTRA_FIELDS if isinstance(kernel, HMC) else ()
        progress = Progress(ex, num_chains, num_warmup, num_samples,
                            enabled=bool(progress_bar) and terminal())
        mcmc = MCMC(ProgressKernel(kernel, progress), num_warmup=num_warmup,
                    num_samples=num_samples, num_chains=num_chains, chain_method=chain_method,
                    progress_bar=False)
        # One run, warmup included (one compilation); the progress callback splits
        # the wall time between the phases by the transitions' iteration numbers.
        with pb.use_executor(ex), progress:
            mcmc.run(key, *model_args, extra_fields=extra, init_params=init_params,
                     **model_kwargs)
            jax.block_until_ready(mcmc.last_state)
            progress.finish()
        attrs = {"warmup_seconds": progress.seconds["warmup"],
                 "sampling_seconds": progress.seconds["sample"],
                 "chain_method": chain_method if isinstance(chain_method, str) else "callable",
                 "num_warmup": int(num_warmup)}
        return pb.to_arviz(mcmc, executor=ex, attrs=attrs, **(arviz_kwargs or {}))
    finally:
        if own:
            ex.close()


def _check_count(name, value, least):
    check_count(value, name, "sample", least=least)


def _key(seed):
    if isinstance(seed, bool):
        raise TypeError(f"sample: seed must be an int or a jax PRNG key, got {seed!r}")
    if isinstance(seed, numbers.Integral):
        return jax.random.PRNGKey(int(seed))
    shape = getattr(seed, "shape", None) if isinstance(seed, (jax.Array, np.ndarray)) else None
    if shape is None or not (shape == () or shape[-1:] == (2,)):
        raise TypeError(f"sample: seed must be an int or a jax PRNG key "
                        f"(jax.random.PRNGKey(0) or jax.random.key(0)), got {seed!r}")
    return seed
