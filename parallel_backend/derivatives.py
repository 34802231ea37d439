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
  block programs (:func:`symmetric_product`: the Hessian is symmetric, so the product is
  its own transpose and reverse over reverse runs as forward over reverse does), or,
  where the route says so (:attr:`.routes.Route.autodiff_products`), JAX's autodiff of the
  blocked sum; third and higher orders are JAX's autodiff of the blocked sum
  (:func:`blocked_sum`, the twin).

Every route's partials meet in one place, :func:`.tasks.combine` (block order), behind
guard ``fence``. Imports jax, numpy and the core below it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from .batching import site_batching
from .guards import fence, one_program
from .internals import is_tracer
from .routes import Wrt
from .spec import kept, merge
from .tasks import combine

__all__ = ["blocked_sum", "linear_zeros", "site_value", "site_value_and_grads",
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
        some = next(t for t in (*tt, *ts) if t is not None)  # the rule runs for one at least
        vectors = tuple(tuple(linear_zeros(x, some) if t is None else t
                              for x, t in zip(kept(xs, u), kept(ts_, u)))
                        for xs, ts_, u in ((traced, tt, along.traced),
                                           (shared, ts, along.shared)))

        def apply(at, b):
            _, hs, ht = combine(*self.route.products(*at, choice, along, b))
            return tuple(ht), tuple(hs)

        def twin(at, b):
            _, ht, hs = tangent_of(self.blocked, along.traced, along.shared, *at,
                                   merge((None,) * len(along.traced), b[0], along.traced),
                                   merge((None,) * len(along.shared), b[1], along.shared))
            return tuple(ht), tuple(hs)

        ht, hs = symmetric_product(apply, twin, (traced, shared), vectors)
        # The value's tangent: the gradients (of every leaf with a tangent) dotted with it.
        g = out if along == wrt else self.value_and_grads(traced, shared, choice, along)
        dv = _dotted(out[0], [*zip(g[1], kept(tt, along.traced)),
                              *zip(g[2], kept(ts, along.shared))])
        return dv, tuple(kept(ht, kept(wrt.traced, along.traced))), \
            tuple(kept(hs, kept(wrt.shared, along.shared)))


def _combined(values, shared_grads, data_grads):
    return fence(combine(values, shared_grads, data_grads))


#: ``fence(combine(...))`` of partials computed eagerly, as one program (guard ``one_program``).
_finish = one_program(_combined)


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
