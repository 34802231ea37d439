"""Every order of JAX transformations a model's log-density is taken with (API.md §8), for
``pb.factor`` and ``pb.observe`` on every executor, against plain NumPyro: one table.

The model is a linear regression over ``N`` rows in float64, its likelihood a
``pb.observe`` site, a ``pb.factor`` site, or the plain observed site in a plate; ``f(b)``
is NumPyro's ``log_density`` in the coefficients ``b``. Each case takes one
transformation order of ``f`` on one executor and compares it with the same order of the
plain model's ``f`` (``rtol`` 1e-10), and checks that the executor evaluated the site
(its ``stats()["chunks"]`` moved): no case passes by falling back to plain's program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer.util import log_density

import parallel_backend as pb

N, D = 300, 3
#: Several chunks, summed in a fixed order.
GRAINSIZE = 50
RTOL = 1e-10


def data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(N, D))
    y = X @ np.array([1.0, -0.5, 0.3]) + 0.7 * rng.normal(size=N)
    return X, y


def rows(X, b):
    return dist.Normal(X @ b, 0.7)


def factor_rows(Xy, b):
    return rows(Xy[0], b).log_prob(Xy[1])


def model(X, y, kind, executor=None):
    b = numpyro.sample("b", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
    if kind == "plain":
        with numpyro.plate("rows", N):
            numpyro.sample("y", rows(X, b), obs=y)
    elif kind == "observe":
        pb.observe("y", rows, X, b, obs=y, executor=executor, grainsize=GRAINSIZE)
    else:
        pb.factor("y", factor_rows, (X, y), b, executor=executor, grainsize=GRAINSIZE)


def log_density_of(kind, executor=None):
    X, y = data()
    return lambda b: log_density(model, (X, y, kind, executor), {}, {"b": b})[0]


B = np.array([0.9, -0.4, 0.2])
T = np.array([0.3, -1.0, 0.5])

#: Each order of transformations of ``f`` at ``b``: its name and how it is taken.
ORDERS = {
    "grad(jit(f))": lambda f, b: jax.grad(jax.jit(f))(b),
    "jit(grad(f))": lambda f, b: jax.jit(jax.grad(f))(b),
    "grad(f) eager": lambda f, b: jax.grad(f)(b),
    "value_and_grad(f) eager": lambda f, b: jax.value_and_grad(f)(b),
    "vjp(f)": lambda f, b: jax.vjp(f, b)[1](jnp.ones(()))[0],
    "vjp(jit(f))": lambda f, b: jax.vjp(jax.jit(f), b)[1](jnp.ones(()))[0],
    "jvp(f)": lambda f, b: jax.jvp(f, (b,), (jnp.asarray(T),)),
    "jit(jvp(f))": lambda f, b: jax.jit(lambda b: jax.jvp(f, (b,), (jnp.asarray(T),)))(b),
    "linearize(f)": lambda f, b: jax.linearize(f, b)[1](jnp.asarray(T)),
    "linearize(jit(f))": lambda f, b: jax.linearize(jax.jit(f), b)[1](jnp.asarray(T)),
    "jacfwd(f)": lambda f, b: jax.jacfwd(f)(b),
    "hessian(f)": lambda f, b: jax.hessian(f)(b),
    "jit(hessian(f))": lambda f, b: jax.jit(jax.hessian(f))(b),
    "grad(grad(f))": lambda f, b: jax.grad(lambda b: jnp.sum(jax.grad(f)(b) ** 2))(b),
    "vmap(grad(f))": lambda f, b: jax.vmap(jax.grad(f))(jnp.stack([b, 0.5 * b, -b])),
    "jit(vmap(grad(f)))": lambda f, b: jax.jit(jax.vmap(jax.grad(f)))(
        jnp.stack([b, 0.5 * b, -b])),
}

#: The two routes: the graph (the serial executor; graph evaluations are counted with
#: ``count_calls``) and the host callback (two threads). A dask cluster below.
EXECUTORS = {
    "serial": lambda: pb.SerialExecutor(count_calls=True),
    "thread2-host": lambda: pb.ThreadExecutor(2, dispatch="host"),
}

_plain: dict = {}


def plain(order):
    """The plain model's result of ``order`` (computed once per order)."""
    if order not in _plain:
        _plain[order] = ORDERS[order](log_density_of("plain"), jnp.asarray(B))
    return _plain[order]


def check(order, kind, executor):
    before = executor.stats()["chunks"]
    got = ORDERS[order](log_density_of(kind, executor), jnp.asarray(B))
    want = plain(order)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=RTOL, atol=1e-12,
                                   err_msg=f"{order} of pb.{kind} on {executor!r}")
    assert executor.stats()["chunks"] > before, (
        f"{order} of pb.{kind}: the executor evaluated nothing")


#: The default run takes every order on the threads' host callback (the route with the
#: most of its own machinery); the slow lane the other executors too.
ROUTES = [pytest.param(name, marks=() if name == "thread2-host" else pytest.mark.slow)
          for name in EXECUTORS]


@pytest.mark.parametrize("kind", ["observe", "factor"])
@pytest.mark.parametrize("name", ROUTES)
@pytest.mark.parametrize("order", list(ORDERS))
def test_every_transformation_order_equals_plain(order, name, kind, x64):
    with EXECUTORS[name]() as ex:
        check(order, kind, ex)


@pytest.mark.dask
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["observe", "factor"])
@pytest.mark.parametrize("order", list(ORDERS))
def test_every_transformation_order_on_dask_equals_plain(order, kind, client, x64):
    with pb.DaskExecutor(client, dispatch="host") as ex:
        check(order, kind, ex)
