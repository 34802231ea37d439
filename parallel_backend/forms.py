"""How a call site's blocks are evaluated, read from ``fn``'s jaxpr (never from a timing).

This module owns the choice of evaluation form and the check for kernels that block
XLA's CPU thread pool. Imports jax only.

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
"""

from __future__ import annotations

import math

from .internals import LAPACK, SCAN, jaxprs_in_params

__all__ = ["FORMS", "blocks_pool", "detect_form", "scan_reduce_per_row"]

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


def detect_form(closed) -> str:
    """``"looped"`` when the jaxpr holds a ``scan``, else ``"batched"``."""
    return "looped" if _uses(closed.jaxpr, LOOPS) else "batched"


def blocks_pool(closed) -> bool:
    """Whether ``fn``'s jaxpr runs a kernel that blocks a thread of XLA's CPU pool
    (see :data:`POOL_BLOCKING`)."""
    return _uses(closed.jaxpr, POOL_BLOCKING)
