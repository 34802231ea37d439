"""A site's derivatives: the rules that hand a route's partials to JAX autodiff.

:func:`site_value` turns a route (:mod:`.routes`) into the function of a ``reduce_sum``
site that JAX differentiates, ``value(traced, shared, choice)``, with two ``custom_jvp``
rules, one per derivative order:

* **first order**, ``value``'s rule: the route's value and gradients (one evaluation of
  every block, bitwise the same on every route), the gradients dotted with the tangent.
  That is linear in the tangent, so JAX transposes it for ``grad``/``vjp`` (the cotangent
  times the gradients) and maps it for ``jacfwd``;
* **second order**, the rule of :func:`value_and_grads` (what differentiating the first
  rule again reaches): per-block Hessian-vector products computed by the route's own
  block programs (:func:`symmetric_product`, a primitive: the Hessian is symmetric, so
  the product is its own transpose and reverse over reverse runs as forward over reverse
  does), or, where the route says so (:attr:`.routes.Route.autodiff_products`), JAX's
  autodiff of the blocked sum; third and higher orders, in every order of forward and
  reverse mode, are JAX's autodiff of the blocked sum (:func:`blocked_sum`, the twin).

Every route's partials meet in one place, :func:`.tasks.combine` (block order), behind
guard ``fence``. Imports jax, numpy and the core below it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from .batching import site_batching
from .guards import fence
from .internals import (
    NOT_MAPPED,
    define_primitive,
    is_tracer,
    is_undefined,
    is_zero,
    move_batch_axis,
    zeros_of,
)
from .kernels import LAYOUTS, Wrt, kept, merge
from .tasks import combine

__all__ = ["blocked_sum", "site_value", "site_value_and_grads",
           "symmetric_product", "tangent_of", "value_and_grads_of"]


def site_value(route, blocked):
    """``value(traced, shared, choice)``: the site's summed log-density on ``route``, with
    the derivative rules of the module docstring. ``blocked(traced, shared)`` is the
    blocked sum in plain JAX (third derivatives)."""
    return _Rules(route, blocked).value


def site_value_and_grads(route):
    """``f(traced, shared, choice, wrt) -> (value, shared gradients, data gradients)`` on
    ``route`` (an eager ``jax.grad`` on the host route compiles it as one program); its
    own derivative rule is never reached."""
    return _Rules(route, None).value_and_grads


class _Rules:
    """The derivative rules of one site on one route (see the module docstring). Every
    triple is ``(value, shared gradients, data gradients)``, as :class:`.tasks.Partials`
    holds them, and every pair of arguments ``(traced, shared)``."""

    def __init__(self, route, blocked):
        self.route, self.blocked = route, blocked
        self._batching: dict = {}
        self.value_and_grads = jax.custom_jvp(self.run, nondiff_argnums=(3,))
        self.value_and_grads.defjvp(self.value_and_grads_jvp, symbolic_zeros=True)
        self.value = jax.custom_jvp(self.run_value)
        self.value.defjvp(self.value_jvp, symbolic_zeros=True)

    def partials(self, traced, shared, choice, wrt: Wrt):
        """The route's per-block partials, through its batching rule (made once per
        ``wrt``)."""
        f = self._batching.get(wrt)
        if f is None:
            f = self._batching[wrt] = site_batching(self.route, wrt)
        return f(traced, shared, choice)

    def run(self, traced, shared, choice, wrt: Wrt):
        """Value and gradients, the partials combined in block order, behind a fence."""
        parts = self.partials(traced, shared, choice, wrt)
        if any(map(is_tracer, jax.tree.leaves(parts))):
            return fence(combine(*parts))
        return _finish(*parts)  # partials computed eagerly: the rest as one program too

    def run_value(self, traced, shared, choice):
        return self.run(traced, shared, choice, Wrt.none(len(traced), len(shared)))[0]

    # -- first order ----------------------------------------------------------------------

    def value_jvp(self, primals, tangents):
        traced, shared, choice = primals
        traced_tangents, shared_tangents, _ = tangents
        wrt = Wrt(_moving(traced, traced_tangents), _moving(shared, shared_tangents))
        value, shared_grads, data_grads = self.grads_for(traced, shared, choice)(
            traced, shared, choice, wrt)
        return value, _dotted(value, [*zip(data_grads, kept(traced_tangents, wrt.traced)),
                                      *zip(shared_grads, kept(shared_tangents, wrt.shared))])

    def grads_for(self, traced, shared, choice):
        """:attr:`value_and_grads`, or, for an eager ``jax.grad`` on a route whose eager
        calls are one program, that program."""
        if not self.route.eager_program or any(map(is_tracer, (*traced, *shared, choice))):
            return self.value_and_grads
        # Not ``value_and_grads``: its derivative rule holds the data (``blocked``), the
        # site would too.
        return self.route.eager("grad", functools.partial(site_value_and_grads, self.route),
                                static_argnums=(3,))

    # -- second order -----------------------------------------------------------------------

    def value_and_grads_jvp(self, wrt, primals, tangents):
        traced, shared, choice = primals
        traced_tangents = _nonzero(traced, tangents[0])
        shared_tangents = _nonzero(shared, tangents[1])
        out = self.value_and_grads(traced, shared, choice, wrt)
        if self.route.autodiff_products:
            return out, tangent_of(self.blocked, wrt, traced, shared, traced_tangents,
                                   shared_tangents)
        return out, self.product_tangent(traced, shared, choice, wrt, traced_tangents,
                                         shared_tangents, out)

    def product_tangent(self, traced, shared, choice, wrt, traced_tangents, shared_tangents,
                        out):
        """The tangent: per-block Hessian-vector products over the leaves with a gradient or
        a tangent (``along``), the gradients' taken out, by the same block programs on
        every route: the same bits."""
        along = Wrt(tuple(d or t is not None for d, t in zip(wrt.traced, traced_tangents)),
                    tuple(d or t is not None for d, t in zip(wrt.shared, shared_tangents)))
        vectors = (_filled(kept(traced, along.traced), kept(traced_tangents, along.traced)),
                   _filled(kept(shared, along.shared), kept(shared_tangents, along.shared)))
        apply = functools.partial(_apply_products, self.route, along)
        twin = functools.partial(_twin_products, self.blocked, along)
        traced_products, shared_products = symmetric_product(
            apply, twin, (traced, shared), vectors, aux=() if choice is None else (choice,))
        # The value's tangent: the gradients (of every leaf with a tangent) dotted with it.
        grads = out if along == wrt else self.value_and_grads(traced, shared, choice, along)
        value_tangent = _dotted(out[0], [*zip(grads[2], kept(traced_tangents, along.traced)),
                                         *zip(grads[1], kept(shared_tangents, along.shared))])
        return (value_tangent, tuple(kept(shared_products, kept(wrt.shared, along.shared))),
                tuple(kept(traced_products, kept(wrt.traced, along.traced))))


def _apply_products(route, along, aux, at, vectors):
    """The route's Hessian-vector products at ``at`` (``(traced, shared)``) along
    ``vectors``, combined in block order: ``(traced products, shared products)``."""
    _, shared_products, traced_products = combine(
        *route.products(*at, aux[0] if aux else None, along, vectors))
    return tuple(traced_products), tuple(shared_products)


def _twin_products(blocked, along, at, vectors):
    """:func:`_apply_products` in plain JAX: the tangent of the blocked sum's gradients."""
    _, shared_products, traced_products = tangent_of(
        blocked, along, *at, merge((None,) * len(along.traced), vectors[0], along.traced),
        merge((None,) * len(along.shared), vectors[1], along.shared))
    return tuple(traced_products), tuple(shared_products)


def _moving(leaves, tangents) -> tuple:
    """Per leaf: a float leaf with a tangent that is not a symbolic zero."""
    return tuple(_is_float(x) and not isinstance(t, SymbolicZero)
                 for x, t in zip(leaves, tangents))


def _nonzero(leaves, tangents) -> tuple:
    """Per leaf its tangent, or ``None`` for a symbolic zero or a leaf that is not a
    float."""
    return tuple(None if isinstance(t, SymbolicZero) or not _is_float(x) else t
                 for x, t in zip(leaves, tangents))


def _filled(leaves, tangents) -> tuple:
    """The tangents, zeros of the leaf's shape where one is ``None``."""
    return tuple(jnp.zeros(jnp.shape(x), jnp.result_type(x)) if t is None else t
                 for x, t in zip(leaves, tangents))


def _combined(values, shared_grads, data_grads):
    return fence(combine(values, shared_grads, data_grads))


#: ``fence(combine(...))`` of partials computed eagerly, as one compiled program.
_finish = jax.jit(_combined)


def _dotted(v, pairs):
    """The value's tangent: each gradient times its tangent (``None``: a zero one), summed
    in order, in ``v``'s dtype."""
    terms = [jnp.sum(g * t).astype(v.dtype) for g, t in pairs if t is not None]
    return functools.reduce(jnp.add, terms) if terms else jnp.zeros_like(v)


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


# -- the Hessian-vector product and its own derivative ---------------------------------------

def value_and_grads_of(blocked, wrt: Wrt, traced, shared):
    """``(value, shared gradients, data gradients)`` of ``blocked(traced, shared)`` for
    the leaves ``wrt`` marks, by JAX's autodiff: the in-graph twin of the route's
    ``value_and_grads``."""

    def total(traced_part, shared_part):
        return blocked(merge(traced, traced_part, wrt.traced),
                       merge(shared, shared_part, wrt.shared))

    value, (data_grads, shared_grads) = jax.value_and_grad(total, argnums=(0, 1))(
        tuple(kept(traced, wrt.traced)), tuple(kept(shared, wrt.shared)))
    return value, tuple(shared_grads), tuple(data_grads)


def tangent_of(blocked, wrt: Wrt, traced, shared, traced_tangents, shared_tangents):
    """The tangent of :func:`value_and_grads_of` along the tangents (per leaf; ``None``
    for a zero tangent), in the caller's program."""
    moving = Wrt(tuple(t is not None for t in traced_tangents),
                 tuple(t is not None for t in shared_tangents))
    at = functools.partial(_value_and_grads_at, blocked, wrt, traced, shared, moving)
    return jax.jvp(at, (tuple(kept(traced, moving.traced)), tuple(kept(shared, moving.shared))),
                   (tuple(kept(traced_tangents, moving.traced)),
                    tuple(kept(shared_tangents, moving.shared))))[1]


def _value_and_grads_at(blocked, wrt, traced, shared, moving, traced_part, shared_part):
    """:func:`value_and_grads_of` with the leaves ``moving`` marks taken from the parts."""
    return value_and_grads_of(blocked, wrt, merge(traced, traced_part, moving.traced),
                              merge(shared, shared_part, moving.shared))


def symmetric_product(apply, twin, primals, tangent, aux=()):
    """``H(primals) @ tangent`` for a symmetric ``H``, computed by ``apply(aux, primals,
    tangent)`` (a host callback, or the graph's block programs), as a map JAX can
    differentiate to every order. ``aux``: arrays ``apply`` reads that have no
    derivative (a site's traced route choice); ``tangent`` and the product have the same
    structure.

    The product is one JAX primitive (:func:`.internals.define_primitive`) with the rules a
    linear map in ``tangent`` needs: its transpose is itself (``H`` is symmetric, so
    reverse mode calls ``apply`` as forward mode does), ``vmap`` maps ``apply`` (once for
    a batch of tangents), and its derivative in ``primals`` (the third order) is
    ``twin``'s, the same product in plain JAX. The plain code it replaces,
    ``jax.jvp(jax.grad(f), (primals,), (tangent,))``, cannot run through a host
    callback; a ``lax.custom_linear_solve`` with ``apply`` as its solve transposes but
    freezes what its solve reads, so a third derivative taken after a reverse pass lost
    the product's dependence on ``primals``.
    """
    p, p_tree = jax.tree.flatten(primals)
    b, b_tree = jax.tree.flatten(tangent)
    rule = _Product(apply, twin, p_tree, b_tree, len(aux), len(p))
    out = _product_p.bind(*aux, *p, *b, rule=rule)
    return jax.tree.unflatten(b_tree, out)


class _Product:
    """The parameter of one :func:`symmetric_product`: its two functions and how its
    operands (``aux``, the primals' leaves, the tangent's leaves) split."""

    def __init__(self, apply, twin, p_tree, b_tree, n_aux, n_p):
        self.apply, self.twin = apply, twin
        self.p_tree, self.b_tree, self.n_aux, self.n_p = p_tree, b_tree, n_aux, n_p

    def split(self, ops):
        ops = list(ops)
        return ops[:self.n_aux], ops[self.n_aux:self.n_aux + self.n_p], \
            ops[self.n_aux + self.n_p:]

    def flat_apply(self, *ops):
        aux, p, b = self.split(ops)
        out = self.apply(tuple(aux), jax.tree.unflatten(self.p_tree, p),
                         jax.tree.unflatten(self.b_tree, b))
        return self.b_tree.flatten_up_to(out)

    def flat_twin(self, p, b):
        out = self.twin(jax.tree.unflatten(self.p_tree, p), jax.tree.unflatten(self.b_tree, b))
        return self.b_tree.flatten_up_to(out)

    def batched(self, axes) -> _Product:
        """This product of a batch (every operand's batch axis first or ``None``): both
        functions mapped."""
        return _BatchedProduct(self, axes)


class _BatchedProduct(_Product):
    """A :class:`_Product` of a batch: ``product``'s two functions under ``vmap``."""

    def __init__(self, product: _Product, axes):
        super().__init__(None, None, product.p_tree, product.b_tree, product.n_aux,
                         product.n_p)
        self.product, self.axes = product, axes
        n = product.n_aux + product.n_p
        self.primal_axes, self.tangent_axes = tuple(axes[product.n_aux:n]), tuple(axes[n:])

    def flat_apply(self, *ops):
        return jax.vmap(self.product.flat_apply, in_axes=self.axes)(*ops)

    def flat_twin(self, p, b):
        return jax.vmap(self._twin, in_axes=(self.primal_axes, self.tangent_axes))(
            tuple(p), tuple(b))

    def _twin(self, p, b):
        return self.product.flat_twin(list(p), list(b))


def _product_impl(*ops, rule):
    return rule.flat_apply(*ops)


def _product_abstract(*avals, rule):
    return rule.split(avals)[2]  # the product has the tangent's shapes and dtypes


def _product_jvp(primals, tangents, *, rule):
    out = _product_p.bind(*primals, rule=rule)
    aux, p, b = rule.split(primals)
    _, dp, db = rule.split(tangents)
    terms = []
    if any(not is_zero(t) for t in db):
        db = [zeros_of(t) if is_zero(t) else t for t in db]
        terms.append(_product_p.bind(*aux, *p, *db, rule=rule))
    moved = [not is_zero(d) and _is_float(x) for x, d in zip(p, dp)]
    if any(moved):
        def at(xs):
            return rule.flat_twin(merge(p, xs, moved), b)

        terms.append(jax.jvp(at, (tuple(kept(p, moved)),), (tuple(kept(dp, moved)),))[1])
    if not terms:
        return out, [jnp.zeros_like(x) for x in out]
    return out, [functools.reduce(jnp.add, parts) for parts in zip(*terms)]


def _product_transpose(cts, *ops, rule):
    aux, p, b = rule.split(ops)
    cts = [zeros_of(ct) if is_zero(ct) else ct for ct in cts]
    out = _product_p.bind(*aux, *p, *cts, rule=rule)
    return [None] * (len(aux) + len(p)) + [o if is_undefined(x) else None
                                            for o, x in zip(out, b)]


def _product_batch(args, dims, *, rule):
    size = next(jnp.shape(x)[d] for x, d in zip(args, dims) if d is not NOT_MAPPED)
    aux, p, b = rule.split([move_batch_axis(x, d) for x, d in zip(args, dims)])
    axes = rule.split([None if d is NOT_MAPPED else 0 for d in dims])
    # Every tangent leaf batched: the product of a batch is a batch.
    b = [x if a == 0 else jnp.broadcast_to(x, (size,) + jnp.shape(x))
         for x, a in zip(b, axes[2])]
    out = _product_p.bind(*aux, *p, *b,
                          rule=rule.batched((*axes[0], *axes[1], *([0] * len(b)))))
    return out, [0] * len(out)


_product_p = define_primitive("pb_symmetric_product", _product_impl, _product_abstract,
                              _product_jvp, _product_transpose, _product_batch)


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

        sums.append(LAYOUTS[spec.form].sum_blocks(one, res_b, tr_b))
    if plan.tail_rows:
        tail = jnp.sum(block([jnp.asarray(x)[full:] for x in resident],
                             [x[full:] for x in traced], shared))
        sums.append(tail[None])
    return jnp.sum(jnp.concatenate(sums))
