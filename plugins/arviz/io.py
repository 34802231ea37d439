"""Save a run as netCDF and load it back unchanged, under either ArviZ major.

One file format for both: a netCDF4 file (HDF5, written and read by h5netcdf through
xarray's public ``DataTree.to_netcdf`` and ``open_datatree``) with one group per ArviZ
group and the run's attributes at its root. A file written under ArviZ 0.x loads
under 1.x and the other way round; :func:`load` returns the installed major's container.

netCDF keeps attribute values as numbers, strings and 1-d arrays: a one-element list
comes back as a scalar and ints as numpy scalars. :func:`save` records which attributes
were lists; :func:`load` restores them and returns plain Python values, so
``load(save(run, path)).attrs == run.attrs``. :func:`save` replaces the file atomically
(a temporary file beside it, flushed to disk, then renamed), so a crash or a kill while
writing leaves the previous file whole: ``pb.sample``'s checkpoints rely on it.
:func:`load` of an unfinished checkpoint gives the draws made so far. Imports xarray,
numpy and :mod:`.container`.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import TYPE_CHECKING, Final

import numpy as np
import xarray as xr

from . import container

if TYPE_CHECKING:
    import arviz

__all__ = ["ENGINE", "load", "read_groups", "save", "write_groups"]

#: Attribute naming the list-valued attributes of a group (removed again by load).
LIST_ATTRS = "parallel_backend_list_attrs"
#: Attribute naming the attributes stored as JSON text: lists that are not all numbers
#: (ArviZ 1.x's ``sample_dims``), which netCDF cannot store as arrays.
JSON_ATTRS = "parallel_backend_json_attrs"
#: netCDF4 with groups, the same library on every stack.
ENGINE: Final = "h5netcdf"


def save(run: xr.DataTree | arviz.InferenceData, path: str | os.PathLike[str]) -> str:
    """Write ``run`` (every group and all attributes) to the netCDF file ``path``.

    Parameters
    ----------
    run : xarray.DataTree or arviz.InferenceData
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
    >>> import os, tempfile, numpy as np, xarray as xr
    >>> from parallel_backend.plugins.arviz import save, load
    >>> from parallel_backend.plugins.arviz.container import build
    >>> run = build({"posterior": xr.Dataset({"mu": (("chain", "draw"), np.zeros((2, 5)))})},
    ...             {"chunk_rows": [128]})
    >>> back = load(save(run, os.path.join(tempfile.mkdtemp(), "run.nc")))
    >>> back.posterior["mu"].shape, back.attrs["chunk_rows"]
    ((2, 5), [128])
    """
    groups, attrs = container.parts(run)
    return write_groups(path, groups, attrs)


def write_groups(path, groups: dict, attrs: dict) -> str:
    """Write ``groups`` (``{name: xarray.Dataset}``) and root ``attrs`` to ``path``,
    atomically (see the module docstring); nothing of the arguments is changed."""
    path = os.fspath(path)
    encoded = {}
    for name, ds in groups.items():
        encoded[name] = ds.copy(deep=False)  # a new attrs dict; the data is shared
        encoded[name].attrs = _encode(dict(ds.attrs), name)
    tree = xr.DataTree.from_dict({"/": xr.Dataset(attrs=_encode(dict(attrs), None)), **encoded})
    with _local_lock():
        _replace(path, lambda tmp: tree.to_netcdf(tmp, engine=ENGINE))
    return path


def load(path: str | os.PathLike[str]) -> xr.DataTree | arviz.InferenceData:
    """Read a run written by :func:`save` (under either ArviZ major), fully into memory
    (the file is closed).

    Parameters
    ----------
    path : str or os.PathLike

    Returns
    -------
    xarray.DataTree or arviz.InferenceData
        As the installed ArviZ keeps a run; equal to the saved one: same groups, values,
        dtypes and attributes. From a ``pb.sample`` checkpoint of an unfinished run:
        ``posterior`` and ``sample_stats`` hold the draws every chain has made
        (``attrs["draws_done"]`` per chain), without the sampler state.

    Raises
    ------
    FileNotFoundError
        No file at ``path``.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"load: no file at {path!r}; write one with save(run, path)")
    attrs, groups = read_groups(path)
    done = attrs.get("draws_done")
    if done is not None:  # an unfinished pb.sample checkpoint: the draws every chain made
        groups.pop("sampler_state", None)
        for name in ("posterior", "sample_stats"):
            if name in groups:
                groups[name] = groups[name].isel(draw=slice(0, min(done)))
    return container.build(groups, attrs)


def read_groups(path) -> tuple:
    """``(attrs, {group: xarray.Dataset})`` of the netCDF file ``path``, read into memory
    with the attributes decoded as :func:`load` returns them, nothing left out.

    The file is opened once, as one open file that every group is read through: a file
    replaced meanwhile, as a running ``pb.sample`` replaces its checkpoint, is read whole
    from one version."""
    with open(os.fspath(path), "rb") as f:
        tree = xr.open_datatree(f, engine=ENGINE)
        try:
            tree.load()
        finally:
            tree.close()
    groups = {}
    for name, node in tree.children.items():
        ds = node.to_dataset()
        ds.attrs = _decode(ds.attrs)
        groups[name] = ds
    return _decode(tree.attrs), groups


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
    out, lists, texts = {}, [], []
    for k, v in attrs.items():
        if isinstance(v, (list, tuple)) and not all(
                isinstance(x, (int, float, np.number)) and not isinstance(x, bool) for x in v):
            texts.append(k)
            v = json.dumps(list(v))
        elif isinstance(v, (list, tuple)):
            lists.append(k)
            v = np.asarray(v)
        elif isinstance(v, (bool, np.bool_)):
            raise TypeError(f"save: attribute {k!r} of {group or 'the run'} is a bool, "
                            "which netCDF cannot store; store it as an int or a str")
        elif v is None or isinstance(v, dict):
            raise TypeError(f"save: attribute {k!r} of {group or 'the run'} is "
                            f"{type(v).__name__}, which netCDF cannot store; drop it or make it "
                            "a str")
        out[k] = v
    if lists:
        out[LIST_ATTRS] = ",".join(lists)
    if texts:
        out[JSON_ATTRS] = ",".join(texts)
    return out


def _decode(attrs) -> dict:
    attrs = dict(attrs)
    lists = set(filter(None, str(attrs.pop(LIST_ATTRS, "")).split(",")))
    texts = set(filter(None, str(attrs.pop(JSON_ATTRS, "")).split(",")))
    out = {}
    for k, v in attrs.items():
        if k in texts:
            out[k] = json.loads(v)
            continue
        if isinstance(v, np.ndarray):
            v = v.tolist()
        elif isinstance(v, np.generic):
            v = v.item()
        if k in lists and not isinstance(v, list):
            v = [v]
        out[k] = v
    return out
