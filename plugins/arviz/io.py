"""Save a run (``arviz.InferenceData``) as netCDF and load it back unchanged.

netCDF keeps attribute values as numbers, strings and 1-d arrays: a one-element
list comes back as a scalar and ints as numpy scalars. :func:`save` records which
attributes were lists; :func:`load` restores them and returns plain Python values,
so ``load(save(idata, path)).attrs == idata.attrs``. Imports arviz and numpy.
"""

from __future__ import annotations

import os

import arviz as az
import numpy as np

__all__ = ["save", "load"]

#: Attribute naming the list-valued attributes of a group (removed again by load).
LIST_ATTRS = "parallel_backend_list_attrs"


def save(idata, path) -> str:
    """Write ``idata`` (every group and all attributes) to the netCDF file ``path``.

    Parameters
    ----------
    idata : arviz.InferenceData
    path : str or os.PathLike

    Returns
    -------
    str
        The path written.

    Raises
    ------
    TypeError
        An attribute netCDF cannot store (a dict, None...); the message names it.

    Examples
    --------
    >>> import os, tempfile, numpy as np, arviz as az
    >>> from parallel_backend.plugins.arviz import save, load
    >>> idata = az.from_dict(posterior={"mu": np.zeros((2, 5))})
    >>> idata.attrs["chunk_rows"] = [128]
    >>> back = load(save(idata, os.path.join(tempfile.mkdtemp(), "run.nc")))
    >>> back.posterior["mu"].shape, back.attrs["chunk_rows"]
    ((2, 5), [128])
    """
    path = os.fspath(path)
    originals = [(None, dict(idata.attrs))] + [(g, dict(getattr(idata, g).attrs))
                                                for g in idata.groups()]
    try:
        for group, attrs in originals:
            target = idata.attrs if group is None else getattr(idata, group).attrs
            target.update(_encode(attrs, group))
        idata.to_netcdf(path)
    finally:
        for group, attrs in originals:
            target = idata.attrs if group is None else getattr(idata, group).attrs
            target.clear()
            target.update(attrs)
    return path


def load(path):
    """Read a run written by :func:`save`, fully into memory (the file is closed).

    Parameters
    ----------
    path : str or os.PathLike

    Returns
    -------
    arviz.InferenceData
        Equal to the saved one: same groups, values, dtypes and attributes.

    Raises
    ------
    FileNotFoundError
        No file at ``path``.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"load: no file at {path!r}; write one with save(idata, path)")
    lazy = az.from_netcdf(path)
    groups = {}
    for name in lazy.groups():
        ds = getattr(lazy, name)
        groups[name] = ds.load()
        ds.close()
        groups[name].attrs = _decode(groups[name].attrs)
    idata = az.InferenceData(**groups)
    idata.attrs.clear()
    idata.attrs.update(_decode(lazy.attrs))
    return idata


def _encode(attrs: dict, group) -> dict:
    out, lists = {}, []
    for k, v in attrs.items():
        if isinstance(v, (list, tuple)):
            lists.append(k)
            v = np.asarray(v)
        elif isinstance(v, (bool, np.bool_)):
            raise TypeError(f"save: attribute {k!r} of {group or 'the InferenceData'} is a bool, "
                            "which netCDF cannot store; store it as an int or a str")
        elif v is None or isinstance(v, dict):
            raise TypeError(f"save: attribute {k!r} of {group or 'the InferenceData'} is "
                            f"{type(v).__name__}, which netCDF cannot store; drop it or make it a str")
        out[k] = v
    if lists:
        out[LIST_ATTRS] = ",".join(lists)
    return out


def _decode(attrs) -> dict:
    attrs = dict(attrs)
    lists = set(filter(None, str(attrs.pop(LIST_ATTRS, "")).split(",")))
    out = {}
    for k, v in attrs.items():
        if isinstance(v, np.ndarray):
            v = v.tolist()
        elif isinstance(v, np.generic):
            v = v.item()
        if k in lists and not isinstance(v, list):
            v = [v]
        out[k] = v
    return out
