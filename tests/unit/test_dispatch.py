"""Where a site runs: the rule without timings, the choice from injected timings (every
branch), the tuner's phases from injected timings, and the runtime switch itself (both
routes compiled into one program, the same bits either way)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallel_backend as pb
from parallel_backend.plugins.sample.tuning import ROUNDS, Probe, Tuner
from parallel_backend.routes import (
    GRAPH,
    HOST,
    MARGIN,
    ROUTES,
    GraphRoute,
    HostRoute,
    Slots,
    carried,
    choose,
    default_route,
)


def hmm_like(y, a):
    """A scan over each row's columns: the looped form at small sizes."""

    def step(c, col):
        return c * a + col, None

    out, _ = jax.lax.scan(step, jnp.zeros(y.shape[0], y.dtype), y.T)
    return -0.5 * out ** 2


def elementwise(y, a):
    return -0.5 * (y - a) ** 2


def site_of(executor, fn, data, *shared):
    """The executor's state of the site ``reduce_sum(fn, data, *shared)`` (traced once)."""
    jax.make_jaxpr(lambda *s: pb.reduce_sum(fn, data, *s, executor=executor))(*shared)
    (state,) = [s for s in executor.sites() if s.spec.label == fn.__name__]
    return state


@pytest.fixture
def scan_data():
    return jnp.asarray(np.random.default_rng(0).normal(size=(4096, 6)), jnp.float32)


# -- the rule without timings -----------------------------------------------------------------


def test_default_route_threads_only_where_the_site_is_looped(scan_data):
    flat = jnp.asarray(np.random.default_rng(1).normal(size=200_000), jnp.float32)
    with pb.ThreadExecutor(2) as two, pb.ThreadExecutor(1) as one, \
            pb.ThreadExecutor(2, dispatch="graph") as fixed:
        looped = site_of(two, hmm_like, scan_data, 0.5)
        assert looped.spec.form == "looped" and looped.spec.tiles.n_tiles >= 4
        assert default_route(two, looped) is HostRoute
        batched = site_of(two, elementwise, flat, 0.5)
        assert batched.spec.form == "batched" and default_route(two, batched) is GraphRoute
        assert default_route(one, site_of(one, hmm_like, scan_data, 0.5)) is GraphRoute
        assert default_route(fixed, site_of(fixed, hmm_like, scan_data, 0.5)) is GraphRoute
    # more workers than tiles: the graph's block loop would hold one core of sixteen
    with pb.ThreadExecutor(16) as many:
        state = site_of(many, hmm_like, scan_data, 0.5)
        assert 2 <= state.spec.tiles.n_tiles < 16
        assert default_route(many, state) is HostRoute


def test_a_scan_is_looped_at_every_size_in_blocks_of_its_own():
    """A scan is looped whatever the rows (a batched scan was rounded differently on
    different batch widths); its default blocks are the looped plan's, not the data
    budget's (blocks of 1,024 HMM sequences ran 0.6x plain), and an explicit
    ``block_rows`` is kept."""
    from parallel_backend.blocks import LOOPED_ROWS, looped_blocks

    y = jnp.zeros((20 * LOOPED_ROWS + 7, 3), jnp.float32)
    with pb.ThreadExecutor(2) as ex:
        state = site_of(ex, hmm_like, y, 0.5)
        assert state.spec.form == "looped"
        assert state.spec.plan == looped_blocks(y.shape[0])
        assert state.spec.plan.block_rows <= LOOPED_ROWS + 16
        assert pb.reduce_sum(hmm_like, y, 0.5, executor=ex, block_rows=1024) is not None
        (fixed,) = [s for s in ex.sites() if s.spec.plan.block_rows == 1024]
        assert fixed.spec.form == "looped"


def forward(y, log_trans):
    """The HMM's forward algorithm over each row (``log_trans``: states x states)."""

    def step(alpha, col):
        alpha = jax.scipy.special.logsumexp(alpha[:, :, None] + log_trans, axis=1)
        return alpha + col[:, None], None

    alpha0 = jnp.zeros((y.shape[0], log_trans.shape[0]), y.dtype)
    alpha, _ = jax.lax.scan(step, alpha0, y.T)
    return jax.scipy.special.logsumexp(alpha, axis=-1)


@pytest.mark.parametrize("states", [2, 4, 6])
def test_a_scan_that_reduces_keeps_its_reductions_under_ynnpacks_threshold(states):
    """The largest reduction in the scan's step reads ``rows * states**2`` elements:
    blocks stay under :data:`YNN_REDUCE` (above it XLA:CPU calls YNNPACK for it at
    every step), and the same rule holds for float64 and under ``jit``."""
    from parallel_backend.analysis import scan_reduce_per_row
    from parallel_backend.blocks import YNN_REDUCE

    def trace(f, *shared):
        return lambda rows: jax.make_jaxpr(f)(jnp.zeros((rows, 5)), *shared)

    for f, shared, expected in ((forward, jnp.zeros((states, states)), states ** 2),
                                (hmm_like, 0.5, 0)):
        assert scan_reduce_per_row(trace(f, shared)(100), 100, trace(f, shared)) == expected
    y = jnp.asarray(np.random.default_rng(0).normal(size=(20_000, 5)), jnp.float32)
    with pb.ThreadExecutor(2) as ex:
        state = site_of(ex, forward, y, jnp.zeros((states, states)))
        plan = state.spec.plan
        assert state.spec.form == "looped" and plan.block_rows * states ** 2 < YNN_REDUCE
        assert plan.n_full * plan.block_rows + plan.tail_rows == y.shape[0]
        assert plan.block_rows & (plan.block_rows - 1)  # never a power of two


def test_a_scan_that_traces_only_at_some_sizes_is_read_from_the_one_trace():
    """The reduction per row is read from traces at two block sizes; ``fn`` that fails at
    the larger one (it accepts at most the data's rows) gets the blocks read from the
    size it traced at, and the sum is ``fn``'s."""

    def bounded(y, log_trans):
        if y.shape[0] > 1000:
            raise ValueError(f"at most 1,000 rows, got {y.shape[0]}")
        return forward(y, log_trans)

    y = jnp.asarray(np.random.default_rng(0).normal(size=(1000, 5)), jnp.float32)
    log_trans = jnp.log(jnp.full((4, 4), 0.25, jnp.float32))
    with pb.SerialExecutor() as ex:
        total = pb.reduce_sum(bounded, y, log_trans, executor=ex)
        (state,) = ex.sites()
        assert state.spec.form == "looped" and state.spec.plan.block_rows * 16 < 4096
    np.testing.assert_allclose(total, forward(y, log_trans).sum(), rtol=1e-5)


def test_looped_blocks_are_even_and_never_a_power_of_two():
    from parallel_backend.blocks import LOOPED_MIN_BLOCKS, LOOPED_ROWS, YNN_REDUCE, looped_blocks

    for n, per_row in itertools.product(
            (1, 100, 999, 3000, 4096, 16_384, 50_000, 65_536, 131_072, 200_003, 1_000_000),
            (0, 4, 9, 16, 36, 64)):
        plan = looped_blocks(n, reduce_per_row=per_row)
        assert plan.n_full * plan.block_rows + plan.tail_rows == n
        assert plan.block_rows <= max(LOOPED_ROWS + 16, 1) or plan.n_blocks == 1
        if per_row:
            assert plan.block_rows * per_row < YNN_REDUCE or plan.block_rows <= 48, (n, plan)
        if plan.n_blocks > 1:
            assert plan.block_rows & (plan.block_rows - 1), (n, plan)
            assert plan.tail_rows == 0 or plan.block_rows - plan.tail_rows <= 32 * plan.n_blocks
        if n >= 8 * 500:
            assert plan.n_blocks >= LOOPED_MIN_BLOCKS


# -- the choice from timings -----------------------------------------------------------------


@pytest.mark.parametrize("default", [GraphRoute, HostRoute])
def test_choose_every_branch(default):
    # clearly faster on the host: host, whatever the default
    assert choose([1.0, 1.1, 1.0], [0.7, 0.72, 0.69], default).route is HostRoute
    # clearly slower on the host: graph, whatever the default
    assert choose([1.0, 1.0, 1.0], [1.3, 1.25, 1.4], default).route is GraphRoute
    # within the margin: the default stays
    tie = choose([1.0, 1.0, 1.0], [0.99, 1.02, 0.98], default)
    assert tie.route is default and "within the noise" in tie.reason
    # a median clearly faster, but faster in too few rounds: the default stays
    split = choose([1.0, 1.0, 1.0, 1.0], [0.5, 0.6, 1.2, 1.3], default)
    assert split.ratio < 1 - MARGIN and split.route is default
    # nothing measured (or not paired): the default, said so
    for g, h in (([], []), ([1.0, 1.0], [0.5]), ([0.0, 1.0], [1.0, 1.0])):
        none = choose(g, h, default)
        assert none.route is default and "not measured" in none.reason and np.isnan(none.ratio)


def test_choose_is_stable_under_noise():
    """Timings that differ only by noise (+-3%) keep the default, run after run; a true
    difference of 20% is found in every run despite the same noise."""
    rng = np.random.default_rng(0)
    for default in (GraphRoute, HostRoute):
        for _ in range(200):
            g = 1.0 * (1 + 0.03 * rng.uniform(-1, 1, ROUNDS))
            same = 1.0 * (1 + 0.03 * rng.uniform(-1, 1, ROUNDS))
            faster = 0.8 * (1 + 0.03 * rng.uniform(-1, 1, ROUNDS))
            assert choose(g, same, default).route is default
            assert choose(g, faster, default).route is HostRoute


# -- the tuner's phases, timings injected -------------------------------------------------------


class Loop:
    """The compiled loop as the tuner sees it: its traced sites, counts and defaults."""

    def __init__(self, sites, num_warmup=200, num_samples=100):
        self.slots = None
        self._sites = sites
        self.num_warmup, self.num_samples = num_warmup, num_samples

    def trace(self):
        self.slots = Slots(np.zeros(8, np.int32))
        for ex, state in self._sites:
            self.slots.take(ex, state)

    def default_choices(self):
        out = np.full(8, GRAPH, np.int32)
        for site in self.slots.sites if self.slots else ():
            if site.slot is not None and site.executor.route(site.state) is HostRoute:
                out[site.slot] = HOST
        return out


def drive(tuner, loop, seconds_per_gradient, gradients_per_iteration=10, total=300):
    """Run the tuner's plan to the end with injected timings; the segments it asked for.
    ``gradients_per_iteration``: a number, or a function of the iteration."""
    per = (gradients_per_iteration if callable(gradients_per_iteration)
           else lambda i: gradients_per_iteration)
    asked, lo = [], 0
    while lo < total:
        hi, choices, route = tuner.next(lo, total)
        if loop.slots is None:
            loop.trace()
        calls = sum(per(i) for i in range(lo, hi))
        seconds = calls * (seconds_per_gradient(route, choices) if route else 0.01)
        tuner.record(route, seconds, calls, calls, (lo, hi))
        tuner.log(choices, calls, calls)
        asked.append((lo, hi, route, choices.copy()))
        lo = hi
    return asked


@pytest.mark.parametrize("host_speed,expected", [(0.6, "host"), (1.4, "graph"), (1.01, None)])
def test_tuner_phases_and_decision(scan_data, host_speed, expected):
    """Compile (one transition), probe (one), then paired rounds alternating the order,
    the default route first, then the decision on every candidate site; a tie keeps each
    site's default."""
    with pb.ThreadExecutor(2) as ex:
        state = site_of(ex, hmm_like, scan_data, 0.5)
        loop = Loop([(ex, state)])
        tuner = Tuner(loop, progress=None)

        def speed(route, choices):
            return 1e-3 * (host_speed if choices[0] == HOST else 1.0)

        asked = drive(tuner, loop, speed)
    routes = [r for _, _, r, _ in asked]
    assert routes[0] is None and routes[1] is Probe
    timed = [r for r in routes if r in (GraphRoute, HostRoute)]
    first = state.decision
    other = {GraphRoute: HostRoute, HostRoute: GraphRoute}[first]
    assert timed == [first, other, other, first, first, other]
    assert len(timed) == 2 * ROUNDS
    for lo, hi, r, choices in asked:
        if r in (GraphRoute, HostRoute):
            assert choices[0] == r.slot
    final = ROUTES[expected] if expected else state.decision
    assert state.measured.route is final
    assert asked[-1][3][0] == final.slot
    assert asked[-1][1] == 300  # after deciding, one segment to the end


def test_tuner_shortens_segments_after_a_slow_transition(scan_data):
    """NUTS's first transition can be one gradient and the next ones thirty: the
    segments sized from the probe shrink once a timed one ran long, so that little of
    the run goes to the slower route (the demo's HMM, four chains: 450 gradients on it)."""
    with pb.ThreadExecutor(2) as ex:
        state = site_of(ex, hmm_like, scan_data, 0.5)
        loop = Loop([(ex, state)])
        tuner = Tuner(loop, progress=None)

        def speed(route, choices):
            return 0.06 if choices[0] == HOST else 0.095

        asked = drive(tuner, loop, speed, gradients_per_iteration=lambda i: 1 if i < 2 else 30)
    timed = [(hi - lo, r) for lo, hi, r, _ in asked if r in (GraphRoute, HostRoute)]
    assert timed[0] == (7, state.decision)  # 0.4 s at the probe's 0.06 s per transition
    assert [n for n, _ in timed[1:]] == [1] * (2 * ROUNDS - 1)  # 1.8 s per transition
    assert state.measured.route is HostRoute
    assert sum(n for n, r in timed if r is GraphRoute) == 3


def test_tuner_retimes_a_segment_a_checkpoint_cut(scan_data):
    """A timed segment cut short by a checkpoint boundary is not used; it is timed
    again (the second phase once broke here: only an end-to-end run caught it)."""
    with pb.ThreadExecutor(2) as ex:
        state = site_of(ex, hmm_like, scan_data, 0.5)
        loop = Loop([(ex, state)])
        tuner = Tuner(loop, progress=None)
        hi, _, route = tuner.next(0, 300)
        loop.trace()
        tuner.record(route, 1.0, 10, 10, (0, hi))
        hi2, _, route = tuner.next(hi, 300)
        tuner.record(route, 0.01, 10, 10, (hi, hi2))
        n, planned = tuner._plan[0]
        lo = hi2
        hi3, _, route = tuner.next(lo, lo + 1)  # a checkpoint cuts it
        tuner.record(route, 0.005, 10, 10, (lo, hi3))
        if n > 1:
            assert tuner._plan[0] == (n, planned) and tuner._times[planned] == []


def test_tuner_without_a_switchable_site_times_nothing():
    y = jnp.asarray(np.random.default_rng(1).normal(size=200_000), jnp.float32)
    with pb.SerialExecutor() as ex:
        state = site_of(ex, elementwise, y, 0.5)
        loop = Loop([(ex, state)])
        tuner = Tuner(loop, progress=None)
        asked = drive(tuner, loop, lambda r, c: 1e-3)
    assert [r for _, _, r, _ in asked] == [None, None] and state.measured is None


def test_tuner_leaves_a_short_run_alone(scan_data):
    """Too few iterations left to time without spending a large share of them: the
    default route stays, unmeasured."""
    with pb.ThreadExecutor(2) as ex:
        state = site_of(ex, hmm_like, scan_data, 0.5)
        loop = Loop([(ex, state)], num_warmup=3, num_samples=3)
        tuner = Tuner(loop, progress=None)
        asked = drive(tuner, loop, lambda r, c: 1.0, total=6)
    assert all(r in (None, Probe) for _, _, r, _ in asked)
    assert state.measured is not None and "not measured" in state.measured.reason


def test_graph_evaluations_are_counted_per_route(scan_data):
    """pb.sample's counts: a site's evaluations in segments it ran in the graph go to its
    executor's stats; those on the host are the host path's own."""
    with pb.ThreadExecutor(2) as ex:
        state = site_of(ex, hmm_like, scan_data, 0.5)
        loop = Loop([(ex, state)])
        tuner = Tuner(loop, progress=None)
        drive(tuner, loop, lambda r, c: 1e-3 * (0.5 if c[0] == HOST else 1.0))
        in_graph = sum(c for choices, c, _ in tuner.segment_log if choices[0] == GRAPH)
        tuner.progress = type("Counter", (), {"gradients": sum(c for _, c, _ in tuner.segment_log),
                                              "batches": sum(b for _, _, b in tuner.segment_log)})
        tuner.count_graph_evaluations()
        assert ex.stats()["graph_calls"] == in_graph > 0


# -- the switch at runtime ----------------------------------------------------------------------


def test_both_routes_in_one_program_give_the_same_bits(scan_data):
    with pb.ThreadExecutor(2) as ex:
        def loss(a, choices):
            with carried(Slots(choices)) as slots:
                v = pb.reduce_sum(hmm_like, scan_data, a, executor=ex)
            assert slots.sites and slots.sites[0].slot == 0
            return v

        f = jax.jit(jax.value_and_grad(loss))
        graph = f(0.5, jnp.array([GRAPH] * 8, jnp.int32))
        host = f(0.5, jnp.array([HOST] * 8, jnp.int32))
        assert ex.stats()["host_calls"] == 1
        np.testing.assert_array_equal(np.asarray(graph[0]), np.asarray(host[0]))
        np.testing.assert_array_equal(np.asarray(graph[1]), np.asarray(host[1]))
        vmapped = jax.jit(jax.vmap(jax.value_and_grad(loss), in_axes=(0, None)))
        a = jnp.array([0.3, 0.5, 0.7])
        for x, y in zip(jax.tree.leaves(vmapped(a, jnp.full(8, GRAPH, jnp.int32))),
                        jax.tree.leaves(vmapped(a, jnp.full(8, HOST, jnp.int32)))):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("fn", [hmm_like, elementwise], ids=["looped", "batched"])
def test_a_choice_per_set_evaluates_each_set_alone(scan_data, fn):
    """Under a ``vmap`` that batches the choices too (a chain transform of the user's may),
    every set runs where its own choice says, unbatched: its bits are those it gets
    alone, whichever route each set took."""
    # A batched site gets a choice where the host can split it: more than one tile.
    data = scan_data if fn is hmm_like else jnp.linspace(-2.0, 2.0, 40_000, dtype=jnp.float32)
    rows = None if fn is hmm_like else 2_500
    with pb.ThreadExecutor(2) as ex:
        def loss(a, choices):
            with carried(Slots(choices)):
                return pb.reduce_sum(fn, data, a, executor=ex, block_rows=rows)

        alone = jax.jit(jax.value_and_grad(loss))
        a = jnp.array([0.3, 0.5, 0.7])
        mixed = jnp.array([[GRAPH] * 8, [HOST] * 8, [GRAPH] * 8], jnp.int32)
        got = jax.jit(jax.vmap(jax.value_and_grad(loss)))(a, mixed)
        assert ex.stats()["host_calls"] == 1
        for i in range(3):
            want = alone(a[i], jnp.full(8, GRAPH, jnp.int32))
            for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                np.testing.assert_array_equal(np.asarray(x)[i], np.asarray(y))
