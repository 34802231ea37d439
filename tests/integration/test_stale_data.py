"""Data that cannot go stale: a NumPy array the user changes in place between two fits.

What a site keeps (prepared rows, worker-resident data, device buffers, the function
it traces) matches the data passed at the latest trace, on every executor: a site's key
hashes a NumPy array at every trace (only immutable ``jax.Array`` digests are
remembered), and a site copies the NumPy arrays it keeps when it is made. Each check
compares with plain JAX doing the same thing (``jnp.sum(fn(data, ...))`` and its
``jax.grad``), which reads a NumPy constant when it traces. Executors: serial, threads,
a dask LocalCluster of two worker processes, and ``DeviceExecutor`` on this process's
one CPU device and (in a subprocess) on two forced ones. No executor keeps anything
keyed by ``id()``: what it holds per site leaves with the site.

The rows (20,011) do not fill the last block: the site's prepared rows are then a copy,
the case that returned the old data's value before (a full last block kept a view of
the user's array, which followed the change by accident).
"""

from __future__ import annotations

import os
import re
import sys
import warnings

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer.util import log_density

import helpers
import parallel_backend as pb
from parallel_backend import identity

# dask workers cannot import this module by name: its functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

N, K, BLOCK_ROWS = 20_011, 4, 1000
RTOL = 2e-5  # float32 sums of 20,011 rows in another order; stale data is off by ~9x


def loglik(rows, mu):
    return -0.5 * jnp.sum((rows - mu) ** 2, axis=1)


def weighted(w):
    """A likelihood that closes over ``w`` (small data the user may change in place)."""

    def fn(rows, mu):
        return -0.5 * jnp.sum((rows * w - mu) ** 2, axis=1)

    return fn


#: Read by :func:`scaled_loglik` from this module's globals.
SCALE = np.ones(K, np.float32)


def scaled_loglik(rows, mu):
    return -0.5 * jnp.sum((rows * SCALE - mu) ** 2, axis=1)


class Config:
    def __init__(self, w):
        self.w = w


#: An object read by :func:`global_object_loglik` from this module's globals.
CONFIG = Config(np.ones(K, np.float32))


def global_object_loglik(rows, mu):
    return -0.5 * jnp.sum((rows * CONFIG.w - mu) ** 2, axis=1)


def rows(seed, scale=1.0):
    return (scale * np.random.default_rng(seed).normal(size=(N, K))).astype(np.float32)


def change(x, seed):
    """Change ``x`` in place to other rows (another seed, three times the spread)."""
    x[...] = rows(seed, 3.0)


def fresh(fn, executor, x):
    return helpers.split_value_and_grad(fn, executor, x, BLOCK_ROWS)


plain = helpers.plain_value_and_grad


# -- executors ------------------------------------------------------------------------


#: Set in the subprocess of :func:`test_device_executor_on_two_forced_devices`.
FORCED = "PARALLEL_BACKEND_TEST_FORCED_DEVICES"


def _device(dispatch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one CPU device here: it warns
        ex = pb.DeviceExecutor(dispatch=dispatch)
    assert ex.workers == int(os.environ.get(FORCED, "1"))
    return ex


MAKERS = {
    "serial": lambda: pb.SerialExecutor(),
    "serial-host": lambda: pb.SerialExecutor(dispatch="host"),
    "thread2-host": lambda: pb.ThreadExecutor(2, dispatch="host"),
    "thread2": lambda: pb.ThreadExecutor(2),
    # One CPU device in this process; two in the subprocess that
    # test_device_executor_on_two_forced_devices starts.
    "device-host": lambda: _device("host"),
    "device-graph": lambda: _device("graph"),
}
ALL = [*MAKERS, pytest.param("dask-host", marks=pytest.mark.dask)]


@pytest.fixture(params=ALL)
def executor(request):
    if request.param == "dask-host":
        ex = pb.DaskExecutor(client=request.getfixturevalue("client"), dispatch="host")
    else:
        ex = MAKERS[request.param]()
    with ex:
        yield ex


# -- between two fits -----------------------------------------------------------------


@pytest.mark.slow
def test_data_changed_in_place_between_fits(executor, assert_close):
    x = rows(0)
    first = fresh(loglik, executor, x)(0.3)
    assert_close(first, plain(loglik, x)(0.3), RTOL)
    change(x, 1)
    second = fresh(loglik, executor, x)(0.3)
    assert_close(second, plain(loglik, x)(0.3), RTOL)
    assert not np.isclose(float(second[0]), float(first[0]), rtol=0.1)


def test_closed_over_array_changed_in_place_between_fits(executor, assert_close):
    x, w = rows(0), np.ones(K, np.float32)
    fn = weighted(w)  # the same function object both times; only w's content changes
    assert_close(fresh(fn, executor, x)(0.3), plain(fn, x)(0.3), RTOL)
    w *= 3.0
    assert_close(fresh(fn, executor, x)(0.3), plain(weighted(w.copy()), x)(0.3), RTOL)
    assert len([s for s in executor.sites() if not any(s.spec.traced)]) == 2


class Weighted:
    """A likelihood as a method of an object that holds its weights (``self.w``) and,
    as a model class may, its executor; ``self.scale`` is rebound, ``self.w`` changed
    in place."""

    def __init__(self, w, executor=None):
        self.w, self.scale, self.executor = w, 1.0, executor

    def loglik(self, rows, mu):
        return -0.5 * self.scale * jnp.sum((rows * self.w - mu) ** 2, axis=1)


@pytest.mark.parametrize("executor", ["serial", "thread2-host", "device-graph",
                                      pytest.param("dask-host", marks=pytest.mark.dask)],
                         indirect=True)
def test_an_objects_arrays_changed_in_place_between_fits(executor, assert_close):
    x, model = rows(0), Weighted(np.ones(K, np.float32))
    assert_close(fresh(model.loglik, executor, x)(0.3), plain(model.loglik, x)(0.3), RTOL)
    model.w *= 3.0  # in place: the same object, the same array object
    want = plain(Weighted(model.w.copy()).loglik, x)(0.3)
    assert_close(fresh(model.loglik, executor, x)(0.3), want, RTOL)
    model.scale = 2.0  # rebound
    want = plain(model.loglik, x)(0.3)
    assert_close(fresh(model.loglik, executor, x)(0.3), want, RTOL)
    assert len([s for s in executor.sites() if not any(s.spec.traced)]) == 3


def test_an_object_read_as_a_global_is_keyed_by_its_attributes():
    x = rows(0)
    try:
        with pb.SerialExecutor() as ex:
            first = fresh(global_object_loglik, ex, x)(0.3)
            CONFIG.w[:] = 3.0
            second = fresh(global_object_loglik, ex, x)(0.3)
            assert len(ex.sites()) == 2
        assert not np.isclose(float(second[0]), float(first[0]), rtol=0.1)
    finally:
        CONFIG.w[:] = 1.0


NOTEBOOK = """
import jax.numpy as jnp

def link(m):
    return jnp.exp(m)

def loglik(rows, mu):
    return -0.5 * jnp.sum((rows - link(mu)) ** 2, axis=1)
"""


def test_a_helper_redefined_between_fits_is_another_site(assert_close):
    """As in a notebook: the likelihood calls a helper of its module, and a later cell
    defines the helper again. Plain NumPyro traces the model again and reads the new
    helper; so does the site."""
    cell = {}
    exec(NOTEBOOK, cell)  # noqa: S102 - a notebook's cells, run in one namespace
    x = rows(0)
    with pb.SerialExecutor() as ex:
        first = fresh(cell["loglik"], ex, x)(0.3)
        assert_close(first, plain(cell["loglik"], x)(0.3), RTOL)
        exec("def link(m):\n    return 2.0 * m", cell)  # noqa: S102 - the next cell
        second = fresh(cell["loglik"], ex, x)(0.3)
        assert_close(second, plain(cell["loglik"], x)(0.3), RTOL)
        assert len(ex.sites()) == 2
    assert not np.isclose(float(second[0]), float(first[0]), rtol=0.1)


def recursive(n):
    return 1.0 if n == 0 else recursive(n - 1) + ping(n - 1)


def ping(n):
    return 0.0 if n == 0 else recursive(n - 1)


def test_helpers_that_call_each_other_have_a_key():
    """A finite key, the same each time (class attributes and helpers changed between
    fits: test_traced_state.py)."""
    assert identity.function_key(recursive) == identity.function_key(recursive)


def test_objects_of_live_libraries_are_keyed_by_identity():
    """An executor held by the object changes (its sites) as it runs: it is keyed by
    identity, so the object's key stays while only the executor's state moves."""
    with pb.ThreadExecutor(2) as ex:
        model = Weighted(np.ones(K, np.float32), ex)
        before = identity.function_key(model.loglik)
        fresh(model.loglik, ex, rows(0))(0.3)
        assert len(ex.sites()) == 1
        assert identity.function_key(model.loglik) == before
        model.w[0] = 2.0
        assert identity.function_key(model.loglik) != before


def test_a_site_keeps_a_copy_of_an_objects_arrays():
    x, model = rows(0), Weighted(np.ones(K, np.float32))
    with pb.ThreadExecutor(2, dispatch="host") as ex:
        fresh(model.loglik, ex, x).lower(0.3)  # traced, never evaluated
        (state,) = ex.sites()
        model.w[...] = 0.0
        kept = state.spec.fn.__self__
        assert kept is not model and np.array_equal(kept.w, np.ones(K))
        assert kept.executor is model.executor  # only the arrays are copied


@pytest.mark.parametrize("executor", ["serial", "thread2-host",
                                      pytest.param("dask-host", marks=pytest.mark.dask)],
                         indirect=True)
def test_global_array_changed_in_place_between_fits(executor, assert_close):
    x = rows(0)
    try:
        assert_close(fresh(scaled_loglik, executor, x)(0.3), plain(scaled_loglik, x)(0.3), RTOL)
        SCALE[:] = 3.0
        assert_close(fresh(scaled_loglik, executor, x)(0.3), plain(scaled_loglik, x)(0.3), RTOL)
    finally:
        SCALE[:] = 1.0


# -- between the trace and the first evaluation ----------------------------------------


def test_data_changed_between_trace_and_first_evaluation(executor, assert_close):
    """The site keeps what was traced, as plain JAX keeps a NumPy constant; the next
    trace sees the new rows."""
    x, w = rows(0), np.ones(K, np.float32)
    fn = weighted(w)
    ours = fresh(fn, executor, x).lower(0.3).compile()  # traced: the site is made
    reference = plain(fn, x).lower(0.3).compile()
    old = plain(weighted(w.copy()), x.copy())(0.3)
    change(x, 1)  # before the site prepared its rows or traced fn's blocks
    w *= 2.0
    assert_close(reference(0.3), old, RTOL)  # plain JAX: the traced data
    assert_close(ours(0.3), old, RTOL)
    assert_close(ours(0.7), plain(weighted(np.ones(K, np.float32)), rows(0))(0.7), RTOL)
    assert_close(fresh(fn, executor, x)(0.3), plain(weighted(w.copy()), x.copy())(0.3), RTOL)


# -- through NumPyro ------------------------------------------------------------------


def factor_model(x, executor=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    pb.factor("y", loglik, x, mu, executor=executor, block_rows=BLOCK_ROWS)


def plain_model(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    numpyro.factor("y", jnp.sum(loglik(x, mu)))


def density(model, *args):
    """A fresh jitted value and gradient of the model's log-density in ``mu``."""
    return jax.jit(jax.value_and_grad(
        lambda mu: log_density(model, args, {}, {"mu": mu})[0]))


def test_factor_model_traced_again_after_a_change(executor, assert_close):
    x = rows(0)
    assert_close(density(factor_model, x, executor)(0.3), density(plain_model, x)(0.3), RTOL)
    change(x, 1)
    assert_close(density(factor_model, x, executor)(0.3), density(plain_model, x)(0.3), RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["serial", "thread2-host"], indirect=True)
def test_mcmc_runs_see_the_changed_data(executor):
    """Two short NUTS runs with the data changed in place between them: the second
    posterior sits at the new data's mean."""
    from numpyro.infer import MCMC, NUTS

    x = rows(0)

    def run():
        mcmc = MCMC(NUTS(factor_model), num_warmup=30, num_samples=30, progress_bar=False)
        mcmc.run(jax.random.PRNGKey(0), x, executor)
        return float(np.mean(np.asarray(mcmc.get_samples()["mu"])))

    assert abs(run() - x.mean()) < 0.05
    x += 2.0  # every row's mean moves from ~0 to ~2
    assert abs(run() - x.mean()) < 0.05


# -- what is remembered ----------------------------------------------------------------


def hashes(fn) -> int:
    """How many hashing steps (``update`` calls of a hashlib object) ``fn()`` makes on
    this thread."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if (event == "c_call" and getattr(arg, "__name__", "") == "update"
                and "hash" in type(getattr(arg, "__self__", None)).__name__.lower()):
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def test_jax_arrays_are_hashed_once_numpy_arrays_every_time():
    a = rows(0)
    j = jnp.asarray(a)
    assert hashes(lambda: identity.digest(j)) > 0
    assert [hashes(lambda: identity.digest(j)) for _ in range(3)] == [0, 0, 0]
    assert all(hashes(lambda: identity.digest(a)) > 0 for _ in range(3))
    d = identity.digest(a)
    a[0, 0] += 1.0
    assert identity.digest(a) != d
    assert identity.digest(j) == d  # the JAX array holds the rows as they were


def test_a_site_over_a_jax_array_is_found_without_hashing_again():
    j = jnp.asarray(rows(0))
    with pb.SerialExecutor() as ex:
        fresh(loglik, ex, j)(0.3)
        assert hashes(lambda: fresh(loglik, ex, j).lower(0.3)) == 0
        assert len(ex.sites()) == 1


def test_function_keys_follow_closed_over_numpy_arrays():
    w = np.ones(K, np.float32)
    fn = weighted(w)
    before = identity.function_key(fn)
    assert identity.function_key(fn) == before
    w[0] = 2.0
    assert identity.function_key(fn) != before


def test_a_site_keeps_copies_of_numpy_data_and_closures():
    x, w = rows(0), np.ones(K, np.float32)
    with pb.ThreadExecutor(2, dispatch="host") as ex:
        fresh(weighted(w), ex, x).lower(0.3)  # traced, never evaluated
        (state,) = ex.sites()
        x[...] = 0.0
        w[...] = 0.0
        prepared = state.prepared()[0]
        assert np.array_equal(prepared.reshape(-1, K)[:N], rows(0))
        assert not np.shares_memory(prepared, x)
        kept = state.spec.fn.__closure__[0].cell_contents
        assert np.array_equal(kept, np.ones(K)) and not np.shares_memory(kept, w)


def test_ids_are_never_keys():
    """A callable object rebuilt at every trace (``pb.observe``'s row function) is keyed
    by what it is, and an object keyed by identity is held by its key, so its id cannot
    be reused by another object while the key lives."""

    class Rows:
        def __init__(self, fn):
            self.fn = fn

        def __call__(self, rows, mu):
            return self.fn(rows, mu)

    assert identity.function_key(Rows(loglik)) == identity.function_key(Rows(loglik))
    assert identity.function_key(Rows(loglik)) != identity.function_key(Rows(scaled_loglik))
    thing = object()
    key = identity.function_key(weighted(thing))
    del thing
    assert all(identity.function_key(weighted(object())) != key for _ in range(100))


def test_a_forgotten_site_is_dropped_by_the_executor(executor):
    """What an executor keeps per site (a graph counter, the host path's data, device
    shares and buffers, the client's copy of a dask site) is held by the site itself,
    never in an executor's dict, and leaves with it."""
    from parallel_backend.site import SiteCache

    executor._states = SiteCache(max_sites=1, on_forget=executor._retire)
    executor.count_calls = True  # a graph counter per site, too
    fresh(loglik, executor, rows(0))(0.3)
    (first,) = executor.sites()
    fresh(loglik, executor, rows(1))(0.3)  # another site: the first leaves the cache
    assert executor.sites() != [first]

    def refers(x, obj, depth=0):
        if x is obj or getattr(x, "state", None) is obj:
            return True
        if depth < 3 and isinstance(x, dict):
            return any(refers(k, obj, depth + 1) or refers(v, obj, depth + 1)
                       for k, v in x.items())
        if depth < 3 and isinstance(x, (list, tuple)):
            return any(refers(v, obj, depth + 1) for v in x)
        return False

    def held(obj):
        """The executor's dicts that refer to ``obj``."""
        return [k for k, v in vars(executor).items() if isinstance(v, dict) and refers(v, obj)]

    live = executor.sites()[0]
    # What the live site holds is on the site itself (every executor), never in an
    # executor's dict keyed by it...
    assert not held(live)
    assert live.placed or live.host is not None or live.counter is not None
    # ...and nothing of the forgotten one, anywhere.
    assert not held(first)
    assert first.placed == {} and first.host is None and first.counter is None


@pytest.mark.slow
def test_device_executor_on_two_forced_devices():
    """The ``DeviceExecutor`` checks of this file on 2 forced host CPU devices, each
    holding its own share of the rows (the count is fixed when JAX starts: a
    subprocess, as in tests/device)."""
    if os.environ.get(FORCED):
        pytest.skip("this is that subprocess")
    proc = helpers.pytest_on_forced_devices(__file__, "device", FORCED)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(r"\b\d+ passed", proc.stdout), proc.stdout[-2000:]
