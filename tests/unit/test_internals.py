"""The private parts of JAX and NumPyro the package relies on, each checked against the
installed release: a failure here names what a new release changed (see
``docs/layout.rst``). dask's are checked in ``tests/integration/test_dask.py``."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import MCMC, NUTS

from parallel_backend import internals
from parallel_backend.analysis import CHEAP, HOST_CODE, POOL_BLOCKING, detect_form
from parallel_backend.plugins.numpyro import internals as numpyro_internals

VERSION = f"jax {jax.__version__}"


def primitives(f, *args) -> set:
    """Every primitive name in the jaxpr of ``f`` (nested jaxprs included)."""
    names = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            names.add(eqn.primitive.name)
            for sub in internals.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(f)(*args).jaxpr)
    return names


def test_literal_is_what_a_constant_operand_is():
    closed = jax.make_jaxpr(lambda x: x * 2.0 + 1)(1.0)
    literals = [v for e in closed.jaxpr.eqns for v in e.invars
                if isinstance(v, internals.Literal)]
    assert literals and all(hasattr(v, "val") for v in literals), VERSION


def test_jaxprs_in_params_finds_nested_bodies():
    def f(x):
        return jax.lax.scan(lambda c, y: (c + jnp.sin(y), None), 0.0, x)[0]

    (scan,) = [e for e in jax.make_jaxpr(f)(jnp.ones(3)).jaxpr.eqns
               if e.primitive.name == internals.SCAN]
    bodies = list(internals.jaxprs_in_params(scan.params))
    assert bodies and any(e.primitive.name == "sin" for b in bodies for e in b.eqns), VERSION


def test_a_jaxpr_of_some_equations_evaluates_as_the_whole():
    """``Jaxpr`` over a subset of another jaxpr's equations (a nested call and a scan),
    evaluated by ``jaxpr_as_fun``, gives the bits of the function it was made from: the
    hoisted part and the per-evaluation part of a likelihood are built this way."""

    @jax.jit
    def inner(x):
        return jnp.tanh(x) * 3.0

    def f(x):
        y = jnp.exp(x)
        return jax.lax.scan(lambda c, z: (c * 0.5 + inner(z), c), 0.0, y)

    x = jnp.linspace(-1, 1, 5)
    closed = jax.make_jaxpr(f)(x)
    jaxpr = closed.jaxpr
    (first, *rest) = jaxpr.eqns
    def info(n_in, n_out):
        return internals.DebugInfo("test", "test", ("x",) * n_in, ("y",) * n_out)

    head = internals.Jaxpr(jaxpr.constvars, jaxpr.invars, first.outvars, [first],
                           jaxpr.effects, info(1, 1))
    tail = internals.Jaxpr(jaxpr.constvars, first.outvars, jaxpr.outvars, rest, jaxpr.effects,
                           info(1, 2))
    (y,) = internals.jaxpr_as_fun(internals.ClosedJaxpr(head, closed.consts))(x)
    got = internals.jaxpr_as_fun(internals.ClosedJaxpr(tail, closed.consts))(y)
    for a, b in zip(got, jax.jit(f)(x)):
        np.testing.assert_array_equal(a, b, err_msg=VERSION)


def test_is_tracer_inside_and_outside_transformations():
    seen = []
    jax.jit(lambda x: seen.append(internals.is_tracer(x)) or x)(1.0)
    jax.vmap(lambda x: seen.append(internals.is_tracer(x)) or x)(jnp.ones(2))
    assert seen == [True, True] and not internals.is_tracer(jnp.ones(2)), VERSION


def test_a_primitive_of_our_own_differentiates_transposes_batches_and_compiles():
    """``define_primitive``: JAX's rule tables (``jax.interpreters``' ad, batching, mlir)
    and ``jax.extend.core.Primitive`` take a linear primitive, here ``x -> 3 x``."""
    def impl(x):
        return [3.0 * x]

    def jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        t = internals.zeros_of(t) if internals.is_zero(t) else t
        return triple.bind(x), triple.bind(t)

    def transpose(cts, x):
        assert internals.is_undefined(x), VERSION
        (ct,) = cts
        return [triple.bind(internals.zeros_of(ct) if internals.is_zero(ct) else ct)[0]]

    def batch(args, dims):
        (x,), (d,) = args, dims
        return triple.bind(internals.move_batch_axis(x, d)), [0]

    triple = internals.define_primitive(
        "pb_test_triple", impl, lambda x: [x], jvp, transpose, batch)
    f = lambda x: triple.bind(x)[0].sum()
    x = jnp.arange(4.0)
    assert float(jax.jit(f)(x)) == 18.0, VERSION
    assert np.array_equal(jax.grad(f)(x), 3 * np.ones(4)), VERSION
    assert np.array_equal(jax.vmap(jax.grad(f), in_axes=1)(jnp.ones((4, 2))),
                          3 * np.ones((2, 4))), VERSION
    assert float(jax.jvp(f, (x,), (jnp.ones(4),))[1]) == 12.0, VERSION


def test_the_primitive_names_held_as_strings_are_jaxs():
    x = jnp.ones((3, 3)) + jnp.eye(3) * 3

    def uses(f, *args):
        return primitives(f, *args)

    assert internals.SCAN in uses(lambda v: jax.lax.scan(lambda c, y: (c + y, None), 0.0, v)[0],
                                  jnp.ones(3)), VERSION
    assert internals.WHILE in uses(lambda v: jax.lax.while_loop(lambda c: c < 3, lambda c: c + v,
                                                                0.0), 1.0), VERSION
    assert "pure_callback" in uses(lambda v: jax.pure_callback(
        np.sin, jax.ShapeDtypeStruct((), v.dtype), v), 1.0), VERSION
    assert {"cholesky", "triangular_solve"} <= uses(
        lambda m: jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(m), m[0]), x), VERSION
    assert uses(lambda m: jnp.linalg.eigh(m)[0], x) & internals.LAPACK, VERSION
    assert uses(jax.jit(jnp.sin), 1.0) & internals.CALLS, VERSION
    assert uses(jax.nn.relu, 1.0) & internals.CALLS, VERSION  # a custom_jvp
    # the calls whose derivative rules traced.computes traces apart
    assert uses(jax.nn.relu, 1.0) & internals.CUSTOM_RULES, VERSION
    with_vjp = jax.custom_vjp(jnp.sin)
    with_vjp.defvjp(lambda v: (jnp.sin(v), v), lambda v, ct: (ct * jnp.cos(v),))
    assert uses(with_vjp, 1.0) & internals.VJP_RULES, VERSION
    assert internals.VJP_RULES <= internals.CUSTOM_RULES
    assert not uses(jax.nn.relu, 1.0) & internals.VJP_RULES, VERSION
    # The elementwise names the hoisting treats as cheap, as this JAX names them.
    made = uses(lambda v: jnp.abs(-v) + jnp.maximum(v, 0) * jnp.square(v) - jnp.reshape(v, (1, 3))[0][::-1]
                + jnp.where(v > 0, v, 0).astype(jnp.float32) + jnp.pad(v, 1)[1:-1] + v ** 2,
                jnp.ones(3))
    expected = {"abs", "neg", "max", "mul", "sub", "add", "reshape", "rev", "gt", "select_n",
                "pad", "slice", "integer_pow", "square"}
    assert expected - (made & CHEAP) <= {"square"}, (sorted(made), VERSION)
    assert internals.HOST_CODE == HOST_CODE and internals.LAPACK <= POOL_BLOCKING


def test_a_scan_still_reads_as_looped():
    closed = jax.make_jaxpr(lambda v: jax.lax.scan(lambda c, y: (c + y, None), 0.0, v)[0])(
        jnp.ones(3))
    assert detect_form(closed) == "looped", VERSION


# -- NumPyro ------------------------------------------------------------------------------


def test_numpyros_private_attributes():
    def model(y):
        mu = numpyro.sample("mu", dist.Normal())
        numpyro.sample("y", dist.Normal(mu), obs=y)

    kernel = NUTS(model, max_tree_depth=7, target_accept_prob=0.9)
    settings = numpyro_internals.kernel_settings(kernel)
    where = f"numpyro {numpyro.__version__}"
    assert settings["max_tree_depth"] == 7 and settings["target_accept_prob"] == 0.9, where
    assert numpyro_internals.max_tree_depth(kernel) == 7, where
    mcmc = MCMC(kernel, num_warmup=5, num_samples=5, progress_bar=False)
    y = jnp.ones(4)
    mcmc.run(jax.random.PRNGKey(0), y, extra_fields=())
    args, kwargs = numpyro_internals.mcmc_arguments(mcmc)
    assert len(args) == 1 and args[0] is y and kwargs == {}, where
    after = numpyro_internals.kernel_settings(kernel)
    assert not (set(after) - set(settings)) - {k.lstrip("_") for k in
                                                 numpyro_internals.BUILT_AT_INIT}, where
    # the handler stack: the plates around a site, before they process it
    seen = []

    def site():
        seen.extend(type(h).__name__ for h in numpyro_internals.handler_stack())

    with numpyro.handlers.seed(rng_seed=0), numpyro.plate("rows", 3):
        site()
    assert seen == ["seed", "plate"], where


@pytest.mark.parametrize("name", numpyro_internals.__all__)
def test_every_numpyro_internal_is_tested_here(name):
    import inspect

    source = inspect.getsource(test_numpyros_private_attributes)
    assert name in source or name == "kernel_function", name


def test_kernel_function_reads_a_potential_kernel():
    def potential(z):
        return jnp.sum(z ** 2)

    where = f"numpyro {numpyro.__version__}"
    assert numpyro_internals.kernel_function(NUTS(potential_fn=potential)) is potential, where
    assert numpyro_internals.kernel_function(NUTS(lambda: None)) is not None, where
