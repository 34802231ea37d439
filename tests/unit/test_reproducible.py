"""Bitwise reproducibility: the value and every gradient are the same bits whichever
executor, worker count or chunk size evaluated them.

The reference is the in-graph ``SerialExecutor()``. The shared scale parameter is
``exp`` of an unconstrained one, computed in the caller's graph as NumPyro does, so
the in-graph path must not let XLA fuse or simplify across the ``reduce_sum`` boundary.
"""

import jax
import pytest

N = 1000
#: 16 blocks: 15 of 64 rows and a tail of 40.
BLOCK_ROWS = 64
GRAINSIZES = {
    "one-block": BLOCK_ROWS,
    "three-blocks": 3 * BLOCK_ROWS,
    "adaptive": None,
    "all-rows": N,
}
BATCH = 4

EXECUTOR_IDS = ["serial-host", "thread1-host", "thread2-host", "thread4-host", "thread2"]


def evaluate(problem, executor, grainsize, batched):
    """Jitted value and gradients, over ``BATCH`` parameter sets when ``batched``."""
    f = jax.value_and_grad(problem.split(executor, block_rows=BLOCK_ROWS, grainsize=grainsize),
                           argnums=(0, 1))
    if batched:
        return jax.jit(jax.vmap(f))(*problem.batch(BATCH))
    return jax.jit(f)(*problem.args)


@pytest.mark.parametrize("batched", [False, True], ids=["single", "vmap"])
@pytest.mark.parametrize("executor", EXECUTOR_IDS, indirect=True)
def test_bitwise_identical_to_serial(precision, executor, make_executor, make_problem,
                                     assert_identical, batched):
    problem = make_problem("random_effects", n=N)
    reference = evaluate(problem, make_executor("serial"), None, batched)
    for label, grainsize in GRAINSIZES.items():
        # Twice: the adaptive chunker may change its chunks after the first call.
        for call in range(2):
            got = evaluate(problem, executor, grainsize, batched)
            try:
                assert_identical(got, reference)
            except AssertionError as e:
                raise AssertionError(f"grainsize {label} ({grainsize}), call {call}: {e}") from e
