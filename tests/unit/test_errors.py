"""Bad inputs get errors that name the argument, the leaf path and the shapes; failures
inside ``fn`` keep their type and message and say which rows; NaN and -inf are values,
never exceptions.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallel_backend as pb

N = 1000
BLOCK_ROWS = 256  # blocks [0, 256), [256, 512), [512, 768) and the tail [768, 1000)


def gaussian(x, mu):
    return -0.5 * (x - mu) ** 2


@pytest.fixture
def x():
    return jnp.linspace(-2.0, 2.0, N)


# -- validation at the boundary, before tracing ----------------------------------------


@pytest.mark.parametrize("fn", [None, 3, "gaussian", np.ones(3)], ids=repr)
def test_fn_not_callable(x, fn):
    with pytest.raises(TypeError, match=r"fn must be callable, got " + type(fn).__name__):
        pb.reduce_sum(fn, x, 0.0)


@pytest.mark.parametrize("grainsize", [0, -1, -256])
def test_grainsize_below_one(x, grainsize):
    with pytest.raises(ValueError, match=rf"grainsize must be an int >= 1 or None.*got {grainsize}"):
        pb.reduce_sum(gaussian, x, 0.0, grainsize=grainsize)


@pytest.mark.parametrize("grainsize", [2.5, "10", True])
def test_grainsize_not_an_int(x, grainsize):
    with pytest.raises(TypeError, match="grainsize must be an int >= 1 or None"):
        pb.reduce_sum(gaussian, x, 0.0, grainsize=grainsize)


def test_leaves_with_different_leading_sizes(x):
    data = {"x": x, "extra": {"w": jnp.ones((7, 2))}}
    with pytest.raises(ValueError) as excinfo:
        pb.reduce_sum(lambda d, mu: gaussian(d["x"], mu), data, 0.0)
    message = str(excinfo.value)
    assert "data" in message and "leading size" in message
    assert "['x']: (1000,)" in message
    assert "['extra']['w']: (7, 2)" in message


def test_scalar_data_leaf(x):
    with pytest.raises(ValueError, match=r"\['scale'\] is a scalar.*shared"):
        pb.reduce_sum(lambda d: d["x"] * d["scale"], {"x": x, "scale": jnp.float32(2.0)})


def test_scalar_output_says_partial_sum(x):
    with pytest.raises(ValueError) as excinfo:
        pb.reduce_sum(lambda x, mu: gaussian(x, mu).sum(), x, 0.0)
    message = str(excinfo.value)
    assert "returned a scalar" in message
    assert "Stan-style partial sum" in message
    assert "(1000,)" in message


@pytest.mark.parametrize("fn, shape", [
    (lambda x, mu: gaussian(x, mu)[:, None], "(1000, 1)"),
    (lambda x, mu: gaussian(x, mu)[:10], "(10,)"),
    (lambda x, mu: jnp.stack([x, x], axis=1), "(1000, 2)"),
], ids=["column", "too-short", "two-columns"])
def test_output_with_wrong_shape(x, fn, shape):
    with pytest.raises(ValueError) as excinfo:
        pb.reduce_sum(fn, x, 0.0)
    message = str(excinfo.value)
    assert "fn must return shape (1000,)" in message
    assert f"got shape {shape}" in message


def test_wrong_shape_reported_for_the_tail_block(x):
    """A fn that only works for full blocks fails on the ragged tail, before sampling."""

    def fixed_width(x, mu):
        return jnp.resize(gaussian(x, mu), (BLOCK_ROWS,))

    with pytest.raises(ValueError, match=r"shape \(232,\).*got shape \(256,\)"):
        pb.reduce_sum(fixed_width, x, 0.0, block_rows=BLOCK_ROWS)


def test_integer_output(x):
    with pytest.raises(TypeError, match="floating-point"):
        pb.reduce_sum(lambda x, mu: jnp.ones(x.shape, jnp.int32), x, 0.0)


def test_unknown_executor_lists_known_names(x):
    known = pb.known_executors()
    assert {"serial", "thread"} <= set(known)
    for call in [lambda: pb.reduce_sum(gaussian, x, 0.0, executor="dsk"),
                 lambda: pb.make_executor("dsk"),
                 lambda: pb.set_default_executor("dsk")]:
        with pytest.raises(ValueError) as excinfo:
            call()
        message = str(excinfo.value)
        assert "'dsk'" in message
        assert all(repr(name) in message for name in known), message


def test_executor_of_wrong_type(x):
    with pytest.raises(TypeError, match="expected an Executor or an executor name"):
        pb.reduce_sum(gaussian, x, 0.0, executor=42)


def test_closing_over_a_traced_parameter(x):
    def log_density(mu):
        return pb.reduce_sum(lambda rows: gaussian(rows, mu), x)

    with pytest.raises(ValueError, match="closes over a traced value.*pass parameters explicitly"):
        jax.grad(log_density)(0.5)
    with pytest.raises(ValueError, match="closes over a traced value"):
        jax.jit(log_density)(0.5)


def test_closing_over_concrete_arrays_is_fine(x):
    offset = jnp.float32(0.25)
    value = pb.reduce_sum(lambda rows, mu: gaussian(rows + offset, mu), x, 0.0)
    np.testing.assert_allclose(value, gaussian(x + offset, 0.0).sum(), rtol=1e-5)


def test_closed_executor_refuses_work(x):
    executor = pb.ThreadExecutor(2, dispatch="host")
    executor.close()
    with pytest.raises(RuntimeError, match="closed"):
        pb.reduce_sum(gaussian, x, 0.0, executor=executor)


# -- exceptions raised by fn -------------------------------------------------------------


class LikelihoodError(Exception):
    pass


def row_range(start, stop):
    return re.compile(rf"\[{start},\s*{stop}\)")


def test_exception_in_fn_keeps_type_message_and_rows(executor, x):
    def broken(x, mu):
        raise LikelihoodError("bad covariate")

    with pytest.raises(LikelihoodError, match="bad covariate") as excinfo:
        jax.grad(lambda mu: pb.reduce_sum(broken, x, mu, executor=executor,
                                          block_rows=BLOCK_ROWS))(0.0)
    notes = "\n".join(getattr(excinfo.value, "__notes__", []))
    # The rows of a chunk fn was given: a full block or the tail.
    match = re.search(r"rows \[(\d+), (\d+)\)", notes)
    assert match, notes
    assert tuple(map(int, match.groups())) in {(0, BLOCK_ROWS), (768, N)}


def test_exception_on_the_tail_chunk_names_its_rows(executor, x):
    def full_blocks_only(x, mu):
        if x.shape[0] != BLOCK_ROWS:
            raise LikelihoodError(f"expected {BLOCK_ROWS} rows, got {x.shape[0]}")
        return gaussian(x, mu)

    with pytest.raises(LikelihoodError, match="expected 256 rows, got 232") as excinfo:
        jax.jit(lambda mu: pb.reduce_sum(full_blocks_only, x, mu, executor=executor,
                                         block_rows=BLOCK_ROWS))(0.0)
    assert row_range(768, N).search("\n".join(excinfo.value.__notes__))


@pytest.mark.parametrize("executor", ["serial-host", "thread2-host"], indirect=True)
def test_runtime_failure_on_a_worker_names_message_and_rows(executor, x):
    """fn calls host code that fails for some rows only; the failure happens on a worker,
    while the chunk runs. Its message and the chunk's rows must reach the caller."""

    def checked(x):
        if np.any(x > 1.9):
            raise LikelihoodError(f"covariate out of range: {np.max(x):.3f}")
        return x

    def loglik(x, mu):
        x = jax.pure_callback(checked, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return gaussian(x, mu)

    with pytest.raises(Exception) as excinfo:
        jax.block_until_ready(pb.reduce_sum(loglik, x, 0.0, executor=executor,
                                            block_rows=BLOCK_ROWS, grainsize=BLOCK_ROWS))
    text = str(excinfo.value) + "\n".join(getattr(excinfo.value, "__notes__", []))
    assert "LikelihoodError" in text and "covariate out of range" in text
    assert repr(executor.name) in text
    # Only the last chunk holds x > 1.9.
    assert row_range(768, N).search(text), text


# -- non-finite log-densities are values ------------------------------------------------


def log_of_shifted(x, mu):
    return jnp.log(x - mu)  # NaN where x < mu


def impossible_above(x, mu):
    return jnp.where(x > mu, -jnp.inf, gaussian(x, mu))


@pytest.mark.parametrize("fn, bad_mu, expected", [
    (log_of_shifted, 0.0, np.nan),
    (impossible_above, 1.5, -np.inf),
], ids=["nan", "-inf"])
def test_non_finite_values_propagate(executor, x, fn, bad_mu, expected):
    f = jax.jit(jax.value_and_grad(lambda mu: pb.reduce_sum(fn, x, mu, executor=executor,
                                                            block_rows=BLOCK_ROWS)))
    value, _ = f(bad_mu)
    np.testing.assert_array_equal(value, expected)
    # The next, finite evaluation is unaffected (NUTS rejects and goes on).
    value, grad = f(-3.0 if fn is log_of_shifted else 3.0)
    assert np.isfinite(value) and np.isfinite(grad)


def test_in_flight_limit_crosses_processes_as_itself():
    """A dask worker in another process answers ``InFlightLimit`` pickled: it must come
    back the same type with the same message (its ``__init__`` takes two arguments, so
    the exception's default pickling, one message, would fail to rebuild it)."""
    import pickle

    from parallel_backend.errors import InFlightLimit

    sent = InFlightLimit("loglik", 12.0)
    got = pickle.loads(pickle.dumps(sent))
    assert type(got) is InFlightLimit
    assert (str(got), got.label, got.seconds) == (str(sent), "loglik", 12.0)
