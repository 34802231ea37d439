"""``pb.profile`` and ``parallel-backend profile``: real models, real executors, real timing."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import parallel_backend as pb
from helpers import scan_loglik
from parallel_backend.blocks import balance_blocks
from parallel_backend.timeline import LOSSES

# The module, not the function of the same name that the package exports.
profile_module = importlib.import_module("parallel_backend.plugins.numpyro.profile")
variants_module = importlib.import_module("parallel_backend.plugins.numpyro.profile")


def normal_loglik(y, mu, sigma):
    return dist.Normal(mu, sigma).log_prob(y)


def normal_model(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    pb.factor("y", normal_loglik, y, mu, sigma)


def plain_normal_model(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    numpyro.sample("y", dist.Normal(mu, sigma), obs=y)


def data(n, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(1.0, 2.0, size=n), jnp.float32)


def cores():
    return len(os.sched_getaffinity(0))


def expected_labels():
    labels = ["plain NumPyro", "SerialExecutor()"]
    labels += [f"ThreadExecutor({w}, dispatch='host')" for w in variants_module._worker_counts(cores())]
    if cores() > 1:
        labels.append(f"ThreadExecutor({cores()})")
    if len(jax.devices()) > 1:
        n = len(jax.devices())
        labels += [f"DeviceExecutor({n} devices, dispatch='host')", f"DeviceExecutor({n} devices)"]
    return labels


def test_report_has_a_row_per_executor_and_a_recommendation():
    report = pb.profile(normal_model, data(20_000))
    assert [r.executor for r in report.rows] == expected_labels()
    plain = report.rows[0]
    assert plain.kind == "plain" and plain.speedup == 1.0
    for row in report.rows:
        assert row.seconds > 0 and np.isfinite(row.seconds)
        assert row.speedup == pytest.approx(plain.seconds / row.seconds)
    for row in report.rows[1:]:
        # Every executor gives the SerialExecutor's value and gradient, bit for bit.
        assert row.identical is True, row
        assert row.dispatch in ("graph", "host")
        if row.dispatch == "host":
            assert row.overhead is not None and 0.0 <= row.overhead <= 1.0
            assert row.chunk_rows and all(0 < c <= 20_000 for c in row.chunk_rows)
    # The default plan, evened out as for every batched (elementwise) likelihood.
    plan = balance_blocks(pb.plan_blocks(20_000, row_bytes=4))
    assert report.sites == [{"name": "y", "rows": 20_000, "block_rows": plan.block_rows,
                             "grainsize": None}]
    if report.best is None:
        assert report.recommendation.startswith("stay with plain NumPyro")
    else:
        assert report.best.speedup >= profile_module.MARGIN
        assert report.recommendation.startswith(f"use {report.best.executor}")
        assert report.recommendation.endswith("inside a short NUTS run")
        assert list(report.nuts) == ["plain NumPyro", report.best.executor]
    text = repr(report)
    assert "recommendation: " + report.recommendation in text
    for label in expected_labels():
        assert label in text


def test_tiny_model_recommends_plain_numpyro():
    # 100 rows are one block: every executor runs plain NumPyro's work in one piece, so
    # the recommendation does not depend on how noisy the timing was.
    report = pb.profile(normal_model, data(100))
    assert report.best is None and report.nuts is None
    assert report.recommendation == ("stay with plain NumPyro: one block per pb.factor site "
                                     "(100 rows), nothing to split"), repr(report)
    assert len(report.rows) == len(expected_labels())
    assert all(r.seconds > 0 for r in report.rows)  # still timed and reported


def _plain_row(seconds):
    return profile_module.ProfileRow("plain NumPyro", "plain", 1, "-", seconds, 1.0, None, None,
                                     (), None)


def _samples(rows):
    return {r.executor: [r.seconds, r.seconds] for r in rows}


@pytest.mark.parametrize("blocks, executor_ms, recommended", [
    ((1,), 1.0, False),      # one block: never, however fast it was timed
    ((1, 1), 1.0, False),
    ((1, 3), 1.0, True),     # one site that splits is enough
    ((3,), 1.0, True),
    ((3,), 9.5, False),      # 1.05x: under the margin
])
def test_recommendation_from_injected_timings(blocks, executor_ms, recommended):
    rows = [_plain_row(0.01), _row("ThreadExecutor(2)", executor_ms / 1e3, 0.01)]
    sites = [{"name": f"y{i}", "rows": 100 * b, "block_rows": 100, "grainsize": None}
             for i, b in enumerate(blocks)]
    text, best = profile_module._recommend(rows, sites, _samples(rows))
    assert (best is rows[1]) == recommended, text
    if recommended:
        assert text.startswith("use ThreadExecutor(2) with grainsize=None: 10.00x faster")
    elif max(blocks) == 1:
        assert "one block per pb.factor site" in text
    else:
        assert text.startswith("stay with plain NumPyro: no executor was 1.1x faster")


def test_recommendation_needs_the_margin_in_the_fastest_round_too():
    rows = [_plain_row(0.01), _row("ThreadExecutor(2)", 0.005, 0.01)]
    sites = [{"name": "y", "rows": 1000, "block_rows": 100, "grainsize": None}]
    samples = {"plain NumPyro": [0.01, 0.004], "ThreadExecutor(2)": [0.005, 0.0045]}
    text, best = profile_module._recommend(rows, sites, samples)
    assert best is None and text.startswith("stay with plain NumPyro"), text


def test_where_chunks_on_workers_cannot_add_the_report_says_so():
    """The blocks in the caller's program win and the threads' chunks do not: the
    recommendation keeps the site in the graph and says why, naming the threads' speed."""
    graph = profile_module.ProfileRow("SerialExecutor()", "serial", 1, "graph", 0.004, 2.5,
                                      None, None, (1000,), True)
    host = _row("ThreadExecutor(2, dispatch='host')", 0.006, 0.01)
    rows = [_plain_row(0.01), graph, host]
    sites = [{"name": "y", "rows": 1000, "block_rows": 100, "grainsize": None}]
    text, best = profile_module._recommend(rows, sites, _samples(rows))
    assert best is graph
    assert text.endswith("chunks on workers add nothing here (ThreadExecutor(2, "
                         "dispatch='host'): 1.67x), so the site stays in the graph"), text
    # where the chunks win, nothing of the kind
    text, best = profile_module._recommend([_plain_row(0.01), graph, _row("T", 0.003, 0.01)],
                                           sites, _samples([_plain_row(0.01), graph,
                                                            _row("T", 0.003, 0.01)]))
    assert best.executor == "T" and "stays in the graph" not in text


@pytest.mark.slow
@pytest.mark.parametrize("executor", [None, "serial"])
def test_short_nuts_run_times_gradients_inside_the_sampler(executor):
    ex = pb.SerialExecutor(count_calls=True) if executor else None
    t = profile_module.nuts_ms_per_gradient(normal_model, (data(2000),), {}, ex, draws=10)
    assert t.draws == 10 and t.gradients >= 10
    assert 0 < t.ms_per_gradient < 1000
    if ex is not None:  # the timed draws ran on the executor (and warmup before them)
        assert ex.stats()["calls"] > t.gradients
        ex.close()


def _row(label, seconds, plain_seconds):
    return profile_module.ProfileRow(label, "thread", 2, "host", seconds, plain_seconds / seconds,
                                     None, None, (), True)


@pytest.mark.parametrize("ms_on_executor, kept", [(5.0, True), (9.5, False)])
def test_recommendation_must_hold_inside_nuts(ms_on_executor, kept):
    best = _row("ThreadExecutor(2)", 0.005, 0.01)
    plain = profile_module.NutsTiming(10.0, 10, 80)
    on_ex = profile_module.NutsTiming(ms_on_executor, 10, 80)
    text, chosen = profile_module._check_in_nuts("use ThreadExecutor(2)", best, plain, on_ex)
    if kept:
        assert chosen is best and text == "use ThreadExecutor(2), 2.00x inside a short NUTS run"
    else:
        assert chosen is None
        assert text.startswith("stay with plain NumPyro: ThreadExecutor(2) was 2.00x faster per "
                               "isolated gradient evaluation but 1.05x inside NUTS")


@pytest.mark.slow
def test_vectorized_chains_are_profiled_as_one_batched_evaluation():
    """chains=k: every variant evaluates k parameter sets at once (per set, what one chain
    evaluates), the executors bit for bit alike; the short NUTS run takes k chains."""
    y = data(6000)
    z = profile_module.initial_params(normal_model, (y,), {}, 3)
    assert all(np.shape(v) == (3,) for v in z.values())
    assert len({float(v) for v in z["mu"]}) == 3  # a draw per chain, not one copied
    serial = pb.SerialExecutor()
    for ex in (None, serial):
        value, grad = profile_module.gradient_fn(normal_model, (y,), {}, ex, 3)(z)
        assert value.shape == (3,) and grad["mu"].shape == (3,)
        one = profile_module.gradient_fn(normal_model, (y,), {}, ex)
        for k in range(3):
            v, g = one({name: x[k] for name, x in z.items()})
            np.testing.assert_allclose(value[k], v, rtol=2e-5)
            np.testing.assert_allclose(grad["mu"][k], g["mu"], rtol=2e-4)
    serial.close()
    with pb.ThreadExecutor(2, dispatch="host") as threads:
        report = pb.profile(normal_model, y, executors=["serial", threads], chains=3, nuts=False)
    assert report.chains == 3 and "of 3 vectorized chains" in repr(report)
    assert report.rows[2].identical is True and report.rows[2].dispatch == "host"
    t = profile_module.nuts_ms_per_gradient(normal_model, (y,), {}, None, draws=5, chains=3)
    assert t.draws == 5 and 0 < t.ms_per_gradient < 1000
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="chains must be a positive int"):
            pb.profile(normal_model, y, chains=bad)


def test_dataframe_and_plot():
    pd = pytest.importorskip("pandas")
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    report = pb.profile(normal_model, data(1000), executors=["serial"])
    frame = report.to_dataframe()
    assert isinstance(frame, pd.DataFrame)
    assert list(frame["executor"]) == ["plain NumPyro", "serial"]
    assert list(frame.columns) == list(profile_module.ProfileRow._fields)
    ax = report.plot()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["plain NumPyro", "serial"]


def test_plain_variant_is_the_numpyro_log_density():
    """The swap to plain NumPyro gives numpyro.sample(obs=...)'s potential and gradient."""
    y = data(3000)
    z = {"mu": jnp.float32(0.7), "sigma": jnp.float32(0.4)}
    swapped = profile_module.gradient_fn(normal_model, (y,), {}, None)(z)
    on_serial = profile_module.gradient_fn(normal_model, (y,), {}, pb.SerialExecutor())(z)
    expected = jax.value_and_grad(lambda p: numpyro.infer.util.potential_energy(
        plain_normal_model, (y,), {}, p))(z)
    for got in (swapped, on_serial):
        for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            np.testing.assert_allclose(a, e, rtol=2e-5)


def test_given_executors_stay_open_and_clients_names_work():
    with pb.ThreadExecutor(2, dispatch="host") as ex:
        report = pb.profile(normal_model, data(5000), executors={"mine": ex, "named": "serial"})
        assert [r.executor for r in report.rows] == ["plain NumPyro", "mine", "named"]
        assert report.rows[1].dispatch == "host" and report.rows[1].identical
        assert ex.stats()["host_calls"] > 0
        assert float(pb.reduce_sum(lambda x: x, jnp.ones(3), executor=ex)) == 3.0


def test_errors_name_the_fix():
    def no_factor(y):
        numpyro.sample("y", dist.Normal(0.0, 1.0), obs=y)

    with pytest.raises(ValueError, match="no pb.factor or pb.observe site"):
        pb.profile(no_factor, data(10))
    with pytest.raises(TypeError, match="executors must be"):
        pb.profile(normal_model, data(10), executors=[3.0])


@pytest.fixture
def cli():
    exe = os.path.join(os.path.dirname(sys.executable), "parallel-backend")

    def run(*args):
        return subprocess.run([exe, "profile", *args], capture_output=True, text=True,
                              timeout=300, check=False)

    return run


@pytest.mark.slow
def test_cli_profiles_a_user_script(cli, tmp_path):
    script = tmp_path / "my_model.py"
    script.write_text(textwrap.dedent("""
        import numpy as np, numpyro, numpyro.distributions as dist
        import parallel_backend as pb

        def loglik(y, mu):
            return dist.Normal(mu, 1.0).log_prob(y)

        def model(y):
            mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
            pb.factor("obs", loglik, y, mu)

        model_args = (np.random.default_rng(0).normal(size=100).astype(np.float32),)
    """))
    out = cli(str(script))
    assert out.returncode == 0, out.stderr
    assert "obs: 100 rows" in out.stdout
    assert "recommendation: stay with plain NumPyro" in out.stdout
    out = cli(str(script), "--chains", "2")
    assert out.returncode == 0, out.stderr
    assert "of 2 vectorized chains (obs: 100 rows" in out.stdout


@pytest.mark.slow  # five variants of the demo model compiled: about 10-25 s
def test_cli_profiles_the_demo_model_and_reports_a_bad_script(cli, tmp_path):
    out = cli("--rows", "5000")
    assert out.returncode == 0, out.stderr
    assert "y: 5,000 rows" in out.stdout and "recommendation: " in out.stdout
    bad = tmp_path / "no_model.py"
    bad.write_text("x = 1\n")
    out = cli(str(bad))
    assert out.returncode != 0 and "must define a callable `model`" in out.stderr


def test_device_map_is_profiled_when_several_devices_exist(tmp_path):
    try:
        _ = pb.DeviceExecutor
    except (ImportError, AttributeError):
        pytest.skip("the device plugin (pb.DeviceExecutor) is not installed")
    script = tmp_path / "device_profile.py"
    script.write_text(textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np, numpyro, numpyro.distributions as dist
        import parallel_backend as pb

        def loglik(y, mu):
            return dist.Normal(mu, 1.0).log_prob(y)

        def model(y):
            mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
            pb.factor("y", loglik, y, mu, block_rows=256)

        assert len(jax.devices()) == 2
        y = jnp.asarray(np.random.default_rng(0).normal(size=5000), jnp.float32)
        report = pb.profile(model, y)
        host, auto = report.rows[-2:]
        assert host.executor == "DeviceExecutor(2 devices, dispatch='host')", report
        assert auto.executor == "DeviceExecutor(2 devices)", report
        for row in (host, auto):
            assert row.kind == "device" and row.workers == 2 and row.identical is True, row
        assert host.dispatch == "host" and host.efficiency > 0 and host.overhead is not None, host
        assert auto.dispatch == "graph", auto  # 5,000 rows: small work stays in the graph
        print("ok")
    """))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, env=env, check=False)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr


def scan_model(x):
    a = numpyro.sample("a", dist.Normal(0.0, 1.0))
    pb.factor("x", scan_loglik, x, a)


def test_timeline_of_the_workers_and_its_plot():
    """The report keeps the host evaluations of an executor whose chunks ran on workers,
    splits their time into chunks and losses (adding up to one), names the largest, and
    draws one evaluation: a row per worker with its chunks, and the callback; the graph
    route is one bar."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4_000, 20)), jnp.float32)
    with pb.ThreadExecutor(2, dispatch="host") as ex:
        report = pb.profile(scan_model, x, executors=[pb.SerialExecutor(), ex], nuts=False,
                            progress_bar=False)
    threads = report.rows[2].executor
    assert list(report.timelines) == [threads]  # the graph route has none
    share = report.losses(threads)
    assert set(share) == {"chunks", *LOSSES}
    assert sum(share.values()) == pytest.approx(1.0) and 0 < share["chunks"] <= 1
    assert report.losses(report.rows[1].executor) is None
    assert f"where {threads}'s workers' time went" in repr(report)
    ax = report.plot_timeline(threads)
    rows = [t.get_text() for t in ax.get_yticklabels()]
    assert rows[0] == "callback" and set(rows[1:]) <= {"thread 0", "thread 1"}
    span = report.timelines[threads][-1]
    bars = [p for p in ax.patches if p.get_facecolor()[:3] == matplotlib.colors.to_rgb("tab:blue")]
    assert len(bars) == len(span.chunks)
    assert "largest loss" in ax.get_title()
    graph = report.plot_timeline(report.rows[1].executor)
    assert [t.get_text() for t in graph.get_yticklabels()] == ["XLA program"]
    with pytest.raises(ValueError, match="no executor 'nope'"):
        report.losses("nope")
