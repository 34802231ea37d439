"""Shared fixtures: precision, executors, test problems and tree assertions.

Everything here is real: real executors, real JAX transformations, no mocks.
Helpers reach the tests as fixtures (``make_problem``, ``assert_close``,
``assert_identical``) because test modules are imported with
``--import-mode=importlib`` and cannot import this file by name.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple


def _compilation_cache() -> None:
    """Share compiled XLA programs between the tests of one test process and the
    subprocesses they start (examples, the CLI, forced-device runs): JAX's persistent
    compilation cache in a temporary folder of this process, removed at exit, unless the
    caller named one (``JAX_COMPILATION_CACHE_DIR``). JAX reads these variables when it
    is imported, here and in every subprocess. The same HLO gives the same executable
    from the cache as from a compile, so no result changes (measured: an example's
    subprocess 30.3 s -> 22.7 s with a warm cache)."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    folder = tempfile.mkdtemp(prefix=f"pb-test-jax-cache-{worker}-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=folder,
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")


_compilation_cache()

import jax  # after the cache's environment is set
import jax.numpy as jnp
import numpy as np
import pytest

import parallel_backend as pb

# -- precision -----------------------------------------------------------------------


@contextlib.contextmanager
def jax_x64(enabled: bool):
    """Set ``jax_enable_x64`` for the block, then restore it: the flag is process-global."""
    before = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", enabled)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)


@pytest.fixture
def x64():
    """Float64 for one test."""
    with jax_x64(True):
        yield np.dtype("float64")


@pytest.fixture(params=["float64", "float32"])
def precision(request):
    """Run the test once in float64 and once in float32; yields the float dtype."""
    with jax_x64(request.param == "float64"):
        yield np.dtype(request.param)


@pytest.fixture(autouse=True)
def _no_leaked_global_state():
    """Fail loudly if a test leaves x64 on or a default executor set."""
    x64_before = bool(jax.config.jax_enable_x64)
    yield
    assert bool(jax.config.jax_enable_x64) == x64_before, "a test leaked jax_enable_x64"
    pb.set_default_executor(None)


@pytest.fixture(scope="module")
def row_loops():
    """Reductions within rows loop their blocks on any machine for the tests of one
    module: the rule loops them only where XLA has few threads
    (``analysis.ROW_REDUCE_LOOP_THREADS``), and these tests are of the looped form."""
    from parallel_backend import analysis

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(analysis, "ROW_REDUCE_LOOP_THREADS", 1 << 20)
        yield


# -- executors -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client():
    """A client of a real dask ``LocalCluster`` of two worker processes, one per test
    module (``helpers.local_client``; skips where distributed is not installed)."""
    import helpers

    with helpers.local_client() as c:
        yield c


#: Every executor configuration the tests use, by id. "host" runs chunks through the
#: host callback on the executor's workers; the default SerialExecutor keeps the block
#: loop in the XLA graph (the reference); the default ThreadExecutor measures ("auto").
#: Graph evaluations are counted (``count_calls=True``: a callback) so that the tests can
#: check every evaluation is counted once; by default only pb.sample counts them.
EXECUTORS: dict[str, Callable[[], pb.Executor]] = {
    "serial": lambda: pb.SerialExecutor(count_calls=True),
    "serial-host": lambda: pb.SerialExecutor(dispatch="host"),
    "thread1-host": lambda: pb.ThreadExecutor(1, dispatch="host"),
    "thread2-host": lambda: pb.ThreadExecutor(2, dispatch="host"),
    "thread4-host": lambda: pb.ThreadExecutor(4, dispatch="host"),
    "thread2": lambda: pb.ThreadExecutor(2, count_calls=True),
}


@pytest.fixture(params=["serial", "serial-host", "thread2-host"])
def executor(request):
    """A fresh executor, closed after the test. Override the ids with
    ``@pytest.mark.parametrize("executor", [...], indirect=True)``."""
    with EXECUTORS[request.param]() as ex:
        yield ex


@pytest.fixture
def fresh_executor():
    """``fresh_executor(id)``: fresh executors from :data:`EXECUTORS`, all closed after the test."""
    made = []

    def make(name: str) -> pb.Executor:
        ex = EXECUTORS[name]()
        made.append(ex)
        return ex

    yield make
    for ex in made:
        ex.close()


# -- test problems -----------------------------------------------------------------------


class Problem(NamedTuple):
    """A pointwise log-density with its data and the parameters to differentiate.

    ``args = (row_params, params)`` are what tests differentiate: ``row_params`` are
    per-row parameters (a dict merged into ``data``, possibly empty) and ``params``
    are unconstrained parameters that ``constrain`` maps to the ``*shared`` of
    ``fn``, in the caller's graph, as a NumPyro model does.
    """

    fn: Callable
    data: Any
    row_params: dict
    params: Any
    constrain: Callable

    @property
    def args(self) -> tuple:
        return self.row_params, self.params

    @property
    def n_rows(self) -> int:
        return int(jax.tree.leaves(self.data)[0].shape[0])

    def rows(self, row_params):
        """The ``data`` pytree handed to ``fn``: the fixed data plus the row parameters."""
        return {**self.data, **row_params} if row_params else self.data

    def split(self, executor=None, **kwargs) -> Callable:
        """``f(row_params, params)`` summed by ``pb.reduce_sum``."""

        def f(row_params, params):
            return pb.reduce_sum(self.fn, self.rows(row_params), *self.constrain(params),
                                 executor=executor, **kwargs)

        return f

    def unsplit(self) -> Callable:
        """``f(row_params, params)`` as the plain sum ``fn(data, *shared).sum()``."""

        def f(row_params, params):
            return self.fn(self.rows(row_params), *self.constrain(params)).sum()

        return f

    def batch(self, k: int) -> tuple:
        """``k`` different parameter sets, stacked on a leading axis (for ``vmap``)."""
        scales = jnp.linspace(0.5, 1.5, k)

        def stack(x):
            return jnp.stack([(x * s).astype(x.dtype) for s in scales])

        return jax.tree.map(stack, self.args)


def _float(x):
    """An array of the current default float (float64 under x64)."""
    return jnp.asarray(x, jnp.result_type(float))


def _identity(params):
    return params


def logistic(n: int, rng) -> Problem:
    """Logistic regression; ``data`` is a dict with a float matrix and int labels."""
    X = rng.normal(size=(n, 3))
    y = (rng.random(n) < 1 / (1 + np.exp(-(X @ [1.0, -2.0, 0.5] + 0.3)))).astype(np.int32)

    def loglik(d, beta, intercept):
        eta = d["X"] @ beta + intercept
        return jnp.where(d["y"] == 1, jax.nn.log_sigmoid(eta), jax.nn.log_sigmoid(-eta))

    params = (_float([0.8, -1.5, 0.2]), _float(0.1))
    return Problem(loglik, {"X": _float(X), "y": jnp.asarray(y)}, {}, params, _identity)


def normal_array(n: int, rng) -> Problem:
    """A normal likelihood; ``data`` is one plain array; the scale is ``exp`` in the caller."""

    def loglik(y, mu, sigma):
        return -0.5 * ((y - mu) / sigma) ** 2 - jnp.log(sigma)

    def constrain(params):
        mu, log_sigma = params
        return mu, jnp.exp(log_sigma)

    return Problem(loglik, _float(rng.normal(1.0, 2.0, size=n)), {},
                   (_float(0.7), _float(0.4)), constrain)


def random_effects(n: int, rng, groups: int = 5) -> Problem:
    """Per-row random effects ``u`` inside ``data``, int group ids, a dict of shared params."""
    group = rng.integers(0, groups, size=n).astype(np.int32)
    y = rng.normal(size=n) + np.linspace(-1, 1, groups)[group]

    def loglik(d, p):
        mean = p["mu"] + p["tau"][d["group"]] + d["u"]
        return -0.5 * ((d["y"] - mean) / p["sigma"]) ** 2 - jnp.log(p["sigma"]) - 0.5 * d["u"] ** 2

    def constrain(params):
        return ({"mu": params["mu"], "tau": params["tau"], "sigma": jnp.exp(params["log_sigma"])},)

    data = {"y": _float(y), "group": jnp.asarray(group)}
    row_params = {"u": _float(0.1 * rng.normal(size=n))}
    params = {"mu": _float(0.2), "tau": _float(np.linspace(-0.5, 0.5, groups)),
              "log_sigma": _float(-0.1)}
    return Problem(loglik, data, row_params, params, constrain)


def poisson_nested(n: int, rng) -> Problem:
    """Poisson regression; nested ``data`` with int counts and float exposures."""
    X = rng.normal(size=(n, 2))
    exposure = rng.uniform(0.5, 2.0, size=n)
    counts = rng.poisson(exposure * np.exp(X @ [0.3, -0.2])).astype(np.int32)

    def loglik(d, beta):
        rate = d["obs"]["exposure"] * jnp.exp(d["X"] @ beta)
        k = d["obs"]["counts"]
        return k * jnp.log(rate) - rate - jax.scipy.special.gammaln(k + 1.0)

    data = {"obs": {"counts": jnp.asarray(counts), "exposure": _float(exposure)}, "X": _float(X)}
    return Problem(loglik, data, {}, (_float([0.1, 0.1]),), _identity)


def negbin(n: int, rng) -> Problem:
    """Negative-binomial regression with an overdispersion parameter on the log scale."""
    X = rng.normal(size=(n, 3)) / np.sqrt(3)
    mu = np.exp(1.0 + X @ [0.5, -0.3, 0.2])
    y = rng.negative_binomial(5.0, 5.0 / (5.0 + mu))

    def loglik(d, alpha, beta, log_phi):
        phi = jnp.exp(log_phi)
        log_mu = alpha + d["X"] @ beta
        log_total = jnp.logaddexp(log_phi, log_mu)
        y = d["y"]
        return (jax.scipy.special.gammaln(y + phi) - jax.scipy.special.gammaln(phi)
                - jax.scipy.special.gammaln(y + 1.0)
                + phi * (log_phi - log_total) + y * (log_mu - log_total))

    params = (_float(0.9), _float([0.4, -0.2, 0.1]), _float(np.log(4.0)))
    return Problem(loglik, {"X": _float(X), "y": _float(y)}, {}, params, _identity)


def hmm(n: int, rng, steps: int = 12, states: int = 3) -> Problem:
    """A Gaussian HMM per row (the forward algorithm over ``steps`` observations)."""
    means = np.linspace(-2.0, 2.0, states)
    obs = means[rng.integers(0, states, size=(n, steps))] + rng.normal(size=(n, steps))

    def loglik(y, logits, mu, log_sigma):
        log_trans = jax.nn.log_softmax(logits, axis=-1)

        def emit(y_t):  # (rows,) -> (rows, states)
            z = (y_t[:, None] - mu) / jnp.exp(log_sigma)
            return -0.5 * z * z - log_sigma

        def step(alpha, y_t):
            alpha = jax.scipy.special.logsumexp(alpha[:, :, None] + log_trans, axis=1)
            return alpha + emit(y_t), None

        alpha, _ = jax.lax.scan(step, emit(y[:, 0]) - jnp.log(float(states)), y[:, 1:].T)
        return jax.scipy.special.logsumexp(alpha, axis=-1)

    params = (_float(2.0 * np.eye(states)), _float(means * 0.9), _float(0.1))
    return Problem(loglik, _float(obs), {}, params, _identity)


def mixture(n: int, rng, components: int = 3) -> Problem:
    """A Gaussian mixture per row: a ``logsumexp`` over a few components within each row."""
    means = np.linspace(-2.0, 2.0, components)
    y = means[rng.integers(0, components, size=n)] + rng.normal(size=n)

    def loglik(y, logits, mu, log_sigma):
        z = (y[:, None] - mu) / jnp.exp(log_sigma)
        comp = jax.nn.log_softmax(logits) - 0.5 * z * z - log_sigma
        return jax.scipy.special.logsumexp(comp, axis=-1)

    params = (_float(np.zeros(components)), _float(means * 0.9), _float(np.zeros(components)))
    return Problem(loglik, _float(y), {}, params, _identity)


def newton(n: int, rng) -> Problem:
    """The benchmarks' per-row iterative solve (``benchmarks/likelihoods.py``): Newton
    steps in a ``while_loop`` until every row of the chunk converged, so the iteration
    count depends on the chunk's rows, differentiated implicitly (``lax.custom_root``)."""
    dtype = np.dtype(jnp.result_type(float))
    fn, data, params = _benchmark_likelihoods().newton(n, dtype, seed=int(rng.integers(2**31)))
    return Problem(fn, {k: jnp.asarray(v) for k, v in data.items()}, {}, tuple(params), _identity)


def _benchmark_likelihoods():
    """``benchmarks/likelihoods.py``, loaded by path (the benchmarks are not a package)."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "likelihoods.py"
    spec = importlib.util.spec_from_file_location("parallel_backend_benchmark_likelihoods", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PROBLEMS = {"logistic": logistic, "normal_array": normal_array,
            "random_effects": random_effects, "poisson_nested": poisson_nested,
            "negbin": negbin, "hmm": hmm, "newton": newton, "mixture": mixture}


@pytest.fixture
def make_problem():
    """``make_problem(name, n=1000, seed=0)``: a :class:`Problem` in the current precision."""

    def make(name: str, n: int = 1000, seed: int = 0) -> Problem:
        return PROBLEMS[name](n, np.random.default_rng(seed))

    return make


# -- assertions -------------------------------------------------------------------------


def _pairs(actual, expected):
    a_leaves, a_def = jax.tree.flatten(actual)
    e_leaves, e_def = jax.tree.flatten(expected)
    assert a_def == e_def, f"tree structures differ: {a_def} vs {e_def}"
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(expected)[0]]
    return zip(paths, map(np.asarray, a_leaves), map(np.asarray, e_leaves))


def _assert_close(actual, expected, rtol: float):
    """Leafwise ``allclose``; the absolute slack is ``rtol`` times the leaf's largest entry."""
    for path, a, e in _pairs(actual, expected):
        assert a.shape == e.shape, f"{path}: shape {a.shape} != {e.shape}"
        assert a.dtype == e.dtype, f"{path}: dtype {a.dtype} != {e.dtype}"
        scale = float(np.max(np.abs(e), initial=0.0)) if e.size else 0.0
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale, err_msg=path)


def _assert_identical(actual, expected):
    """Leafwise bitwise equality (NaNs equal to NaNs)."""
    for path, a, e in _pairs(actual, expected):
        assert a.dtype == e.dtype, f"{path}: dtype {a.dtype} != {e.dtype}"
        assert np.array_equal(a, e, equal_nan=True), (
            f"{path} differs: max |diff| {np.max(np.abs(a.astype(float) - e.astype(float)))}")


@pytest.fixture
def assert_close():
    """``assert_close(actual, expected, rtol)`` over two pytrees."""
    return _assert_close


@pytest.fixture
def assert_identical():
    """``assert_identical(actual, expected)``: bitwise equal pytrees."""
    return _assert_identical
