"""Every device that steers XLA or its runtime, in one place.

Two promises rest on how XLA compiles and runs programs, not only on what they compute:

* **the same bits on every route**: a block computed inside the caller's program (the
  graph route), in a host chunk program on a worker thread or process, or on a device
  must round the same way, so XLA must compile the block's arithmetic alike in all of
  them;
* **a host route that never hangs**: chunk programs launched from inside a host callback
  need room on XLA's CPU runtime while the caller's program waits for them.

Today's XLA (jaxlib 0.10 and 0.12) breaks each in a few known ways. Each guard below
answers one of them; :data:`GUARDS` names it, says which and on which versions it was
seen. ``tests/unit/test_guards.py`` holds, per guard, the promise with the guard on and
what XLA does without it, per JAX version: a test fails, naming the guard, when the guard
is removed, and when XLA stops (or starts) doing what it answers. :func:`disabled` turns
guards off for those tests; nothing else may use it.

Imports jax, numpy, :mod:`.errors` and :mod:`.internals`.
"""

from __future__ import annotations

import contextlib
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .errors import EvaluationStalled, InFlightLimit
from .internals import custom_vmap

__all__ = [
    "GUARDS",
    "disabled",
    "enabled",
    "fence",
    "gather",
    "hide",
    "pin",
]

#: Each guard and the behaviour of XLA it answers.
GUARDS = {
    "pin": "XLA:CPU compiles a small while loop that reads little memory and holds no "
           "matrix product as one kernel (SmallWhileLoopHoistingPass, a call marked "
           "xla_cpu_small_call; jax 0.10 and 0.12); a block evaluated in such a loop of the "
           "caller's (NUTS on small data, a scan over parameter sets) then rounds unlike the "
           "same block in a host chunk program (jax 0.12; on 0.10 the kernel rounds alike). "
           "The fence's predicate holds the same product: with the fence in place, removing "
           "the pin alone changed no bit",
    "fence": "XLA fuses the caller's arithmetic on a result (a leapfrog step p + eps * g) "
             "into the in-graph evaluation that made it, but not into a host callback's "
             "result, and rounds the two differently (an FMA or not; jax 0.10 and 0.12); an "
             "optimization barrier does not hold: XLA removes it before it fuses",
    "hide": "XLA folds data it can see (constants of the caller's program) into the "
            "block's code and evaluates the arithmetic on it alone at compile time (constant "
            "folding), rounded otherwise than a host chunk program computes it from the data "
            "it receives at run time (y * 0.7 + 0.3, recomputed in every block: jax 0.10 and "
            "0.12)",
    "stall_probe": "a host callback's chunk programs wait for a place among those XLA "
                   "keeps for programs in flight; where the caller queued operations on "
                   "the callback's result before it was ready, those places never free "
                   "and the callback would wait forever (jax 0.10 and 0.12)",
}

_disabled: set = set()


def enabled(name: str) -> bool:
    """Whether guard ``name`` is on (it always is, but inside :func:`disabled`)."""
    return name not in _disabled


@contextlib.contextmanager
def disabled(*names: str):
    """A block in which the guards ``names`` are off, process-wide: programs traced (and
    chunk programs compiled) inside it are built without them. For the tests that show
    what each guard answers; never for users.

    Examples
    --------
    >>> with disabled("pin"):
    ...     enabled("pin")
    False
    >>> enabled("pin")
    True
    """
    unknown = sorted(set(names) - set(GUARDS))
    if unknown:
        raise ValueError(f"unknown guard(s) {unknown}; known: {sorted(GUARDS)}")
    before = set(_disabled)
    _disabled.update(names)
    try:
        yield
    finally:
        _disabled.clear()
        _disabled.update(before)


# -- guards in the compiled programs ---------------------------------------------------


def _product_test(x):
    """``True`` for each element of ``x``, from a small integer matrix product XLA cannot
    fold (its operand depends on ``x``)."""
    flag = (x == x).astype(jnp.int32)  # noqa: PLR0124 - data XLA cannot fold
    grid = jnp.arange(16, dtype=jnp.int32).reshape(4, 4) % 3
    product = jnp.matmul(grid, grid * flag[..., None, None] + (1 - flag[..., None, None]))
    return product[..., 0, 0] >= 0


def pin(values, *arrays):
    """``(values, arrays)`` bit for bit, beside a small integer matrix product: guard
    ``pin``. The product (it selects nothing: never negative) keeps any loop around a
    block out of the small-loop kernel path, on every route. ``arrays`` have the leading
    axes of ``values``."""
    if not enabled("pin"):
        return values, arrays
    keep = _product_test(values)

    def pinned(x):
        k = keep.reshape(keep.shape + (1,) * (jnp.ndim(x) - keep.ndim))
        return jnp.where(k, x, jnp.nan)

    return pinned(values), tuple(pinned(a) for a in arrays)


@custom_vmap
def _fenced(tree):
    if not (leaves := [x for x in jax.tree.leaves(tree) if jnp.size(x)]):
        return tree

    def broken(t):
        return jax.tree.map(lambda a: jnp.full_like(a, jnp.nan)
                            if jnp.issubdtype(a.dtype, jnp.inexact) else a, t)

    return lax.cond(_product_test(jnp.ravel(leaves[0])[0]), lambda t: t, broken, tree)


@_fenced.def_vmap
def _fenced_batch(axis_size, in_batched, tree):
    # Mapped, a conditional becomes a select of both branches: one conditional over the
    # batch instead.
    return _fenced(tree), in_batched[0]


def fence(tree):
    """``tree`` as it is, through a conditional XLA cannot remove (its predicate a small
    product, its other branch NaN): a fusion boundary, guard ``fence``."""
    return _fenced(tree) if enabled("fence") else tree


def hide(*trees):
    """``trees`` behind one optimization barrier: guard ``hide`` (data XLA must not see)."""
    if not enabled("hide"):
        return trees
    return lax.optimization_barrier(trees)


# -- guards of the host route's runtime ------------------------------------------------

#: Seconds a host-route evaluation waits with no chunk finishing before it asks whether
#: XLA's device can still start a program, and how long that question waits.
STALL_SECONDS = 2.0
PROBE_SECONDS = 8.0


def gather(futures, devices, label: str, timeout: float | None = None, rows=None,
           executor: str = "?") -> list:
    """``[f.result() for f in futures]`` (chunk tasks on this process's threads, the
    ``i``-th on ``devices[i]``), every wait bounded.

    * Where no chunk finishes for ``timeout`` seconds (an executor's ``stall_timeout``;
      ``None``: no bound), the chunks not started are cancelled and
      :class:`~parallel_backend.errors.EvaluationStalled` names the site, the seconds and
      the rows of the chunks still running (``rows()``: ``[start, stop)`` per future,
      asked for only then).
    * Guard ``stall_probe``: where no chunk finishes for :data:`STALL_SECONDS`, a program
      of one addition is started on each device a pending chunk runs on; if one cannot
      start within :data:`PROBE_SECONDS`, :class:`~parallel_backend.errors.InFlightLimit`
      is raised at once. A chunk that is merely slow (compiling, a long evaluation)
      leaves places free, and the wait goes on up to ``timeout``.
    """
    probe = enabled("stall_probe")
    results, seen, since = [], 0, time.monotonic()
    for future in futures:
        while True:
            waited = time.monotonic() - since
            step = STALL_SECONDS if probe else None
            if timeout is not None:
                step = max(0.0, min(step if step is not None else timeout, timeout - waited))
            try:
                results.append(future.result(timeout=step))
                break
            except TimeoutError:
                finished = sum(f.done() for f in futures)
                if finished != seen:  # progress: the clocks start again
                    seen, since = finished, time.monotonic()
                    continue
                if probe:  # nothing finished for a while: can the chunks start at all?
                    stuck = {d for f, d in zip(futures, devices) if not f.done()}
                    if not all(_starts(d, PROBE_SECONDS) for d in stuck) and \
                            sum(f.done() for f in futures) == finished:
                        raise InFlightLimit(label, STALL_SECONDS + PROBE_SECONDS) from None
                if timeout is not None and time.monotonic() - since >= timeout and \
                        sum(f.done() for f in futures) == finished:
                    ranges = rows() if rows is not None else [()] * len(futures)
                    pending = [r for f, r in zip(futures, ranges) if not f.done() and r]
                    for f in futures:
                        f.cancel()
                    raise EvaluationStalled(label, timeout, pending, executor) from None
    return results


_ADD_ONE = jax.jit(lambda x: x + 1)


def _starts(device, seconds: float) -> bool:
    """Whether a one-addition program starts and ends on ``device`` within ``seconds``.
    It runs on a daemon thread of its own, left to finish on its own where it cannot
    start (it then holds nothing but a place in XLA's queue)."""
    ended = threading.Event()

    def run():
        jax.block_until_ready(_ADD_ONE(jax.device_put(np.int32(0), device)))
        ended.set()

    threading.Thread(target=run, name="pb-inflight-probe", daemon=True).start()
    return ended.wait(seconds)
