"""``pb.loo``: exact PSIS-LOO of a fitted run that never holds its draws x rows matrix.

PSIS-LOO treats every observation on its own: its draws' log-likelihood are
Pareto-smoothed into importance weights, which give that observation's ``elpd_i``,
``pareto_k`` and share of ``p``; only the sums and the standard error see all of them.
So the site's rows come a group at a time (``plugins/numpyro/rowwise.py``: each group's
log-likelihood for every draw, its rows evaluated where they are, on the executor), each
group is smoothed as the installed ArviZ smooths (the relative efficiency ``reff``
computed once from the run's posterior, as ArviZ does, and used for every group: on
ArviZ 0.x its own ``loo`` per group, on 1.x ``psis.py``, arviz_stats' steps over the whole
group at once), and only its per-row results are kept; the totals are ArviZ's formulas over all of them.
The result is the installed ArviZ's LOO object, with what ``arviz.loo`` of the run's
``log_likelihood`` group would hold but the smoothed log weights (draws x rows: the
matrix this avoids). Imports arviz, xarray, numpy and the plugins below it.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any

import arviz as az
import numpy as np
import xarray as xr

import parallel_backend as pb

from ..numpyro.display import Bar
from ..numpyro.rowwise import row_groups
from . import container
from .psis import loo_rows

__all__ = ["LOO_MEMORY", "loo"]

#: Default of ``memory``: bytes of log-likelihood values (and ArviZ's working copies of
#: them) held at once.
LOO_MEMORY = 256 * 2 ** 20
#: Bytes per value held, ArviZ's working copies included (the values, their negation, the
#: smoothed log weights and a sorted copy, in float64).
BYTES_PER_VALUE = 8 * 4

LOGGER = logging.getLogger("parallel_backend.loo")


def loo(data: Any, model: Any, *model_args: Any, executor: pb.Executor | str | None = None,
        memory: int | None = None, var_name: str | None = None, pointwise: bool = True,
        progress_bar: bool = True, **model_kwargs: Any) -> Any:
    """Exact PSIS-LOO of a fitted run, its log-likelihood made and smoothed in row groups.

    Equals ``arviz.loo`` of the same run's ``log_likelihood`` group to round-off, without
    ever holding that group: at most ``memory`` bytes of log-likelihood exist at once.

    Parameters
    ----------
    data : xarray.DataTree or arviz.InferenceData
        A run with a ``posterior`` group: what ``pb.sample`` or ``pb.to_arviz`` returns
        (with or without its ``log_likelihood`` group).
    model : callable
        The model the run was fitted with.
    *model_args, **model_kwargs
        The model's arguments, with the observations, as given to the fit.
    executor : Executor or str, optional
        Who evaluates the rows of a ``pb.observe``/``pb.factor`` site; default: the
        site's own ``executor=``, else the innermost ``use_executor``, else the default
        executor. One made here from a name is closed before returning.
    memory : int, optional
        Bytes of log-likelihood held at once, ArviZ's working copies included (about
        32 bytes per value); default ``LOO_MEMORY``, 256 MiB.
    var_name : str, optional
        The observed site to leave out, where the model has several (as ``arviz.loo``
        requires).
    pointwise : bool
        Keep the per-row ``elpd_i`` (ArviZ 0.x: ``loo_i``) and ``pareto_k``.
    progress_bar : bool
        Show progress over the rows (stderr; a line per tenth where no bar can be seen).

    Returns
    -------
    ELPDData
        The installed ArviZ's LOO result (``arviz_stats``' ``ELPDDataLOO`` on ArviZ 1.x,
        arviz's ``ELPDData`` on 0.x): ``elpd`` (0.x: ``elpd_loo``), ``se``, ``p`` (0.x:
        ``p_loo``), ``n_samples``, ``n_data_points``, ``warning``, ``good_k``, ``scale``
        and, with ``pointwise``, the per-row values on the observations' dims.
        ``arviz.compare`` takes it. The smoothed log weights are not kept.

    Raises
    ------
    ValueError
        ``data`` has no posterior; the model has no observed site, or several and
        ``var_name`` names none of them; ``memory`` is not a positive number of bytes.

    Examples
    --------
    >>> import jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import parallel_backend as pb
    >>> def model(x, y=None):
    ...     b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    ...     pb.observe("y", lambda x, b: dist.Normal(b * x, 1.0), x, b, obs=y)
    >>> x = jnp.linspace(-1.0, 1.0, 50)
    >>> run = pb.sample(model, x, 0.5 * x, num_warmup=50, num_samples=50, num_chains=1,
    ...                 progress_bar=False, arviz_kwargs={"log_likelihood": False})
    >>> result = pb.loo(run, model, x, 0.5 * x, progress_bar=False)
    >>> int(result.n_data_points), int(result.n_samples)
    (50, 50)
    """
    memory = LOO_MEMORY if memory is None else memory
    if not isinstance(memory, (int, np.integer)) or isinstance(memory, bool) or memory <= 0:
        raise ValueError(f"pb.loo: memory must be a positive number of bytes, got {memory!r}")
    groups, _ = container.parts(data)
    posterior = groups.get("posterior")
    if posterior is None:
        raise ValueError("pb.loo: data must be a run with a posterior group (what pb.sample or "
                         f"pb.to_arviz returns); its groups are {sorted(groups)}")
    chains, draws = int(posterior.sizes["chain"]), int(posterior.sizes["draw"])
    n_samples = chains * draws
    samples = {v: np.asarray(posterior[v].values).reshape((n_samples,) + posterior[v].shape[2:])
               for v in posterior.data_vars}
    reff = _reff(posterior, chains, n_samples)
    with contextlib.ExitStack() as stack:
        site = row_groups(model, samples, model_args, model_kwargs, var_name=var_name,
                          executor=executor, stack=stack,
                          values_per_group=max(1, int(memory) // BYTES_PER_VALUE))
        dims, coords = _obs_dims(site, groups)
        elpd_i, pareto_k, p_i, last = [], [], [], None
        with Bar(site.rows, f"pb.loo {site.name!r}", LOGGER, enabled=progress_bar,
                 unit="row") as bar:
            for first, end, values in site.groups:
                last, e, k, p = _group_loo(site.name, values, chains, draws, reff)
                elpd_i.append(e)
                pareto_k.append(k)
                p_i.append(p)
                del values
                bar.update(end - first)
    return _result(last, site.name, np.concatenate(elpd_i), np.concatenate(pareto_k),
                   np.concatenate(p_i), n_samples, site.shape, dims, coords, pointwise)


def _reff(posterior: xr.Dataset, chains: int, n_samples: int) -> float:
    """The relative efficiency ArviZ's ``loo`` computes from a run's posterior: 1 for one
    chain, else the mean of every variable's mean-ESS over the draws."""
    if chains == 1:
        return 1.0
    ess = az.ess(posterior, method="mean")
    return float(np.hstack([np.asarray(ess[v].values).ravel() for v in ess.data_vars]).mean()
                 / n_samples)


def _obs_dims(site, groups) -> tuple[list[str], dict]:
    """The observations' dims and coordinates, as the run's ``log_likelihood`` group has
    (or would have) them."""
    rank = len(site.shape)
    for group in ("log_likelihood", "observed_data"):
        ds = groups.get(group)
        if ds is not None and site.name in ds:
            var = ds[site.name]
            dims = [d for d in var.dims if d not in ("chain", "draw")][:rank]
            if len(dims) == rank:
                return dims, {d: var.coords[d].values for d in dims if d in var.coords}
    return [f"{site.name}_dim_{i}" for i in range(rank)], {}


def _group_loo(name, values, chains, draws, reff):
    """ArviZ's PSIS-LOO of one group of rows: the per-row ``elpd_i``, ``pareto_k`` and
    ``p`` (ArviZ 0.x gives their sum, which adds up over groups as the rows do), and, on
    ArviZ 0.x, its result object (the type of the whole site's)."""
    with warnings.catch_warnings():
        # Said once for the whole site (below), not once per group.
        warnings.simplefilter("ignore")
        if container.DATATREE:
            # What arviz_stats.loo computes per observation (its smoothed log weights, which
            # it also keeps, are the draws x rows this avoids), over the whole group at
            # once (psis.py; arviz_stats runs it one observation at a time in Python).
            return (None, *loo_rows(values, reff))
        da = xr.DataArray(values.reshape(chains, draws, values.shape[1]),
                          dims=("chain", "draw", "__row__"))
        run = az.InferenceData(log_likelihood=xr.Dataset({name: da}))
        out = az.loo(run, pointwise=True, var_name=name, reff=reff)
        return out, np.asarray(out["loo_i"].values), np.asarray(out["pareto_k"].values), \
            np.array([float(out["p_loo"])])


def _result(last, name, elpd_i, pareto_k, p_i, n_samples, shape, dims, coords, pointwise):
    """The installed ArviZ's LOO object for the whole site, built as ``arviz.loo`` builds
    it from the per-row values."""
    n = int(elpd_i.size)
    good_k = min(1 - 1 / np.log10(n_samples), 0.7) if n_samples > 1 else 0.7
    warn = bool(np.any(pareto_k > good_k))
    if warn:
        warnings.warn(f"pb.loo: the estimated shape parameter of the Pareto distribution is "
                      f"greater than {good_k:.2f} for {int(np.sum(pareto_k > good_k))} of {n} "
                      f"observations of {name!r}: importance sampling is less likely to work "
                      "there (a more robust model, or exact refits of those observations)",
                      UserWarning, stacklevel=3)

    def array(v):
        return xr.DataArray(v.reshape(shape), dims=dims, coords=coords, name=name)

    if container.DATATREE:
        from arviz_stats import ELPDDataLOO

        elpd_da = xr.DataArray(elpd_i)
        elpd, se, p, _ = elpd_da.azstats.loo_summary(xr.DataArray(p_i))  # ArviZ's totals
        return ELPDDataLOO(
            elpd=float(elpd), se=float(se), p=float(p), n_samples=int(n_samples),
            n_data_points=n, scale="log", warning=warn, good_k=good_k,
            elpd_i=array(elpd_i) if pointwise else None,
            pareto_k=array(pareto_k) if pointwise else None, approx_posterior=False)
    # ArviZ 0.x's totals, as its loo computes them
    elpd, se = float(elpd_i.sum()), float((n * np.var(elpd_i)) ** 0.5)
    index = ["elpd_loo", "se", "p_loo", "n_samples", "n_data_points", "warning"]
    values = [elpd, se, float(np.sum(p_i)), int(n_samples), n, warn]
    if pointwise:
        index += ["loo_i", "pareto_k"]
        values += [array(elpd_i), array(pareto_k)]
    index += ["scale", "good_k"]
    values += [last["scale"], good_k]
    return type(last)(data=values, index=index)
