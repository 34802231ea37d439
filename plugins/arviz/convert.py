"""``pb.to_arviz``: a NumPyro ``MCMC`` run as ``arviz.InferenceData``.

ArviZ's own ``from_numpyro`` makes ``posterior``, ``sample_stats`` and
``observed_data``; this module adds the ``log_likelihood`` group, pointwise over
the rows of every ``pb.factor`` site (recomputed on the executor by
:mod:`.loglik`), the sites' row data as ``constant_data``, and the run's
``attrs``. It imports arviz, numpy, numpyro and the core's public names.
"""

from __future__ import annotations

import time

import numpy as np

try:
    import arviz as az
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError('parallel_backend.to_arviz needs ArviZ: pip install "parallel-backend[arviz]"') from e
import jax
import xarray as xr

import parallel_backend as pb
from parallel_backend.plugins.numpyro.replay import (HMC_EXTRA_FIELDS, factor_sites, quietly,
                                                     trace_model)

from .loglik import pointwise_log_likelihood

__all__ = ["to_arviz", "HMC_EXTRA_FIELDS"]



def to_arviz(mcmc, model=None, *, model_args=None, model_kwargs=None, executor=None,
             log_likelihood=True, factor_data=True, coords=None, dims=None, chunk_draws=None,
             chunk_rows=None, attrs=None, **from_numpyro_kwargs):
    """Convert a finished NumPyro ``MCMC`` run to ``arviz.InferenceData``.

    Parameters
    ----------
    mcmc : numpyro.infer.MCMC
        A run; collect ``extra_fields=HMC_EXTRA_FIELDS`` for the full
        ``sample_stats`` (``pb.sample`` does).
    model : callable, optional
        The model; default ``mcmc.sampler.model``.
    model_args, model_kwargs : tuple, dict, optional
        The model's arguments; default those of the last ``mcmc.run``.
    executor : Executor or str, optional
        Who evaluates the pointwise log-likelihood; default: each site's own
        ``executor=``, else the innermost ``use_executor``, else the default.
    log_likelihood : bool
        Compute the ``log_likelihood`` group (``chains x draws x rows`` values per
        ``pb.factor`` site; switch off for very large data).
    factor_data : bool
        Put the ``pb.factor`` sites' row data that does not depend on parameters in
        ``constant_data`` (as ``<site>_<key>``, rows on the site's row dimension).
    coords, dims : dict, optional
        As for ``arviz.from_numpyro``. A ``pb.factor`` site's rows are on dimension
        ``<site>_dim_0`` unless ``dims[site]`` names it.
    chunk_draws, chunk_rows : int, optional
        Draws and rows per log-likelihood task (see :mod:`.loglik`).
    attrs : dict, optional
        Extra attributes for ``idata.attrs`` (``pb.sample`` passes wall times).
    **from_numpyro_kwargs
        Passed to ``arviz.from_numpyro`` (``constant_data``, ``posterior_predictive``...).

    Returns
    -------
    arviz.InferenceData
        Groups ``posterior``, ``sample_stats``, ``log_likelihood`` (if asked),
        ``observed_data`` (ordinary observed sites), ``constant_data``; ``attrs``
        hold ``parallel_backend_version``, ``executor``, ``workers``, ``chunk_rows``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import parallel_backend as pb
    >>> from parallel_backend.plugins.arviz.convert import HMC_EXTRA_FIELDS
    >>> y = jnp.linspace(-1.0, 1.0, 20)
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    ...     pb.factor("y", lambda y, mu: dist.Normal(mu, 1.0).log_prob(y), y, mu)
    >>> mcmc = numpyro.infer.MCMC(numpyro.infer.NUTS(model), num_warmup=20, num_samples=10,
    ...                           progress_bar=False)
    >>> mcmc.run(jax.random.PRNGKey(0), y, extra_fields=HMC_EXTRA_FIELDS)
    >>> idata = pb.to_arviz(mcmc)
    >>> idata.log_likelihood["y"].shape, idata.attrs["executor"]
    ((1, 10, 20), 'serial')
    """
    model = model if model is not None else getattr(mcmc.sampler, "model", None)
    if model_args is None:
        model_args = mcmc._args  # noqa: SLF001 - as arviz.from_numpyro reads them
    if model_kwargs is None:
        model_kwargs = mcmc._kwargs  # noqa: SLF001
    model_args, model_kwargs = tuple(model_args), dict(model_kwargs)
    dims = dict(dims or {})
    own = isinstance(executor, str)  # made here from a name: closed when done
    ex = pb.executors.resolve_executor(executor)

    samples = mcmc.get_samples(group_by_chain=True)
    n_chains, n_draws = np.shape(jax.tree.leaves(samples)[0])[:2]
    flat = jax.tree.map(lambda x: np.reshape(np.asarray(x), (n_chains * n_draws,) + np.shape(x)[2:]),
                        samples)
    factor_sites, plans, ll_seconds = {}, {}, 0.0
    if model is not None:
        factor_sites = _factor_sites(model, flat, model_args, model_kwargs)

    # from_numpyro replays the model once for observed_data: keep that evaluation off
    # the caller's executor. A pb.factor site's dims are its rows', not its empty value's.
    with quietly():
        idata = az.from_numpyro(mcmc, log_likelihood=False, coords=coords,
                                dims={k: v for k, v in dims.items() if k not in factor_sites},
                                **from_numpyro_kwargs)
    if log_likelihood and factor_sites:
        t0 = time.perf_counter()
        values, plans = pointwise_log_likelihood(
            model, flat, *model_args, executor=ex if executor is not None else None,
            chunk_draws=chunk_draws,
            chunk_rows=chunk_rows, **model_kwargs)
        ll_seconds = time.perf_counter() - t0
        ll = {name: v.reshape((n_chains, n_draws) + v.shape[1:]) for name, v in values.items()}
        ll_dims = {name: list(dims.get(name, [f"{name}_dim_0"])) for name in factor_sites}
        ll_dims.update({k: v for k, v in dims.items() if k in ll and k not in ll_dims})
        ds = az.dict_to_dataset(ll, library=_numpyro(), coords=coords, dims=ll_dims)
        idata.add_groups(log_likelihood=ds)

    # A pb.factor site is observed at an empty value (as numpyro.factor): not data.
    if hasattr(idata, "observed_data"):
        keep = [v for v in idata.observed_data.data_vars if v not in factor_sites]
        if keep:
            idata.observed_data = idata.observed_data[keep]
        else:
            del idata.observed_data
    if factor_data and factor_sites:
        const = _constant_rows(factor_sites, dims)
        if const:
            used = {d for ds_dims in const[1].values() for d in ds_dims}
            ds = xr.Dataset({k: (const[1][k], v) for k, v in const[0].items()},
                            coords={k: v for k, v in (coords or {}).items() if k in used})
            if hasattr(idata, "constant_data"):
                idata.constant_data = xr.merge([idata.constant_data, ds])
            else:
                idata.add_groups(constant_data=ds)

    stats = ex.stats()
    if own:
        ex.close()
    info = {
        "parallel_backend_version": pb.__version__,
        "executor": stats["executor"],
        "workers": int(stats["workers"]),
        "chunk_rows": [int(r) for r in stats["chunk_rows"]] or [0],
        "gradient_evaluations": int(stats["calls"]),
        "num_chains": int(n_chains),
        "num_draws": int(n_draws),
    }
    if plans:
        info["log_likelihood_seconds"] = float(ll_seconds)
        info["log_likelihood_chunk_draws"] = int(max(p.chunk_draws for p in plans.values()))
        info["log_likelihood_chunk_rows"] = [int(p.chunk_rows) for p in plans.values()]
    info.update(attrs or {})
    idata.attrs.update(info)
    for group in ("posterior", "sample_stats", "log_likelihood"):
        if hasattr(idata, group):
            getattr(idata, group).attrs.update(
                {"parallel_backend_version": pb.__version__, "executor": stats["executor"]})
    return idata


def _numpyro():
    import numpyro

    return numpyro


def _factor_sites(model, flat, model_args, model_kwargs) -> dict:
    """``{site: info}`` of the pb.factor sites, from one replay at the first draw."""
    first = jax.tree.map(lambda x: x[0], flat)
    found = {}

    def replay(draw):
        found.update(factor_sites(trace_model(model, model_args, model_kwargs, params=draw)))
        return 0

    # Traced, not run: leaves computed from the draws (or from anything) stay tracers,
    # the data arrays given to the model stay concrete; no likelihood is evaluated.
    with quietly():
        jax.make_jaxpr(replay)(first)
    return found


def _constant_rows(sites: dict, dims: dict):
    """Concrete data leaves of each site, named ``<site>_<key path>``, with their dims."""
    values, var_dims = {}, {}
    for name, info in sites.items():
        row_dim = list(dims.get(name, [f"{name}_dim_0"]))[0]
        for path, leaf in jax.tree_util.tree_flatten_with_path(info["data"])[0]:
            if isinstance(leaf, jax.core.Tracer):
                continue
            arr = np.asarray(leaf)
            keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
            var = "_".join([name, *keys]) if keys else f"{name}_data"
            values[var] = arr
            var_dims[var] = [row_dim] + [f"{var}_dim_{i}" for i in range(1, arr.ndim)]
    return (values, var_dims) if values else None
