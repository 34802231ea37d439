"""Reading ``fn``'s jaxpr: everything the core learns from a trace of ``fn`` on one block,
never from a timing.

This module owns the three things read from that jaxpr:

* **the evaluation form** (:func:`form_of`): ``"batched"``, every block of a run in one
  ``vmap`` (XLA threads it as it threads plain NumPyro), or ``"looped"``, one block per
  iteration of a loop whose body is the same everywhere, chosen where ``fn`` holds a
  ``scan`` (an HMM's forward algorithm: the residuals its gradient keeps per step stay in
  cache for one block at a time) or, on a machine where XLA has at most
  :data:`ROW_REDUCE_LOOP_THREADS` threads, where ``fn`` reduces within each row over a few
  values (a mixture's ``logsumexp``, kept off YNNPACK); how a batch of parameter sets is
  evaluated (:func:`sets_form`); how many rows ``fn`` may take at once so that its
  LAPACK kernels run in place (:func:`lapack_rows`) and which data it reads only as
  positions (:func:`index_leaves`);
* **the hoisted split** (:func:`split_known`): plain NumPyro closes over concrete data, so
  XLA folds every data-only subexpression (``gammaln(y + 1)``) into a constant at compile
  time. A block cannot let XLA do that (the host route passes the data at run time, and
  both routes must give the same bits), so the core does the folding itself, the same way
  on every route: the equations whose inputs are all resident data or constants (the
  *known* part) are evaluated once per site and their results (the residuals) handed to
  every evaluation as data; cheap ones are recomputed instead, and nothing is hoisted
  where the residuals would take more than :data:`MAX_RESIDUAL_RATIO` times the data's
  memory. Conditions on the data that hold in every row or in none are read as
  constants (:func:`constant_conditions`);
* **what ``fn`` computes** (:func:`computes`): a digest of the jaxpr and its constants,
  part of a site's key and checked by every process that traces the site again.

Every rule depends only on the jaxpr (and the machine's thread count, for the form), so
every process makes the same choices. Imports jax, numpy, :mod:`.blocks` (the block
constants), :mod:`.identity` (array digests) and :mod:`.internals` (JAX's jaxpr types).
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .blocks import YNN_REDUCE, xla_threads
from .identity import digest
from .internals import (
    CALLS,
    CUSTOM_RULES,
    HOST_CODE,
    LAPACK,
    SCAN,
    VJP_RULES,
    ClosedJaxpr,
    DebugInfo,
    Jaxpr,
    Literal,
    jaxpr_as_fun,
    jaxprs_in_params,
)

__all__ = ["CHEAP", "FORMS", "HOST_CODE", "LAPACK_POOL_WORK", "MAX_RESIDUAL_RATIO",
           "POOL_BLOCKING", "Split", "computes", "conditions",
           "constant_conditions", "detect_form", "form_of", "index_leaves", "known_function",
           "lapack_rows", "part", "row_reduce_cap",
           "row_reduce_elements", "scan_reduce_per_row", "sets_form", "split_known",
           "unknown_function"]


# -- the evaluation form ----------------------------------------------------------------

FORMS = ("batched", "looped")
#: Primitives that make ``fn`` run best one block at a time (see the module docstring).
LOOPS = frozenset({SCAN})
#: Primitives that run as foreign kernels (jaxlib's LAPACK, a user's ``ffi_call``), which
#: may split their work over XLA's CPU pool themselves: a site that calls one is never
#: looped for a reduction within its rows (:func:`form_of`; see :data:`LAPACK_POOL_WORK`
#: for the LAPACK kernels of jaxlib 0.10).
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
#: from smaller blocks on (the sweeps: git history of docs/performance.md).
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
#: 5 components on, faster at 2 and 3 (git history of docs/performance.md).
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
#: (docs/performance.md, "Vectorized chains"). jax 0.11 is not
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
    the sets inside the blocks (:mod:`.batching`). ``closed``: ``fn`` traced on ``rows``."""
    if form == "looped":
        return "each"
    wide = SETS_EACH_WIDTH and _row_contraction(closed.jaxpr, rows) >= SETS_EACH_WIDTH
    return "each" if wide else "inside"


#: jaxlib before 0.11 runs a LAPACK kernel (Cholesky, triangular solve, LU, QR, eigh,
#: SVD...) on a batch of matrices as pieces on XLA's CPU thread pool, and the thread
#: that runs the kernel waits for them: where kernels run at once on every thread of
#: the pool, each waits for pieces that no thread is left to run, forever. It keeps a
#: batch whose work (jaxlib's estimate, in flops) is under this many in place, on the
#: thread that runs the kernel, and a batch of one matrix always; 0: kernels never wait
#: (jaxlib 0.11 builds run every batch in place).
LAPACK_POOL_WORK = 200_000 if jax.__version_info__ < (0, 11) else 0


def _lapack_work(eqn) -> tuple[int, int]:
    """``(matrices, flops per matrix)`` of a LAPACK equation: its batch and jaxlib 0.10's
    estimate of one matrix's work (``jaxlib/cpu/lapack_kernels.cc``), the largest of the
    kernels it lowers to (``qr``: a factorization and the product of its reflectors)."""
    name = eqn.primitive.name
    solve = name in ("triangular_solve", "tridiagonal_solve")
    shape = tuple(eqn.invars[-1 if solve else 0].aval.shape)  # a solve's right-hand side
    m, n = (shape[-2:] if len(shape) >= 2 else (shape[-1], 1))
    low, high = min(m, n), max(m, n)
    if name == "triangular_solve":
        flops = m * n * (m if eqn.params.get("left_side", True) else n)
    elif name == "cholesky":
        flops = n ** 3 // 3
    elif name == "lu":
        flops = m * n * low
    elif name in ("qr", "geqrf", "geqp3", "householder_product"):
        flops = 4 * m * n * low
    elif name == "eigh":
        flops = (4 if jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.complexfloating) else 5) * n ** 3
    elif name == "svd":
        flops = 10 * m * n * low
    else:  # eig, schur, hessenberg, tridiagonal...: the most any kernel estimates
        flops = 10 * high ** 3
    if jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.complexfloating):
        flops *= 3
    return math.prod(shape[:-2]), max(int(flops), 1)


def _lapack_kernels(jaxpr) -> list:
    """``(matrices, flops per matrix)`` of every LAPACK equation of ``jaxpr``, at any
    depth, in order."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in LAPACK:
            found.append(_lapack_work(eqn))
        for sub in jaxprs_in_params(eqn.params):
            found.extend(_lapack_kernels(sub))
    return found


def lapack_rows(closed, trace, rows: int) -> int:
    """The most rows a block program may hand ``fn`` at once so that each of its LAPACK
    kernels runs in place (a batch under :data:`LAPACK_POOL_WORK`), or 0 where nothing
    needs a limit (no LAPACK, or a jaxlib whose kernels never wait).

    ``closed`` is ``fn`` traced on ``rows`` rows (without a LAPACK kernel there, none is
    looked for in its derivatives); ``trace(n)`` gives the block's programs (value,
    gradient, Hessian-vector product) as jaxprs on ``n`` rows. Each kernel's batch, read at two row counts (one and two,
    or ``rows`` and twice that where ``fn`` takes only some sizes), is a part per row and
    a part that does not grow with the rows; a kernel of the second kind cannot be kept
    in place by fewer rows and is left as it is."""
    if not LAPACK_POOL_WORK or not _uses(closed.jaxpr, LAPACK):
        return 0
    for sizes in ((1, 2), (rows, 2 * rows)):
        try:
            seen = [[k for closed in trace(n) for k in _lapack_kernels(closed.jaxpr)]
                    for n in sizes]
        except Exception:  # noqa: BLE001, S112 - fn may accept only some sizes: try others
            continue
        if len(seen[0]) == len(seen[1]):
            break
    else:
        return 0
    (r1, r2), most = sizes, None
    for (b1, flops), (b2, _) in zip(*seen):
        per_row = (b2 - b1) // (r2 - r1)
        if per_row <= 0:
            continue
        fixed = b1 - per_row * r1
        room = max(1, (LAPACK_POOL_WORK - 1) // flops)
        limit = max(1, (room - fixed) // per_row)
        most = limit if most is None else min(most, limit)
    return most or 0

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


# -- the hoisted split ------------------------------------------------------------------

#: Primitives not worth a stored residual on their own: data movement and arithmetic
#: that costs about as much as reading its result back from memory.
CHEAP = frozenset({
    "abs", "add", "and", "broadcast_in_dim", "ceil", "clamp", "concatenate", "convert_element_type",
    "copy", "copy_p", "dynamic_slice", "eq", "expand_dims", "floor", "ge", "gt", "integer_pow",
    "iota", "is_finite", "le", "lt", "max", "min", "mul", "ne", "neg", "not", "or", "pad",
    "reshape", "rev", "round", "select_n", "sign", "slice", "square", "squeeze", "stop_gradient",
    "sub", "transpose", "xor",
})
#: Residuals may take at most this many times the bytes of the block's resident data.
MAX_RESIDUAL_RATIO = 2.0


class Split(NamedTuple):
    """The known/unknown split of one block's jaxpr.

    Attributes
    ----------
    jaxpr : ClosedJaxpr
        ``fn`` on one block: inputs are the resident leaves, the traced leaves and the
        shared leaves, in that order; the output is the pointwise log-density.
    n_resident, n_traced : int
        How many inputs are resident data leaves and traced data leaves.
    known : tuple of int
        Indices (into ``jaxpr.jaxpr.eqns``) of the equations computed once.
    unknown : tuple of int
        Indices of the equations computed at every evaluation.
    residuals : tuple
        The variables of the known part that the unknown part reads (or returns).
    raw : tuple of int
        The resident leaves (by position) that the unknown part reads directly.
    constants : tuple of (var, bool)
        Conditions on the data alone that hold everywhere or nowhere in it (see
        :func:`constant_conditions`): the unknown part reads each as a constant.
    """

    jaxpr: ClosedJaxpr
    n_resident: int
    n_traced: int
    known: tuple
    unknown: tuple
    residuals: tuple
    raw: tuple
    constants: tuple = ()

    @property
    def hoisted(self) -> bool:
        """Whether the block runs the split (something computed once, or a condition
        read as a constant) rather than ``fn`` itself."""
        return bool(self.residuals or self.constants)


def _is_cheap(eqn) -> bool:
    name = eqn.primitive.name
    if name in CHEAP:
        return True
    if name in CALLS:
        inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
        inner = getattr(inner, "jaxpr", inner)
        return inner is not None and all(_is_cheap(e) for e in inner.eqns)
    return False


def _runs_host_code(eqn) -> bool:
    if eqn.primitive.name in HOST_CODE:
        return True
    return any(_runs_host_code(e) for sub in jaxprs_in_params(eqn.params)
               for e in sub.eqns)


def _nbytes(var) -> int:
    aval = var.aval
    size = 1
    for d in aval.shape:
        size *= int(d)
    return size * aval.dtype.itemsize


def _known(jaxpr, n_resident: int) -> tuple:
    """Per equation of ``jaxpr``: whether it depends on the first ``n_resident`` inputs
    (the resident data) and constants alone, and whether it depends on the data at all."""
    known_vars = set(jaxpr.invars[:n_resident]) | set(jaxpr.constvars)
    from_data = set(jaxpr.invars[:n_resident])  # known variables computed from the data
    is_known, on_data = [], []
    for eqn in jaxpr.eqns:
        ok = (not eqn.effects and not _runs_host_code(eqn)
              and all(isinstance(v, Literal) or v in known_vars for v in eqn.invars))
        is_known.append(ok)
        on_data.append(ok and any(v in from_data for v in eqn.invars if not isinstance(v, Literal)))
        if ok:
            known_vars.update(eqn.outvars)
        if on_data[-1]:
            from_data.update(eqn.outvars)
    return is_known, on_data


def _producers(jaxpr, outs) -> tuple:
    """The equations (indices, in order) that ``outs``, computed from the data alone,
    depend on."""
    producer = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
    wanted, stack = set(), list(outs)
    while stack:
        i = producer.get(stack.pop())
        if i is None or i in wanted:
            continue
        wanted.add(i)
        stack += [u for u in jaxpr.eqns[i].invars if not isinstance(u, Literal)]
    return tuple(sorted(wanted))


def split_known(closed, n_resident: int, n_traced: int, constants=()) -> Split:
    """Split ``closed`` (``fn`` on one block) into the part computed once and the rest;
    ``constants`` (from :func:`constant_conditions`) are read as constants.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from jax.scipy.special import gammaln
    >>> def block(y, mu):                       # y resident, mu shared
    ...     return y * jnp.log(mu) - mu - gammaln(y + 1.0)
    >>> split = split_known(jax.make_jaxpr(block)(jnp.ones(8), 2.0), n_resident=1, n_traced=0)
    >>> split.hoisted, [str(v.aval) for v in split.residuals]
    (True, ['float32[8]'])
    """
    jaxpr = closed.jaxpr
    eqns = jaxpr.eqns
    resident = jaxpr.invars[:n_resident]
    is_known, on_data = _known(jaxpr, n_resident)
    producer = {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars}
    const_vars = {}
    for i, name, value in constants:
        if i >= len(eqns) or eqns[i].primitive.name != name or not is_known[i]:
            raise RuntimeError(f"fn traced to another program in this process: equation {i} "
                               f"is not the condition {name!r} found where the site was made")
        const_vars[eqns[i].outvars[0]] = value
    consts = tuple((v, const_vars[v]) for v in sorted(const_vars, key=lambda v: producer[v]))
    dropped = {producer[v] for v in const_vars}  # their producers: not evaluated per call

    # Walk back from what the unknown part needs; a known cheap equation is moved to
    # the unknown part (recomputed) and its own inputs become needed in turn.
    moved = [False] * len(eqns)
    needed = [v for i, e in enumerate(eqns) if not is_known[i] for v in e.invars
              if not isinstance(v, Literal)]
    needed += [v for v in jaxpr.outvars if not isinstance(v, Literal)]
    residuals: list = []
    seen = set()
    while needed:
        v = needed.pop()
        if v in seen:
            continue
        seen.add(v)
        i = producer.get(v)
        if i is None or not is_known[i] or v in const_vars:
            continue  # an input, a constant, or made by the unknown part
        # Constants alone are XLA's to fold, the same way in every program.
        if _is_cheap(eqns[i]) or not on_data[i]:
            if not moved[i]:
                moved[i] = True
                needed += [u for u in eqns[i].invars if not isinstance(u, Literal)]
        else:
            residuals.append(v)

    def none() -> Split:
        unknown = tuple(i for i in range(len(eqns)) if i not in dropped)
        used = {v for i in unknown for v in eqns[i].invars if not isinstance(v, Literal)}
        raw = tuple(k for k, v in enumerate(resident) if v in used | set(jaxpr.outvars))
        return Split(closed, n_resident, n_traced, (), unknown, (), raw, consts)

    if not residuals:
        return none()
    block_bytes = sum(_nbytes(v) for v in resident) or 1
    if sum(_nbytes(v) for v in residuals) > MAX_RESIDUAL_RATIO * block_bytes:
        return none()
    wanted = _producers(jaxpr, residuals)  # the known part
    unknown = tuple(i for i in range(len(eqns)) if not is_known[i] or moved[i])
    reads = {v for i in unknown for v in eqns[i].invars if not isinstance(v, Literal)}
    reads |= set(jaxpr.outvars)
    raw = tuple(k for k, v in enumerate(resident) if v in reads)
    # A residual read only by equations that were moved may have become unneeded.
    kept = tuple(sorted(set(residuals) & reads, key=lambda v: producer[v]))
    if not kept:
        return none()
    return Split(closed, n_resident, n_traced, wanted, unknown, kept, raw, consts)


def part(closed, eqns, invars, outvars):
    """The equations ``eqns`` of ``closed`` (``fn``'s jaxpr on one block) as a function of
    ``invars`` (built with ``jax.extend.core``'s ``Jaxpr`` and evaluated by its
    ``jaxpr_as_fun``, as JAX evaluates any jaxpr)."""
    jaxpr = closed.jaxpr
    info = DebugInfo("reduce_sum block", "parallel_backend.analysis",
                     tuple(f"in{i}" for i in range(len(invars))),
                     tuple(f"out{i}" for i in range(len(outvars))))
    sub = Jaxpr(jaxpr.constvars, list(invars), list(outvars),
                [jaxpr.eqns[i] for i in eqns], jaxpr.effects, info)
    return jaxpr_as_fun(ClosedJaxpr(sub, closed.consts))


def known_function(split: Split):
    """``f(resident_leaves) -> residuals`` for one block."""
    inv = split.jaxpr.jaxpr.invars
    run = part(split.jaxpr, split.known, inv[:split.n_resident], split.residuals)

    def known(resident):
        return tuple(run(*resident))

    return known


def unknown_function(split: Split):
    """``f(raw_resident, residuals, traced, shared) -> pointwise`` for one block: the
    equations computed at every evaluation (only for a split that hoisted something;
    otherwise the site calls ``fn`` itself)."""
    inv = split.jaxpr.jaxpr.invars
    start = split.n_resident + split.n_traced
    run = part(split.jaxpr, split.unknown,
               [inv[k] for k in split.raw] + list(split.residuals)
               + [v for v, _ in split.constants]
               + list(inv[split.n_resident:start]) + list(inv[start:]),
               split.jaxpr.jaxpr.outvars)
    fills = [(v.aval.shape, v.aval.dtype, value) for v, value in split.constants]

    def unknown(raw, residuals, traced, shared):
        # A constant of the program, the same in every route: XLA may simplify with it.
        constants = [jnp.full(shape, value, dtype) for shape, dtype, value in fills]
        (out,) = run(*raw, *residuals, *constants, *traced, *shared)
        return out

    return unknown


def conditions(closed, n_resident: int) -> tuple:
    """Equations (indices) of ``closed`` that make a boolean from the resident data alone
    which the rest of ``fn`` reads: a support check (``y >= 0``, ``y % 1 == 0``) that
    NumPyro's ``validate_args`` puts in front of every ``log_prob``, a mask."""
    jaxpr = closed.jaxpr
    is_known, on_data = _known(jaxpr, n_resident)
    read = {v for i, e in enumerate(jaxpr.eqns) if not is_known[i] for v in e.invars
            if not isinstance(v, Literal)}
    return tuple(i for i, e in enumerate(jaxpr.eqns)
                 if on_data[i] and len(e.outvars) == 1 and e.outvars[0] in read
                 and e.outvars[0].aval.dtype == jnp.bool_)


def constant_conditions(closed, n_resident: int, blocks, found=None) -> tuple:
    """``((equation, primitive name, value), ...)``: the :func:`conditions` of ``closed``
    that are ``True`` everywhere in the data, or ``False`` everywhere. ``blocks``: the
    resident leaves, padded into blocks as every route reads them; ``found``: the
    :func:`conditions` of ``closed`` where the caller has them already.

    Every route reads such a condition as a constant (:func:`split_known`), so XLA
    may simplify the program with it (a ``where`` that always keeps the log-density is
    dropped) the same way on every route. Plain NumPyro gets the same from XLA, which
    folds the data it closes over; a block cannot let it, as the host route passes
    the data at run time (git history of docs/performance.md)."""
    found = conditions(closed, n_resident) if found is None else found
    if not found:
        return ()
    jaxpr = closed.jaxpr
    outs = [jaxpr.eqns[i].outvars[0] for i in found]
    run = part(closed, _producers(jaxpr, outs), jaxpr.invars[:n_resident], outs)

    def values(*leaves):
        return tuple(run(*leaves))

    try:
        held = jax.jit(jax.vmap(values))(*blocks)
    except Exception:  # noqa: BLE001 - not batchable: one block at a time
        held = jax.jit(lambda *b: lax.map(lambda x: values(*x), b))(*blocks)
    out = []
    for i, value in zip(found, held):
        value = np.asarray(value)
        if value.size and (value.all() or not value.any()):
            out.append((i, jaxpr.eqns[i].primitive.name, bool(value.all())))
    return tuple(out)


# -- what fn computes --------------------------------------------------------------------

def computes(closed, rules: bool = True) -> str:
    """A digest of what a traced function computes: its jaxpr as JAX prints it (every
    equation, parameter and scalar constant, nested jaxprs too) and the content of its
    array constants. Whatever ``fn`` reads (a module's attribute, another module's
    helper, an object without a ``__dict__``) shows in it, where a key made of ``fn``
    itself can miss it. Two digests agree only where the traces compute alike.

    A ``custom_jvp`` or ``custom_vjp`` rule is a Python function that the jaxpr names
    but does not trace: where one is called (and ``rules``), the digest holds the jaxpr
    of the function's derivative too (:func:`_derivative`), so a rule that reads
    something changed since is seen. First derivatives only; where the derivative
    cannot be traced (a rule that refuses some input), only that is in the digest.
    Trace it under the precision of ``closed``'s trace."""
    # Printed without colours: JAX colours a jaxpr where its process started on a
    # terminal or in Jupyter, and a dask worker's digest must be the caller's.
    h = hashlib.sha256(closed.jaxpr.pretty_print(use_color=False).encode())
    todo, called = [(closed.consts, closed.jaxpr)], set()
    while todo:
        consts, jaxpr = todo.pop()
        for c in consts:
            h.update(digest(c).encode())
        for eqn in jaxpr.eqns:
            called.add(eqn.primitive.name)
            for v in eqn.invars:
                if isinstance(v, Literal) and np.ndim(v.val):
                    h.update(digest(v.val).encode())
            for p in eqn.params.values():
                for x in p if isinstance(p, (tuple, list)) else (p,):
                    if isinstance(x, ClosedJaxpr):
                        todo.append((x.consts, x.jaxpr))
                    elif isinstance(x, Jaxpr):
                        todo.append(((), x))
    if rules and called & CUSTOM_RULES:
        try:
            derivative = _derivative(closed, transpose=bool(called & VJP_RULES))
            h.update(computes(derivative, rules=False).encode())
        except Exception as e:  # noqa: BLE001 - a rule that refuses these inputs: named only
            h.update(f"no derivative: {type(e).__name__}".encode())
    return h.hexdigest()


def _inexact_part(fun, args, inexact, outs, *moving):
    """``fun``'s inexact outputs, ``moving`` taking the place of its inexact inputs."""
    it = iter(moving)
    out = fun(*(next(it) if f else x for x, f in zip(args, inexact)))
    return [out[i] for i in outs]


def _derivative(closed, transpose: bool):
    """The jaxpr of ``closed``'s derivative over its inexact inputs, traced now: the
    rules it calls run in that trace. A ``custom_jvp`` rule runs in the forward
    derivative (``jax.jvp``); a ``custom_vjp``'s backward rule only when the product is
    transposed (``transpose``: ``jax.vjp``, whose trace cost the negbin's block about
    three times the forward one's)."""
    fun = jaxpr_as_fun(closed)
    inexact = [np.issubdtype(a.dtype, np.inexact) for a in closed.in_avals]
    outs = [i for i, a in enumerate(closed.out_avals) if np.issubdtype(a.dtype, np.inexact)]

    def derivative(args, vectors):
        part = functools.partial(_inexact_part, fun, args, inexact, outs)
        primals = tuple(x for x, f in zip(args, inexact) if f)
        if not transpose:
            return jax.jvp(part, primals, tuple(vectors))
        _, back = jax.vjp(part, *primals)
        return back(vectors)

    def struct(a):
        return jax.ShapeDtypeStruct(a.shape, a.dtype)

    args = [struct(a) for a in closed.in_avals]
    vectors = ([struct(closed.out_avals[i]) for i in outs] if transpose
               else [s for s, f in zip(args, inexact) if f])
    return jax.make_jaxpr(derivative)(args, vectors)
