"""Routes: where a call site's blocks are evaluated, as values, and how the route is chosen.

A route computes a site's per-block partials (values, shared gradients, per-row data
gradients; or their tangents, a Hessian-vector product per block) for given parameters:

* :class:`GraphRoute`: every block inside the caller's XLA program (no callback);
* :class:`HostRoute`: chunks of blocks on the executor's workers, through one
  ``jax.pure_callback`` per evaluation (:mod:`.host`);
* :class:`SwitchedRoute`: either, chosen at run time by an int32 the caller's program
  carries (``pb.sample`` measures both on real segments of the sampler).

Every route computes every block with the same compiled body, so the route changes the
speed, never a bit. What differs between them is a property of the route: how it
evaluates a batch of parameter sets (:meth:`Route.batched`, the rule behind ``vmap``),
whether an eager call runs as one program, where second derivatives are taken. One
module builds a site's derivative rules from any route (:mod:`.derivatives`).

The choice is made two ways:

* :func:`default_route`: a rule of the executor and the site's shapes, with no timing
  and no compiling: what a ``reduce_sum`` traced outside ``pb.sample`` uses, and what
  ``pb.sample`` starts from. Threads pay where XLA leaves cores idle: a likelihood
  evaluated block by block (``"looped"``, the form of a ``scan``; XLA keeps such a
  loop on one core) in two tiles or more; everything else stays in the graph.
* ``Slots`` and :func:`choose`: ``pb.sample`` carries each site's choice into its
  compiled sampling loop as a runtime input (a slot per site), times real segments of
  the sampler on each route, and keeps the host only where it is faster by more than
  the noise; ``choose`` is a pure function of the measured seconds.

Imports jax, numpy and the core below it (:mod:`.batching`, :mod:`.host`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import host as host_path
from .batching import map_sets, nest_sets, tangent_batching
from .blocks import accelerator, device_shards
from .internals import is_tracer
from .kernels import HESSIAN_VECTOR_PRODUCT, Wrt

__all__ = [
    "GRAPH",
    "HOST",
    "LOOP",
    "MARGIN",
    "ROUTES",
    "Choice",
    "GraphCounter",
    "GraphRoute",
    "HostRoute",
    "Route",
    "SlotSite",
    "Slots",
    "SwitchedRoute",
    "Wrt",
    "carried",
    "choose",
    "current_slot",
    "default_route",
    "in_a_loop",
    "route_of",
]

#: Slot values: where a site runs.
GRAPH, HOST = 0, 1
#: The host path must be faster than the graph by this fraction (in the median and in
#: most rounds) to be chosen; the same margin the other way to leave a default host.
MARGIN = 0.05
#: Evaluations per timed call of :func:`in_a_loop` (benchmarks and ``pb.profile``).
LOOP = 4


class Route:
    """Where a site's blocks are evaluated (see the module docstring). Subclasses define
    :meth:`partials`, :meth:`batched` and :meth:`products`; the rest are properties the
    derivative rules read.

    The route classes are also the decision: :func:`default_route`,
    :meth:`Executor.route` and :func:`choose` give :class:`GraphRoute` or
    :class:`HostRoute` (the class), and :func:`route_of` makes the route the site uses
    from it (:meth:`for_site`). Strings appear only where users read or write them: the
    public ``dispatch=`` values (:data:`ROUTES` reads them) and ``stats()`` (:attr:`name`).

    Attributes
    ----------
    name : {"graph", "host", "switched"}
        What ``dispatch=`` and ``stats()`` call it.
    slot : int
        Its value in a program's slots (:data:`GRAPH`, :data:`HOST`).
    sets_each : bool
        A batch of parameter sets is evaluated one set at a time, each the unbatched
        program (the site's spec says ``sets="each"``), rather than with the sets inside
        the blocks.
    eager_program : bool
        An eager call (no traced argument) runs as one compiled program (``jax.jit``)
        rather than an operation at a time: the host route.
    autodiff_products : bool
        Second derivatives are JAX's autodiff of the blocked sum in the caller's program,
        not the blocks' Hessian-vector products: a batched site of ``sets="each"`` that
        may run in the graph, whose batched products measured slower than autodiff.
    """

    name = "route"
    slot = -1

    def __init__(self, executor, state):
        self.executor, self.state = executor, state
        self.sets_each = state.spec.sets == "each"
        self.eager_program = False
        self.autodiff_products = self.sets_each and state.spec.form != "looped"

    def partials(self, traced, shared, choice, wrt: Wrt):
        """Per-block partials of one parameter set: ``(values, shared_grads,
        data_grads)``."""
        raise NotImplementedError

    def batched(self, traced, shared, choice, wrt: Wrt, axes, choice_batched: bool, again):
        """The partials of a batch of parameter sets (``axes``: 0 or ``None`` per traced
        and per shared leaf), outputs leading with the sets; ``choice_batched``: a choice
        per set. ``again``: this route's batching functions ``f(t, s, c)`` themselves
        (:class:`.batching.Again`), to map over the sets with (an outer ``vmap`` then
        maps again)."""
        raise NotImplementedError

    def products(self, traced, shared, choice, wrt: Wrt, tangents):
        """The tangents of the partials along ``tangents`` (those of the leaves ``wrt``
        marks): per-block Hessian-vector products."""
        raise NotImplementedError

    @classmethod
    def for_site(cls, executor, state, grainsize) -> Route:
        """This route for ``state``'s site on ``executor`` (``grainsize``: the host
        route's fixed chunk size, or ``None``)."""
        raise NotImplementedError

    def uncounted(self) -> Route:
        """This route without its evaluation counter (where the caller counts a batch
        once)."""
        return self

    def eager(self, key, make, **jit_options):
        """``make()`` compiled as one program for this route's eager calls, made once per
        ``key`` and kept by the site (:meth:`.site.SiteState.eager_call`)."""
        return self.state.eager_call((self.name, key), make, **jit_options)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.state.spec.label})"


def _per_set(again, traced, shared, axes, *extra):
    """``again(t, s, *extra_set)`` for each parameter set of the batch, mapped
    (:func:`.batching.map_sets`), the leaves ``axes`` marks taken per set."""
    flat, tree = jax.tree_util.tree_flatten((traced, shared))
    batched = [a == 0 for a in (*axes[0], *axes[1])]

    def one(members):
        it = iter(members)
        traced_set, shared_set = jax.tree_util.tree_unflatten(
            tree, [next(it) if b else x for x, b in zip(flat, batched)])
        return again(traced_set, shared_set, *it)

    return map_sets(one, [x for x, b in zip(flat, batched) if b] + list(extra))


class GraphRoute(Route):
    """Every block inside the caller's program (``Executor.graph_partials``), counted
    by the site's ``GraphCounter`` where the executor counts graph calls."""

    name = "graph"
    slot = GRAPH

    def __init__(self, executor, state, counter=None):
        super().__init__(executor, state)
        self.counter = counter

    @classmethod
    def for_site(cls, executor, state, grainsize) -> GraphRoute:
        """Counted by the site's counter where the executor counts graph calls."""
        del grainsize
        return cls(executor, state, executor.graph_counter(state) if executor.count_calls
                   else None)

    def uncounted(self) -> GraphRoute:
        return GraphRoute(self.executor, self.state) if self.counter is not None else self

    def count(self, out):
        """``out`` plus a zero that counts one evaluation (of as many sets as ``out``'s
        values have leading entries) where this route counts; ``out`` otherwise."""
        if self.counter is None:
            return out
        values, shared_grads, data_grads = out
        zero = self.counter.zero(values.sum(axis=-1))

        def add(x):
            return x + zero.reshape(zero.shape + (1,) * (x.ndim - zero.ndim)).astype(x.dtype)

        return add(values), tuple(map(add, shared_grads)), tuple(map(add, data_grads))

    def partials(self, traced, shared, choice, wrt):
        return self.count(self.executor.graph_partials(self.state, traced, shared,
                                                       wrt.traced, wrt.shared))

    def batched(self, traced, shared, choice, wrt, axes, choice_batched, again):
        if self.sets_each:
            return self.count(_per_set(lambda t, s: again.uncounted(t, s, None), traced,
                                      shared, axes))
        return self.count(nest_sets(
            lambda t, s, ax: self.executor.graph_partials(self.state, t, s, wrt.traced,
                                                          wrt.shared, ax), axes)(traced, shared))

    def products(self, traced, shared, choice, wrt, tangents):
        if any(map(is_tracer, (*traced, *shared, *tangents[0], *tangents[1]))):
            return self._products(wrt, traced, shared, tangents)
        # Eager (an eager ``jax.hessian``, NumPyro's first gradient of a per-row site):
        # one compiled program, made once. Run op by op, the ``cond`` that answers a
        # product along zero compiled its branches anew at each call (1.4 s for the
        # demo's 200,000 rows).
        program = self.eager(("products", wrt, self.counter is not None),
                             lambda: functools.partial(self._products, wrt))
        return program(traced, shared, tangents)

    def _products(self, wrt, traced, shared, tangents):
        evaluate = functools.partial(_products_in_graph, self.state, wrt, len(traced),
                                     len(shared))
        return self.count(tangent_batching(evaluate)((*traced, *tangents[0]),
                                                     (*shared, *tangents[1])))


def _products_in_graph(state, wrt, n_traced, n_shared, traced, shared, set_axes):
    """The graph route's Hessian-vector products (``traced`` and ``shared`` end with the
    tangents), a batch laid out as a host task lays it out; along zero (every set of the
    batch), zeros, as the host route answers, without evaluating a block."""
    products = functools.partial(state.program.graph_partials, state.prepared(), traced,
                                 shared, wrt, HESSIAN_VECTOR_PRODUCT, set_axes)
    moving = [jnp.any(x != 0) for x in (*traced[n_traced:], *shared[n_shared:])]
    shapes = jax.eval_shape(products)
    return lax.cond(functools.reduce(jnp.logical_or, moving, jnp.bool_(False)),
                    products, functools.partial(_zeros_like, shapes))


def _zeros_like(shapes):
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)


class HostRoute(Route):
    """Chunks on the executor's workers, through one host callback per evaluation (a
    batch of parameter sets or of tangents included): ``host.evaluate``."""

    name = "host"
    slot = HOST

    def __init__(self, executor, state, grainsize):
        super().__init__(executor, state)
        self.grainsize = grainsize
        self.eager_program = True
        self.autodiff_products = False

    @classmethod
    def for_site(cls, executor, state, grainsize) -> HostRoute:
        return cls(executor, state, grainsize)

    def eager(self, key, make, **jit_options):
        """As :meth:`Route.eager`, per chunk size (``grainsize``)."""
        return super().eager((self.grainsize, key), make, **jit_options)

    def partials(self, traced, shared, choice, wrt, tangents=((), ())):
        return host_path.partials(self.state, self.executor, self.grainsize, traced, shared,
                                  wrt.traced, wrt.shared, tangents)

    def batched(self, traced, shared, choice, wrt, axes, choice_batched, again):
        return jax.vmap(lambda t, s: self.partials(t, s, None, wrt), in_axes=axes)(traced,
                                                                                  shared)

    def products(self, traced, shared, choice, wrt, tangents):
        return self.partials(traced, shared, choice, wrt, tangents)


class SwitchedRoute(Route):
    """The graph or the host, where the traced int32 ``choice`` says (:data:`GRAPH`,
    :data:`HOST`): both are compiled into the caller's program."""

    name = "switched"

    def __init__(self, graph: GraphRoute, host: HostRoute):
        super().__init__(graph.executor, graph.state)
        self.graph, self.host = graph, host

    def uncounted(self) -> SwitchedRoute:
        graph = self.graph.uncounted()
        return self if graph is self.graph else SwitchedRoute(graph, self.host)

    def partials(self, traced, shared, choice, wrt):
        return lax.cond(choice == HOST, lambda: self.host.partials(traced, shared, None, wrt),
                        lambda: self.graph.partials(traced, shared, None, wrt))

    def batched(self, traced, shared, choice, wrt, axes, choice_batched, again):
        if choice_batched:  # a choice per set: each set alone, where its choice says
            return _per_set(again.counted, traced, shared, axes, choice)

        def on_graph():
            if not self.sets_each:
                return self.graph.batched(traced, shared, None, wrt, axes, False, again)
            # Through ``again``: an outer vmap level maps again.
            graph = jnp.int32(GRAPH)
            return self.graph.count(_per_set(lambda t, s: again.uncounted(t, s, graph), traced,
                                             shared, axes))

        return lax.cond(choice == HOST, lambda: self.host.batched(
            traced, shared, None, wrt, axes, False, again), on_graph)

    def products(self, traced, shared, choice, wrt, tangents):
        return self.graph.products(traced, shared, choice, wrt, tangents)


def route_of(executor, state, grainsize, choice=None) -> Route:
    """The route of ``state``'s site on ``executor``: where ``choice`` (a traced int32
    from ``pb.sample``'s slots) is given, switched at run time; else the executor's
    route for the site (:meth:`Executor.route`).

    In a program that runs on several devices at once (:func:`.blocks.device_shards`:
    ``jax.pmap``, NumPyro's ``chain_method="parallel"``), the graph, whatever the
    executor's ``dispatch``: each device's shard would call back at the same time and
    hold a thread of XLA's CPU pool while it waits, and once the shards hold every pool
    thread, chunk programs in this process never start (seen with jax 0.10: two devices
    on two cores). The devices already run in parallel there, and the graph gives the
    same bits."""
    if device_shards() > 1:
        return GraphRoute.for_site(executor, state, grainsize)
    if choice is not None:
        return SwitchedRoute(GraphRoute.for_site(executor, state, grainsize),
                             HostRoute.for_site(executor, state, grainsize))
    return executor.route(state).for_site(executor, state, grainsize)


def default_route(executor, state) -> type[Route]:
    """:class:`GraphRoute` or :class:`HostRoute` for ``state``'s site on ``executor``
    without measuring: the executor's fixed route (``dispatch="graph"`` or ``"host"``,
    ``Executor.fixed_route``), else (``"auto"``) the host where the site is
    evaluated block by block for a ``scan`` (XLA keeps such a body on one core) and the
    host path can split it (two workers, two tiles), else the graph (where XLA threads
    the batched evaluation as it threads plain NumPyro, and the blocks looped for a
    reduction within rows, whose loop body XLA already spreads over the cores: two chunk
    programs of such blocks at once on two threads ran hardly faster than one after the
    other).

    On an accelerator (a GPU, a TPU) the graph, where it evaluates plain NumPyro's
    program (``Program.plain_partials``): one kernel over every row, which a
    block loop or a callback to host threads only slows.

    Fewer tiles than workers still pays: on 16 cores the HMM at 10,000 and 50,000
    sequences (8 and 25 tiles) beat plain on the host and lost in the graph, whose block
    loop holds one core while plain's scan takes three (docs/performance.md)."""
    if executor.fixed_route is not None:
        return executor.fixed_route
    if accelerator():  # the graph is plain's program on the device: nothing to split
        return GraphRoute
    if executor.can_use_host(state) and state.spec.form == "looped" and not state.spec.row_loop:
        return HostRoute
    return GraphRoute


#: The routes by the names ``dispatch=`` takes (``"auto"``: none fixed).
ROUTES: dict[str, type[Route]] = {"graph": GraphRoute, "host": HostRoute}


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
            switchable = (executor.fixed_route is None and executor.can_use_host(state)
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
    route : type[Route]
        :class:`GraphRoute` or :class:`HostRoute`.
    ratio : float
        Median seconds per gradient on the host over those in the graph (< 1: the host
        is faster); ``nan`` without measurements.
    reason : str
        One line: what the measurements said.
    """

    route: type[Route]
    ratio: float
    reason: str


def choose(graph, host, default: type[Route], margin: float = MARGIN) -> Choice:
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
    >>> choose([1.0, 1.0, 1.1], [0.7, 0.8, 0.75], GraphRoute).route.name
    'host'
    >>> choose([1.0, 1.0, 1.0], [0.98, 1.03, 0.99], HostRoute).route.name
    'host'
    >>> choose([1.0, 1.0, 1.0], [1.2, 1.3, 1.1], HostRoute).route.name
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
        return Choice(HostRoute, ratio, text)
    if ratio > 1 + margin and slower >= need:
        return Choice(GraphRoute, ratio, text)
    return Choice(default, ratio,
                  text + f": within the noise, the default ({default.name}) stays")


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

    return jax.jit(functools.partial(_loop, f, loops))


def _loop(f, loops, *args):
    """:func:`in_a_loop`'s program."""
    body = functools.partial(_loop_step, f)
    return jax.lax.fori_loop(1, loops, body, (_zero_of(f(*args)), args))[0]


def _loop_step(f, _, carry):
    zero, args = carry
    return _zero_of(f(*_nudged(args, zero))), args


def _zero_of(out):
    """Zero that depends on every output."""
    return sum(jnp.sum(x) for x in jax.tree.leaves(out)) * 0


def _nudged(args, zero):
    """``args`` plus ``zero`` (their float leaves): the next call depends on the last."""
    return jax.tree.map(lambda x: x + zero.astype(x.dtype)
                        if jnp.issubdtype(jnp.result_type(x), jnp.inexact) else x, args)


# -- counting graph evaluations ------------------------------------------------------


class GraphCounter:
    """Counts the graph evaluations of one call site: calls, and parameter sets (a
    ``vmap`` batch of ``k`` is one call of ``k``)."""

    def __init__(self):
        self._counts = [0, 0]
        self._lock = threading.Lock()

    def zero(self, value):
        """A traced zero shaped like ``value`` that counts one evaluation when computed
        (the caller adds it to the value and to the gradient's cotangent, so that XLA
        keeps it wherever either is used)."""
        dtype = jnp.result_type(value)

        def count(v):
            with self._lock:
                self._counts[0] += 1
                self._counts[1] += max(int(np.size(v)), 1)
            return np.zeros(np.shape(v), dtype)

        return jax.pure_callback(count, jax.ShapeDtypeStruct(jnp.shape(value), dtype),
                                 jax.lax.stop_gradient(value), vmap_method="expand_dims")

    def counts(self) -> tuple[int, int]:
        """``(calls, parameter sets)`` counted so far."""
        with self._lock:
            return tuple(self._counts)
