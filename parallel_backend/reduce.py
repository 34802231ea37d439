"""``reduce_sum``: a pointwise log-likelihood, summed block by block, with a custom JVP.

This module owns the public primitive: validation at the boundary (before any tracing;
the checks are in :mod:`.arguments`), the call site's :class:`~parallel_backend.spec.SiteSpec`,
the ``jax.custom_jvp`` that hands value and gradients to JAX autodiff (second derivatives:
:mod:`.second_order`), and the ``jax.pure_callback`` through which the host path
(:mod:`.host`) runs. It imports jax, numpy and the core modules; never NumPyro, dask or ArviZ.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from . import host as host_path
from .arguments import as_leaf, check_closure, check_output, leading_size, output_dtype
from .batching import set_batching, tangent_batching
from .blocks import (
    MIN_BLOCK_ROWS,
    BlockPlan,
    TilePlan,
    balance_blocks,
    looped_blocks,
    plan_blocks,
    plan_tiles,
    row_bytes,
)
from .dispatch import HOST, current_slot
from .errors import check_count
from .executors.registry import resolve_executor
from .forms import form_of, row_reduce_cap, row_reduce_elements, scan_reduce_per_row, sets_form
from .guards import fence, one_program
from .hoist import conditions, constant_conditions
from .identity import site_key, snapshot
from .internals import is_tracer
from .second_order import blocked_sum, kept, linear_zeros, merge, symmetric_product, tangent_of
from .site import SiteState, run_eagerly
from .spec import SiteSpec
from .tasks import combine, host_device, pad_blocks
from .traced import computes

__all__ = ["reduce_sum"]


def reduce_sum(fn, data, *shared, executor=None, grainsize=None, block_rows=None):
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
    value_dtype, traces = None, []
    for rows in sorted({plan.block_rows if plan.n_full else 0, plan.tail_rows} - {0}):
        value_dtype, closed = check_output(fn, data_treedef, leaves, shared_treedef,
                                           shared_leaves, rows, plan, paths)
        traces.append(computes(closed, rules=not traces))  # rules read alike on any block

    executor = resolve_executor(executor)
    traced_mask = tuple(_is_traced(x) for x in leaves)
    x64 = bool(jax.config.jax_enable_x64)
    # What the key hashes is what the site keeps: a NumPy leaf is copied first, so a change
    # in place (by another thread, say) cannot part the key from the rows.
    resident = [snapshot(x) for x, t in zip(leaves, traced_mask) if not t]
    key = site_key(fn, data_treedef, shared_treedef, plan, x64, resident,
                   [(jnp.shape(x), str(jnp.result_type(x)), t) for x, t in zip(leaves, traced_mask)],
                   [(jnp.shape(x), str(jnp.result_type(x))) for x in shared_leaves], traces)

    def make():
        spec = make_spec(fn, data_treedef, shared_treedef, leaves, shared_leaves, plan,
                         value_dtype, x64, balance=block_rows is None, resident=resident)
        return SiteState(spec, resident, executor.workers)

    state = executor.site_state(key, make)
    default = executor.route(state)
    choice = current_slot(executor, state)
    traced = tuple(x for x in leaves if _is_traced(x))
    route = default if choice is None else None
    if route == "host" and not traced and not any(map(_is_traced, shared_leaves)):
        # Called eagerly (NumPyro's initialisation runs the model so): one program. Op by
        # op, the ops after the callback took every slot of XLA's in-flight limit, and the
        # chunk programs it waits for, launched from the executor's threads, waited for one.
        # (The graph route's blocks are one program already, the data its argument.)
        eager = state.eager_call((grainsize, "value"),
                                 lambda: _reduce(state, executor, grainsize, route, _no_derivative))
        return eager(traced, tuple(shared_leaves), choice)
    blocked = functools.partial(blocked_sum, state.spec, resident)
    call = _reduce(state, executor, grainsize, route, blocked)
    return call(traced, tuple(shared_leaves), choice)


def _combined(values, shared_grads, data_grads):
    return fence(combine(values, shared_grads, data_grads))


#: ``fence(combine(...))`` of partials computed eagerly, as one program (guard ``one_program``).
_finish = one_program(_combined)


def _no_derivative(*args):
    raise AssertionError("an eager call has no tangents: its program differentiates nothing")


def make_spec(fn, data_treedef, shared_treedef, leaves, shared_leaves, plan, value_dtype, x64,
              label=None, balance=True, resident=None) -> SiteSpec:
    """The :class:`SiteSpec` of a call: which leaves are traced, the evaluation form (from
    a trace of ``fn`` on one block), the tile plan, and, with the default block size, the
    form's own blocks: batched, no larger than :func:`~.forms.row_reduce_cap` allows and
    evened out; looped, :func:`~.blocks.looped_blocks`; and the conditions on the
    resident rows read as constants."""
    traced = tuple(_is_traced(x) for x in leaves)
    row_avals = tuple((tuple(jnp.shape(x)[1:]), str(jnp.result_type(x))) for x in leaves)
    shared_avals = tuple((tuple(jnp.shape(x)), str(jnp.result_type(x))) for x in shared_leaves)
    label = label or getattr(fn, "__name__", type(fn).__name__)
    draft = SiteSpec(fn, data_treedef, shared_treedef, traced, row_avals, shared_avals, plan,
                     TilePlan(plan.n_blocks, 1), "batched", str(np.dtype(value_dtype)),
                     bool(x64), label)
    resident_s, traced_s, shared_s = draft.block_struct()
    block, rows = draft.block_fn(), draft.plan.block_rows

    def trace(n):  # fn on a block of ``n`` rows
        return jax.make_jaxpr(block)(*draft._replace(plan=BlockPlan(n, n, 1, 0))
                                     .block_struct())

    with jax.enable_x64(x64):
        closed = jax.make_jaxpr(block)(resident_s, traced_s, shared_s)
        form, row_loop = form_of(closed, rows, fixed=not balance)
        if form == "batched" and not _batchable(block, resident_s, traced_s, shared_s):
            form = "looped"
        if balance and form == "looped":
            per_row = (row_reduce_elements(closed, rows) if row_loop
                       else scan_reduce_per_row(closed, rows, trace))
            plan = looped_blocks(plan.n_rows, np.dtype(value_dtype).itemsize, per_row)
    if balance and form == "batched":  # smaller blocks where fn reduces within rows
        cap = row_reduce_cap(closed, rows)
        if cap and max(cap, MIN_BLOCK_ROWS) < plan.block_rows:
            plan = plan_blocks(plan.n_rows, max(cap, MIN_BLOCK_ROWS))
        plan = balance_blocks(plan)
    spec = draft._replace(plan=plan, form=form, tiles=plan_tiles(plan, batched=form == "batched"),
                          row_loop=row_loop, sets=sets_form(closed, rows, form))
    if resident is None:
        resident = [x for x, t in zip(leaves, traced) if not t]
    # fn on one block of the spec's plan, as every process traces it
    with jax.enable_x64(x64), jax.default_device(host_device()):
        closed = jax.make_jaxpr(spec.block_fn())(*spec.block_struct())
        digest = computes(closed)
    return spec._replace(constants=_constants(spec, resident, closed), computes=digest)


def _constants(spec: SiteSpec, resident, closed) -> tuple:
    """Conditions on the data that hold in every row or in none, constants on every route
    (:func:`.hoist.constant_conditions`), read from ``closed`` (``fn`` on one block)."""
    structs = spec.block_struct()
    with jax.enable_x64(spec.x64), jax.default_device(host_device()):
        found = conditions(closed, len(structs[0]))
        if not found:  # the data are padded into blocks only where there is a condition
            return ()
        blocks = [pad_blocks(np.asarray(x), spec.plan) for x in resident]
        try:
            return run_eagerly(constant_conditions, closed, len(structs[0]), blocks, found)
        except Exception:  # noqa: BLE001 - a shortcut only: without it every route reads them
            return ()


def _batchable(block, resident, traced, shared) -> bool:
    """Whether ``fn`` can be ``vmap``-ed over blocks (a callback without a
    ``vmap_method`` cannot); otherwise its blocks are looped over."""

    def stack(structs):
        return [jax.ShapeDtypeStruct((2,) + s.shape, s.dtype) for s in structs]

    try:
        jax.eval_shape(jax.vmap(block, in_axes=(0, 0, None)), stack(resident), stack(traced),
                       shared)
    except Exception:  # noqa: BLE001 - any failure to batch means: loop instead
        return False
    return True


# -- the custom JVP ----------------------------------------------------------------


def _reduce(state, executor, grainsize, route, blocked, grads=False):
    """The differentiable function of (traced data leaves, shared leaves, choice),
    evaluated on ``route`` (``"graph"`` or ``"host"``; ``choice`` is ``None``), or, with
    ``route=None``, where the int32 ``choice`` says when the program runs
    (:data:`~parallel_backend.dispatch.HOST` or ``GRAPH``; both are compiled in).
    ``grads``: its value and gradients, ``f(traced, shared, choice, dt, ds)``, instead."""
    counter = executor.graph_counter(state) if executor.count_calls else None

    def counted(out):
        if counter is None:
            return out
        # A zero that counts the evaluation; adding it to every output keeps the counter
        # alive (not dead code) wherever the value or a gradient is used.
        values, gs, gd = out
        zero = counter.zero(values.sum(axis=-1))
        add = functools.partial(_add_zero, zero)
        return add(values), tuple(map(add, gs)), tuple(map(add, gd))

    def host(traced, shared, dt, ds, tangents=((), ())):
        return host_path.partials(state, executor, grainsize, traced, shared, dt, ds, tangents)

    def graph(traced, shared, dt, ds, set_axes=None):  # set_axes: a batch, under vmap
        return executor.graph_partials(state, traced, shared, dt, ds, set_axes)

    def graph_products(traced, shared, dt, ds, tangents):  # a batch laid out as a task's
        def evaluate(t, s, set_axes):
            return state.program.graph_partials(state.prepared(), t, s, dt, ds, set_axes, 2)

        return tangent_batching(evaluate)((*traced, *tangents[0]), (*shared, *tangents[1]))

    def routed(count):
        """The partials on ``route`` (or where ``choice`` says), the graph's through ``count``."""

        def partials(traced, shared, choice, dt, ds):
            def on_graph():
                return count(graph(traced, shared, dt, ds))

            if route == "host":
                return host(traced, shared, dt, ds)
            if route == "graph":
                return on_graph()
            return lax.cond(choice == HOST, lambda: host(traced, shared, dt, ds), on_graph)

        return partials

    partials = set_batching(routed, host, graph, counted, route, state.spec.sets == "each")

    def run(traced, shared, choice, dt, ds):
        # A fence on the way out, on every route (guard ``fence``).
        parts = partials(traced, shared, choice, dt, ds)
        if any(map(_is_traced, jax.tree.leaves(parts))):
            return fence(combine(*parts))
        return _finish(*parts)  # partials computed eagerly: the rest as one program too

    # Value and gradients (of the leaves ``dt``, ``ds`` mark); their tangent: product_tangent.
    @functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4))
    def value_and_grads(traced, shared, choice, dt, ds):
        v, gs, gd = run(traced, shared, choice, dt, ds)
        return v, gd, gs

    def value_and_grads_jvp(dt, ds, primals, tangents):
        traced, shared, choice = primals
        tt, ts = (tuple(None if isinstance(t, SymbolicZero) or not _is_float(x) else t
                        for x, t in zip(xs, ts_)) for xs, ts_ in zip(primals[:2], tangents[:2]))
        out = value_and_grads(traced, shared, choice, dt, ds)
        if route != "host" and state.program.sets_each and not state.program.is_looped:
            return out, tangent_of(blocked, dt, ds, traced, shared, tt, ts)
        return out, product_tangent(traced, shared, choice, dt, ds, tt, ts, out)

    def product_tangent(traced, shared, choice, dt, ds, tt, ts, out):
        """The tangent: per-block Hessian-vector products over the leaves with a gradient or
        a tangent (``ut``, ``us``), the gradients' taken out, by the same block programs on
        every route: the same bits (not in the graph for a wide regression on jax 0.10)."""
        ut = tuple(d or t is not None for d, t in zip(dt, tt))
        us = tuple(d or t is not None for d, t in zip(ds, ts))
        some = next(t for t in (*tt, *ts) if t is not None)  # the rule runs for one at least
        along = tuple(tuple(linear_zeros(x, some) if t is None else t
                            for x, t in zip(kept(xs, u), kept(ts_, u)))
                      for xs, ts_, u in ((traced, tt, ut), (shared, ts, us)))

        def apply(at, b):
            _, hs, ht = combine(*(host if route == "host" else graph_products)(*at, ut, us, b))
            return tuple(ht), tuple(hs)

        def twin(at, b):
            _, ht, hs = tangent_of(blocked, ut, us, *at, merge((None,) * len(ut), b[0], ut),
                                   merge((None,) * len(us), b[1], us))
            return tuple(ht), tuple(hs)

        ht, hs = symmetric_product(apply, twin, (traced, shared), along)
        # The value's tangent: the gradients (of every leaf with a tangent) dotted with it.
        g = out if (ut, us) == (dt, ds) else value_and_grads(traced, shared, choice, ut, us)
        dv = _dotted(out[0], [*zip(g[1], kept(tt, ut)), *zip(g[2], kept(ts, us))])
        return dv, tuple(kept(ht, kept(dt, ut))), tuple(kept(hs, kept(ds, us)))

    value_and_grads.defjvp(value_and_grads_jvp, symbolic_zeros=True)

    @jax.custom_jvp
    def value(traced, shared, choice):
        no = (False,) * len(traced), (False,) * len(shared)
        return run(traced, shared, choice, *no)[0]

    def value_jvp(primals, tangents):
        # The route's gradients (bitwise on every executor) dotted with the tangent: linear
        # in it, so JAX transposes it for ``grad``/``vjp`` (the cotangent times the
        # gradients) and maps it for ``jacfwd``; a second derivative reaches the rule above.
        traced, shared, choice = primals
        tt, ts, _ = tangents
        dt = tuple(_is_float(x) and not isinstance(t, SymbolicZero) for x, t in zip(traced, tt))
        ds = tuple(_is_float(x) and not isinstance(t, SymbolicZero) for x, t in zip(shared, ts))
        v, gd, gs = eager_or(traced, shared, choice)(traced, shared, choice, dt, ds)
        return v, _dotted(v, [*zip(gd, kept(tt, dt)), *zip(gs, kept(ts, ds))])

    def eager_or(traced, shared, choice):
        """``value_and_grads``, or, for an eager ``jax.grad`` on the host route, one program."""
        if route != "host" or any(map(_is_traced, (*traced, *shared, choice))):
            return value_and_grads
        # Not this one: its derivative rule holds the data (``blocked``), the site would too.
        return state.eager_call((grainsize, "grad"), lambda: _reduce(
            state, executor, grainsize, route, _no_derivative, grads=True), static_argnums=(3, 4))

    value.defjvp(value_jvp, symbolic_zeros=True)
    return value_and_grads if grads else value


def _dotted(v, pairs):
    """The value's tangent: each gradient times its tangent (``None``: a zero one), summed
    in order, in ``v``'s dtype."""
    terms = [jnp.sum(g * t).astype(v.dtype) for g, t in pairs if t is not None]
    return functools.reduce(jnp.add, terms) if terms else jnp.zeros_like(v)


def _add_zero(zero, x):
    """``x`` plus ``zero`` (a counter's), broadcast over ``x``'s per-evaluation axes."""
    return x + zero.reshape(zero.shape + (1,) * (x.ndim - zero.ndim)).astype(x.dtype)


# -- validation --------------------------------------------------------------------


def _is_traced(x) -> bool:
    return is_tracer(x)


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)
