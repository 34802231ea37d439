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
    """``f(traced, shared, choice, wrt) -> (value, data gradients, shared gradients)`` on
    ``route`` (an eager ``jax.grad`` on the host route compiles it as one program); its
    own derivative rule is never reached."""
    return _Rules(route, None).value_and_grads


class _Rules:
    """The derivative rules of one site on one route (see the module docstring)."""

    def __init__(self, route, blocked):
        self.route, self.blocked = route, blocked
        self._batching: dict = {}
        self.value_and_grads = jax.custom_jvp(self.run_grads, nondiff_argnums=(3,))
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

    def run_grads(self, traced, shared, choice, wrt: Wrt):
        v, gs, gd = self.run(traced, shared, choice, wrt)
        return v, gd, gs

    def run_value(self, traced, shared, choice):
        return self.run(traced, shared, choice, Wrt.none(len(traced), len(shared)))[0]

    # -- first order ----------------------------------------------------------------------

    def value_jvp(self, primals, tangents):
        traced, shared, choice = primals
        tt, ts, _ = tangents
        wrt = Wrt(tuple(_is_float(x) and not isinstance(t, SymbolicZero)
                        for x, t in zip(traced, tt)),
                  tuple(_is_float(x) and not isinstance(t, SymbolicZero)
                        for x, t in zip(shared, ts)))
        v, gd, gs = self.grads_for(traced, shared, choice)(traced, shared, choice, wrt)
        return v, _dotted(v, [*zip(gd, kept(tt, wrt.traced)), *zip(gs, kept(ts, wrt.shared))])

    def grads_for(self, traced, shared, choice):
        """:attr:`value_and_grads`, or, for an eager ``jax.grad`` on a route whose eager
        calls are one program, that program."""
        if not self.route.eager_program or any(map(is_tracer, (*traced, *shared, choice))):
            return self.value_and_grads
        # Not ``value_and_grads``: its derivative rule holds the data (``blocked``), the
        # site would too.
        return self.route.state.eager_call((self.route.grainsize, "grad"),
                                           lambda: site_value_and_grads(self.route),
                                           static_argnums=(3,))

    # -- second order -----------------------------------------------------------------------

    def value_and_grads_jvp(self, wrt, primals, tangents):
        traced, shared, choice = primals
        tt, ts = (tuple(None if isinstance(t, SymbolicZero) or not _is_float(x) else t
                        for x, t in zip(xs, ts_)) for xs, ts_ in zip(primals[:2], tangents[:2]))
        out = self.value_and_grads(traced, shared, choice, wrt)
        if self.route.autodiff_products:
            return out, tangent_of(self.blocked, wrt.traced, wrt.shared, traced, shared, tt, ts)
        return out, self.product_tangent(traced, shared, choice, wrt, tt, ts, out)

    def product_tangent(self, traced, shared, choice, wrt, tt, ts, out):
        """The tangent: per-block Hessian-vector products over the leaves with a gradient or
        a tangent (``along``), the gradients' taken out, by the same block programs on
        every route: the same bits."""
        along = Wrt(tuple(d or t is not None for d, t in zip(wrt.traced, tt)),
                    tuple(d or t is not None for d, t in zip(wrt.shared, ts)))
        vectors = tuple(tuple(jnp.zeros(jnp.shape(x), jnp.result_type(x)) if t is None else t
                              for x, t in zip(kept(xs, u), kept(ts_, u)))
                        for xs, ts_, u in ((traced, tt, along.traced),
                                           (shared, ts, along.shared)))

        def apply(aux, at, b):
            _, hs, ht = combine(*self.route.products(*at, aux[0] if aux else None, along, b))
            return tuple(ht), tuple(hs)

        def twin(at, b):
            _, ht, hs = tangent_of(self.blocked, along.traced, along.shared, *at,
                                   merge((None,) * len(along.traced), b[0], along.traced),
                                   merge((None,) * len(along.shared), b[1], along.shared))
            return tuple(ht), tuple(hs)

        ht, hs = symmetric_product(apply, twin, (traced, shared), vectors,
                                   aux=() if choice is None else (choice,))
        # The value's tangent: the gradients (of every leaf with a tangent) dotted with it.
        g = out if along == wrt else self.value_and_grads(traced, shared, choice, along)
        dv = _dotted(out[0], [*zip(g[1], kept(tt, along.traced)),
                              *zip(g[2], kept(ts, along.shared))])
        return dv, tuple(kept(ht, kept(wrt.traced, along.traced))), \
            tuple(kept(hs, kept(wrt.shared, along.shared)))


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

    def batched(self, axes):
        """This product of a batch (every operand's batch axis first or ``None``): both
        functions mapped."""
        n = self.n_aux + self.n_p
        ap, bp = axes[self.n_aux:n], axes[n:]
        outer = self

        class Batched(_Product):
            def flat_apply(self, *ops):
                return jax.vmap(outer.flat_apply, in_axes=axes)(*ops)

            def flat_twin(self, p, b):
                return jax.vmap(lambda p, b: outer.flat_twin(list(p), list(b)),
                                in_axes=(tuple(ap), tuple(bp)))(tuple(p), tuple(b))

        return Batched(None, None, self.p_tree, self.b_tree, self.n_aux, self.n_p)


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
