"""Vectorized chains: how a site evaluates a batch of parameter sets under ``vmap``.

This module owns the batching rules (``custom_vmap``) of a site and the layouts they use:

* **sets inside the blocks** (:func:`over_blocks`, the default): a batch is one
  evaluation of every set, the blocks outside and the sets mapped inside each block,
  the shared leaves broadcast over the blocks, on every route (the graph, every host
  chunk, every device), so a set's bits do not depend on where it ran (they may differ
  from the same set evaluated alone). :func:`nest_sets` keeps that layout under nested
  ``vmap``, folding each level into one axis of sets, as the host callback flattens them.
  Two choices, both measured (docs/performance.md): the shared leaves are broadcast over
  the blocks (a linear predictor ``X @ beta`` then becomes a dot batched over the blocks,
  laid out with the sets before the rows), and the sets map inside the blocks, not
  outside them;
* **one set at a time** (:func:`map_sets`, :func:`each_set`), for a site whose spec says
  ``sets="each"`` (a looped site, whose ``fn`` holds a ``scan``, and on jax before 0.12 a
  wide regression: :func:`.analysis.sets_form`): each set is the unbatched program, so
  its bits are those of the set alone, a few sets to a loop step so that XLA can run
  them side by side;
* :func:`site_batching`, the ``custom_vmap`` through which a site's route evaluates a
  batch (each route's rule is its own: :meth:`.routes.Route.batched`), and
  :func:`tangent_batching`, which lays out a batch of tangents (``jax.hessian``) as a
  host task does.

Imports jax, :mod:`.blocks` (the block axis) and :mod:`.internals`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .blocks import block_axis
from .internals import custom_vmap, is_tracer

__all__ = ["SETS_AT_ONCE", "Again", "each_set", "map_sets", "nest_sets", "over_blocks",
           "set_by_set", "site_batching", "tangent_batching", "unblock"]

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
    return functools.partial(_each_set, one, in_axes, split)


def _each_set(one, in_axes, split, prepared, traced, shared, *rest):
    axes_t, axes_s = in_axes
    tail_t = tuple(rest[1][1]) if split else ()
    leaves = (*traced, *shared, *tail_t)
    axes = axes_t + axes_s + (axes_t if split else ())
    member = functools.partial(_set_member, one, split, prepared, leaves, axes, len(traced),
                               len(shared), rest)
    return map_sets(member, [x for x, a in zip(leaves, axes) if a == 0])


def _set_member(one, split, prepared, leaves, axes, n_traced, n_shared, rest, mapped):
    """:func:`each_set`'s program on one set: ``mapped`` holds its slices of the leaves
    that ``axes`` maps."""
    mine = _taken(leaves, axes, mapped)
    traced, shared = tuple(mine[:n_traced]), tuple(mine[n_traced:n_traced + n_shared])
    if split:
        valid, (tail_prepared, _, tail_valid) = rest
        rest = (valid, (tail_prepared, tuple(mine[n_traced + n_shared:]), tail_valid))
    return one(prepared, traced, shared, *rest)


def _taken(leaves, axes, mapped) -> list:
    """``leaves`` with those ``axes`` maps (axis 0) replaced by ``mapped``, in order."""
    it = iter(mapped)
    return [next(it) if a == 0 else x for x, a in zip(leaves, axes)]


def set_by_set(f, set_axes):
    """``g(traced, shared)``: what ``jax.vmap(f, in_axes=set_axes)`` gives, each parameter
    set evaluated by ``f`` alone (:func:`map_sets`), the leaves ``set_axes`` maps taken
    per set."""
    return functools.partial(_set_by_set, f, set_axes)


def _set_by_set(f, set_axes, traced, shared):
    axes = (*set_axes[0], *set_axes[1])
    leaves = (*traced, *shared)
    member = functools.partial(_one_set, f, leaves, axes, len(traced))
    return map_sets(member, [x for x, a in zip(leaves, axes) if a == 0])


def _one_set(f, leaves, axes, n_traced, mapped):
    """:func:`set_by_set`'s ``f`` on one set."""
    mine = _taken(leaves, axes, mapped)
    return f(tuple(mine[:n_traced]), tuple(mine[n_traced:]))


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
    f = custom_vmap(functools.partial(_evaluate_sets, evaluate, set_axes))
    f.def_vmap(functools.partial(_fold_level, evaluate, set_axes))
    return f


def _evaluate_sets(evaluate, set_axes, traced, shared):
    return evaluate(traced, shared, set_axes)


def _fold_level(evaluate, set_axes, size, in_batched, traced, shared):
    """:func:`nest_sets`' batching rule: this level's axis (``size``) folded into the
    sets, outer major."""
    batched_traced, batched_shared = in_batched
    axes_t, axes_s = set_axes
    inner = next(x.shape[1 if b else 0] for x, a, b in
                 zip(traced + shared, axes_t + axes_s, batched_traced + batched_shared)
                 if a == 0)
    folded_t = [_fold(x, b, a, size, inner) for x, b, a in zip(traced, batched_traced, axes_t)]
    folded_s = [_fold(x, b, a, size, inner) for x, b, a in zip(shared, batched_shared, axes_s)]
    folded = nest_sets(evaluate, (tuple(a for _, a in folded_t), tuple(a for _, a in folded_s)))
    out = folded(tuple(x for x, _ in folded_t), tuple(x for x, _ in folded_s))
    out = jax.tree.map(lambda x: x.reshape((size, inner) + x.shape[1:]), out)
    return out, jax.tree.map(lambda _: True, out)


def _fold(x, outer: bool, axis, size: int, inner: int):
    """``(x, axis)`` with the outer level (``outer``: ``x`` leads with it) and the inner
    sets (``axis`` 0) as one axis of ``size * inner`` sets; a leaf with neither stays."""
    if not outer and axis is None:
        return x, None
    if not outer:
        x = jnp.broadcast_to(x, (size,) + x.shape)
    elif axis is None:
        x = jnp.broadcast_to(x[:, None], (size, inner) + x.shape[1:])
    return x.reshape((size * inner,) + x.shape[2:]), 0


def unblock(g, n_rows: int, lead: int = 0):
    """``(*sets, blocks, block_rows, *rest)`` per-row gradients back to ``(*sets, N, *rest)``
    (``lead``: 1 with a leading axis of parameter sets, else 0)."""
    g = g.reshape(g.shape[:lead] + (g.shape[lead] * g.shape[lead + 1],) + g.shape[lead + 2:])
    return g[(slice(None),) * lead + (slice(0, n_rows),)]


class Again(NamedTuple):
    """A site's batching functions ``f(traced, shared, choice)``, as a route's batching
    rule maps over parameter sets with them: ``counted`` counts each evaluation where the
    route counts, ``uncounted`` never (where the caller counts the batch once)."""

    counted: object
    uncounted: object


def site_batching(route, wrt):
    """``f(traced, shared, choice)``: ``route.partials``, whose batching rule under
    ``vmap`` (vectorized chains) is the route's own (:meth:`.routes.Route.batched`): one
    evaluation of every set with the sets inside the blocks, on every route, or, for a
    site of ``sets="each"``, each set alone, the bits of the unbatched program."""
    counted, uncounted = _BatchingRule(route, wrt), _BatchingRule(route.uncounted(), wrt)
    again = Again(_batched_partials(counted), _batched_partials(uncounted))
    counted.again = uncounted.again = again  # each rule maps with both functions
    return functools.partial(_site_partials, route, wrt, again.counted)


class _BatchingRule:
    """:func:`site_batching`'s batching rule for one route: the route's own
    (:meth:`.routes.Route.batched`), handed the site's batching functions (``again``)."""

    def __init__(self, route, wrt):
        self.route, self.wrt, self.again = route, wrt, None

    def __call__(self, size, in_batched, traced, shared, choice):
        batched_traced, batched_shared, batched_choice = in_batched
        axes = (tuple(0 if b else None for b in batched_traced),
                tuple(0 if b else None for b in batched_shared))
        out = self.route.batched(traced, shared, choice, self.wrt, axes,
                                 any(jax.tree_util.tree_leaves(batched_choice)), self.again)
        return out, jax.tree.map(lambda _: True, out)


def _batched_partials(rule: _BatchingRule):
    """``rule.route.partials`` behind a ``custom_vmap`` whose batching rule is ``rule``."""
    f = custom_vmap(functools.partial(_route_partials, rule.route, rule.wrt))
    f.def_vmap(rule)
    return f


def _route_partials(route, wrt, traced, shared, choice):
    return route.partials(traced, shared, choice, wrt)


def _site_partials(route, wrt, counted, traced, shared, choice):
    """:func:`site_batching`'s function."""
    if not any(is_tracer(x) for x in jax.tree_util.tree_leaves((traced, shared, choice))):
        # Called eagerly, outside any vmap: the partials as they are (through the
        # custom_vmap, a DeviceExecutor's shard_map that counted failed to lower:
        # "Cannot convert GSPMDSharding {maximal device=0} into SdyArray").
        return route.partials(traced, shared, choice, wrt)
    return counted(traced, shared, choice)


def tangent_batching(evaluate):
    """``f(traced, shared)``: ``evaluate(traced, shared, None)``, and under ``vmap`` (a batch
    of tangents, as ``jax.hessian`` makes, or of parameter sets) ``evaluate(traced, shared,
    set_axes)`` with every level's axis folded into one axis of sets (:func:`.batching.nest_sets`),
    as the host path's callback flattens the levels: the graph's Hessian-vector products
    then lay out their batch as a host task does, and have its bits."""

    @custom_vmap
    def f(traced, shared):
        return evaluate(traced, shared, None)

    @f.def_vmap
    def rule(size, in_batched, traced, shared):
        axes = tuple(tuple(0 if b else None for b in batched) for batched in in_batched)
        out = nest_sets(evaluate, axes)(traced, shared)
        return out, jax.tree.map(lambda _: True, out)

    return f
