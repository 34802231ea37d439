"""What a traced ``fn`` computes, as a digest (:func:`computes`): a site's key holds it,
and every process that traces the site again checks it (``spec.Program``). Imports
jax, numpy, hashlib, :mod:`.identity` (the content digest of arrays) and
:mod:`.internals`.
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np

from .identity import digest
from .internals import CUSTOM_RULES, VJP_RULES, ClosedJaxpr, Jaxpr, Literal, jaxpr_as_fun

__all__ = ["computes"]


def computes(closed, rules: bool = True) -> str:
    """A digest of what a traced function computes: its jaxpr as JAX prints it (every
    equation, parameter and scalar constant, nested jaxprs too) and the content of its
    array constants. Whatever ``fn`` reads (a module's attribute, another module's
    helper, an object without a ``__dict__``) shows in it, where a key made of ``fn``
    itself can miss it. Two digests agree only where the traces compute alike.

    A ``custom_jvp`` or ``custom_vjp`` rule is a Python function that the jaxpr names
    but does not trace: where one is called (and ``rules``), the digest holds the jaxpr
    of the function's derivative too (:func:`_derivative`), so a rule that reads
    something changed since is seen. First derivatives only; where the derivative
    cannot be traced (a rule that refuses some input), only that is in the digest.
    Trace it under the precision of ``closed``'s trace."""
    h = hashlib.sha256(str(closed.jaxpr).encode())
    todo, called = [(closed.consts, closed.jaxpr)], set()
    while todo:
        consts, jaxpr = todo.pop()
        for c in consts:
            h.update(digest(c).encode())
        for eqn in jaxpr.eqns:
            called.add(eqn.primitive.name)
            for v in eqn.invars:
                if isinstance(v, Literal) and np.ndim(v.val):
                    h.update(digest(v.val).encode())
            for p in eqn.params.values():
                for x in p if isinstance(p, (tuple, list)) else (p,):
                    if isinstance(x, ClosedJaxpr):
                        todo.append((x.consts, x.jaxpr))
                    elif isinstance(x, Jaxpr):
                        todo.append(((), x))
    if rules and called & CUSTOM_RULES:
        try:
            derivative = _derivative(closed, transpose=bool(called & VJP_RULES))
            h.update(computes(derivative, rules=False).encode())
        except Exception as e:  # noqa: BLE001 - a rule that refuses these inputs: named only
            h.update(f"no derivative: {type(e).__name__}".encode())
    return h.hexdigest()


def _derivative(closed, transpose: bool):
    """The jaxpr of ``closed``'s derivative over its inexact inputs, traced now: the
    rules it calls run in that trace. A ``custom_jvp`` rule runs in the forward
    derivative (``jax.jvp``); a ``custom_vjp``'s backward rule only when the product is
    transposed (``transpose``: ``jax.vjp``, whose trace cost the negbin's block about
    three times the forward one's)."""
    fun = jaxpr_as_fun(closed)
    inexact = [np.issubdtype(a.dtype, np.inexact) for a in closed.in_avals]
    outs = [i for i, a in enumerate(closed.out_avals) if np.issubdtype(a.dtype, np.inexact)]

    def derivative(args, vectors):
        def part(*d):
            it = iter(d)
            out = fun(*(next(it) if f else x for x, f in zip(args, inexact)))
            return [out[i] for i in outs]

        primals = tuple(x for x, f in zip(args, inexact) if f)
        if not transpose:
            return jax.jvp(part, primals, tuple(vectors))
        _, back = jax.vjp(part, *primals)
        return back(vectors)

    def struct(a):
        return jax.ShapeDtypeStruct(a.shape, a.dtype)

    args = [struct(a) for a in closed.in_avals]
    vectors = ([struct(closed.out_avals[i]) for i in outs] if transpose
               else [s for s, f in zip(args, inexact) if f])
    return jax.make_jaxpr(derivative)(args, vectors)
