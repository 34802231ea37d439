"""Where a call site runs: inside the caller's XLA program, or on the executor's workers.

This module owns the decision an executor makes once per call site
(:func:`decide`) and the measurement behind ``dispatch="auto"``
(:func:`calibrate`). The decision only chooses *where* blocks are evaluated, never
*how*: both places compute every block with the same form, so whatever is
measured, the results are the same bits. Imports jax, numpy and the core.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from .spec import combine

__all__ = ["decide", "calibrate", "in_a_loop", "GRAPH_ALWAYS_SECONDS", "HOST_MARGIN", "LOOP"]

#: Below this time per evaluation in the graph, a callback and task dispatch cannot pay.
GRAPH_ALWAYS_SECONDS = 1.5e-3
#: Measured cost of one host callback, added to the host path's time.
CALLBACK_SECONDS = 1e-4
#: The host path must beat the faster of the graph and plain NumPyro by this factor,
#: in the median and in the fastest round, to be chosen.
HOST_MARGIN = 0.85
#: Evaluations per timed call of the in-graph options (the graph and plain's form):
#: they run in one compiled loop, as inside a sampler, where XLA allocates their
#: temporaries once for the whole loop instead of once per call. Isolated calls
#: overstated plain's cost (HMM, 3,000 sequences: 48.5 ms per isolated gradient,
#: 35.8 ms in a loop), and so made the host path look better than it is in NUTS.
LOOP = 4
#: Timed rounds (each option once per round, in turn); fewer for slow evaluations.
ROUNDS = 7
SLOW_ROUNDS = 3
SLOW_SECONDS = 0.1


def decide(executor, state, grainsize, data_leaves, shared_leaves):
    """``("graph" or "host", timing)`` for ``state``'s call site on ``executor``.

    With ``dispatch="auto"``: small work, one worker or one tile stays in the graph;
    otherwise every option is timed (see :func:`calibrate`) and the host path is
    chosen only when it clearly beats both the graph and plain NumPyro's own form.
    ``timing`` is what was measured (``None`` when nothing was).
    """
    if executor.dispatch != "auto":
        return executor.dispatch, None
    if executor.workers < 2 or state.spec.tiles.n_tiles < 2:
        return "graph", None
    # Measure on a thread of its own: this runs while the caller's jit is tracing,
    # and on this thread every jax operation would be staged into that trace.
    with ThreadPoolExecutor(1, thread_name_prefix="parallel_backend_calibrate") as pool:
        timing = pool.submit(calibrate, executor, state, grainsize, data_leaves,
                             shared_leaves).result()
    return choose(timing), timing


def choose(timing: dict) -> str:
    """The decision from measured seconds (``{"graph": [...], "host": [...], "plain": [...]}``)."""
    med = {k: float(np.median(v)) for k, v in timing.items() if v}
    best = {k: float(np.min(v)) for k, v in timing.items() if v}
    if "host" not in med or med["graph"] < GRAPH_ALWAYS_SECONDS:
        return "graph"
    ref_med = min(med["graph"], med.get("plain", np.inf))
    ref_best = min(best["graph"], best.get("plain", np.inf))
    host_wins = (med["host"] + CALLBACK_SECONDS < HOST_MARGIN * ref_med
                 and best["host"] + CALLBACK_SECONDS < HOST_MARGIN * ref_best)
    return "host" if host_wins else "graph"


def calibrate(executor, state, grainsize, data_leaves, shared_leaves) -> dict:
    """Seconds of one value-and-gradient evaluation on each option, per timed round.

    ``graph`` is the block evaluation inside a jitted program, ``host`` the chunks
    on the executor's workers, ``plain`` ``fn(data, *shared).sum()`` as plain
    NumPyro differentiates it (timed only where the host path beats the graph).
    Parameters are the values at hand (ones where they are traced). Every option is
    warmed up first (compiled; the chunker settled), then the options are timed in
    interleaved rounds, so a noisy neighbour slows them alike. Stops early (after the
    first round) when the graph alone is below :data:`GRAPH_ALWAYS_SECONDS`.
    """
    from .host import evaluate

    spec = state.spec
    program = state.program
    prepared = state.prepared()

    def probe(x):
        if isinstance(x, jax.core.Tracer):
            return np.ones(x.shape, x.dtype)
        return np.asarray(x)

    leaves = [probe(x) for x in data_leaves]
    traced = tuple(x for x, t in zip(leaves, spec.traced) if t)
    shared = tuple(probe(x) for x in shared_leaves)
    dt = tuple(np.issubdtype(x.dtype, np.inexact) for x in traced)
    ds = tuple(np.issubdtype(x.dtype, np.inexact) for x in shared)

    with jax.enable_x64(spec.x64):
        graph = in_a_loop(lambda t, s: combine(*program.graph_partials(prepared, t, s, dt, ds)))

        def unsplit(t, s):
            it = iter(t)
            full = [next(it) if is_t else x for x, is_t in zip(leaves, spec.traced)]
            data = jax.tree_util.tree_unflatten(spec.data_treedef, full)
            args = jax.tree_util.tree_unflatten(spec.shared_treedef, list(s))
            return spec.fn(data, *args).sum()

        plain = in_a_loop(jax.value_and_grad(unsplit, argnums=(0, 1)))

    ndims = tuple(np.ndim(x) for x in (*traced, *shared))

    def run(option):
        with jax.enable_x64(spec.x64):
            if option == "host":
                evaluate(executor, state, grainsize, traced, shared, dt, ds, ndims, count=False)
            elif option == "graph":
                jax.block_until_ready(graph(traced, shared))
            else:
                jax.block_until_ready(plain(traced, shared))

    warm = {"graph": 2, "plain": 2,
            "host": 2 + (0 if grainsize is not None else state.chunker.settle_after)}
    # Plain's form matters only where the host path may beat the graph (else the graph
    # is kept whatever plain does), and compiling it costs the most (XLA folds the data
    # into it: negbin, 200,000 rows, 1.7 s of a 4.4 s calibration), so it is timed, in
    # fresh rounds of all three, only where the host path was faster at all (and the
    # graph not so fast that :func:`choose` keeps it anyway).
    times = _rounds(run, ["graph", "host"], warm)
    med_graph, med_host = np.median(times["graph"]), np.median(times["host"])
    if GRAPH_ALWAYS_SECONDS <= med_graph and med_host < med_graph:
        times = _rounds(run, ["graph", "plain", "host"], warm)
    return times


def _rounds(run, options, warm) -> dict:
    """Warm up (compile) each option not yet warm, then time them in interleaved rounds."""
    for option in options:
        for _ in range(warm.pop(option, 0)):
            run(option)
    times = {k: [] for k in options}
    rounds = ROUNDS
    r = 0
    while r < rounds:
        for option in options:
            t0 = time.perf_counter()
            run(option)
            elapsed = time.perf_counter() - t0
            times[option].append(elapsed if option == "host" else elapsed / LOOP)
        if r == 0:
            if times["graph"][0] < GRAPH_ALWAYS_SECONDS / 2:
                break
            if times["graph"][0] > SLOW_SECONDS:
                rounds = SLOW_ROUNDS
        r += 1
    return times


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
