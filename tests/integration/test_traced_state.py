"""What ``fn`` reads besides its arguments, and what a site therefore computes.

A likelihood may read a module's attribute (``settings.SCALE``), call a helper of
another module that reads that module's globals, or read a class attribute. Plain
NumPyro traces the model again for every fit and reads the new values; a site is found
again by its key, and its key holds what ``fn`` computes on the call's blocks
(:func:`parallel_backend.analysis.computes`), so a change between two fits makes
another site. A process that traces the site again later (a dask worker that imports
the module from its file, this process at the first host evaluation) and finds that
``fn`` computes something else there says so instead of returning its number.
Each check compares with plain JAX (``jnp.sum(fn(x, mu))`` and its gradient).
"""

from __future__ import annotations

import sys
import types
import uuid

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import parallel_backend as pb

# dask workers cannot import this module by name: its functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

N, K, BLOCK_ROWS = 5_003, 3, 1000
RTOL = 2e-5

#: A module whose attribute the likelihood reads (``settings.SCALE``): made here, it
#: is not importable, and cloudpickle sends it to dask workers as it is.
SETTINGS = types.ModuleType("pb_test_settings")
SETTINGS.SCALE = 1.0

#: Another module, with a helper that reads its own global ``K``.
HELPERS = types.ModuleType("pb_test_helpers")
exec("import jax.numpy as jnp\nK = 1.0\n"  # noqa: S102 - a module's source
     "def loglik(rows, mu):\n    return -0.5 * K * jnp.sum((rows - mu) ** 2, axis=1)\n",
     HELPERS.__dict__)


#: A module whose attribute the derivative rules below read, and only they.
RULES = types.ModuleType("pb_test_rules")
RULES.SCALE = 1.0


@jax.custom_jvp
def _jvp_square(d):
    return -0.5 * d ** 2


@_jvp_square.defjvp
def _jvp_square_rule(primals, tangents):
    (d,), (t,) = primals, tangents
    return _jvp_square(d), -RULES.SCALE * d * t


def _vjp_square():
    """Made at each trace: on jax 0.10 a ``custom_vjp`` object sent by value (this
    module's are) cannot be unpickled by a dask worker; what it is made of can."""
    @jax.custom_vjp
    def square(d):
        return -0.5 * d ** 2

    square.defvjp(lambda d: (square(d), d), lambda d, ct: (-RULES.SCALE * d * ct,))
    return square


class Spread:
    k = 1.0


def attribute_loglik(rows, mu):
    return -0.5 * SETTINGS.SCALE * jnp.sum((rows - mu) ** 2, axis=1)


def helper_loglik(rows, mu):
    return HELPERS.loglik(rows, mu)


def class_loglik(rows, mu):
    return -0.5 * jnp.sum((rows - Spread.k * mu) ** 2, axis=1)


def jvp_rule_loglik(rows, mu):
    return jnp.sum(_jvp_square(rows - mu), axis=1)


def vjp_rule_loglik(rows, mu):
    return jnp.sum(_vjp_square()(rows - mu), axis=1)


CASES = {
    "module attribute": (attribute_loglik, lambda v: setattr(SETTINGS, "SCALE", v)),
    "helper of another module": (helper_loglik, lambda v: setattr(HELPERS, "K", v)),
    "class attribute": (class_loglik, lambda v: setattr(Spread, "k", v)),
    # the values agree, the gradients do not: the rule is what changed
    "custom_jvp rule": (jvp_rule_loglik, lambda v: setattr(RULES, "SCALE", v)),
    "custom_vjp rule": (vjp_rule_loglik, lambda v: setattr(RULES, "SCALE", v)),
}


def rows(seed=0):
    return np.random.default_rng(seed).normal(size=(N, K)).astype(np.float32)


def fresh(fn, executor, x):
    return helpers.split_value_and_grad(fn, executor, x, BLOCK_ROWS)


plain = helpers.plain_value_and_grad


@pytest.fixture(params=["serial", "thread2-host", pytest.param("dask-host", marks=pytest.mark.dask)])
def executor(request):
    if request.param == "dask-host":
        ex = pb.DaskExecutor(client=request.getfixturevalue("client"), dispatch="host")
    elif request.param == "serial":
        ex = pb.SerialExecutor()
    else:
        ex = pb.ThreadExecutor(2, dispatch="host")
    with ex:
        yield ex


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_what_fn_reads_changed_between_fits(case, executor, assert_close, assert_identical):
    fn, set_value = CASES[case]
    x = rows()
    try:
        set_value(1.0)
        first = fresh(fn, executor, x)(0.3)
        assert_close(first, plain(fn, x)(0.3), RTOL)
        set_value(3.0)
        second = fresh(fn, executor, x)(0.3)
        assert_close(second, plain(fn, x)(0.3), RTOL)
        assert len(executor.sites()) == 2
        set_value(1.0)  # as at first: the first site again
        assert_identical(fresh(fn, executor, x)(0.3), first)
        assert len(executor.sites()) == 2
    finally:
        set_value(1.0)
    assert not np.isclose(float(second[1]), float(first[1]), rtol=0.1)  # the gradients


def test_a_site_traced_again_after_a_change_says_so():
    """Traced, then the attribute changes before the first host evaluation: the host
    route traces ``fn`` again for its block programs and finds another computation."""
    x = rows()
    try:
        with pb.ThreadExecutor(2, dispatch="host") as ex:
            compiled = fresh(attribute_loglik, ex, x).lower(0.3).compile()
            SETTINGS.SCALE = 3.0
            with pytest.raises(Exception, match="computes here something else"):
                jax.block_until_ready(compiled(0.3))
    finally:
        SETTINGS.SCALE = 1.0


def module_on_disk(tmp_path, monkeypatch, source: str):
    """A module written to a file that this process and dask worker processes (started
    afterwards, with this ``sys.path``) import."""
    name = f"pb_test_state_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return __import__(name)


@pytest.mark.dask
def test_a_worker_that_computes_something_else_says_so(tmp_path, monkeypatch, assert_close):
    """``fn`` of an importable module travels to the workers by name, and they import
    the module from its file; its attribute changed here is not changed there."""
    mod = module_on_disk(tmp_path, monkeypatch, "import jax.numpy as jnp\nK = 1.0\n"
                         "def loglik(rows, mu):\n"
                         "    return -0.5 * K * jnp.sum((rows - mu) ** 2, axis=1)\n")
    x = rows()
    with pb.DaskExecutor(n_workers=1, dispatch="host") as ex:
        mod.K = 3.0  # here only
        with pytest.raises(Exception, match="computes here something else"):
            fresh(mod.loglik, ex, x)(0.3)
        mod.K = 1.0  # as in the file: the same cluster computes it
        assert_close(fresh(mod.loglik, ex, x)(0.3), plain(mod.loglik, x)(0.3), RTOL)


@pytest.mark.parametrize("case", ["class attribute", "module attribute"])
def test_a_chunk_shape_compiled_after_another_site_computes_the_first(case, executor,
                                                                         assert_close,
                                                                         assert_identical):
    """A chunk shape compiled later traces ``fn`` again. On a dask worker a class sent by
    value with the second site's ``fn`` is the first site's class object too, its
    attribute set to the second's: a new shape of the first site, compiled there after
    the second site arrived, returned the second site's value and gradient (the third
    fit of the test above, where the adaptive chunker had moved). The grainsize forces
    the new shape here."""
    fn, set_value = CASES[case]
    x = rows()

    def fit(grainsize):
        return jax.jit(jax.value_and_grad(lambda mu: pb.reduce_sum(
            fn, x, mu, executor=executor, block_rows=BLOCK_ROWS, grainsize=grainsize)))(0.3)

    try:
        set_value(1.0)
        first = fit(2 * BLOCK_ROWS)
        set_value(3.0)
        fit(2 * BLOCK_ROWS)
        set_value(1.0)
        again = fit(3 * BLOCK_ROWS)  # the first site, a chunk shape it never compiled
        assert len(executor.sites()) == 2
        assert_identical(again, first)  # chunking never changes a bit
        assert_close(again, plain(fn, x)(0.3), RTOL)
    finally:
        set_value(1.0)


def test_what_fn_computes_reads_alike_in_a_terminal(tmp_path):
    """JAX prints a jaxpr in colour where its process started on a terminal (or in
    Jupyter); a dask worker's does not, and the digest of what ``fn`` computes must be
    the same in both, or every site from a terminal would be refused on the workers."""
    import os
    import subprocess
    import sys

    script = tmp_path / "digest.py"
    out = tmp_path / "digest.txt"
    script.write_text(
        "import sys, jax, jax.numpy as jnp\n"
        "from parallel_backend.analysis import computes\n"
        "assert sys.stdout.isatty()\n"
        "c = jax.make_jaxpr(lambda x, m: -(x - m) ** 2 + jnp.log(x))(jnp.ones(3), 0.5)\n"
        f"open({str(out)!r}, 'w').write(computes(c))\n")
    primary, secondary = os.openpty()
    try:
        done = subprocess.run([sys.executable, str(script)], stdout=secondary,
                              stderr=subprocess.PIPE, timeout=120, check=False)
    finally:
        os.close(primary)
        os.close(secondary)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    from parallel_backend.analysis import computes

    here = computes(jax.make_jaxpr(lambda x, m: -(x - m) ** 2 + jnp.log(x))(jnp.ones(3), 0.5))
    assert out.read_text() == here
