"""``reduce_sum``: a pointwise log-likelihood, summed block by block.

This module owns the public primitive, end to end: validation at the boundary (before
any tracing; the checks are in :mod:`.arguments`), the call site's key and its
:class:`~parallel_backend.spec.SiteSpec` (made once per site and executor: the evaluation
form and the block plan read from ``fn``'s jaxpr), and the route the call takes
(:mod:`.routes`), whose partials reach JAX autodiff through the site's derivative rules
(:mod:`.derivatives`). Imports jax, numpy and the core; never NumPyro, dask or ArviZ.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from .analysis import (
    computes,
)
from .blocks import (
    plan_blocks,
    row_bytes,
)
from .derivatives import blocked_sum, site_value
from .errors import check_count
from .executors.registry import resolve_executor
from .identity import digest, site_key, snapshot
from .internals import is_tracer
from .routes import current_slot, route_of
from .site import SiteState
from .spec import make_spec

if TYPE_CHECKING:
    from jax.typing import ArrayLike

    from .executors.base import Executor

__all__ = ["RowSum", "Weighted", "reduce_rows", "reduce_sum"]


def reduce_sum(fn: Callable[..., ArrayLike], data: Any, *shared: Any,
               executor: Executor | str | None = None, grainsize: int | None = None,
               block_rows: int | None = None) -> jax.Array:
    """Sum a pointwise log-density over the rows of ``data``, in parallel chunks.

    The rows are cut into fixed-size blocks; an executor evaluates runs of blocks
    (chunks), value and gradient, and the per-block partials are combined in block
    order. The result equals ``fn(data, *shared).sum()`` and is bitwise the same
    whichever executor, worker count or chunking evaluated it.

    Parameters
    ----------
    fn : callable
        ``fn(data_chunk, *shared)`` returns the log-density of each row of
        ``data_chunk``: an array of shape ``(rows_in_chunk,)``.
    data : pytree of arrays
        Every leaf has the same leading size ``N``, the axis that is split. Float
        leaves may be parameters (per-row random effects) and get gradients.
    *shared : pytrees
        Passed whole to every chunk: parameters and small data.
    executor : Executor or str, optional
        Who evaluates the chunks; default: the innermost ``use_executor``, else
        the default executor (``SerialExecutor``). Fixed when the call is traced.
    grainsize : int, optional
        Rows per chunk (rounded to whole blocks); ``None`` lets the chunker pick
        from measured costs.
    block_rows : int, optional
        Rows per block. The default depends only on ``N`` and the bytes of data
        per row (about 256 KiB of data per block); results are bitwise
        reproducible for a given ``block_rows``.

    Returns
    -------
    jax.Array
        A scalar.

    Raises
    ------
    TypeError
        ``fn`` is not callable.
    ValueError
        Leaves of ``data`` with different leading sizes, ``grainsize < 1``, or an
        output of ``fn`` that is not of shape ``(rows,)``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, parallel_backend as pb
    >>> x = jnp.linspace(-1.0, 1.0, 5)
    >>> def loglik(x, mu):
    ...     return -0.5 * (x - mu) ** 2
    >>> float(pb.reduce_sum(loglik, x, 0.5))
    -1.875
    >>> float(jax.grad(lambda m: pb.reduce_sum(loglik, x, m))(0.5))
    -2.5
    """
    if not callable(fn):
        raise TypeError(f"reduce_sum: fn must be callable, got {type(fn).__name__}")
    grainsize = check_count(grainsize, "grainsize", "reduce_sum", none_ok=True,
                            what="rows per chunk")
    check_closure(fn)

    paths_leaves, data_treedef = jax.tree_util.tree_flatten_with_path(data)
    if not paths_leaves:
        raise ValueError("reduce_sum: data has no array leaves; it must hold the rows to split")
    paths = [jax.tree_util.keystr(p) or "data" for p, _ in paths_leaves]
    leaves = [as_leaf(x, "data" + p if p != "data" else p) for p, (_, x) in zip(paths, paths_leaves)]
    n_rows = leading_size(paths, leaves)

    shared_leaves, shared_treedef = jax.tree_util.tree_flatten(shared)
    shared_leaves = [as_leaf(x, "shared") for x in shared_leaves]

    plan = plan_blocks(n_rows, block_rows, row_bytes=row_bytes(leaves))
    if n_rows == 0:
        return jnp.zeros((), output_dtype(fn, data_treedef, leaves, shared_treedef, shared_leaves, 0))
    value_dtype = None
    traces: list[Any] = []
    for rows in sorted({plan.block_rows if plan.n_full else 0, plan.tail_rows} - {0}):
        value_dtype, closed = check_output(fn, data_treedef, leaves, shared_treedef,
                                           shared_leaves, rows, plan, paths)
        traces.append(computes(closed, rules=not traces))  # rules read alike on any block

    executor = resolve_executor(executor)
    traced_mask = tuple(is_tracer(x) for x in leaves)
    # jax before 0.12 gives its options no types (it sets them by setattr)
    x64 = bool(jax.config.jax_enable_x64)  # type: ignore[attr-defined, unused-ignore]
    resident = [x for x, t in zip(leaves, traced_mask) if not t]
    key = site_key(fn, data_treedef, shared_treedef, plan, x64, resident,
                   [(jnp.shape(x), str(jnp.result_type(x)), t) for x, t in zip(leaves, traced_mask)],
                   [(jnp.shape(x), str(jnp.result_type(x))) for x in shared_leaves], traces)

    def make():
        # The site keeps read-only copies of writable NumPy leaves; what it keeps must be
        # what the key hashed (another thread may change the user's array meanwhile).
        kept = [snapshot(x) for x in resident]
        if tuple(digest(x) for x in kept) != key.data:
            raise RuntimeError("reduce_sum: a data array changed while the call was traced "
                               "(another thread wrote to it); trace the model again")
        spec = make_spec(fn, data_treedef, shared_treedef, leaves, shared_leaves, plan,
                         value_dtype, x64, balance=block_rows is None, resident=kept)
        return SiteState(spec, kept, executor.workers, executor.chunks_per_worker)

    state = executor.site_state(key, make)
    choice = current_slot(executor, state)
    route = route_of(executor, state, grainsize, choice)
    traced = tuple(x for x in leaves if is_tracer(x))
    args = (traced, tuple(shared_leaves), choice)
    if route.eager_program and not any(map(is_tracer, (*traced, *shared_leaves))):
        # Called eagerly (NumPyro's initialisation runs the model so): one compiled program,
        # not an operation at a time.
        return route.eager("value", lambda: site_value(route, None))(*args)
    return site_value(route, functools.partial(blocked_sum, state.spec, resident))(*args)


def reduce_rows(fn: Callable[..., ArrayLike], data: Any, *shared: Any,
                executor: Executor | str | None = None, grainsize: int | None = None,
                block_rows: int | None = None, summed: bool = True) -> jax.Array:
    """``fn(data, *shared)``, the log-density of each row, evaluated as :func:`reduce_sum`
    evaluates (in blocks, on the executor, bitwise the same on every route).

    ``fn`` returns an array whose leading axis is the rows, ``(rows, *rest)``. What the
    call gives depends on whether it is differentiated and on ``summed``:

    * not differentiated (``numpyro.infer.log_likelihood``, a value alone): each row's
      value, through the site ``sum_i w_i fn(data, *shared)_i`` (:class:`Weighted`),
      whose gradient in the weights ``w`` at ``w = 1`` is the rows' values;
    * differentiated, ``summed=True`` (the default: a caller that sums the rows with one
      weight, as NumPyro's ``log_density`` does): the rows' sum in the first entry and
      zeros in the others, with the sum's derivatives of every order. So a gradient is
      one ``reduce_sum`` of ``fn``'s rows (:class:`RowSum`): parameters out, partials back,
      nothing per row;
    * differentiated, ``summed=False`` (a caller that weighs the rows one by one or reads
      them: per-row ``handlers.scale``, an estimator's proxy): the rows' values with
      their own derivatives (those of the weighted site, which cost a Hessian-vector
      product per gradient).

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> x = jnp.linspace(-1.0, 1.0, 5)
    >>> rows = reduce_rows(lambda x, m: -0.5 * (x - m) ** 2, x, 0.25)
    >>> rows.tolist()
    [-0.78125, -0.28125, -0.03125, -0.03125, -0.28125]
    >>> float(jax.grad(lambda m: reduce_rows(lambda x, m: -0.5 * (x - m) ** 2, x, m).sum())(0.5))
    -2.5
    """
    if not callable(fn):
        raise TypeError(f"reduce_rows: fn must be callable, got {type(fn).__name__}")
    leaves = jax.tree.leaves(data)
    if not leaves:
        raise ValueError("reduce_rows: data has no array leaves; it must hold the rows to split")
    n = int(jnp.shape(leaves[0])[0]) if jnp.ndim(leaves[0]) else 0
    out = jax.eval_shape(lambda d, s: fn(d, *s), _structs(data), _structs(shared))
    if not out.shape or out.shape[0] != n:
        raise ValueError(f"reduce_rows: fn must return the rows' values, an array of leading "
                         f"size {n} (the rows of data); got shape {out.shape}")
    site = _Rows(fn, data, shared, resolve_executor(executor), grainsize, block_rows,
                 out.shape, out.dtype)
    if summed:
        return site.summed(site.moving_leaves)
    return site.values(site.moving_leaves)


class _Rows:
    """The two sites of :func:`reduce_rows` over the same rows: ``total(moving)`` (the
    rows summed) and ``values(moving)`` (the rows' values), functions of the traced
    leaves only. Nothing here holds a tracer: the concrete leaves stay, the traced ones
    are arguments (a rule that held a traced value would fail once its trace ended, as
    under ``grad(jit(f))``)."""

    def __init__(self, fn, data, shared, executor, grainsize, block_rows, shape, dtype):
        flat, self.tree = jax.tree.flatten((data, shared))
        self.moving = tuple(i for i, x in enumerate(flat) if is_tracer(x))
        self.moving_leaves = tuple(flat[i] for i in self.moving)
        self.fixed = tuple(None if i in self.moving else x for i, x in enumerate(flat))
        self.fn, self.executor = fn, executor
        self.grainsize, self.block_rows = grainsize, block_rows
        self.shape, self.dtype = tuple(shape), dtype
        self.summed = jax.custom_jvp(self.values)
        self.summed.defjvp(self.summed_jvp)

    def rebuilt(self, moving):
        leaves = list(self.fixed)
        for i, x in zip(self.moving, moving):
            leaves[i] = x
        return jax.tree.unflatten(self.tree, leaves)

    def total(self, moving):
        data, shared = self.rebuilt(moving)
        return reduce_sum(RowSum(self.fn), data, *shared, executor=self.executor,
                          grainsize=self.grainsize, block_rows=self.block_rows)

    def values(self, moving):
        data, shared = self.rebuilt(moving)

        def weighted(w):
            return reduce_sum(Weighted(self.fn), (data, w), *shared, executor=self.executor,
                              grainsize=self.grainsize, block_rows=self.block_rows)

        return jax.grad(weighted)(jnp.ones(self.shape, self.dtype))

    def summed_jvp(self, primals, tangents):
        value, tangent = jax.jvp(self.total, primals, tangents)
        return self.first(value), self.first(tangent)

    def first(self, x):
        """``x`` (a scalar) in the first entry of an array of the rows' shape, zeros in
        the others (a pad: linear in ``x``, so JAX transposes it to the first entry of a
        cotangent)."""
        x = jnp.asarray(x, self.dtype)
        return jnp.pad(x.reshape((1,) * len(self.shape)), [(0, k - 1) for k in self.shape])


class RowSum:
    """``fn(data, *shared)`` summed over the axes after the rows: one value per row, the
    site through which :func:`reduce_rows` sums the rows. Keyed, as any callable object,
    by its class and ``fn``."""

    def __init__(self, fn: Callable[..., jax.Array]) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, data: Any, *shared: Any) -> jax.Array:
        terms = self.fn(data, *shared)
        return terms.reshape(terms.shape[:1] + (-1,)).sum(axis=1) if terms.ndim > 1 else terms


class Weighted:
    """``w * fn(data, *shared)`` of the rows ``(data, w)``, summed over the axes after the
    rows: the site through which :func:`reduce_rows` evaluates ``fn``. Keyed, as any
    callable object, by its class and ``fn``."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, rows, *shared):
        data, w = rows
        terms = w * self.fn(data, *shared)
        return terms.reshape(terms.shape[:1] + (-1,)).sum(axis=1) if terms.ndim > 1 else terms


def _structs(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


# -- checks at the boundary -------------------------------------------------------------


def as_leaf(x, where: str):
    if is_tracer(x) or isinstance(x, (np.ndarray, jax.Array)):
        return x
    try:
        return jnp.asarray(x)
    except TypeError as e:
        raise TypeError(f"reduce_sum: {where} leaf of type {type(x).__name__} is not an array") from e


def leading_size(paths, leaves) -> int:
    sizes: dict[int, list[str]] = {}
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
