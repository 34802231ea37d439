"""How a call site's blocks are evaluated, read from ``fn``'s jaxpr (never from a timing).

This module owns the choice of evaluation form, the check for kernels that block
XLA's CPU thread pool and the check for data used only as positions. Imports jax only.

The two evaluation forms:

* ``"batched"``: the blocks of a tile, or of every tile at once, in one ``vmap``;
  XLA threads it as it threads plain NumPyro. Per-block partials are the same bits
  for any batch of whole tiles (see :mod:`.blocks`).
* ``"looped"``: one block per iteration of a ``while`` loop whose body is the same
  everywhere, chosen when ``fn`` holds a ``scan`` (an HMM's forward algorithm): the
  residuals its gradient keeps for every step then stay in cache for one block at a
  time, which measured faster than any batch (HMM, 5,000 sequences). Bitwise the same for any run of blocks by construction.
  A ``while_loop`` alone (an iterative solve per row) keeps no such residuals and is
  batched: looped it lost to plain, batched it did not (Newton solve, 200,000 rows).
  Also chosen where ``fn`` reduces within each row over a few values (a mixture's
  ``logsumexp``), in blocks that keep the reduction off YNNPACK (:func:`detect_form`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .blocks import YNN_REDUCE, xla_threads
from .guards import hide
from .internals import CALLS, LAPACK, SCAN, Literal, jaxprs_in_params

__all__ = ["FORMS", "blocks_pool", "detect_form", "form_of", "hide_values", "index_leaves",
           "row_reduce_cap", "row_reduce_elements", "scan_reduce_per_row", "sets_form"]

FORMS = ("batched", "looped")
#: Primitives that make ``fn`` run best one block at a time (see the module docstring).
LOOPS = frozenset({SCAN})
#: Primitives that XLA:CPU runs as jaxlib LAPACK kernels which, on a batch of
#: matrices, hand parts of it to XLA's intra-op thread pool and *block* the pool
#: thread they run on until those parts are done. As many such programs at once as
#: the pool has threads then wait for each other forever (measured: two chunk
#: programs with a batched ``solve_triangular`` on a 2-thread pool), so the host path
#: runs fewer of them at a time (see :mod:`.host`). Foreign functions (``ffi_call``)
#: may do the same and count too.
POOL_BLOCKING = LAPACK | {"ffi_call", "custom_call"}
#: Reductions that XLA:CPU may hand to YNNPACK (see :data:`.blocks.YNN_REDUCE`).
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min"})


def _uses(jaxpr, names) -> bool:
    """Whether ``jaxpr`` (or a jaxpr nested in it) binds one of the primitives ``names``."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in names:
            return True
        if any(_uses(sub, names) for sub in jaxprs_in_params(eqn.params)):
            return True
    return False


def _scan_reductions(jaxpr, inside: bool = False) -> list:
    """Elements read by each reduction inside a ``scan``'s body (at any depth), in
    jaxpr order."""
    out = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if inside and name in REDUCTIONS:
            out.append(math.prod(eqn.invars[0].aval.shape))
        for sub in jaxprs_in_params(eqn.params):
            out.extend(_scan_reductions(sub, inside or name in LOOPS))
    return out


def scan_reduce_per_row(closed, rows: int, trace) -> float:
    """Elements per row of a block read by the largest reduction in a ``scan``'s body
    (an HMM's ``logsumexp`` over ``(rows, states, states)``: ``states**2``), or 0.

    ``closed`` is ``fn``'s closed jaxpr on a block of ``rows`` rows, ``trace(r)`` gives
    it on ``r`` rows. ``fn`` is traced at twice ``rows`` too, so that what does not grow
    with the rows does not count; where it fails there or traces another structure,
    ``closed`` is read alone."""
    small = _scan_reductions(closed.jaxpr)
    if not small:
        return 0.0
    try:
        large = _scan_reductions(trace(2 * rows).jaxpr)
    except Exception:  # noqa: BLE001 - fn may accept only some sizes: read the one trace
        large = None
    if large is None or len(large) != len(small):
        return max(small) / rows
    return max(max(b - a, 0) / rows for a, b in zip(small, large))


#: A batched block reads at most about this many bytes in each reduction within its
#: rows: a mixture's ``logsumexp`` lost to plain in large blocks, and a wider mixture
#: from smaller blocks on (the sweeps: docs/performance.md, "The block rule").
ROW_REDUCE_BYTES = 96 * 1024


def row_reduce_cap(closed, rows: int) -> int:
    """The most rows per block (a power of two) that keep the widest reduction within
    rows of ``fn``'s jaxpr (traced on ``rows`` rows) under :data:`ROW_REDUCE_BYTES`, or
    0 where ``fn`` reduces nothing within rows (then only the data sizes the blocks)."""
    per_row = _row_reduce(closed.jaxpr, rows, bytes_=True)
    return 1 << int(math.log2(max(ROW_REDUCE_BYTES // per_row, 1))) if per_row else 0


def row_reduce_elements(closed, rows: int) -> int:
    """Elements per row of the widest array ``fn``'s jaxpr (traced on ``rows`` rows)
    reduces within each row, or 0 (see :func:`_row_reduce`)."""
    return _row_reduce(closed.jaxpr, rows)


def _row_reduce(jaxpr, rows: int, bytes_: bool = False) -> int:
    """Elements (``bytes_``: bytes) per row of the widest array ``jaxpr`` reduces within
    each row (a mixture's ``logsumexp`` over its components: ``(rows, k)`` to
    ``(rows,)``, ``k`` values per row), at any depth, or 0. Reductions over the rows
    themselves do not count."""
    widest = 0
    for eqn in jaxpr.eqns:
        aval = eqn.invars[0].aval if eqn.invars else None
        if (eqn.primitive.name in REDUCTIONS and aval is not None and len(aval.shape) > 1
                and aval.shape[0] == rows and 0 not in eqn.params.get("axes", (0,))):
            size = math.prod(aval.shape[1:]) * (aval.dtype.itemsize if bytes_ else 1)
            widest = max(widest, size)
        for sub in jaxprs_in_params(eqn.params):
            widest = max(widest, _row_reduce(sub, rows, bytes_))
    return widest


#: Where ``fn`` reduces within each row and has no ``scan``, the blocks loop if one of
#: this many rows keeps that reduction under :data:`.blocks.YNN_REDUCE` (see
#: :func:`detect_form`). jax 0.12 ran every width of mixture tried faster looped, down to
#: the smallest blocks; jax 0.10 ran the same looped programs slower than the batch from
#: 5 components on, faster at 2 and 3 (docs/performance.md, "Reductions within rows").
ROW_REDUCE_LOOP_ROWS = 48 if jax.__version_info__ >= (0, 12) else 1024

#: Reductions within rows loop their blocks only where XLA's CPU pool has at most this
#: many threads: a looped block keeps its reduction on a core or two, where plain's
#: program and the batched form spread theirs over every core, and from four cores on
#: the batch ran faster at every size measured (docs/performance.md, "Reductions within
#: rows on many cores").
ROW_REDUCE_LOOP_THREADS = 2


def form_of(closed, rows: int | None = None, fixed: bool = False) -> tuple[str, bool]:
    """The form (see :func:`detect_form`) and whether a looped form is for a reduction
    within rows (where XLA threads a block itself) rather than for a ``scan``."""
    if _uses(closed.jaxpr, LOOPS):
        return "looped", False
    if rows is not None and xla_threads() <= ROW_REDUCE_LOOP_THREADS and \
            not _uses(closed.jaxpr, POOL_BLOCKING):
        per_row = row_reduce_elements(closed, rows)
        least = max(rows, ROW_REDUCE_LOOP_ROWS) if fixed else ROW_REDUCE_LOOP_ROWS
        if per_row and least * per_row < YNN_REDUCE:
            return "looped", True
    return "batched", False


def detect_form(closed, rows: int | None = None, fixed: bool = False) -> str:
    """``"looped"`` when the jaxpr holds a ``scan``; with ``rows`` (the rows ``closed``
    was traced on), also where ``fn`` reduces within each row (a mixture's
    ``logsumexp``) so few elements that a looped block keeps that reduction under
    :data:`.blocks.YNN_REDUCE`: a block of :data:`ROW_REDUCE_LOOP_ROWS` rows, or of
    ``rows`` where the blocks are ``fixed`` (given by the caller) and larger, on a
    machine where XLA's CPU pool has at most :data:`ROW_REDUCE_LOOP_THREADS` threads;
    else ``"batched"``.

    A batched evaluation reduces within the rows of all its blocks at once: XLA:CPU
    hands that reduction to YNNPACK, whose operands it must first write out in full
    (each elementwise step of the ``logsumexp`` and of its gradient), where a looped
    block under the threshold keeps them in XLA's own fused loops (docs/performance.md,
    "Reductions within rows")."""
    return form_of(closed, rows, fixed)[0]


#: Before jax 0.12, a batched site whose ``fn`` contracts each row with a parameter over
#: at least this many elements (a linear predictor ``X @ beta`` of that many features)
#: evaluates a batch of parameter sets one set at a time; 0: never. With the sets inside
#: the blocks, XLA 0.10 ran that contraction, batched over the blocks, slower the wider it
#: was (to a quarter of plain's speed at 80 features), where one set at a time followed
#: plain from 8 features on; jax 0.12 ran every width as fast or faster with the sets inside
#: (docs/performance.md, "Vectorized chains of a wide regression"). jax 0.11 is not
#: measured and takes jax 0.10's rule (``benchmarks/device_check.sh``, part ``sets``).
SETS_EACH_WIDTH = 8 if jax.__version_info__ < (0, 12) else 0


def _row_contraction(jaxpr, rows: int) -> int:
    """The widest contraction of a ``dot_general`` in ``jaxpr`` (at any depth) between an
    operand with the rows as its leading axis and one without them, or 0."""
    widest = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lc, rc), _ = eqn.params["dimension_numbers"]
            shapes = [v.aval.shape for v in eqn.invars]
            for k, (mine, other) in enumerate(((shapes[0], shapes[1]), (shapes[1], shapes[0]))):
                if mine[:1] == (rows,) and other[:1] != (rows,):
                    widest = max(widest, math.prod(mine[d] for d in (lc, rc)[k]))
        for sub in jaxprs_in_params(eqn.params):
            widest = max(widest, _row_contraction(sub, rows))
    return widest


def sets_form(closed, rows: int, form: str) -> str:
    """How a batch of parameter sets (vectorized chains) is evaluated: ``"each"``, one
    set at a time, each the unbatched program (a looped site, and a batched one that
    contracts rows over :data:`SETS_EACH_WIDTH` or more elements), else ``"inside"``,
    the sets inside the blocks (:mod:`.sets`). ``closed``: ``fn`` traced on ``rows``."""
    if form == "looped":
        return "each"
    wide = SETS_EACH_WIDTH and _row_contraction(closed.jaxpr, rows) >= SETS_EACH_WIDTH
    return "each" if wide else "inside"


def blocks_pool(closed) -> bool:
    """Whether ``fn``'s jaxpr runs a kernel that blocks a thread of XLA's CPU pool
    (see :data:`POOL_BLOCKING`)."""
    return _uses(closed.jaxpr, POOL_BLOCKING)


#: Primitives whose integer or boolean results are exact functions of their operands:
#: an index computed from index data (``g + n`` where ``g < 0``...) is still index data.
EXACT = frozenset({
    "abs", "add", "and", "broadcast_in_dim", "clamp", "concatenate", "convert_element_type",
    "copy", "eq", "expand_dims", "ge", "gt", "le", "lt", "max", "min", "mul", "ne", "neg",
    "not", "or", "reshape", "rev", "select_n", "sign", "slice", "squeeze", "sub",
    "transpose", "xor",
})
#: Operands read as positions, never as values: ``gather``'s indices, ``dynamic_slice``'s
#: starts (``select_n``'s predicate picks a value without rounding it).
INDEX_OPERANDS = {"gather": lambda i: i == 1, "dynamic_slice": lambda i: i >= 1,
                  "dynamic_update_slice": lambda i: i >= 2, "select_n": lambda i: i == 0}


def _exact(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.integer) or aval.dtype == jnp.bool_


def _index_flow(jaxpr, marked: set) -> set | None:
    """The outputs of ``jaxpr`` (by position) computed from its inputs ``marked``, or
    ``None`` when a marked value is read as a number (converted to a float, multiplied
    into one, passed to a primitive not known to be exact)."""
    marked = {jaxpr.invars[i] for i in marked}
    for eqn in jaxpr.eqns:
        reads = [i for i, v in enumerate(eqn.invars) if not isinstance(v, Literal) and v in marked]
        if not reads:
            continue
        name = eqn.primitive.name
        sink = INDEX_OPERANDS.get(name)
        values = [i for i in reads if not (sink and sink(i))]
        if not values:
            continue
        if name in CALLS or name == "custom_vjp_call":
            subs = list(jaxprs_in_params(eqn.params))
            if len(subs) != 1 or len(subs[0].invars) != len(eqn.invars):
                return None
            out = _index_flow(subs[0], set(reads))
            if out is None:
                return None
            marked.update(eqn.outvars[i] for i in out)
            continue
        if name not in EXACT and name not in INDEX_OPERANDS:
            return None
        if not all(_exact(v.aval) for v in eqn.outvars):
            return None
        marked.update(eqn.outvars)
    return {i for i, v in enumerate(jaxpr.outvars) if not isinstance(v, Literal) and v in marked}


def index_leaves(closed, leaves) -> tuple:
    """For each input ``leaves`` of ``fn``'s jaxpr (positions), whether it is integer
    or boolean data that ``fn`` uses only as positions (a gather's indices, a group
    number, a mask for ``where``) and never as a number in its arithmetic.

    The in-graph route lets XLA see such data (see ``spec.Program._graph_fn``): the
    ``(block, index)`` pairs of a gather's batched transpose are then folded once at
    compile time instead of rebuilt at every evaluation (docs/performance.md, "Data
    read only as positions"), and a position is never rounded. Data read as a number
    stays hidden, as everywhere else: folded, XLA could evaluate functions of it at
    compile time with other code than the host route runs.
    """
    out = []
    for k in leaves:
        ok = _exact(closed.jaxpr.invars[k].aval)
        if ok:
            flow = _index_flow(closed.jaxpr, {k})
            ok = flow is not None and not flow
        out.append(ok)
    return tuple(out)


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
