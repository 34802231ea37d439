"""The one place that knows which ArviZ is installed.

ArviZ 1.x (Python >= 3.12) keeps a run in an ``xarray.DataTree`` with one child per
group; ArviZ 0.x in an ``arviz.InferenceData``. Everything else in this plugin works
on plain parts, ``({group: xarray.Dataset}, attrs)``, and turns them into the
installed major's container only at the end (:func:`build`), so both majors take the
same path but for :func:`from_numpyro`, :func:`dataset` and :func:`build`/:func:`parts`.

:func:`from_numpyro` hands ArviZ a finished run through ArviZ's public interface for
each major: a ``NumPyroInferenceAdapter`` subclass on 1.x; on 0.x, whose
``from_numpyro`` takes only an ``MCMC``, an object with the attributes it reads from
one (:class:`_MCMCView`). Imports arviz, xarray, numpy and jax.
"""

from __future__ import annotations

import types

import arviz as az
import jax
import numpy as np
import xarray as xr

__all__ = ["ARVIZ_MAJOR", "DATATREE", "ORDER", "build", "dataset", "from_numpyro", "group_names",
           "parts"]

ARVIZ_MAJOR = int(az.__version__.split(".")[0])
#: Whether runs are ``xarray.DataTree`` (ArviZ 1.x) rather than ``arviz.InferenceData``.
DATATREE = ARVIZ_MAJOR >= 1
#: Groups in the order ``arviz.from_numpyro`` makes them; others follow in their own order.
ORDER = ("posterior", "sample_stats", "log_likelihood", "posterior_predictive", "predictions",
         "prior", "prior_predictive", "observed_data", "constant_data",
         "predictions_constant_data")


def _numpyro():
    import numpyro

    return numpyro


def from_numpyro(record, **kwargs):
    """``arviz.from_numpyro`` of a :class:`~parallel_backend.plugins.numpyro.RunRecord`
    (without the log-likelihood, which this plugin computes on the executor)."""
    if DATATREE:
        if kwargs.get("dims") is None and record.model is not None:
            # Named here, not by ArviZ's infer_dims: that reads numpyro.infer.initialization
            # as an attribute, missing where ArviZ was imported before NumPyro (below).
            kwargs["dims"] = plate_dims(record.model, record.model_args, record.model_kwargs)
        if kwargs.get("pred_dims") is None:
            kwargs["pred_dims"] = kwargs["dims"]
        return az.from_numpyro(_adapter(record), log_likelihood=False, **kwargs)
    return az.from_numpyro(_MCMCView(record), log_likelihood=False, **kwargs)


def dataset(data: dict, coords=None, dims=None) -> xr.Dataset:
    """``arviz.dict_to_dataset`` of ``data`` (leading dims chain, draw) with NumPyro as
    the inference library, as the installed ArviZ names it."""
    key = "inference_library" if DATATREE else "library"
    return az.dict_to_dataset(data, coords=coords, dims=dims, **{key: _numpyro()})


def build(groups: dict, attrs: dict):
    """The installed ArviZ's container of ``groups`` (``{name: xarray.Dataset}``) with
    ``attrs`` at its root, groups in :data:`ORDER`."""
    names = sorted(groups, key=lambda g: (ORDER.index(g) if g in ORDER else len(ORDER)))
    if DATATREE:
        tree = xr.DataTree.from_dict({"/": xr.Dataset(attrs=dict(attrs)),
                                      **{g: groups[g] for g in names}})
        return tree
    idata = az.InferenceData(**{g: groups[g] for g in names})
    idata.attrs.update(attrs)
    return idata


def parts(run) -> tuple[dict, dict]:
    """``({group: xarray.Dataset}, attrs)`` of a run in either container (copies of the
    attribute dicts; the datasets are the run's)."""
    if isinstance(run, xr.DataTree):
        groups = {name: node.to_dataset() for name, node in run.children.items()}
        return groups, dict(run.attrs)
    return {g: getattr(run, g) for g in run.groups()}, dict(run.attrs)


def group_names(run) -> list[str]:
    """The groups of a run in either container."""
    return list(parts(run)[0])


# -- handing a run to ArviZ -------------------------------------------------------------


def plate_dims(model, args=(), kwargs=None) -> dict:
    """``{site: [dim names]}``: the plates each sample or deterministic site sits in,
    outermost first, then the ``infer={"event_dims": [...]}`` names it declares (the names
    ArviZ gives from the same trace). Traced abstractly: nothing is computed.

    Why not ArviZ's own ``infer_dims``: ArviZ 1.x loads numpyro lazily
    (``lazy_loader.load``); where ArviZ is imported before NumPyro, the first
    ``import numpyro.infer`` runs ``numpyro/infer/__init__.py`` twice, and the package
    left in ``sys.modules`` lacks its submodules as attributes, so ArviZ's
    ``numpyro.infer.initialization`` fails (arviz-base 1.3, lazy_loader 0.4, numpyro
    0.22). Imported by name, as here, the submodule is found either way."""
    from numpyro import handlers
    from numpyro.infer.initialization import init_to_sample

    def sites():
        seeded = handlers.substitute(handlers.seed(model, 0), substitute_fn=init_to_sample)
        trace = handlers.trace(seeded).get_trace(*args, **(kwargs or {}))
        out = {}
        for name, site in trace.items():
            if site["type"] not in ("sample", "deterministic"):
                continue
            frames = sorted(site.get("cond_indep_stack", ()), key=lambda f: f.dim)
            names = [f.name for f in frames] + list(site.get("infer", {}).get("event_dims", ()))
            if names:
                out[name] = names
        return out

    found = {}

    def record():  # names are Python values: kept aside, the trace returns nothing
        found.update(sites())

    jax.eval_shape(record)
    return found


def _adapter(record):
    """ArviZ 1.x's public way to convert draws a custom driver made."""

    class RunAdapter(az.NumPyroInferenceAdapter):
        def __init__(self, rec):
            super().__init__(None, rec.model, rec.model_args, rec.model_kwargs,
                             (rec.num_chains, rec.num_draws))
            # ArviZ 1.x reads this from an adapter to mark reached_max_tree_depth, as its
            # own MCMC adapter sets it.
            self._max_tree_depth = rec.max_tree_depth
            self.record = rec

        @property
        def sample_dims(self):
            return ["chain", "draw"]

        def get_samples(self, seed=None, **kwargs):
            return self.record.samples

        def get_sample_stats(self, **kwargs):
            return dict(self.record.stats)

    return RunAdapter(record)


class _MCMCView:
    """What ArviZ 0.x's ``from_numpyro`` reads from a ``numpyro.infer.MCMC`` (its only
    input type): the model, the arguments, counts and the draws."""

    thinning = 1

    def __init__(self, record):
        self.sampler = types.SimpleNamespace(model=record.model)
        self.num_chains, self.num_samples = record.num_chains, record.num_draws
        self._args, self._kwargs = record.model_args, record.model_kwargs
        self.record = record

    def _get(self, tree, group_by_chain):
        if group_by_chain:
            return tree
        return jax.tree.map(lambda x: np.reshape(x, (-1,) + np.shape(x)[2:]), tree)

    def get_samples(self, group_by_chain=False):
        return self._get(self.record.samples, group_by_chain)

    def get_extra_fields(self, group_by_chain=False):
        return self._get(dict(self.record.stats), group_by_chain)
