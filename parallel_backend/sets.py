"""Blocks of the batched form over parameter sets: the sets inside the blocks.

This module owns :func:`over_blocks`, how the batched form maps one block's
computation over a run of blocks and, under ``vmap`` (vectorized chains), over the
parameter sets, :func:`nest_sets`, which keeps that layout under nested ``vmap``,
:func:`map_sets`, how a site that evaluates its sets one at a time maps over them (on
every route), and :func:`each_set`, such a site's chunk program. Imports jax only.

Two choices, both measured (negative binomial regression, 200,000 rows, float32, a
loop of value-and-gradient calls on 2 cores, ratios to plain NumPyro):

* **The shared leaves are broadcast over the blocks** (``vmap`` with ``in_axes=0``,
  not ``None``): a linear predictor ``X @ beta`` then becomes a dot batched over the
  blocks, which XLA lays out with the sets before the rows. Unbroadcast, ``beta`` is
  a free operand and the blocked dot comes out ``(rows, sets)``, which every
  elementwise operation after it reads across (slower on both stacks than broadcast
  with the sets inside). One set keeps ``shared`` unbroadcast: broadcast, the package's
  benchmarks moved both ways (negbin faster, logistic slower; docs/performance.md).
* **The sets map inside the blocks** (blocks outside, sets inside): with the sets
  outside, the broadcast alone lost to plain.

Every route evaluates a batch of sets this way (the graph, every host chunk, every
device), so the bits of a set do not depend on where it ran; they may differ from
the same set evaluated alone. A site whose spec says ``sets="each"`` never comes here
with a batch: it evaluates one set at a time (:func:`.forms.sets_form`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap

from .tasks import block_axis

__all__ = ["SETS_AT_ONCE", "each_set", "map_sets", "nest_sets", "over_blocks", "unblock"]

#: Sets one at a time run this many to a loop step, unrolled (see :func:`map_sets`).
SETS_AT_ONCE = 4


def over_blocks(block, prepared, traced, shared, valid, set_axes=None):
    """``block(prepared, traced, shared, valid)`` of one block, for every block of the
    arrays (leading axis of ``prepared`` and ``valid``; of ``traced`` after any set
    axis).

    ``set_axes``: ``None`` (one parameter set: ``shared`` as it is), or
    ``(axes_traced, axes_shared)``, ``0`` for a leaf with a leading axis of parameter
    sets and ``None`` for one without: ``shared`` is then broadcast over the blocks and
    the sets mapped inside them, and the outputs lead with the sets: ``(sets, blocks,
    ...)``.
    """
    if set_axes is None:
        return jax.vmap(block, in_axes=(0, 0, None, 0))(tuple(prepared), tuple(traced),
                                                        tuple(shared), valid)
    n = valid.shape[0]
    spread = tuple(jnp.broadcast_to(s, (n,) + jnp.shape(s)) for s in shared)
    axes_t, axes_s = set_axes

    def one_block(p, t, s, v):
        return jax.vmap(lambda t, s: block(p, t, s, v), in_axes=(axes_t, axes_s))(t, s)

    out = jax.vmap(one_block, in_axes=(0, tuple(block_axis(a) for a in axes_t), 0, 0))(
        tuple(prepared), tuple(traced), spread, valid)
    return jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), out)


def each_set(one, in_axes, split: bool = False):
    """``f(prepared, traced, shared, *rest)``: ``one`` (an unbatched chunk program) on each
    parameter set of the batch in turn, the leaves ``in_axes`` maps taken per set; with
    ``split``, ``rest`` is ``(valid, tail)`` and the tail's traced leaves are taken too."""
    axes_t, axes_s = in_axes

    def run(prepared, traced, shared, *rest):
        tail_t = tuple(rest[1][1]) if split else ()
        leaves = (*traced, *shared, *tail_t)
        axes = axes_t + axes_s + (axes_t if split else ())

        def member(mapped):
            it = iter(mapped)
            mine = [next(it) if a == 0 else x for x, a in zip(leaves, axes)]
            t, s = tuple(mine[:len(traced)]), tuple(mine[len(traced):len(traced) + len(shared)])
            if split:
                rest_m = (rest[0], (rest[1][0], tuple(mine[len(traced) + len(shared):]),
                                    rest[1][2]))
                return one(prepared, t, s, *rest_m)
            return one(prepared, t, s, *rest)

        return map_sets(member, [x for x, a in zip(leaves, axes) if a == 0])

    return run


def map_sets(f, xs):
    """``f(members)`` for each parameter set, ``members`` the set's slices of ``xs`` (leaves
    with a leading axis of sets), outputs stacked: ``lax.map`` with :data:`SETS_AT_ONCE`
    sets to a step, unrolled, so that XLA can run them side by side (each set the same
    program as alone, so the same bits); a batch of that many or fewer has no loop."""
    size = xs[0].shape[0]
    k = min(size, SETS_AT_ONCE)

    def step(group):
        return _stacked([f([x[i] for x in group]) for i in range(len(group[0]))])

    whole = size - size % k
    if whole == k:
        parts = [step([x[:k] for x in xs])]
    else:
        looped = lax.map(step, [x[:whole].reshape((whole // k, k) + x.shape[1:]) for x in xs])
        parts = [jax.tree.map(lambda y: y.reshape((whole,) + y.shape[2:]), looped)]
    if whole < size:
        parts.append(step([x[whole:] for x in xs]))
    return parts[0] if len(parts) == 1 else jax.tree.map(lambda *y: jnp.concatenate(y), *parts)


def _stacked(outs):
    return jax.tree.map(lambda *y: jnp.stack(y), *outs)


def nest_sets(evaluate, set_axes):
    """``f(traced, shared)``: ``evaluate(traced, shared, set_axes)`` (outputs leading
    with the sets), which under a further ``vmap`` folds that level's axis into the
    sets (outer major, as the host path flattens them) instead of mapping around them,
    so that a nested ``vmap`` evaluates every set as one batch on every route."""

    @custom_vmap
    def f(traced, shared):
        return evaluate(traced, shared, set_axes)

    @f.def_vmap
    def rule(size, in_batched, traced, shared):
        bt, bs = in_batched
        axes_t, axes_s = set_axes
        inner = next(x.shape[1 if b else 0] for x, a, b in
                     zip(traced + shared, axes_t + axes_s, bt + bs) if a == 0)

        def fold(x, outer, axis):
            if not outer and axis is None:
                return x, None
            if not outer:
                x = jnp.broadcast_to(x, (size,) + x.shape)
            elif axis is None:
                x = jnp.broadcast_to(x[:, None], (size, inner) + x.shape[1:])
            return x.reshape((size * inner,) + x.shape[2:]), 0

        ft = [fold(x, b, a) for x, b, a in zip(traced, bt, axes_t)]
        fs = [fold(x, b, a) for x, b, a in zip(shared, bs, axes_s)]
        folded = nest_sets(evaluate, (tuple(a for _, a in ft), tuple(a for _, a in fs)))
        out = folded(tuple(x for x, _ in ft), tuple(x for x, _ in fs))
        out = jax.tree.map(lambda x: x.reshape((size, inner) + x.shape[1:]), out)
        return out, jax.tree.map(lambda _: True, out)

    return f


def unblock(g, n_rows: int, lead: int = 0):
    """``(*sets, blocks, block_rows, *rest)`` per-row gradients back to ``(*sets, N, *rest)``
    (``lead``: 1 with a leading axis of parameter sets, else 0)."""
    g = g.reshape(g.shape[:lead] + (g.shape[lead] * g.shape[lead + 1],) + g.shape[lead + 2:])
    return g[(slice(None),) * lead + (slice(0, n_rows),)]
