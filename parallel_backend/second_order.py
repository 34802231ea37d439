"""Second derivatives of ``reduce_sum``: the plain-JAX twin of a site's value and
gradients, block by block, that the custom JVP's inner rule differentiates.

``reduce_sum``'s rule returns the route's gradients dotted with the tangent (first
derivatives, bitwise on every executor); differentiating that again reaches the
value-and-gradients evaluation, whose tangent :func:`value_and_grads_of` gives: JAX's
autodiff of ``fn`` summed block by block (:func:`blocked_sum`), forward over reverse, a
Hessian-vector product per block, inside the caller's program. Imports jax only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["blocked_sum", "kept", "value_and_grads_of"]


def kept(xs, mask):
    return [x for x, m in zip(xs, mask) if m]


def value_and_grads_of(blocked, dt, ds, traced, shared):
    """``(value, data gradients, shared gradients)`` of ``blocked(traced, shared)`` for the
    leaves ``dt``/``ds`` mark, by JAX's autodiff: the in-graph twin of the route's
    ``value_and_grads``, differentiated for second derivatives."""

    def total(td, sd):
        it_t, it_s = iter(td), iter(sd)
        t = tuple(next(it_t) if d else x for x, d in zip(traced, dt))
        s = tuple(next(it_s) if d else x for x, d in zip(shared, ds))
        return blocked(t, s)

    v, (gd, gs) = jax.value_and_grad(total, argnums=(0, 1))(tuple(kept(traced, dt)),
                                                            tuple(kept(shared, ds)))
    return v, tuple(gd), tuple(gs)


def blocked_sum(spec, resident, traced, shared):
    """``fn``'s log-density summed block by block in block order, in plain JAX (no
    callback, no barrier): full blocks together (``vmap``, or ``lax.map`` for a site
    whose ``fn`` cannot be batched), the last partial block apart. It is what second
    derivatives differentiate."""
    plan = spec.plan
    block = spec.block_fn()
    full = plan.n_full * plan.block_rows

    def blocks(x):
        return jnp.reshape(x[:full], (plan.n_full, plan.block_rows) + tuple(jnp.shape(x)[1:]))

    sums = []
    if plan.n_full:
        res_b = [blocks(jnp.asarray(x)) for x in resident]
        tr_b = [blocks(x) for x in traced]

        def one(r, t):
            return jnp.sum(block(r, t, shared))

        if spec.form == "batched":
            sums.append(jax.vmap(one)(res_b, tr_b))
        else:
            sums.append(lax.map(lambda rt: one(*rt), (res_b, tr_b)))
    if plan.tail_rows:
        tail = jnp.sum(block([jnp.asarray(x)[full:] for x in resident],
                             [x[full:] for x in traced], shared))
        sums.append(tail[None])
    return jnp.sum(jnp.concatenate(sums))
