"""A ``reduce_sum`` call site: its immutable description and the block computations.

This module owns :class:`SiteSpec`, the picklable description of one call site
(``fn``, tree structures, which data leaves are traced, the block and tile plans,
the evaluation form, precision), and :class:`Program`, what a spec computes in one
process: the hoisted split of ``fn`` (:mod:`.analysis`), the data prepared once per
site (padded into blocks, with the residuals), and the pure functions that turn
blocks into per-block partials. Imports jax and numpy. The forms: see :mod:`.analysis`.

Every block has ``block_rows`` rows; the last is padded with copies of the last
row, and a mask keeps the padding out of the value and of every gradient (in the
batched form only that block is masked, evaluated after the others).
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .analysis import (
    Split,
    computes,
    conditions,
    constant_conditions,
    form_of,
    index_leaves,
    known_function,
    lapack_rows,
    row_reduce_cap,
    row_reduce_elements,
    scan_reduce_per_row,
    sets_form,
    split_known,
    unknown_function,
)
from .batching import each_set, unblock
from .blocks import (
    MIN_BLOCK_ROWS,
    BlockPlan,
    TilePlan,
    accelerator,
    balance_blocks,
    block_axis,
    looped_blocks,
    pad_blocks,
    plan_blocks,
    plan_tiles,
)
from .errors import TracedElsewhere
from .guards import fence, hide
from .identity import owned
from .internals import is_tracer, jaxpr_as_fun
from .kernels import LAYOUTS, Wrt, kept, kernel_for, merge
from .tasks import Partials, host_device, program_key

__all__ = ["Program", "SiteSpec", "kept", "make_spec", "merge", "run_eagerly"]

class SiteSpec(NamedTuple):
    """The static description of one ``reduce_sum`` call site (picklable with cloudpickle).

    Attributes
    ----------
    fn : callable
        ``fn(data_chunk, *shared) -> (rows,)``.
    data_treedef, shared_treedef : PyTreeDef
        Structure of ``data`` and of the tuple ``shared``.
    traced : tuple of bool
        Per data leaf: ``True`` for a traced leaf (a per-row parameter, sent at every
        evaluation), ``False`` for resident data (concrete when traced; prepared once).
    row_avals : tuple of (tuple, str)
        Per data leaf: the shape of one row and the dtype.
    shared_avals : tuple of (tuple, str)
        Per shared leaf: shape and dtype.
    plan : BlockPlan
        How the rows are cut into blocks.
    tiles : TilePlan
        How blocks are grouped into tiles, the smallest unit any executor evaluates.
    form : {"batched", "looped"}
        How a run of blocks is evaluated (see the module docstring).
    value_dtype : str
        dtype of ``fn``'s output.
    x64 : bool
        The caller's ``jax_enable_x64``: blocks run in the same precision everywhere.
    label : str
        ``fn``'s name, for messages.
    constants : tuple
        Conditions on the data read as constants (:func:`.analysis.constant_conditions`).
    computes : str
        What ``fn`` computes on a block where the site was made
        (:func:`.analysis.computes`); every process that traces the spec checks it.
    row_loop : bool
        Looped for a reduction within rows, not for a ``scan`` (:func:`.analysis.detect_form`).
    sets : {"inside", "each"}
        How a batch of parameter sets is evaluated (:func:`.analysis.sets_form`).
    lapack_rows : int
        The most rows ``fn`` is handed at once (:func:`.analysis.lapack_rows`: each of its
        LAPACK kernels then runs in place), or 0 for no limit; a block of more rows
        calls ``fn`` on runs of rows one after another (:meth:`block_fn`).
    """

    fn: Any
    data_treedef: Any
    shared_treedef: Any
    traced: tuple
    row_avals: tuple
    shared_avals: tuple
    plan: BlockPlan
    tiles: TilePlan
    form: str
    value_dtype: str
    x64: bool
    label: str
    constants: tuple = ()
    computes: str = ""
    row_loop: bool = False
    sets: str = "inside"
    lapack_rows: int = 0

    def block_struct(self):
        """Shapes of one block's resident leaves, traced leaves and shared leaves."""
        rows = self.plan.block_rows

        def struct(shape, dtype):
            return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))

        data = [struct((rows, *s), d) for s, d in self.row_avals]
        resident = [x for x, t in zip(data, self.traced) if not t]
        traced = [x for x, t in zip(data, self.traced) if t]
        shared = [struct(s, d) for s, d in self.shared_avals]
        return resident, traced, shared

    def block_fn(self):
        """``f(resident, traced, shared) -> (rows,)``: ``fn`` on one block's leaves (on
        runs of at most :attr:`lapack_rows` rows, one after another, where that is set
        and the block is larger: see :func:`runs_of_rows`)."""
        spec = self

        def f(resident, traced, shared):
            it_r, it_t = iter(resident), iter(traced)
            leaves = [next(it_t) if t else next(it_r) for t in spec.traced]
            data = jax.tree_util.tree_unflatten(spec.data_treedef, leaves)
            args = jax.tree_util.tree_unflatten(spec.shared_treedef, list(shared))
            return jnp.asarray(spec.fn(data, *args)).astype(spec.value_dtype)

        return runs_of_rows(f, self.lapack_rows) if self.lapack_rows else f

    def rows(self, first_block: int, count: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` of blocks ``[first_block, first_block + count)``."""
        return self.plan.block_range(first_block)[0], self.plan.block_range(
            first_block + count - 1)[1]


class Program:
    """What a :class:`SiteSpec` computes, traced in this process.

    Holds the hoisted split of ``fn`` and the functions over blocks. Pure functions
    only cross ``jit``; the compiled host functions are cached here per shape.
    """

    def __init__(self, spec: SiteSpec):
        self.spec = spec
        resident, traced, _ = spec.block_struct()
        with jax.enable_x64(spec.x64):
            closed = traced_block(spec)
            if spec.computes and computes(closed) != spec.computes:
                raise TracedElsewhere(spec.label)
        self.split: Split = split_known(closed, len(resident), len(traced), spec.constants)
        #: Per prepared leaf, whether ``fn`` reads it only as positions: the in-graph
        #: route shows those to XLA (see :func:`.analysis.index_leaves`); residuals never.
        self.positions = index_leaves(closed, self.split.raw) + (False,) * len(self.split.residuals)
        if self.split.hoisted:
            self._known = known_function(self.split)
            self._unknown = unknown_function(self.split)
        else:  # nothing computed once: every block calls the user's function itself
            self._unknown = calls_fn(spec, resident, self.split.raw, closed)
        plan = spec.plan
        valid = np.full(plan.n_blocks, plan.block_rows, np.int32)
        if plan.n_blocks:
            valid[-1] = plan.n_rows - (plan.n_blocks - 1) * plan.block_rows
        #: Real (unpadded) rows of each block.
        self.valid = valid
        #: (kind, blocks) -> times traced: a compiled shape is traced once.
        self.traces: Counter[tuple] = Counter()
        self._lock = threading.Lock()
        #: The compiled chunk programs, by :func:`.tasks.program_key` (read by tasks).
        self.cache: dict = {}
        #: The form, whether a batch of parameter sets runs one set at a time and whether
        #: the last block is padded and run apart, as attributes (read by every task).
        #: How a run of blocks is evaluated (:data:`.kernels.LAYOUTS`).
        self.layout = LAYOUTS[spec.form]
        self.sets_each = spec.sets == "each"
        self.split_tail = bool(spec.tiles.tail)

    # -- data, once per site -----------------------------------------------------

    def prepare(self, resident_leaves) -> tuple:
        """Resident data as the evaluations read it: numpy arrays ``(blocks, block_rows, ...)``,
        first the resident leaves ``fn`` reads directly, then the hoisted residuals."""
        plan = self.spec.plan
        with jax.enable_x64(self.spec.x64), jax.default_device(host_device()):
            blocks = [owned(pad_blocks(np.asarray(x), plan)) for x in resident_leaves]
            raw = tuple(blocks[k] for k in self.split.raw)
            if not self.split.residuals:
                return raw
            one_by_one = jax.jit(lambda b: lax.map(self._known, b))
            if self.spec.lapack_rows:  # a batch of blocks would batch their matrices
                residuals = one_by_one(blocks)
            else:
                try:
                    residuals = jax.jit(jax.vmap(self._known))(blocks)
                except Exception:  # noqa: BLE001 - not batchable: one block at a time
                    residuals = one_by_one(blocks)
            return raw + tuple(np.asarray(r) for r in residuals)

    # -- one block, and the site's programs over blocks -----------------------------

    def block(self, prepared, traced, shared, valid, *, kernel, wrt: Wrt, counted,
              finish) -> Partials:
        """One block's partials by ``kernel`` (:mod:`.kernels`): ``fn`` on the block's
        prepared data (the hoisted split: raw leaves, then residuals), ``counted`` saying
        which rows count, ``finish`` whether the result is pinned."""
        raw, residuals = prepared[:len(self.split.raw)], prepared[len(self.split.raw):]
        pointwise = functools.partial(self._unknown, raw, residuals)
        return kernel.block(pointwise, traced, shared, valid, self.spec.plan.block_rows, wrt,
                            counted, finish)

    # -- the graph path: all blocks inside the caller's program --------------------

    def graph_partials(self, prepared, traced, shared, wrt: Wrt, kernel, set_axes=None):
        """Every block's partials by ``kernel`` inside the caller's program (a nested
        ``jit``, inlined there; called eagerly, one compiled program: op by op would round
        otherwise): per-block values and shared gradients, per-row data gradients (``N``
        rows); with ``set_axes`` for each parameter set of a batch, leading (looped:
        Hessian-vector products only, a batch of tangents, mapped as a host task maps
        it)."""
        prepared = tuple(prepared)
        split = self.spec.tiles.tail
        # The padded last block as arrays of its own: numpy views, constants of the
        # caller's program, so XLA copies nothing per evaluation.
        tail = tuple(x[-1:] for x in prepared) if split else ()
        head = tuple(x[:-1] for x in prepared) if split else prepared
        return self._graph_fn(wrt, kernel, set_axes)(head, tail, tuple(traced), tuple(shared))

    def plain_partials(self, resident, traced, shared, wrt: Wrt, kernel, set_axes=None):
        """Plain NumPyro's program in the caller's: ``fn`` on every row at once, JAX's own
        derivatives (``kernel.plain``), as partials of the plan's shape (the whole value
        and gradients in the first block, zeros in the others, so that every route's
        partials combine alike). What the graph evaluates on an accelerator
        (:func:`.routes.accelerator`). ``resident``: the site's data leaves, unpadded."""
        key = ("plain", wrt, kernel, set_axes)
        fn = self.cache.get(key)
        if fn is None:
            fn = self.cache.setdefault(key, jax.jit(functools.partial(
                self._plain_blocks, self.plain_sums(wrt, kernel, set_axes),
                0 if set_axes is None else 1)))
        return fn(tuple(resident), tuple(traced), tuple(shared))

    def _plain_blocks(self, sums, lead, resident, traced, shared):
        """:meth:`plain_partials`' program: the sums in block 0, zeros in the others."""
        n_blocks = self.spec.plan.n_blocks

        def first_of(x):  # the whole in block 0, zeros in the others (after any sets)
            shape = jnp.shape(x)[:lead] + (n_blocks,) + jnp.shape(x)[lead:]
            return jnp.zeros(shape, jnp.result_type(x)).at[(slice(None),) * lead + (0,)].set(x)

        value, shared_grads, data_grads = sums(resident, traced, shared)
        return first_of(value), tuple(map(first_of, shared_grads)), data_grads

    def plain_sums(self, wrt: Wrt, kernel, set_axes=None):
        """``f(resident, traced, shared, valid=None) -> (value, shared gradients, per-row
        gradients)``: ``fn`` on all the rows it is given at once, summed, with JAX's own
        derivatives (plain NumPyro's program, :meth:`.kernels.Gradient.plain`; the
        tangents of the three for a Hessian-vector product). ``valid``: only rows ``[0,
        valid)`` count (a device's share padded with copies of its last row), else all.
        ``set_axes``: a batch of parameter sets, leading in the outputs."""
        one = functools.partial(_plain_sum, kernel, self.spec.block_fn(), wrt)
        if set_axes is None:
            return one
        return functools.partial(_plain_sets, one, (None,) + tuple(set_axes) + (None,))

    def _graph_fn(self, wrt: Wrt, kernel, set_axes):
        key = ("graph", wrt, kernel, set_axes)
        if key in self.cache:
            return self.cache[key]
        fn = jax.jit(functools.partial(self._graph_program, wrt, kernel, set_axes))
        with self._lock:
            return self.cache.setdefault(key, fn)

    def _graph_program(self, wrt: Wrt, kernel, set_axes, prepared, prepared_tail, traced,
                       shared):
        """The graph route's program: the blocks of ``traced`` made, the inputs behind
        the guards, the layout's evaluation, the partials fenced on the way out."""
        plan = self.spec.plan
        traced_axes = set_axes[0] if set_axes else (None,) * len(traced)  # tangents included
        traced = tuple(pad_blocks(t, plan, block_axis(a), jnp)
                       for t, a in zip(traced, traced_axes))
        # The inputs as opaque as to a host program (guards ``hide`` and ``fence``): data
        # read only as positions stays in view (a gather's index pairs fold at compile).
        prepared, prepared_tail, valid = hide_values(self.positions, prepared, prepared_tail,
                                                     jnp.asarray(self.valid))
        traced, shared = fence((traced, shared))
        out = self.layout.graph(self, kernel, prepared, prepared_tail, traced, shared, valid,
                                wrt, set_axes, traced_axes)
        # ...and on the way out: the caller's use of the partials is not fused into them.
        out = fence(out)
        lead = 0 if set_axes is None else 1
        return out.values, out.shared_grads, tuple(unblock(g, plan.n_rows, lead)
                                                  for g in out.data_grads)

    # -- the host path: compiled functions of whole tiles ---------------------------

    def compiled(self, blocks: int, diff_traced, diff_shared, in_axes, last: bool = False,
                 order: int = 1):
        """The jitted evaluation of ``blocks`` blocks (one or more whole tiles), cached by
        :func:`.tasks.program_key`: the layout's chunk program
        (:meth:`.kernels.Batched.chunk_program`) of the kernel of ``order``
        (:func:`.kernels.kernel_for`). ``last``: the chunk ends with the plan's last
        block (padded, run apart where the tiles say so). ``in_axes``: the vmap axes of
        ``(traced, shared)`` under a batch of parameter sets (or of tangents), mapped
        inside the blocks as in the graph path, or ``None``; a site of ``sets="each"``
        maps the unbatched program over the sets (:func:`.batching.each_set`) where the
        kernel says so (:attr:`.kernels.Gradient.sets_apart`)."""
        split = last and self.split_tail
        key = program_key(blocks, diff_traced, diff_shared, in_axes, split, order)
        if key in self.cache:
            return self.cache[key]
        wrt = Wrt(tuple(diff_traced), tuple(diff_shared))
        kernel = kernel_for(order, wrt)
        if in_axes is not None and self.sets_each and kernel.sets_apart(self.spec):
            run = each_set(self.compiled(blocks, diff_traced, diff_shared, None, last, order),
                           in_axes, split)
        else:
            run = self.layout.chunk_program(self, kernel, blocks, wrt, in_axes, split)
        fn = jax.jit(run)
        with self._lock:
            return self.cache.setdefault(key, fn)


def _plain_sum(kernel, block, wrt, resident, traced, shared, valid=None):
    """:meth:`Program.plain_sums` of one parameter set."""
    return kernel.plain(block, resident, traced, shared, valid, wrt)


def _plain_sets(one, in_axes, resident, traced, shared, valid=None):
    """:meth:`Program.plain_sums` of a batch of parameter sets (``in_axes``)."""
    return jax.vmap(one, in_axes=in_axes)(resident, traced, shared, valid)


def runs_of_rows(f, most: int):
    """``f(resident, traced, shared)`` on runs of at most ``most`` rows one after another
    (``lax.map``; runs of equal size, the largest that divides the rows), the rows'
    values concatenated: each row's value as ``f`` gives it on all of them at once."""

    def runs(resident, traced, shared):
        rows = int(jnp.shape((*resident, *traced)[0])[0])
        size = next(d for d in range(min(most, rows), 0, -1) if rows % d == 0)
        if size == rows:
            return f(resident, traced, shared)
        out = lax.map(lambda rt: f(rt[0], rt[1], shared),
                      (_in_runs(resident, size), _in_runs(traced, size)))
        return jnp.reshape(out, (rows,))

    return runs


def _in_runs(xs, size: int) -> list:
    """Each of ``xs`` (rows first) as ``(runs, size, ...)``."""
    return [jnp.reshape(x, (jnp.shape(x)[0] // size, size) + tuple(jnp.shape(x)[1:]))
            for x in xs]


def block_programs(spec: SiteSpec):
    """``programs(rows)``: the jaxprs of what a block program evaluates on ``rows`` rows:
    ``fn``'s value, its gradient in every float leaf (traced and shared), and their
    Hessian-vector product (for :func:`.analysis.lapack_rows`)."""
    return functools.partial(_block_programs, spec)


def _block_programs(spec: SiteSpec, rows: int) -> list:
    one = spec._replace(plan=BlockPlan(rows, rows, 1, 0))
    resident, traced, shared = one.block_struct()
    wrt = Wrt(tuple(jnp.issubdtype(x.dtype, jnp.inexact) for x in traced),
              tuple(jnp.issubdtype(x.dtype, jnp.inexact) for x in shared))
    total = functools.partial(_summed, one.block_fn())
    grads = functools.partial(_grads_of, total, wrt)
    hvp = functools.partial(_hvp_of, grads)
    args = (resident, traced, shared, kept(traced, wrt.traced), kept(shared, wrt.shared))
    return [jax.make_jaxpr(total)(*args[:3])] + [jax.make_jaxpr(g)(*args) for g in (grads, hvp)]


def _summed(block, resident, traced, shared):
    return jnp.sum(block(resident, traced, shared))


def _grads_of(total, wrt, resident, traced, shared, traced_part, shared_part):
    """The gradient of ``total`` in the leaves ``wrt`` marks, at the parts given."""
    return jax.grad(lambda tp, sp: total(resident, merge(traced, tp, wrt.traced),
                                         merge(shared, sp, wrt.shared)),
                    argnums=(0, 1))(traced_part, shared_part)


def _hvp_of(grads, resident, traced, shared, traced_part, shared_part):
    """``grads``' tangent along the parts themselves (a Hessian-vector product)."""
    return jax.jvp(lambda tp, sp: grads(resident, traced, shared, tp, sp),
                   (traced_part, shared_part), (traced_part, shared_part))[1]


def make_spec(fn, data_treedef, shared_treedef, leaves, shared_leaves, plan, value_dtype, x64,
              label=None, balance=True, resident=None) -> SiteSpec:
    """The :class:`SiteSpec` of a call: which leaves are traced, the evaluation form (from
    a trace of ``fn`` on one block), the tile plan, and, with the default block size, the
    form's own blocks: batched, no larger than :func:`~.analysis.row_reduce_cap` allows and
    evened out; looped, :func:`~.blocks.looped_blocks`; and the conditions on the
    resident rows read as constants."""
    traced = tuple(is_tracer(x) for x in leaves)
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
        # LAPACK kernels that must run in place: blocks one at a time (a batch of blocks,
        # or of parameter sets, would batch their matrices), of at most that many rows.
        most = 0 if accelerator() else lapack_rows(closed, block_programs(draft), rows)
        if most:
            form, row_loop = "looped", False
        if balance and form == "looped":
            per_row = (row_reduce_elements(closed, rows) if row_loop
                       else scan_reduce_per_row(closed, rows, trace))
            plan = looped_blocks(plan.n_rows, np.dtype(value_dtype).itemsize, per_row)
            if most and plan.block_rows > most:
                plan = plan_blocks(plan.n_rows, most)
    if balance and form == "batched":  # smaller blocks where fn reduces within rows
        cap = row_reduce_cap(closed, rows)
        if cap and max(cap, MIN_BLOCK_ROWS) < plan.block_rows:
            plan = plan_blocks(plan.n_rows, max(cap, MIN_BLOCK_ROWS))
        plan = balance_blocks(plan)
    spec = draft._replace(plan=plan, form=form, tiles=plan_tiles(plan, batched=form == "batched"),
                          row_loop=row_loop, sets=sets_form(closed, rows, form),
                          lapack_rows=most)
    if resident is None:
        resident = [x for x, t in zip(leaves, traced) if not t]
    # fn on one block of the spec's plan, as every process traces it
    with jax.enable_x64(x64), jax.default_device(host_device()):
        closed = jax.make_jaxpr(spec.block_fn())(*spec.block_struct())
        digest = computes(closed)
    return spec._replace(constants=_constants(spec, resident, closed), computes=digest)


def _constants(spec: SiteSpec, resident, closed) -> tuple:
    """Conditions on the data that hold in every row or in none, constants on every route
    (:func:`.analysis.constant_conditions`), read from ``closed`` (``fn`` on one block)."""
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


def run_eagerly(fn, *args):
    """``fn(*args)`` on concrete values, also while a caller's function is traced
    (``jax.ensure_compile_time_eval``): preparing a site's data is data work done once,
    never a part of the traced program."""
    with jax.ensure_compile_time_eval():
        return fn(*args)


def traced_block(spec):
    """``fn``'s jaxpr on one block of ``spec``, traced now: a new function each time, as
    JAX keeps the trace of a function it traced before (and would answer with what
    ``fn`` computed then)."""
    return jax.make_jaxpr(spec.block_fn())(*spec.block_struct())


def calls_fn(spec, resident, raw, closed=None):
    """``f(raw, residuals, traced, shared) -> pointwise``: ``fn`` on one block, for a site
    with nothing hoisted. Only the resident leaves ``fn`` reads are kept (``raw``); the
    others are zeros of their shape, which ``fn`` never reads.

    ``closed`` is ``fn``'s jaxpr on one block as the site's key describes it (checked
    against ``spec.computes`` when the site's program was made). A chunk shape compiled
    later traces ``fn`` again, and what ``fn`` reads besides its arguments may have
    changed since in this process: on a dask worker, a class sent by value with another
    site's ``fn`` is the same class object there, its attributes set to the other
    site's. Each such trace compares what ``fn`` computes now with the key, and where
    they differ it evaluates ``closed``, what the site computed when it was made, instead
    of returning another site's number."""
    block = spec.block_fn()
    frozen = jaxpr_as_fun(closed) if closed is not None and spec.computes else None

    def unknown(raw_leaves, residuals, traced, shared):
        leaves = [jnp.zeros(r.shape, r.dtype) for r in resident]
        for k, x in zip(raw, raw_leaves):
            leaves[k] = x
        if frozen is not None and computes(traced_block(spec)) != spec.computes:
            (out,) = frozen(*leaves, *traced, *shared)
            return out
        return block(leaves, traced, shared)

    return unknown


def hide_values(positions, prepared, tail, valid) -> tuple:
    """``(prepared, tail, valid)`` behind guard ``hide`` (:func:`.guards.hide`), but for the
    leaves that ``positions`` (from :func:`index_leaves`) marks: those XLA may see."""
    pick = [k for k, p in enumerate(positions) if not p]
    hidden, hidden_tail, valid = hide(
        [prepared[k] for k in pick], [tail[k] for k in pick] if tail else [], valid)
    prepared, tail = list(prepared), list(tail)
    for j, k in enumerate(pick):
        prepared[k] = hidden[j]
        if tail:
            tail[k] = hidden_tail[j]
    return tuple(prepared), tuple(tail), valid
