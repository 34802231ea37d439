"""``pb.to_arviz``: a finished NumPyro run in ArviZ's format, under either ArviZ major.

ArviZ's own ``from_numpyro`` makes ``posterior``, ``sample_stats`` and
``observed_data`` (:func:`.container.from_numpyro`); this module adds the
``log_likelihood`` group, pointwise over the rows of every ``pb.factor`` site and of
every observed site (recomputed on the executor by the NumPyro plugin's
``pointwise_log_likelihood``), the sites' row data as ``constant_data``, and the run's
``attrs``, and builds the installed major's container. Imports jax, numpy, xarray, the
core's public names, the NumPyro plugin's modules, and :mod:`.container`.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import xarray as xr
from numpyro.infer import Predictive

import parallel_backend as pb
from parallel_backend.extend import is_tracer, resolve_executor

from ..numpyro.loglik import pointwise_log_likelihood
from ..numpyro.observe import unobserved
from ..numpyro.record import run_record
from ..numpyro.replay import (
    HMC_EXTRA_FIELDS,
    factor_sites,
    quietly,
    site_distribution,
    trace_model,
)
from . import container

if TYPE_CHECKING:
    import arviz
    from numpyro.infer import MCMC

__all__ = ["HMC_EXTRA_FIELDS", "to_arviz"]


#: Default of ``to_arviz``'s ``log_likelihood_budget``: bytes the ``log_likelihood`` group
#: may take unless asked for explicitly (above every run of the tests and examples).
LOG_LIKELIHOOD_BUDGET = 2 * 2 ** 30


def to_arviz(mcmc: MCMC, model: Callable[..., Any] | None = None, *,
             model_args: tuple | None = None, model_kwargs: Mapping[str, Any] | None = None,
             executor: pb.Executor | str | None = None, log_likelihood: bool | None = None,
             log_likelihood_budget: int = LOG_LIKELIHOOD_BUDGET,
             factor_data: bool = True, coords: Mapping[str, Any] | None = None,
             dims: Mapping[str, list[str]] | None = None, chunk_draws: int | None = None,
             chunk_rows: int | None = None, attrs: Mapping[str, Any] | None = None,
             posterior_predictive: bool | Mapping[str, Any] | None = None,
             predictive_seed: int | jax.Array = 0,
             **from_numpyro_kwargs: Any) -> xr.DataTree | arviz.InferenceData:
    """Convert a finished NumPyro ``MCMC`` run to ArviZ's format.

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
    log_likelihood : bool, optional
        Compute the ``log_likelihood`` group (``chains x draws x observations`` values
        per ``pb.factor``, ``pb.observe`` and observed site). ``None`` (the default): where
        those values fit in ``log_likelihood_budget`` bytes; above it the group is not
        stored, a warning says so and points to ``pb.loo`` (exact PSIS-LOO that never
        holds the group), and ``attrs["log_likelihood_not_stored_bytes"]`` holds what it
        would have taken. ``True`` stores it whatever its size; ``False`` never.
    log_likelihood_budget : int
        Bytes the ``log_likelihood`` group may take when ``log_likelihood`` is ``None``;
        default ``LOG_LIKELIHOOD_BUDGET``, 2 GiB.
    factor_data : bool
        Put the ``pb.factor`` sites' row data that does not depend on parameters in
        ``constant_data`` (as ``<site>_<key>``, rows on the site's row dimension).
    coords, dims : dict, optional
        As for ``arviz.from_numpyro``. A ``pb.factor`` site's rows are on dimension
        ``<site>_dim_0`` unless ``dims[site]`` names it.
    chunk_draws, chunk_rows : int, optional
        Draws and rows per log-likelihood task (see
        :func:`~parallel_backend.plugins.numpyro.loglik.pointwise_log_likelihood`).
    attrs : dict, optional
        Extra attributes for the run's ``attrs`` (``pb.sample`` passes wall times).
    posterior_predictive : bool or dict, optional
        ``True``: add a ``posterior_predictive`` group, one draw of every observed site
        (``pb.observe`` and ``numpyro.sample(obs=...)``) per posterior draw, with the
        observations' dims; a dict of arrays ``(chains, draws, ...)`` is passed to ArviZ.
    predictive_seed : int or PRNG key
        The key of those draws (``pb.sample`` passes one made from its ``seed``).
    **from_numpyro_kwargs
        Passed to ``arviz.from_numpyro`` (``constant_data``, ``posterior_predictive``...).

    Returns
    -------
    xarray.DataTree or arviz.InferenceData
        ``DataTree`` with ArviZ 1.x, ``InferenceData`` with ArviZ 0.x; groups
        ``posterior``, ``sample_stats``, ``log_likelihood`` (if asked),
        ``observed_data`` (ordinary observed sites), ``constant_data``; ``attrs`` hold
        ``parallel_backend_version``, ``executor``, ``workers``, ``chunk_rows``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import parallel_backend as pb
    >>> from parallel_backend.plugins.arviz import HMC_EXTRA_FIELDS
    >>> y = jnp.linspace(-1.0, 1.0, 20)
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    ...     pb.factor("y", lambda y, mu: dist.Normal(mu, 1.0).log_prob(y), y, mu)
    >>> mcmc = numpyro.infer.MCMC(numpyro.infer.NUTS(model), num_warmup=20, num_samples=10,
    ...                           progress_bar=False)
    >>> mcmc.run(jax.random.PRNGKey(0), y, extra_fields=HMC_EXTRA_FIELDS)
    >>> run = pb.to_arviz(mcmc)
    >>> run.log_likelihood["y"].shape, run.attrs["executor"]
    ((1, 10, 20), 'serial')
    """
    rec = run_record(mcmc, model, model_args, model_kwargs)
    given_dims, dims = dims, dict(dims or {})
    ex = resolve_executor(executor)
    flat = jax.tree.map(lambda x: np.reshape(np.asarray(x), (-1,) + np.shape(x)[2:]),
                        rec.samples)
    sites, ll_bytes = _replay_sites(rec, flat) if rec.model is not None else ({}, 0)
    # from_numpyro replays the model for observed_data: keep that evaluation off the
    # caller's executor. A pb.factor site's dims are its rows', not its empty value's.
    with quietly():
        # dims=None lets ArviZ infer them from plates, as from_numpyro does.
        base = container.from_numpyro(
            rec, coords=coords, **from_numpyro_kwargs,
            dims=None if given_dims is None else
            {k: v for k, v in dims.items() if k not in sites})
    groups, root = container.parts(base)
    # A pb.factor site is observed at an empty value (as numpyro.factor): not data.
    if "observed_data" in groups:
        keep = [v for v in groups["observed_data"].data_vars
                if sites.get(v, {}).get("kind", "observe") == "observe"]
        groups["observed_data"] = groups["observed_data"][keep]
        if not keep:
            del groups["observed_data"]
    if posterior_predictive is True and rec.model is not None:
        pp = _posterior_predictive(rec, flat, groups, predictive_seed, coords)
        if pp is not None:
            groups["posterior_predictive"] = pp
    info: dict = {}
    if log_likelihood is None and rec.model is not None:
        nbytes = rec.num_chains * rec.num_draws * ll_bytes
        log_likelihood = nbytes <= log_likelihood_budget
        if not log_likelihood:
            info["log_likelihood_not_stored_bytes"] = int(nbytes)
            warnings.warn(
                f"the log_likelihood group would take {nbytes / 2 ** 30:.2f} GiB "
                f"({rec.num_chains} chains x {rec.num_draws} draws x every observation), "
                f"above log_likelihood_budget ({log_likelihood_budget / 2 ** 30:.2f} GiB): "
                f"not stored. For LOO, pb.loo(run, model, *model_args) computes it in row "
                f"groups without holding it; to store it anyway, pass log_likelihood=True "
                f"(pb.sample: arviz_kwargs={{'log_likelihood': True}})", UserWarning,
                stacklevel=2)
    if log_likelihood and rec.model is not None:
        ll, info = _log_likelihood(rec, flat, sites, groups, ex, executor, coords, dims,
                                   chunk_draws, chunk_rows)
        if ll is not None:
            groups["log_likelihood"] = ll
    if factor_data and sites:
        _add_constant_rows(groups, sites, coords, dims)
    stats = ex.stats()
    root.update({
        "parallel_backend_version": pb.__version__,
        "executor": stats["executor"],
        "workers": int(stats["workers"]),
        "chunk_rows": [int(r) for r in stats["chunk_rows"]] or [0],
        "gradient_evaluations": int(stats["calls"]),
        "num_chains": int(rec.num_chains),
        "num_draws": int(rec.num_draws),
        **info, **(attrs or {})})
    for group in ("posterior", "sample_stats", "log_likelihood"):
        if group in groups:
            groups[group].attrs.update({"parallel_backend_version": pb.__version__,
                                        "executor": stats["executor"]})
    return container.build(groups, root)


def _log_likelihood(rec, flat, sites, groups, ex, executor, coords, dims, chunk_draws,
                    chunk_rows):
    """The ``log_likelihood`` dataset (``None`` without any likelihood site) and what its
    computation adds to ``attrs``."""
    t0 = time.perf_counter()
    values, plans = pointwise_log_likelihood(
        rec.model, flat, *rec.model_args, executor=ex if executor is not None else None,
        chunk_draws=chunk_draws, chunk_rows=chunk_rows, **rec.model_kwargs)
    seconds = time.perf_counter() - t0
    if not values:
        return None, {}
    ll = {name: v.reshape((rec.num_chains, rec.num_draws) + v.shape[1:])
          for name, v in values.items()}
    ll_dims = {}
    observed = groups.get("observed_data")
    for name, v in ll.items():
        if name in dims:
            ll_dims[name] = list(dims[name])
        elif name in sites and sites[name].get("kind") == "observe" and observed is not None \
                and name in observed:
            # the observations' batch dims (the rows, then any later ones), as for a plain site
            ll_dims[name] = list(observed[name].dims[:v.ndim - 2])
        elif name in sites:
            ll_dims[name] = [f"{name}_dim_0"]
        elif observed is not None and name in observed:
            # as from_numpyro(log_likelihood=True) names them: the observation's batch dims
            ll_dims[name] = list(observed[name].dims[:v.ndim - 2])
    info = {}
    if plans:
        info = {"log_likelihood_seconds": float(seconds),
                "log_likelihood_chunk_draws": int(max(p.chunk_draws for p in plans.values())),
                "log_likelihood_chunk_rows": [int(p.chunk_rows) for p in plans.values()]}
    return container.dataset(ll, coords=coords, dims=ll_dims), info


def _posterior_predictive(rec, flat, groups, seed, coords):
    """The ``posterior_predictive`` dataset: every observed site drawn at every posterior
    draw (``numpyro.infer.Predictive`` of the model with its observations unobserved), on
    the observations' dims; ``None`` without observed sites."""
    observed = groups.get("observed_data")
    names = list(observed.data_vars) if observed is not None else []
    if not names:
        return None
    key = jax.random.PRNGKey(seed) if isinstance(seed, int) else seed
    with quietly():
        draws = Predictive(unobserved(rec.model, names=names), flat, return_sites=names)(
            key, *rec.model_args, **rec.model_kwargs)
    pp = {n: np.asarray(v).reshape((rec.num_chains, rec.num_draws) + np.shape(v)[1:])
          for n, v in draws.items()}
    dims = {n: list(observed[n].dims) for n in pp}
    return container.dataset(pp, coords=coords, dims=dims)


def _replay_sites(rec, flat) -> tuple[dict, int]:
    """From one abstract replay at the first draw: ``{site: info}`` of the pb.factor and
    pb.observe sites, and the bytes of one draw's pointwise log-likelihood, every
    likelihood site together (a ``pb.factor`` site's rows, the batch shape of a
    ``pb.observe`` or observed site)."""
    first = jax.tree.map(lambda x: x[0], flat)
    found: dict = {}
    values: dict = {}

    def replay(draw):
        trace = trace_model(rec.model, rec.model_args, rec.model_kwargs, params=draw)
        found.update(factor_sites(trace))
        for name, site in trace.items():
            if (site["type"] != "sample" or not site["is_observed"]
                    or site.get("infer", {}).get("is_auxiliary", False)):
                continue
            d = site_distribution(site["fn"])
            if d is not None and d.pb_site == "factor":
                leaves = jax.tree.leaves(d.data)
                n = d.rows if d.rows is not None else (leaves[0].shape[0] if leaves else 1)
            else:
                n = int(np.prod(site["fn"].batch_shape, dtype=np.int64))
            values[name] = int(n)
        return 0

    # Traced, not run: leaves computed from the draws (or from anything) stay tracers,
    # the data arrays given to the model stay concrete; no likelihood is evaluated.
    with quietly():
        jax.make_jaxpr(replay)(first)
    itemsize = 8 if jax.config.jax_enable_x64 else 4  # type: ignore[attr-defined, unused-ignore]
    return found, itemsize * sum(values.values())


def _add_constant_rows(groups: dict, sites: dict, coords, dims) -> None:
    """The concrete data leaves of each site in ``constant_data``, named
    ``<site>_<key path>``, rows on the site's row dimension."""
    values, var_dims = {}, {}
    for name, info in sites.items():
        row_dim = next(iter(dims.get(name, [f"{name}_dim_0"])))
        # an observed site's obs goes to observed_data
        data = info["data"][0] if info.get("kind") == "observe" else info["data"]
        for path, leaf in jax.tree_util.tree_flatten_with_path(data)[0]:
            if is_tracer(leaf):
                continue
            arr = np.asarray(leaf)
            keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
            var = "_".join([name, *keys]) if keys else f"{name}_data"
            values[var] = arr
            var_dims[var] = [row_dim] + [f"{var}_dim_{i}" for i in range(1, arr.ndim)]
    if not values:
        return
    used = {d for ds_dims in var_dims.values() for d in ds_dims}
    ds = xr.Dataset({k: (var_dims[k], v) for k, v in values.items()},
                    coords={k: v for k, v in (coords or {}).items() if k in used})
    if "constant_data" in groups:
        ds = xr.merge([groups["constant_data"], ds])
    groups["constant_data"] = ds
