"""Where a call site runs: inside the caller's XLA program (``"graph"``) or as chunks on
the executor's workers through a host callback (``"host"``).

Both compute every block with the same compiled body, so the choice changes the speed,
never a bit, and it may change at any moment. This module owns the two ways it is made:

* :func:`default_route`: a rule of the executor and the site's shapes, with no timing
  and no compiling: what a ``reduce_sum`` traced outside ``pb.sample`` uses, and what
  ``pb.sample`` starts from. Threads pay where XLA leaves cores idle: a likelihood
  evaluated block by block (``"looped"``, the form of a ``scan``; XLA keeps such a
  loop on one core) in two tiles or more; everything else stays in the graph.
* ``Slots`` and :func:`choose`: ``pb.sample`` carries each site's choice into its
  compiled sampling loop as a runtime input (a slot per site: the program holds both
  paths behind a ``lax.cond``), times real segments of the sampler on each path, and
  keeps the host only where it is faster by more than the noise (:func:`choose`);
  ``choose`` is a pure function of the measured seconds, tested with injected timings.

Imports jax and numpy.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "GRAPH",
    "HOST",
    "LOOP",
    "MARGIN",
    "Choice",
    "SlotSite",
    "Slots",
    "carried",
    "choose",
    "current_slot",
    "default_route",
    "in_a_loop",
]

#: Slot values: where a site runs.
GRAPH, HOST = 0, 1
#: The host path must be faster than the graph by this fraction (in the median and in
#: most rounds) to be chosen; the same margin the other way to leave a default host.
MARGIN = 0.05
#: Evaluations per timed call of :func:`in_a_loop` (benchmarks and ``pb.profile``).
LOOP = 4


def default_route(executor, state) -> str:
    """``"graph"`` or ``"host"`` for ``state``'s site on ``executor`` without measuring:
    the executor's fixed ``dispatch``, else (``"auto"``) the host where the site is
    evaluated block by block for a ``scan`` (XLA keeps such a body on one core) and the
    host path can split it (two workers, two tiles), else the graph (where XLA threads
    the batched evaluation as it threads plain NumPyro, and the blocks looped for a
    reduction within rows, whose loop body XLA already spreads over the cores: two chunk
    programs of such blocks at once on two threads ran hardly faster than one after the
    other).

    Fewer tiles than workers still pays: on 16 cores the HMM at 10,000 and 50,000
    sequences (8 and 25 tiles) beat plain on the host and lost in the graph, whose block
    loop holds one core while plain's scan takes three (docs/performance.md)."""
    if executor.dispatch != "auto":
        return executor.dispatch
    if executor.can_use_host(state) and state.spec.form == "looped" and not state.spec.row_loop:
        return "host"
    return "graph"


# -- choices carried into a compiled program ------------------------------------------


class SlotSite(NamedTuple):
    """A site traced in a program that carries :class:`Slots`: its executor and state,
    and its slot (``None`` where its route is fixed: a fixed ``dispatch``, a host
    path that cannot pay, or no slot left)."""

    executor: object
    state: object
    slot: int | None


class Slots:
    """The runtime choices of one compiled program: ``values`` (an int32 array, traced
    when the program is traced) holds one slot per switchable site, :data:`GRAPH` or
    :data:`HOST`.

    Every site traced in the program is recorded in :attr:`sites`, in the order first
    traced (a site traced again keeps its entry), for the caller to read after
    tracing; switchable ones take slots in that order, up to ``len(values)``.
    """

    def __init__(self, values):
        self.values = values
        self.capacity = int(np.shape(values)[0])
        self.sites: list = []
        self._index: dict = {}

    def take(self, executor, state):
        """The traced choice of ``state``'s site on ``executor``, or ``None`` where its
        route is fixed (it then runs where :meth:`Executor.route` says)."""
        key = (executor, state)  # both hash by identity, and the entry holds them
        i = self._index.get(key)
        if i is None:
            used = sum(s.slot is not None for s in self.sites)
            switchable = (executor.dispatch == "auto" and executor.can_use_host(state)
                          and used < self.capacity)
            i = self._index[key] = len(self.sites)
            self.sites.append(SlotSite(executor, state, used if switchable else None))
        slot = self.sites[i].slot
        return None if slot is None else self.values[slot]


_carried = threading.local()


@contextlib.contextmanager
def carried(slots: Slots):
    """A block in which ``reduce_sum`` calls traced take their choice from ``slots``."""
    previous = getattr(_carried, "slots", None)
    _carried.slots = slots
    try:
        yield slots
    finally:
        _carried.slots = previous


def current_slot(executor, state):
    """The traced choice for ``state``'s site in the innermost :func:`carried` block
    (``None`` outside one, or where the site's route is fixed)."""
    slots = getattr(_carried, "slots", None)
    return None if slots is None else slots.take(executor, state)


# -- the decision from measured segments ------------------------------------------------


class Choice(NamedTuple):
    """What :func:`choose` decided and why.

    Attributes
    ----------
    route : {"graph", "host"}
    ratio : float
        Median seconds per gradient on the host over those in the graph (< 1: the host
        is faster); ``nan`` without measurements.
    reason : str
        One line: what the measurements said.
    """

    route: str
    ratio: float
    reason: str


def choose(graph, host, default: str, margin: float = MARGIN) -> Choice:
    """The route from paired measurements: ``graph[i]`` and ``host[i]`` are seconds per
    gradient of round ``i`` (each measured on a real segment of the sampler).

    The host is chosen where its median is below ``1 - margin`` of the graph's and it
    was faster in at least three quarters of the rounds; the graph where the host's
    median is above ``1 + margin`` and it was slower as often; otherwise the measurements do not
    tell the two apart beyond the noise, and ``default`` (:func:`default_route`) stays.
    So the same model on the same machine gets the same route run after run, unless
    the timings truly differ.

    Examples
    --------
    >>> choose([1.0, 1.0, 1.1], [0.7, 0.8, 0.75], "graph").route
    'host'
    >>> choose([1.0, 1.0, 1.0], [0.98, 1.03, 0.99], "host").route
    'host'
    >>> choose([1.0, 1.0, 1.0], [1.2, 1.3, 1.1], "host").route
    'graph'
    """
    g, h = np.asarray(graph, float), np.asarray(host, float)
    if g.size == 0 or g.size != h.size or not (np.all(g > 0) and np.all(h > 0)):
        return Choice(default, float("nan"), "not measured: the default rule")
    ratio = float(np.median(h) / np.median(g))
    need = math.ceil(0.75 * g.size)
    faster, slower = int(np.sum(h < g)), int(np.sum(h > g))
    text = f"host/graph {ratio:.3f} per gradient, host faster in {faster} of {g.size} rounds"
    if ratio < 1 - margin and faster >= need:
        return Choice("host", ratio, text)
    if ratio > 1 + margin and slower >= need:
        return Choice("graph", ratio, text)
    return Choice(default, ratio, text + f": within the noise, the default ({default}) stays")


def in_a_loop(f, loops: int = LOOP):
    """``jit`` of ``loops`` evaluations of ``f(*args)`` (any pytree of outputs, such as a
    value and its gradients) in one compiled loop, as a sampler evaluates a log-density.

    Each iteration's arguments depend on every output of the previous one (plus zero
    times their sum), so XLA can neither hoist an evaluation out of the loop nor drop
    an output. Returns zero (of the outputs' dtype): time the call, divide by ``loops``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> f = in_a_loop(jax.value_and_grad(lambda m: -jnp.sum((jnp.arange(4.0) - m) ** 2)), 3)
    >>> float(f(1.0)) == 0.0
    True
    """

    def zero_of(out):
        return sum(jnp.sum(x) for x in jax.tree.leaves(out)) * 0

    def nudge(args, zero):
        return jax.tree.map(lambda x: x + zero.astype(x.dtype)
                            if jnp.issubdtype(jnp.result_type(x), jnp.inexact) else x, args)

    def loop(*args):
        def body(_, carry):
            zero, a = carry
            return zero_of(f(*nudge(a, zero))), a

        return jax.lax.fori_loop(1, loops, body, (zero_of(f(*args)), args))[0]

    return jax.jit(loop)
