"""Checks of ``reduce_sum``'s arguments, at the boundary, before anything is traced or
split: every data leaf an array with the same leading size, no traced value hidden in
``fn``'s closure, and ``fn`` returning one floating-point log-density per row of a block
(traced on a block's shapes, so that its errors surface in the caller, naming the rows).
Imports jax and numpy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .internals import is_tracer

__all__ = ["as_leaf", "check_closure", "check_output", "leading_size", "output_dtype"]


def as_leaf(x, where: str):
    if is_tracer(x) or isinstance(x, (np.ndarray, jax.Array)):
        return x
    try:
        return jnp.asarray(x)
    except TypeError as e:
        raise TypeError(f"reduce_sum: {where} leaf of type {type(x).__name__} is not an array") from e


def leading_size(paths, leaves) -> int:
    sizes = {}
    for path, x in zip(paths, leaves):
        shape = jnp.shape(x)
        if len(shape) == 0:
            raise ValueError(f"reduce_sum: data leaf {path} is a scalar (shape ()); every data leaf "
                             "needs the leading row axis N. Pass scalars in *shared instead.")
        sizes.setdefault(shape[0], []).append(f"{path}: {tuple(shape)}")
    if len(sizes) > 1:
        listing = "; ".join(s for group in sizes.values() for s in group)
        raise ValueError("reduce_sum: data leaves must share the leading size N (the rows to split), "
                         f"got {listing}")
    return int(next(iter(sizes)))


def cell_ok(cell) -> bool:
    try:
        _ = cell.cell_contents  # an empty cell raises
    except ValueError:
        return False
    return True


def check_closure(fn) -> None:
    objs = []
    if isinstance(fn, functools.partial):
        objs += list(fn.args) + list(fn.keywords.values())
        fn = fn.func
    objs += [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if cell_ok(c)]
    for obj in objs:
        if any(is_tracer(x) for x in jax.tree_util.tree_leaves(obj)):
            raise ValueError(
                "reduce_sum: fn closes over a traced value (a parameter of the model). Chunks may "
                "run on other threads, processes or machines, so pass parameters explicitly: "
                "reduce_sum(fn, data, param, ...) with fn(data_chunk, param, ...).")


def block_struct(leaves, rows):
    return [jax.ShapeDtypeStruct((rows,) + tuple(jnp.shape(x))[1:], jnp.result_type(x)) for x in leaves]


def shape_on_block(fn, data_treedef, leaves, shared_treedef, shared_leaves, rows):
    """``fn`` traced on a block of ``rows`` rows (nothing computed): its jaxpr and its
    output's shape and dtype. Shared leaves enter with their dtype, never weakly typed
    (a Python float one trace, an array the next), as the site's blocks see them."""
    shared = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in shared_leaves]
    return jax.make_jaxpr(
        lambda d, s: fn(jax.tree_util.tree_unflatten(data_treedef, d),
                        *jax.tree_util.tree_unflatten(shared_treedef, s)), return_shape=True,
    )(block_struct(leaves, rows), shared)


def output_dtype(fn, data_treedef, leaves, shared_treedef, shared_leaves, rows):
    try:
        return shape_on_block(fn, data_treedef, leaves, shared_treedef, shared_leaves,
                              rows)[1].dtype
    except Exception:  # noqa: BLE001 - fn may not handle 0 rows; fall back to the default float
        return jnp.result_type(float)


def check_output(fn, data_treedef, leaves, shared_treedef, shared_leaves, rows, plan, paths):
    """Trace ``fn`` on a block's shapes: errors surface here, in the caller, before sampling.
    Returns the output's dtype and the trace (a ``ClosedJaxpr``)."""
    start = 0 if rows == plan.block_rows and plan.n_full else plan.n_full * plan.block_rows
    try:
        closed, out = shape_on_block(fn, data_treedef, leaves, shared_treedef, shared_leaves,
                                     rows)
    except Exception as e:
        e.add_note(f"reduce_sum: raised by fn on a chunk of rows [{start}, {start + rows}) "
                   f"of data with leaves {', '.join(paths)}")
        raise
    if not hasattr(out, "shape"):
        raise TypeError(f"reduce_sum: fn must return one array of shape ({rows},) for a chunk of "
                        f"{rows} rows, got {type(out).__name__}")
    if out.shape == ():
        raise ValueError(
            f"reduce_sum: fn returned a scalar for a chunk of {rows} rows; it must return the "
            f"pointwise log-density, shape ({rows},). A Stan-style partial sum (fn(...).sum()) "
            "is not accepted: drop the .sum(), reduce_sum does the summing.")
    if out.shape != (rows,):
        raise ValueError(f"reduce_sum: fn must return shape ({rows},) for a chunk of {rows} rows "
                         f"(one log-density per row), got shape {out.shape}")
    if not jnp.issubdtype(out.dtype, jnp.inexact):
        raise TypeError(f"reduce_sum: fn must return floating-point log-densities, got {out.dtype}")
    return out.dtype, closed
