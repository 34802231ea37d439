"""A looped site under ``vmap``: one parameter set at a time.

This module owns :func:`one_set_at_a_time`, the ``custom_vmap`` that keeps a looped
site (``fn`` holds a ``scan``; see :mod:`.forms`) from being batched over the
parameter sets of vectorized chains. Imports jax only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap

from .dispatch import GRAPH, HOST

__all__ = ["one_set_at_a_time"]


def one_set_at_a_time(routed, host, counted, route):
    """The partials of a looped site that, under ``vmap`` (vectorized chains), evaluate
    ``fn`` on one parameter set at a time instead of batching it over the sets.

    ``routed(count)`` gives the site's unbatched partials on ``route`` (or where the
    traced choice says when ``route`` is ``None``), the graph's passed through
    ``count``; ``host`` the host path's; ``counted`` adds the graph counter.

    The looped form runs one block's ``scan`` per loop iteration: batched over four
    chains, the HMM's blocks took 4.7 times one chain's time (3,000 sequences, 0.67x
    plain on a 2-core AMD EPYC), the residuals of every chain's steps no longer in
    cache. Here the graph path maps over the sets (``lax.map``) and the host path hands
    the whole batch to one callback whose tasks evaluate each set unbatched (see
    :func:`.host.run_chunk`): on both, a set's values and gradients are the bits of the
    unbatched program, whether chains are vectorized or not. A batch counts as one
    graph call of as many sets, as a batched site's does."""

    def wrapped(traced, shared, choice, dt, ds):
        def make(count):
            single = routed(count)

            @custom_vmap
            def each(t, s, c):
                return single(t, s, c, dt, ds)

            @each.def_vmap
            def rule(size, in_batched, t, s, c):
                bt, bs, bc = in_batched
                flat, tree = jax.tree_util.tree_flatten((t, s))
                batched = jax.tree_util.tree_leaves((bt, bs))

                def per_set(f, *extra):
                    def one(members):
                        it = iter(members)
                        t1, s1 = jax.tree_util.tree_unflatten(
                            tree, [next(it) if b else x for x, b in zip(flat, batched)])
                        return f(t1, s1, *it)

                    return lax.map(one, [x for x, b in zip(flat, batched) if b] + list(extra))

                def on_graph():  # through ``each``: an outer vmap level maps again
                    graph_choice = None if route is not None else jnp.int32(GRAPH)
                    return count(per_set(lambda t1, s1: uncounted(t1, s1, graph_choice)))

                def on_host():
                    axes = (tuple(0 if b else None for b in bt),
                            tuple(0 if b else None for b in bs))
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

        uncounted = make(lambda out: out)
        return make(counted)(traced, shared, choice)

    return wrapped
