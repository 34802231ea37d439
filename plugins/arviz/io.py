"""Save a run (``arviz.InferenceData``) as netCDF and load it back unchanged.

netCDF keeps attribute values as numbers, strings and 1-d arrays: a one-element
list comes back as a scalar and ints as numpy scalars. :func:`save` records which
attributes were lists; :func:`load` restores them and returns plain Python values,
so ``load(save(idata, path)).attrs == idata.attrs``. :func:`save` replaces the file
atomically (a temporary file beside it, flushed to disk, then renamed), so a crash or a
kill while writing leaves the previous file whole: ``pb.sample``'s checkpoints rely on
it. :func:`load` of an unfinished checkpoint gives the draws made so far. Imports arviz
and numpy.
"""

from __future__ import annotations

import contextlib
import os

import arviz as az
import numpy as np

__all__ = ["save", "load", "read_groups"]

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
        with _local_lock():
            _replace(path, idata.to_netcdf)
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
        Equal to the saved one: same groups, values, dtypes and attributes. From a
        ``pb.sample`` checkpoint of an unfinished run: ``posterior`` and
        ``sample_stats`` hold the draws every chain has made (``attrs["draws_done"]``
        per chain), without the sampler state.

    Raises
    ------
    FileNotFoundError
        No file at ``path``.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"load: no file at {path!r}; write one with save(idata, path)")
    attrs, groups = read_groups(path)
    done = attrs.get("draws_done")
    if done is not None:  # an unfinished pb.sample checkpoint: the draws every chain made
        groups.pop("sampler_state", None)
        for name in ("posterior", "sample_stats"):
            if name in groups:
                groups[name] = groups[name].isel(draw=slice(0, min(done)))
    idata = az.InferenceData(**groups)
    idata.attrs.clear()
    idata.attrs.update(attrs)
    return idata


def read_groups(path) -> tuple:
    """``(attrs, {group: xarray.Dataset})`` of the netCDF file ``path``, read into memory
    with the attributes decoded as :func:`load` returns them, nothing left out.

    The file is opened once and every group read through that handle (``arviz.from_netcdf``
    opens it again per group): a file replaced meanwhile, as a running ``pb.sample``
    replaces its checkpoint, is read whole from one version."""
    import h5netcdf
    import xarray as xr

    groups = {}
    with h5netcdf.File(os.fspath(path), "r") as f:
        for name in list(f.groups):
            ds = xr.open_dataset(xr.backends.H5NetCDFStore(f, group=name)).load()
            ds.attrs = _decode(ds.attrs)
            groups[name] = ds
        attrs = _decode(xr.open_dataset(xr.backends.H5NetCDFStore(f)).attrs)
    return attrs, groups


def _local_lock():
    """A block in which xarray locks files with a process-local lock. With a
    dask.distributed client as dask's default scheduler it would take a lock on the
    scheduler for every variable written: a round trip each, and a save that fails when
    the scheduler is gone (a checkpoint is needed most then)."""
    try:
        import dask
    except ImportError:
        return contextlib.nullcontext()
    return dask.config.set(scheduler="synchronous")


def _replace(path: str, write) -> None:
    """``write(temporary path)``, flushed to disk, then renamed over ``path`` (one step
    on POSIX and Windows): readers see the old file or the new one, never a part."""
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)),
                       f".{os.path.basename(path)}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    if hasattr(os, "O_DIRECTORY"):  # the rename itself on disk (POSIX)
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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
