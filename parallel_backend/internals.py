"""Every use of JAX's internals, in one place.

The core reads jaxprs (to pick an evaluation form and to hoist data-only work out of
the per-evaluation program) and evaluates parts of them again, with JAX's public API
(``jax.make_jaxpr``, and ``jax.extend.core``, whose pieces JAX marks as unstable); the
rest are equation attributes (``primitive.name``, ``params``, ``effects``) and primitive
names held as strings. Each use is a small name here, and ``tests/unit/test_internals.py`` fails,
naming the JAX version, when a release changes one of them. Tested on jax 0.10.2
(Python 3.11) and jax 0.12.0.1 (Python 3.12 and 3.13); ``docs/layout.rst`` lists them.
Imports jax only.
"""

from __future__ import annotations

import jax
import jax.extend.core as _jex
import jax.numpy as jnp
from jax.custom_batching import custom_vmap as _custom_vmap
from jax.interpreters import ad as _ad
from jax.interpreters import batching as _batching
from jax.interpreters import mlir as _mlir

__all__ = [
    "CALLS",
    "CUSTOM_RULES",
    "HOST_CODE",
    "LAPACK",
    "NOT_MAPPED",
    "SCAN",
    "VJP_RULES",
    "WHILE",
    "ClosedJaxpr",
    "DebugInfo",
    "Jaxpr",
    "Literal",
    "custom_vmap",
    "define_primitive",
    "is_tracer",
    "is_undefined",
    "is_zero",
    "jaxpr_as_fun",
    "jaxprs_in_params",
    "move_batch_axis",
    "zeros_of",
]

#: A constant operand of a jaxpr equation (``jax.extend.core``, unstable).
Literal = _jex.Literal
#: The jaxprs held in an equation's parameters (a ``scan``'s body...), ``jax.extend.core``.
jaxprs_in_params = _jex.jaxprs_in_params
#: A jaxpr made of some of another's equations, and how JAX evaluates one
#: (``jax.extend.core``): the hoisted part of a likelihood and the part left per call.
Jaxpr = _jex.Jaxpr
ClosedJaxpr = _jex.ClosedJaxpr
DebugInfo = _jex.DebugInfo
jaxpr_as_fun = _jex.jaxpr_as_fun

#: A function with its own batching rule (``jax.custom_batching``, marked experimental):
#: the rules by which a site evaluates a batch of parameter sets (:mod:`.batching`) and
#: the fence (:mod:`.guards`) stay one program under ``vmap``.
custom_vmap = _custom_vmap

# Primitive names, as ``eqn.primitive.name`` gives them: JAX exports no constants.
#: The loop over a sequence (an HMM's forward algorithm).
SCAN = "scan"
#: ``lax.while_loop``.
WHILE = "while"
#: Calls of a nested jaxpr that are transparent for cost purposes.
CALLS = frozenset({"pjit", "jit", "closed_call", "custom_jvp_call"})
#: Calls whose derivative is a Python rule (``custom_jvp``, ``custom_vjp``): the jaxpr
#: names the rule but does not hold what it computes.
CUSTOM_RULES = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
#: Those of them whose backward rule runs only when the derivative is transposed.
VJP_RULES = frozenset({"custom_vjp_call", "custom_vjp_call_jaxpr"})
#: Host code: callbacks and foreign calls.
HOST_CODE = frozenset({"pure_callback", "io_callback", "callback", "debug_callback",
                       "custom_call", "ffi_call"})
#: Linear algebra that XLA:CPU runs as jaxlib LAPACK kernels (see :mod:`.analysis`).
LAPACK = frozenset({"cholesky", "triangular_solve", "lu", "qr", "geqrf", "geqp3",
                    "householder_product", "eigh", "eig", "svd", "schur", "hessenberg",
                    "tridiagonal", "tridiagonal_solve"})


def is_tracer(x) -> bool:
    """Whether ``x`` is a JAX tracer (an abstract value inside ``jit``, ``grad``,
    ``vmap``) rather than a concrete array (``jax.core.Tracer``)."""
    return isinstance(x, jax.core.Tracer)


# -- a primitive of the package's own (the symmetric product of .derivatives) ----------------
# ``jax.extend.core.Primitive`` and the rule tables of ``jax.interpreters`` (ad, batching,
# mlir): the way JAX documents for a primitive with its own derivative, transpose and
# batching rules.

#: The batch axis of an operand that ``vmap`` does not map.
NOT_MAPPED = None


def define_primitive(name, impl, abstract_eval, jvp, transpose, batch):
    """A JAX primitive of several results with these rules (``impl`` also lowers it)."""
    prim = _jex.Primitive(name)
    prim.multiple_results = True
    prim.def_impl(impl)
    prim.def_abstract_eval(abstract_eval)
    _ad.primitive_jvps[prim] = jvp
    _ad.primitive_transposes[prim] = transpose
    _batching.primitive_batchers[prim] = batch
    _mlir.register_lowering(prim, _mlir.lower_fun(impl, multiple_results=True))
    return prim


def is_zero(t) -> bool:
    """Whether a tangent or cotangent is JAX's symbolic zero."""
    return type(t) is _ad.Zero


def zeros_of(t):
    """Zeros for a symbolic zero ``t``, as an array."""
    return jnp.zeros(t.aval.shape, t.aval.dtype)


def is_undefined(x) -> bool:
    """Whether a transpose rule's operand is the linear input (undefined primal)."""
    return _ad.is_undefined_primal(x)


def move_batch_axis(x, d):
    """``x`` with its batch axis ``d`` first (unchanged where ``d`` is :data:`NOT_MAPPED`)."""
    return x if d is NOT_MAPPED else jnp.moveaxis(x, d, 0)
