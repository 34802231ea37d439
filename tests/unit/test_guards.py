"""Every guard of :mod:`parallel_backend.guards` (STYLE 17): per guard, the promise it keeps
with the guard on, and what today's XLA does with the guard removed, on the stacks where it
does it. A message names the guard either way: ``guard 'x': ...`` where the promise broke
with the guard on, ``guard 'x' no longer needed on jax ...`` where XLA stopped doing what the
guard answers, ``guard 'x' now needed on jax ...`` where it started.

What removing each guard did here (2 cores; jax 0.10.2 on Python 3.11, jax 0.12.0.1 on 3.12):

* ``fence``: a descent's points part between the graph and the host route (both stacks);
* ``hide``: data-only arithmetic folded at compile time rounds otherwise (both stacks);
* the LAPACK row limit (:func:`.analysis.lapack_rows`, not a guard of ``guards.py``: a rule
  of how a site is cut): without it batched LAPACK kernels wait for each other forever on
  jax 0.10 (and the limit is 0 on 0.12, where they never did);
* ``stall_probe``: the queued-operations case hangs instead of raising (both stacks);
* ``pin``: a small loop of the caller's rounds apart on jax 0.12, where the fence (whose
  predicate holds the same product) is removed too; alone, no bit was seen to change;

Two former guards changed no bit and hung nothing here when removed, and went:
``hide_bounds`` (the loop over a looped site's blocks in the graph had its bounds hidden
from XLA, which now knows its trip count) and ``one_program`` (an eager call is still
one compiled program, ``jax.jit``, for speed). The promises they were kept for stay
tested below: a looped site's graph route gives the host route's bits, and an eager call
the jitted call's.

Removed guards are removed with :func:`.guards.disabled`: programs traced (and chunk
programs compiled) inside it lack them, so every case builds its executors inside the
block. Deadlocks run in a subprocess with XLA's pool fixed at two threads (``NPROC=2``)
and a watchdog, so that a hang is a clean failure.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallel_backend as pb
from helpers import regression_data
from parallel_backend import guards
from parallel_backend.guards import fence
from parallel_backend.tasks import Partials

ROOT = Path(__file__).resolve().parents[2]
JAX = jax.__version__
_MINOR = tuple(int(v) for v in JAX.split(".")[:2])
#: Where XLA:CPU's kernel of a small loop rounds a block unlike the host route (seen on
#: jax 0.12, not 0.10).
SMALL_LOOP_ROUNDS_APART = _MINOR >= (0, 12)
#: Where batched LAPACK kernels at once wait for each other forever on a pool of two
#: threads (jaxlib 0.10; never on 0.12, whose kernels run their batch in place).
LAPACK_BLOCKS_POOL = _MINOR < (0, 11)


def differing(got, want) -> int:
    """Entries whose bits differ (NaN equal to NaN)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype
    return int(np.sum(~((got == want) | (np.isnan(got) & np.isnan(want)))))


def on_both_routes(run, *removed):
    """``(host, graph)``: ``run(executor)`` on the host route (two threads) and in the
    graph, with the guards ``removed``."""
    with guards.disabled(*removed):
        with pb.SerialExecutor() as graph:
            want = np.asarray(run(graph))
        with pb.ThreadExecutor(2, dispatch="host") as host:
            got = np.asarray(run(host))
    return got, want


def flat(tree):
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])


# -- likelihoods ------------------------------------------------------------------------


def normal(rows, a, b, s):  # no ``where`` anywhere: nothing else keeps the loop apart
    return -0.5 * ((rows["y"] - a - b * rows["x"]) / s) ** 2 - jnp.log(jnp.sqrt(2 * jnp.pi) * s)


def running(rows, a, b, s):  # a scan per row: the looped form, its own loop over blocks
    def step(c, x):
        c = 0.5 * c + a + b * x
        return c, -0.5 * ((x - c) / s) ** 2
    xs = jnp.stack([rows["x"], rows["y"]], axis=1).T
    return jax.lax.scan(step, jnp.zeros_like(rows["x"]), xs)[1].sum(0) - 2 * jnp.log(s)


def filtered(rows, a, b, s):  # a local-level filter per row: 12 steps of a scan
    ys = jnp.stack([rows["y"] + k * 0.1 * rows["x"] for k in range(12)])
    q, r = jnp.exp(a) * 0.1 + 0.01, s * s

    def step(c, yt):
        m, p, ll = c
        p = p + q
        e, v = yt - m - b, p + r
        return (m + p / v * e, (1 - p / v) * p, ll - 0.5 * (jnp.log(v) + e * e / v)), None

    n = rows["y"].shape[0]
    return jax.lax.scan(step, (jnp.zeros(n), jnp.ones(n), jnp.zeros(n)), ys)[0][2]


def gradient(fn, data, executor, block_rows=None):
    return jax.grad(lambda p: pb.reduce_sum(fn, data, p[0], p[1], p[2], executor=executor,
                                            block_rows=block_rows))


# -- pin ----------------------------------------------------------------------------------


def test_pin_changes_no_bit():
    x = jnp.asarray([1.5, -0.0, np.inf, np.nan, -3.25], jnp.float32)
    got = jax.vmap(lambda v: Partials(v, (v * 2,), (v,)).pinned())(x)
    for a, b in zip(jax.tree.leaves(got), [x, x * 2, x]):
        assert np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32)), \
            "guard 'pin' changed a bit of the partials it passes"


#: 64 parameter sets, one per step of the small loops.
SETS = jnp.asarray(np.abs(np.random.default_rng(0).normal(size=(64, 3))) + 0.1, jnp.float32)


def small_loop(loop, grad):
    """``f(sets)``: ``grad`` in a small loop of the caller's, 64 steps."""
    if loop == "scan":
        return lambda ps: jax.lax.scan(lambda c, p: (c, grad(p)), 0.0, ps)[1]
    if loop == "map":
        return lambda ps: jax.lax.map(grad, ps)
    # a descent: each step from the last one's gradient
    return lambda ps: jax.lax.fori_loop(0, 64, lambda i, p: p + 1e-4 * grad(p), ps[0])


@pytest.mark.parametrize("fn", [normal, running], ids=["batched", "looped"])
@pytest.mark.parametrize("loop", ["scan", "map", "fori"])
def test_pin_a_small_loop_over_the_graph_gives_the_host_bits(loop, fn):
    """A block evaluated in the caller's program inside a small loop (NUTS on little data,
    a ``scan`` over parameter sets) gives the host route's bits, and the loop changes
    none: each set alone, outside any loop, gives the same."""
    data = regression_data(400)

    def run(executor):
        return jax.jit(small_loop(loop, gradient(fn, data, executor, 64)))(SETS)

    got, want = on_both_routes(run)
    assert not differing(got, want), (
        f"guard 'pin': a block in a {loop} of the caller's rounds unlike the host route in "
        f"{differing(got, want)} of {want.size} entries")
    if loop != "fori":
        with pb.SerialExecutor() as graph:
            one = jax.jit(gradient(fn, data, graph, 64))
            alone = np.stack([np.asarray(one(p)) for p in SETS])
        assert not differing(alone, want), f"guard 'pin': the {loop} changed the bits of a set"


SMALL_CALL = 'xla_cpu_small_call="true"'


def test_pin_keeps_a_small_loop_of_the_caller_off_xlas_small_loop_path():
    """XLA:CPU compiles a small ``while`` loop that reads little memory as one kernel
    (``SmallWhileLoopHoistingPass``, a call marked ``xla_cpu_small_call``; jax 0.10 and
    0.12), and a block in such a loop of the caller's rounds unlike the host route's chunk
    programs: a scan over 8 sets on 32 rows, 16 of 24 gradient entries on jax 0.12 (none on
    0.10, where the kernel rounds alike). The pin's product keeps the loop off that path.
    The fence's predicate is the same product, so the fence is off in both runs: with it
    on, removing the pin alone changed no bit of any case tried, on either stack."""
    data = regression_data(32)

    def run(executor):
        return jax.jit(small_loop("scan", gradient(normal, data, executor)))(SETS[:8])

    def small_calls(*removed):
        with guards.disabled("fence", *removed), pb.SerialExecutor() as graph:
            f = jax.jit(small_loop("scan", gradient(normal, data, graph)))
            return f.lower(SETS[:8]).compile().as_text().count(SMALL_CALL)

    got, want = on_both_routes(run, "fence")
    assert not differing(got, want), (
        f"guard 'pin': a block in a small scan of the caller's rounds unlike the host route "
        f"in {differing(got, want)} of {want.size} entries")
    assert small_calls() == 0, (
        "guard 'pin': XLA compiled the caller's scan around a block as one small-loop kernel "
        "although every block carries the pin's product")
    assert small_calls("pin"), (
        f"guard 'pin' no longer needed on jax {JAX}? Without it (and the fence) XLA no "
        "longer compiles the caller's small scan as one kernel")
    got, want = on_both_routes(run, "fence", "pin")
    if SMALL_LOOP_ROUNDS_APART:
        assert differing(got, want), (
            f"guard 'pin' no longer needed on jax {JAX}? Without it (and the fence) the "
            "small-loop kernel rounds the block as the host route does")
    else:
        assert not differing(got, want), (
            f"guard 'pin' now needed on jax {JAX}: without it (and the fence) the small-loop "
            f"kernel rounds the block unlike the host route in {differing(got, want)} of "
            f"{want.size} entries, as on jax 0.12")


# -- fence --------------------------------------------------------------------------------


def test_fence_changes_no_bit():
    x = jnp.asarray([1.5, -0.0, np.inf, np.nan, -3.25], jnp.float32)
    got = jax.jit(lambda t: fence(t))((x, jnp.arange(3), x[::-1]))
    for a, b in zip(got, (x, jnp.arange(3), x[::-1])):
        assert np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32)), \
            "guard 'fence' changed a bit of what it passes"
    # Leaves without elements pass, first or not; nothing to fence passes as it is.
    empty = (jnp.zeros((0,)), x)
    assert jax.tree.map(np.shape, jax.jit(fence)(empty)) == ((0,), (5,))
    assert fence(()) == ()
    # Mapped, it passes every member as it is.
    x = jnp.asarray([[1.5, -0.0], [np.inf, np.nan]], jnp.float32)
    assert np.array_equal(np.asarray(jax.vmap(fence)(x)).view(np.uint32),
                          np.asarray(x).view(np.uint32))


def descent(fn, data, executor):
    """16 steps ``p + 1e-4 * g`` from one point, in a ``fori_loop``: a leapfrog's arithmetic."""
    start = jnp.asarray([0.35, 0.15, 0.9], jnp.float32)
    grad = gradient(fn, data, executor)
    return jax.jit(lambda p: jax.lax.fori_loop(0, 16, lambda i, p: p + 1e-4 * grad(p), p))(start)


@pytest.mark.parametrize("fn", [running, filtered])
@pytest.mark.parametrize("rows", [130, 400])
def test_fence_a_step_on_the_gradient_rounds_alike_on_every_route(fn, rows):
    """The caller's arithmetic on a gradient (a descent's ``p + 1e-4 * g``, a leapfrog
    step) is not fused into the in-graph evaluation, so it rounds as after a host callback
    (one block of 130 or 400 rows; two and three threads)."""
    data = regression_data(rows)
    with pb.SerialExecutor() as graph:
        want = np.asarray(descent(fn, data, graph))
    for workers in (2, 3):
        with pb.ThreadExecutor(workers, dispatch="host") as host:
            got = np.asarray(descent(fn, data, host))
        assert not differing(got, want), (
            f"guard 'fence': the descent's points part between the graph and the host route "
            f"({workers} threads) in {differing(got, want)} of 3 entries")


def test_fence_removed_a_step_on_the_gradient_rounds_apart():
    """Without the fence XLA fuses the step into the in-graph evaluation's last operations
    and rounds it otherwise (an FMA or not) than after the host callback, whose result it
    cannot see into: every entry of the filter's point at 400 rows parts (jax 0.10 and
    0.12; the running mean at 400 rows parts in one, the filter at 130 rows in two)."""
    got, want = on_both_routes(lambda ex: descent(filtered, regression_data(400), ex), "fence")
    assert differing(got, want), (
        f"guard 'fence' no longer needed on jax {JAX}? Without it the descent's points no "
        "longer part between the graph and the host route")


@pytest.mark.parametrize("fn", [running, filtered])
def test_fence_vectorized_chains_step_alike_on_every_route(fn):
    """As above with the sets mapped (NumPyro's vectorized chains): the fence under
    ``vmap`` stays a conditional over the batch (mapped as a ``select``, XLA fused the step
    into the in-graph evaluation: jax 0.10 and 0.12, from the second step, when looped
    sites were still mapped; they now run one set at a time, and a ``select`` in its place
    changed no bit here)."""
    data = regression_data(130)
    starts = jnp.asarray([[0.35, 0.15, 0.9], [0.2, 0.4, 1.1], [0.5, 0.1, 0.7],
                          [0.3, 0.3, 1.3]], jnp.float32)

    def steps(executor):
        grad = gradient(fn, data, executor)

        def walk(p):
            return jax.lax.scan(lambda p, _: (p + 1e-4 * grad(p), grad(p)), p, None,
                                length=4)[1]

        return jax.jit(jax.vmap(walk))(starts)

    got, want = on_both_routes(steps)
    assert not differing(got, want), (
        f"guard 'fence': vectorized chains step apart on the graph and the host route in "
        f"{differing(got, want)} of {want.size} entries")


# -- hide ---------------------------------------------------------------------------------


def affine(rows, a, b):  # y * 0.7 + 0.3: data-only arithmetic, too cheap to hoist
    return -0.5 * (rows["y"] * 0.7 + 0.3 - a - b * rows["x"]) ** 2


def test_hide_keeps_the_data_from_being_folded_at_compile_time():
    """Data XLA can see (constants of the caller's program) it folds: ``y * 0.7 + 0.3``,
    recomputed in every block (:mod:`.hoist` keeps no residual that cheap), is evaluated at
    compile time, rounded otherwise than the host chunk program computes it at run time.
    With the data hidden the two routes agree; without, one of the three entries (value
    and two gradients) parts (300 rows, one block; jax 0.10 and 0.12)."""
    rng = np.random.default_rng(1)
    data = {"x": jnp.asarray(rng.normal(size=300), jnp.float32),
            "y": jnp.asarray(rng.normal(size=300), jnp.float32)}

    def run(executor):
        f = jax.value_and_grad(lambda a, b: pb.reduce_sum(affine, data, a, b, executor=executor),
                               (0, 1))
        return flat(jax.jit(f)(jnp.float32(0.2), jnp.float32(0.5)))

    got, want = on_both_routes(run)
    assert not differing(got, want), (
        f"guard 'hide': the graph route folded the data: {differing(got, want)} of 3 entries "
        "part from the host route")
    got, want = on_both_routes(run, "hide")
    assert differing(got, want), (
        f"guard 'hide' no longer needed on jax {JAX}? With the data in view XLA no longer "
        "rounds the folded arithmetic otherwise")


# -- promises without a guard --------------------------------------------------------------


def test_a_looped_site_in_the_graph_gives_the_host_bits():
    """A looped site's blocks run in the graph in a loop whose trip count XLA knows (7
    blocks here), and in the host chunk program in one whose bounds are arguments: the
    same bits."""
    data = regression_data(400)

    def run(executor):
        return flat(jax.jit(jax.value_and_grad(lambda p: pb.reduce_sum(
            running, data, p[0], p[1], p[2], executor=executor, block_rows=64)))(
                jnp.asarray([0.35, 0.15, 0.9], jnp.float32)))

    got, want = on_both_routes(run)
    assert not differing(got, want), (
        f"a looped site's graph route parts from the host route in "
        f"{differing(got, want)} of {want.size} entries")


def test_an_eager_call_gives_the_jitted_bits_on_every_route():
    """Called eagerly (NumPyro's initialisation runs the model so), a site's value and
    gradient are one compiled program on either route, with the bits of the same call
    under ``jit``."""
    data = regression_data(1000)
    p = jnp.asarray([0.35, 0.15, 0.9], jnp.float32)

    def run(executor):
        def f(p):
            return pb.reduce_sum(normal, data, p[0], p[1], p[2], executor=executor)

        eager = flat((f(p), jax.grad(f)(p)))
        jitted = flat((jax.jit(f)(p), jax.jit(jax.grad(f))(p)))
        assert not differing(eager, jitted), (
            f"called eagerly on {executor!r}, {differing(eager, jitted)} "
            "entries part from the same call under jit")
        return eager

    got, want = on_both_routes(run)
    assert not differing(got, want), (
        f"eager calls part between the graph and the host route in "
        f"{differing(got, want)} of {want.size} entries")


# -- the runtime guards: deadlocks, in a subprocess --------------------------------------------

#: Seconds one evaluation may take before the script counts it as hung: where the guard
#: is on (it should end), and where it is off (it should hang).
WATCH_ON, WATCH_OFF = 90, 10

_WATCH = f"WATCH_ON, WATCH_OFF = {WATCH_ON}, {WATCH_OFF}\n"

LAPACK = _WATCH + textwrap.dedent("""
    import faulthandler
    import jax, jax.numpy as jnp, numpy as np
    import parallel_backend as pb
    from parallel_backend import guards

    import sys
    sys.path.insert(0, "tests")  # run from the repository's root
    from helpers import group_loglik  # a Cholesky and a triangular solve per group (row)

    rng = np.random.default_rng(0)
    data = {"t": np.sort(rng.uniform(0, 10, size=(20_000, 12)), axis=1).astype(np.float32),
            "y": rng.normal(size=(20_000, 12)).astype(np.float32)}

    def evaluate(f, count, watch):
        for i in range(count):  # a call that takes ``watch`` seconds hung: exit 1, "Timeout"
            faulthandler.dump_traceback_later(watch, exit=True)
            jax.block_until_ready(f(np.float32(0.1 * i)))
        faulthandler.cancel_dump_traceback_later()
""")

#: The LAPACK row limit, on the graph and the host route: 20,000 groups in blocks of 3,000
#: (a padded last block), the jitted gradient. Without the limit the gradient's batched
#: solves run at once on both threads of XLA's pool and wait for each other (jax 0.10).
LAPACK_ROWS = LAPACK + textwrap.dedent("""
    from parallel_backend import analysis

    def both(calls, watch):
        for ex in (pb.SerialExecutor(), pb.ThreadExecutor(2, dispatch="host")):
            with ex:
                f = jax.jit(jax.value_and_grad(lambda p: pb.reduce_sum(
                    group_loglik, data, p, executor=ex, block_rows=3_000)))
                evaluate(f.lower(np.float32(0)).compile(), calls, watch)

    both(20, WATCH_ON)
    print("on ok", flush=True)
    analysis.LAPACK_POOL_WORK = 0  # sites made from here on: no limit
    both(20, WATCH_OFF)
    print("off ok", flush=True)
""")

#: Guard ``stall_probe``: the caller's program waits for its parameters, and 40
#: operations queued on its result take every place XLA keeps for programs in flight.
STALL_PROBE = _WATCH + textwrap.dedent("""
    import faulthandler
    import jax, jax.numpy as jnp, numpy as np
    import parallel_backend as pb
    from parallel_backend import guards
    from benchmarks.likelihoods import LIKELIHOODS

    fn, data, params = LIKELIHOODS["hmm_1k"][0](1_000, np.float32)
    x = jnp.ones(1_000_000, np.float32)
    slow = jax.jit(lambda x: jax.lax.fori_loop(0, 100, lambda i, x: jnp.sin(x) + 0.5, x)
                   .sum() * 0.0)
    jax.block_until_ready(slow(x))

    def queued(phase, watch):
        with pb.ThreadExecutor(2, dispatch="host") as ex:
            f = jax.jit(lambda *q: pb.reduce_sum(fn, data, *q, executor=ex))
            want = np.float32(f(*params)) + np.float32(40)
            # Short waits from here: the chunk programs are compiled (a slow compile under
            # load is not a stall).
            guards.STALL_SECONDS, guards.PROBE_SECONDS = 0.5, 1.0
            faulthandler.dump_traceback_later(watch, exit=True)
            v = f(*[q + slow(x) for q in params])  # its parameters still being computed
            for _ in range(40):  # queued on v before it is ready
                v = v + 1.0
            try:
                print(phase, "value", float(v) == float(want), flush=True)
            except Exception as e:
                print(phase, "error", "InFlightLimit" in str(e), flush=True)
            faulthandler.cancel_dump_traceback_later()

    queued("on", WATCH_ON)
    with guards.disabled("stall_probe"):
        queued("off", WATCH_OFF)
""")


@pytest.fixture(scope="module")
def deadlocks():
    """``finish(name)`` -> ``(output, hung)`` of the script of guard ``name``: the three
    scripts run at once, each in a fresh process on a pool of two XLA threads; ``hung``
    where its watchdog ended it."""
    env = dict(os.environ, NPROC="2", JAX_PLATFORMS="cpu")
    runs = {name: subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name, script in (("lapack_rows", LAPACK_ROWS), ("stall_probe", STALL_PROBE))}

    def finish(name):
        run = runs[name]
        try:
            out, err = run.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            run.kill()
            out, err = run.communicate()
            pytest.fail(f"guard '{name}': its script hung past its watchdog\n{out}{err[-3000:]}")
        hung = run.returncode != 0 and "Timeout (" in err
        assert run.returncode == 0 or hung, out + err[-3000:]
        return out + err[-2000:], hung

    yield finish
    for run in runs.values():
        if run.poll() is None:
            run.kill()
            run.communicate()


def check_deadlock_guard(name: str, out: str, hung: bool, expected: bool, kernels: str):
    """The script's guard-on phase finished; its guard-off phase hung as ``expected``."""
    assert "on ok" in out, f"guard '{name}': {kernels} hung with the guard on\n{out}"
    if expected:
        assert hung, (
            f"guard '{name}' no longer needed on jax {JAX}? Without it {kernels} no longer "
            f"hang\n{out}")
    else:
        assert not hung and "off ok" in out, (
            f"guard '{name}' now needed on jax {JAX}: without it {kernels} wait for each "
            f"other forever, as on jax 0.10\n{out}")


def test_lapack_rows_keep_a_sites_lapack_kernels_from_waiting_for_each_other(deadlocks):
    """A site whose ``fn`` solves per group keeps each LAPACK kernel's batch small enough
    to run in place (``analysis.lapack_rows``): its jitted gradient finishes on the graph
    and on two threads. Without the limit, on jax 0.10, the gradient's batched solves
    ran at once on both threads of XLA's pool and waited for each other forever (within
    a few evaluations, every run); on jax 0.12 the kernels run in place and there is no
    limit to remove."""
    out, hung = deadlocks("lapack_rows")
    check_deadlock_guard("lapack_rows", out, hung, LAPACK_BLOCKS_POOL,
                         "batched LAPACK kernels of a site's gradient")


def test_stall_probe_ends_a_host_callback_whose_chunks_cannot_start(deadlocks):
    """The chunk programs of a callback whose result has 40 operations queued on it can
    never start: with the guard the callback raises ``InFlightLimit`` within seconds (or
    returns the value where XLA admitted them after all); without it, it waits forever
    (jax 0.10 and 0.12, every run)."""
    out, hung = deadlocks("stall_probe")
    assert re.search(r"^on (error|value) True$", out, re.MULTILINE), (
        f"guard 'stall_probe': the callback neither raised InFlightLimit nor returned the "
        f"value (ended by its watchdog: {hung})\n{out}")
    assert hung, (
        f"guard 'stall_probe' no longer needed on jax {JAX}? Without it the queued case "
        f"no longer hangs\n{out}")
