"""Second derivatives of ``reduce_sum``: the tangent of a site's value and gradients.

``reduce_sum``'s rule returns the route's gradients dotted with the tangent (first
derivatives, bitwise on every executor); differentiating that again reaches the
value-and-gradients evaluation, whose tangent is a Hessian-vector product. This module
owns the product and its own derivative:

* :func:`symmetric_product`: a product that the site's per-block programs compute (a
  host callback's tasks on the executor, see :mod:`.host`, or the same programs in the
  caller's program on the graph route: the same bits), made a linear map JAX can
  transpose: the Hessian is symmetric, so the product is its own transpose, and reverse
  over reverse runs as forward over reverse does;
* :func:`tangent_of`: JAX's autodiff of ``fn`` summed block by block
  (:func:`blocked_sum`), forward over reverse, in the caller's program: the product's own
  derivative (third order and higher).

Imports jax and numpy only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

__all__ = ["blocked_sum", "kept", "linear_zeros", "merge", "symmetric_product", "tangent_of",
           "value_and_grads_of"]


def kept(xs, mask) -> list:
    return [x for x, m in zip(xs, mask) if m]


def merge(full, subset, mask) -> tuple:
    """``full`` with the entries ``mask`` marks taken from ``subset``, in order."""
    it = iter(subset)
    return tuple(next(it) if m else x for x, m in zip(full, mask))


def value_and_grads_of(blocked, dt, ds, traced, shared):
    """``(value, data gradients, shared gradients)`` of ``blocked(traced, shared)`` for the
    leaves ``dt``/``ds`` mark, by JAX's autodiff: the in-graph twin of the route's
    ``value_and_grads``."""

    def total(td, sd):
        return blocked(merge(traced, td, dt), merge(shared, sd, ds))

    v, (gd, gs) = jax.value_and_grad(total, argnums=(0, 1))(tuple(kept(traced, dt)),
                                                            tuple(kept(shared, ds)))
    return v, tuple(gd), tuple(gs)


def tangent_of(blocked, dt, ds, traced, shared, tt, ts):
    """The tangent of :func:`value_and_grads_of` along ``tt``/``ts`` (per leaf; ``None``
    for a zero tangent), in the caller's program."""
    ft = tuple(t is not None for t in tt)
    fs = tuple(t is not None for t in ts)

    def at(xt, xs):
        return value_and_grads_of(blocked, dt, ds, merge(traced, xt, ft), merge(shared, xs, fs))

    return jax.jvp(at, (tuple(kept(traced, ft)), tuple(kept(shared, fs))),
                   (tuple(kept(tt, ft)), tuple(kept(ts, fs))))[1]


def linear_zeros(like, t):
    """Zeros shaped like ``like``, linear in ``t``: reverse mode transposes a product only
    where every part of its tangent depends on the tangents it traces back to (a constant
    zero there fails JAX's transpose of the linear solve in :func:`symmetric_product`)."""
    none = jnp.ravel(t)[:0].astype(jnp.result_type(like))
    return lax.pad(none, jnp.zeros((), none.dtype), [(0, int(np.prod(jnp.shape(like))), 0)]
                   ).reshape(jnp.shape(like))


def symmetric_product(apply, twin, primals, tangent):
    """``H(primals) @ tangent`` for a symmetric ``H``, computed by ``apply(primals,
    tangent)`` (a host callback, or the graph's block programs), as a map JAX can
    differentiate.

    For JAX the product is linear in ``tangent`` and is its own transpose, so forward and
    reverse mode both call ``apply`` (under ``vmap``, once for a batch of tangents). Its
    derivative in ``primals`` (third order) is ``twin``'s, the same product in plain JAX.
    ``tangent`` and the product have the same structure.
    """
    fixed = lax.stop_gradient(primals)  # ``primals`` reach the product through ``higher``
    # A linear solve for its transpose rule alone: ``solve`` is the product, its own
    # transpose (``symmetric``); ``matvec`` (the inverse of H) is never evaluated.
    product = lax.custom_linear_solve(lambda b: b, _dense_tangents(tangent),
                                      lambda _, b: apply(fixed, b), symmetric=True)

    @jax.custom_jvp
    def higher(primals, tangent, product):
        return product

    def higher_jvp(args, tangents):
        primals, tangent, product = args
        d_primals, _, d_product = tangents  # d_tangent reached d_product (linear in it)
        out, out_tree = jax.tree.flatten(product)
        terms = [out_tree.flatten_up_to(d_product)]
        leaves, tree = jax.tree.flatten(primals)
        d_leaves = tree.flatten_up_to(d_primals)
        moved = [not isinstance(d, SymbolicZero) for d in d_leaves]
        if any(moved):
            def at(xs):
                return twin(jax.tree.unflatten(tree, merge(leaves, xs, moved)), tangent)

            third = jax.jvp(at, (tuple(kept(leaves, moved)),), (tuple(kept(d_leaves, moved)),))[1]
            terms.append(out_tree.flatten_up_to(third))
        sums = []
        for x, *parts in zip(out, *terms):
            parts = [p for p in parts if not isinstance(p, SymbolicZero)]
            sums.append(functools.reduce(jnp.add, parts) if parts else jnp.zeros_like(x))
        return product, jax.tree.unflatten(out_tree, sums)

    higher.defjvp(higher_jvp, symbolic_zeros=True)
    return higher(primals, tangent, product)


@jax.custom_jvp
def _dense_tangents(x):
    """``x``, whose tangent has no symbolic zero in some leaves and not in others: the
    linear solve's forward rule passes such a zero on as if it were an array."""
    return x


@_dense_tangents.defjvp
def _dense_tangents_jvp(primals, tangents):  # without symbolic_zeros: JAX fills in zeros
    return primals[0], tangents[0]


def blocked_sum(spec, resident, traced, shared):
    """``fn``'s log-density summed block by block in block order, in plain JAX (no
    callback, no barrier): full blocks together (``vmap``, or ``lax.map`` for a site
    whose ``fn`` cannot be batched), the last partial block apart. It is what third
    derivatives differentiate in the caller's program."""
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
