"""Every use of JAX's internals, in one place.

The core reads jaxprs (to pick an evaluation form and to hoist data-only work out of
the per-evaluation program) and evaluates parts of them again. JAX's public API covers
part of that (``jax.make_jaxpr``, ``jax.extend.core``, whose pieces JAX marks as
unstable); the rest are attributes of jaxpr equations and primitive names held as
strings. Each use is a small name here, and ``tests/unit/test_internals.py`` fails,
naming the JAX version, when a release changes one of them. Tested on jax 0.10.2
(Python 3.11) and jax 0.12.0.1 (Python 3.12 and 3.13); ``docs/layout.rst`` lists them.
Imports jax only.
"""

from __future__ import annotations

import contextlib

import jax
import jax.extend.core as _jex

__all__ = ["Literal", "jaxprs_in_params", "bind_params", "equation_context", "is_tracer",
           "SCAN", "WHILE", "CALLS", "HOST_CODE", "LAPACK"]

#: A constant operand of a jaxpr equation (``jax.extend.core``, unstable).
Literal = _jex.Literal
#: The jaxprs held in an equation's parameters (a ``scan``'s body...), ``jax.extend.core``.
jaxprs_in_params = _jex.jaxprs_in_params

# Primitive names, as ``eqn.primitive.name`` gives them: JAX exports no constants.
#: The loop over a sequence (an HMM's forward algorithm).
SCAN = "scan"
#: ``lax.while_loop``.
WHILE = "while"
#: Calls of a nested jaxpr that are transparent for cost purposes.
CALLS = frozenset({"pjit", "jit", "closed_call", "custom_jvp_call"})
#: Host code: callbacks and foreign calls.
HOST_CODE = frozenset({"pure_callback", "io_callback", "callback", "debug_callback",
                       "custom_call", "ffi_call"})
#: Linear algebra that XLA:CPU runs as jaxlib LAPACK kernels (see :mod:`.forms`).
LAPACK = frozenset({"cholesky", "triangular_solve", "lu", "qr", "geqrf", "geqp3",
                    "householder_product", "eigh", "eig", "svd", "schur", "hessenberg",
                    "tridiagonal", "tridiagonal_solve"})


def bind_params(eqn) -> dict:
    """The keyword arguments that bind ``eqn``'s primitive again
    (``Primitive.get_bind_params``: a call primitive stores its jaxpr in a form
    ``bind`` does not take)."""
    return eqn.primitive.get_bind_params(eqn.params)


def equation_context(eqn):
    """The context an equation was traced in (``eqn.ctx.manager``: its name stack and
    compute type), to re-bind it as it was traced; a null context where a JAX release
    has none."""
    ctx = getattr(eqn, "ctx", None)
    manager = getattr(ctx, "manager", None)
    return manager if manager is not None else contextlib.nullcontext()


def is_tracer(x) -> bool:
    """Whether ``x`` is a JAX tracer (an abstract value inside ``jit``, ``grad``,
    ``vmap``) rather than a concrete array (``jax.core.Tracer``)."""
    return isinstance(x, jax.core.Tracer)
