"""A site under ``vmap`` (vectorized chains): how a batch of parameter sets is evaluated.

This module owns :func:`set_batching`, the ``custom_vmap`` that decides it: a site whose
spec says ``sets="each"`` (a looped site, whose ``fn`` holds a ``scan``, and on jax
before 0.12 a wide regression; see :func:`.forms.sets_form`) evaluates one parameter set
at a time; any other evaluates the whole batch with the sets inside its blocks (see
:mod:`.sets`), on every route. Imports jax only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap

from .dispatch import GRAPH, HOST
from .internals import is_tracer
from .sets import map_sets, nest_sets

__all__ = ["set_batching", "tangent_batching"]


def set_batching(routed, host, graph, counted, route, one_by_one):
    """The partials of a site that, under ``vmap`` (vectorized chains), evaluate one
    parameter set at a time (``one_by_one``) or with the sets inside the blocks, on
    every route.

    ``routed(count)`` gives the site's unbatched partials on ``route`` (or where the
    traced choice says when ``route`` is ``None``), the graph's passed through
    ``count``; ``host`` the host path's; ``graph(traced, shared, dt, ds, set_axes)`` the
    graph path's, batched; ``counted`` adds the graph counter.

    With the sets inside, a batch is one evaluation of every set, its blocks with the sets
    inside (see :mod:`.sets`), on the graph as on the host path (whose chunk programs
    lay it out the same way), so a set's bits do not depend on the route. A per-set
    choice (a ``vmap`` over choices, as a user's chain transform may make) maps over
    the sets, each unbatched.

    One by one: the looped form runs one block's ``scan`` per loop iteration; batched
    over four chains, the HMM's blocks took several times one chain's time and lost to
    plain (docs/performance.md), the residuals of every chain's steps no longer in
    cache (a wide regression on jax 0.10: :data:`.forms.SETS_EACH_WIDTH`). The graph
    path maps over the sets (:func:`.sets.map_sets`) and the host path hands the batch to one
    callback whose tasks evaluate each set unbatched (see :func:`.tasks.run_task`): on
    both, a set's values and gradients are the bits of the unbatched program, whether
    chains are vectorized or not. A batch counts as one graph call of as many sets, as
    it does with the sets inside."""

    def wrapped(traced, shared, choice, dt, ds):
        def make(count):
            single = routed(count)

            @custom_vmap
            def each(t, s, c):
                return single(t, s, c, dt, ds)

            @each.def_vmap
            def rule(size, in_batched, t, s, c):
                bt, bs, bc = in_batched
                axes = (tuple(0 if b else None for b in bt), tuple(0 if b else None for b in bs))
                flat, tree = jax.tree_util.tree_flatten((t, s))
                batched = jax.tree_util.tree_leaves((bt, bs))

                def per_set(f, *extra):
                    def one(members):
                        it = iter(members)
                        t1, s1 = jax.tree_util.tree_unflatten(
                            tree, [next(it) if b else x for x, b in zip(flat, batched)])
                        return f(t1, s1, *it)

                    return map_sets(one, [x for x, b in zip(flat, batched) if b] + list(extra))

                def on_graph():
                    if not one_by_one:  # an outer vmap level joins the sets
                        return nest_sets(lambda t1, s1, ax: graph(t1, s1, dt, ds, ax),
                                         axes)(t, s)
                    # Through ``each``: an outer vmap level maps again.
                    graph_choice = None if route is not None else jnp.int32(GRAPH)
                    return count(per_set(lambda t1, s1: uncounted(t1, s1, graph_choice)))

                def on_host():
                    return jax.vmap(lambda t1, s1: host(t1, s1, dt, ds), in_axes=axes)(t, s)

                if route == "host":
                    out = on_host()
                elif route == "graph":
                    out = on_graph()
                elif any(jax.tree_util.tree_leaves(bc)):  # a choice per set
                    out = per_set(each, c)
                else:
                    out = lax.cond(c == HOST, on_host, on_graph)
                return out, jax.tree.map(lambda _: True, out)

            return each

        if not any(is_tracer(x) for x in jax.tree_util.tree_leaves((traced, shared, choice))):
            # Called eagerly, outside any vmap: the unbatched partials, as they are (through
            # the custom_vmap, a DeviceExecutor's shard_map with count_calls=True failed to
            # lower: "Cannot convert GSPMDSharding {maximal device=0} into SdyArray").
            return routed(counted)(traced, shared, choice, dt, ds)
        uncounted = make(lambda out: out)
        if one_by_one:
            return make(counted)(traced, shared, choice)
        # With the sets inside, a site counts where it did before it had a custom_vmap:
        # outside it, the counter's callback batched by vmap (a call of every set).
        out = uncounted(traced, shared, choice)
        if route is not None:
            return counted(out) if route == "graph" else out
        return lax.cond(choice == HOST, lambda o: o, counted, out)

    return wrapped


def tangent_batching(evaluate):
    """``f(traced, shared)``: ``evaluate(traced, shared, None)``, and under ``vmap`` (a batch
    of tangents, as ``jax.hessian`` makes, or of parameter sets) ``evaluate(traced, shared,
    set_axes)`` with every level's axis folded into one axis of sets (:func:`.sets.nest_sets`),
    as the host path's callback flattens the levels: the graph's Hessian-vector products
    then lay out their batch as a host task does, and have its bits."""

    @custom_vmap
    def f(traced, shared):
        return evaluate(traced, shared, None)

    @f.def_vmap
    def rule(size, in_batched, traced, shared):
        axes = tuple(tuple(0 if b else None for b in bs) for bs in in_batched)
        out = nest_sets(evaluate, axes)(traced, shared)
        return out, jax.tree.map(lambda _: True, out)

    return f
