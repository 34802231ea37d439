"""Hoisting: the part of ``fn`` that depends on the data alone, computed once.

Plain NumPyro closes over concrete data, so XLA folds every data-only
subexpression of the log-density (``gammaln(y + 1)`` in a negative binomial, say)
into a constant at compile time and never computes it again. A ``reduce_sum``
block cannot let XLA do that: the host path passes the data as a runtime input,
where nothing is folded, and the two paths must give the same bits. So this
module does the folding itself, the same way for every path: it splits the
jaxpr of ``fn`` on one block into a *known* part (equations whose inputs are all
resident data or constants) and an *unknown* part, evaluates the known part once
per call site with one compiled program, and hands its results (the residuals)
to every evaluation as data.

Only work worth keeping is hoisted: a residual made by cheap data movement or
arithmetic (a reshape, ``y + 1``) is recomputed instead of stored, and nothing is
hoisted when the residuals would take more than ``MAX_RESIDUAL_RATIO`` times the
memory of the data. The split depends only on the jaxpr, so every process makes
the same one. Where nothing is hoisted, a block calls ``fn`` itself (:func:`calls_fn`);
otherwise the two parts are jaxprs of ``fn``'s equations, built and evaluated with
``jax.extend.core`` (:func:`part`). Imports jax and numpy.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .internals import CALLS, ClosedJaxpr, DebugInfo, Jaxpr, Literal, jaxpr_as_fun, jaxprs_in_params
from .internals import HOST_CODE as _HOST_CODE
from .traced import computes

__all__ = ["Split", "calls_fn", "conditions", "constant_conditions", "known_function", "part",
           "split_known", "traced_block", "unknown_function"]

#: Primitives not worth a stored residual on their own: data movement and arithmetic
#: that costs about as much as reading its result back from memory.
CHEAP = frozenset({
    "abs", "add", "and", "broadcast_in_dim", "ceil", "clamp", "concatenate", "convert_element_type",
    "copy", "copy_p", "dynamic_slice", "eq", "expand_dims", "floor", "ge", "gt", "integer_pow",
    "iota", "is_finite", "le", "lt", "max", "min", "mul", "ne", "neg", "not", "or", "pad",
    "reshape", "rev", "round", "select_n", "sign", "slice", "square", "squeeze", "stop_gradient",
    "sub", "transpose", "xor",
})
#: Primitives never hoisted: host code (a callback may fail, print or depend on state,
#: and must run where and when the user's evaluation runs).
HOST_CODE = _HOST_CODE
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

    jaxpr: object
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
    consts = tuple((v, const_vars[v]) for v in sorted(const_vars, key=producer.get))
    dropped = {producer[v] for v in const_vars}  # their producers: not evaluated per call

    # Walk back from what the unknown part needs; a known cheap equation is moved to
    # the unknown part (recomputed) and its own inputs become needed in turn.
    moved = [False] * len(eqns)
    needed = [v for i, e in enumerate(eqns) if not is_known[i] for v in e.invars
              if not isinstance(v, Literal)]
    needed += [v for v in jaxpr.outvars if not isinstance(v, Literal)]
    residuals, seen = [], set()
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
    residuals = tuple(sorted(set(residuals) & reads, key=lambda v: producer[v]))
    if not residuals:
        return none()
    return Split(closed, n_resident, n_traced, wanted, unknown, residuals, raw,
                 consts)


def part(closed, eqns, invars, outvars):
    """The equations ``eqns`` of ``closed`` (``fn``'s jaxpr on one block) as a function of
    ``invars`` (built with ``jax.extend.core``'s ``Jaxpr`` and evaluated by its
    ``jaxpr_as_fun``, as JAX evaluates any jaxpr)."""
    jaxpr = closed.jaxpr
    info = DebugInfo("reduce_sum block", "parallel_backend.hoist",
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
    the data at run time (docs/performance.md, "Conditions on the data")."""
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
