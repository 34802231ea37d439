"""NUTS through ``DaskExecutor`` on a cluster of separate network hosts.

The scheduler and every worker run in their own network namespace (``benchmarks/
netcluster``): a 1-thread worker behind a 2 ms round trip, a 2-thread worker behind
100 Mbit/s. Workers die and join while NUTS runs; the draws stay bitwise those of
:class:`SerialExecutor`, also where this process reaches only the scheduler (the workers
behind it, on a bridge this namespace has no address on: ``reach="scheduler"``), as a
client of a Kubernetes service, a port-forward or a gateway does. A scheduler that cannot
be reached, or dies, fails fast, naming its address. Run with
``pytest -n 0 -m netcluster tests/cluster`` (as root).
"""

from __future__ import annotations

import sys
import threading
import time
import warnings

import cloudpickle
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import parallel_backend as pb
from helpers import run_nuts
from parallel_backend.plugins.dask.worker import holdings

pytestmark = [pytest.mark.netcluster, pytest.mark.dask, pytest.mark.timeout(420)]

# The workers cannot import this module: its functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: 36 blocks in 4 tiles (tiles are at least 8,192 rows): a share for each worker.
N = 36_000
BLOCK_ROWS = 1000


def make_data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n)
    y = 0.5 + 1.2 * x + 0.8 * rng.standard_t(5, size=n)
    counts = rng.poisson(np.exp(0.3 + 0.4 * x))
    return {"x": jnp.asarray(x), "y": jnp.asarray(y), "counts": jnp.asarray(counts, float)}


def normal_rows(rows, alpha, beta, sigma):
    return dist.Normal(alpha + beta * rows, sigma)


def poisson_rows(rows, gamma, delta):
    return dist.Poisson(jnp.exp(gamma + delta * rows["x"])).log_prob(rows["counts"])


def model(data, executor=None):
    alpha = numpyro.sample("alpha", dist.Normal(0.0, 5.0))
    beta = numpyro.sample("beta", dist.Normal(0.0, 5.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    gamma = numpyro.sample("gamma", dist.Normal(0.0, 2.0))
    delta = numpyro.sample("delta", dist.Normal(0.0, 2.0))
    pb.observe("y", normal_rows, data["x"], alpha, beta, sigma, obs=data["y"],
               executor=executor, block_rows=BLOCK_ROWS)
    numpyro.factor("counts", pb.reduce_sum(poisson_rows, data, gamma, delta,
                                           executor=executor, block_rows=BLOCK_ROWS))


def kill_after(ex, cluster, host: str, calls: int, done: threading.Event, before=None):
    """A thread that kills ``host`` once ``ex`` has made ``calls`` evaluations (calling
    ``before()`` just before)."""
    def go():
        deadline = time.monotonic() + 240
        while ex.stats()["calls"] < calls and time.monotonic() < deadline:
            time.sleep(0.005)
        if time.monotonic() < deadline:
            if before is not None:
                before()
            cluster.kill(host)
            done.set()

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("reach", ["all", "scheduler"])
def test_nuts_bitwise_while_workers_die_and_join(netcluster, reach, x64):
    """Three hosts die or join while one chain runs: w1 dies in warmup (its shards go to
    w2), w3 joins before sampling and takes a share of the data, w2 dies in sampling
    (everything goes to w3). Where the client reaches only the scheduler, the executor
    finds that at its first message and sends every message through the scheduler."""
    data = make_data()
    ref = run_nuts(model, pb.SerialExecutor(), data, warmup=40, samples=40)
    cluster = netcluster(reach=reach)
    killed_w1, killed_w2 = threading.Event(), threading.Event()
    with pb.DaskExecutor(address=cluster.address, dispatch="host", timeout=30) as ex:
        assert ex.workers == 3
        t1 = kill_after(ex, cluster, "w1", 25, killed_w1)
        seen = {}

        def between():
            t1.join(60)
            assert killed_w1.is_set(), "warmup ended before w1 was killed: make it longer"
            w3 = cluster.add_worker(threads=1, rtt_ms=1.0)
            seen["w3"] = w3.address
            deadline = time.monotonic() + 60  # until its probe has told the executor
            while w3.address not in ex._live.nthreads and time.monotonic() < deadline:
                time.sleep(0.05)
            assert w3.address in ex._live.nthreads, "the executor never heard w3 join"
            seen["share"] = 0

            def watch():  # the joiner's largest share while w2 still holds blocks (the
                # weighing may later move it back to w2, the faster host)
                while not killed_w2.is_set():
                    held = ex.stats()["blocks_per_worker"].get(w3.address, 0)
                    seen["share"] = max(seen["share"], held)
                    time.sleep(0.01)

            threading.Thread(target=watch, daemon=True).start()
            seen["t2"] = kill_after(ex, cluster, "w2", ex.stats()["calls"] + 20, killed_w2)

        got = run_nuts(model, ex, data, warmup=40, samples=40, between=between)
        seen["t2"].join(5)
        stats = ex.stats()
        held = ex.client.run(holdings, ex._plugin, workers=[seen["w3"]])
    assert killed_w2.is_set(), "sampling ended before w2 was killed: make it longer"
    assert stats["worker_failures"] >= 2, stats
    assert seen["share"] >= 1, seen  # the joiner took blocks before w2 died
    assert held[seen["w3"]]["shards"] >= 1, held  # the late worker took over the data
    assert stats["transport"] == ("direct" if reach == "all" else "scheduler"), stats
    assert set(stats["routes"].values()) == {stats["transport"]}, stats
    assert ref.keys() == got.keys()
    for k in ref:
        assert np.array_equal(ref[k], got[k]), f"draws of {k} differ from SerialExecutor's"


def test_unreachable_scheduler_fails_fast_naming_it(netcluster):
    """No host at the address (nothing answers on the wire), and the scheduler's host
    with its cable cut: both fail within the timeout, naming the address; the cluster
    works again once the cable is back."""
    cluster = netcluster({"threads": 1})
    nobody = "tcp://10.77.0.250:8786"
    for address in (nobody, cluster.address):
        t0 = time.monotonic()
        if address == cluster.address:
            from benchmarks.netcluster import net

            net.set_link_up("s", False)
        try:
            with pytest.raises(ConnectionError, match=address.replace(".", r"\.")):
                pb.DaskExecutor(address=address, timeout=3)
        finally:
            net_up = address == cluster.address
            if net_up:
                net.set_link_up("s", True)
        assert time.monotonic() - t0 < 20, f"{address}: took {time.monotonic() - t0:.1f} s"
    with pb.DaskExecutor(address=cluster.address, dispatch="host", timeout=30) as ex:
        x = jnp.arange(3000.0)
        v = pb.reduce_sum(lambda r, m: -(r - m) ** 2, x, 1.0, executor=ex, block_rows=500)
        assert float(v) == float(pb.reduce_sum(lambda r, m: -(r - m) ** 2, x, 1.0,
                                               block_rows=500))


def test_direct_transport_where_only_the_scheduler_is_reached_says_so(netcluster, x64):
    """``transport="direct"`` asked for on a cluster whose workers this client cannot reach:
    the evaluation fails within seconds with an error that says the scheduler lists the
    worker, that it did not answer this client, and to use the scheduler transport (not
    "no workers left")."""
    cluster = netcluster({"threads": 1}, reach="scheduler")
    worker = cluster.workers()[0].address
    x = jnp.arange(3000.0)
    with pb.DaskExecutor(address=cluster.address, dispatch="host", transport="direct",
                         timeout=3) as ex:
        t0 = time.monotonic()
        with pytest.raises(Exception) as info:
            pb.reduce_sum(lambda r, m: -(r - m) ** 2, x, 1.0, executor=ex, block_rows=500)
        took = time.monotonic() - t0
    message = str(info.value)
    assert took < 30, f"took {took:.1f} s"
    assert "lists 1 worker(s), but none of them answered this client" in message, message
    assert worker in message and "transport='scheduler'" in message, message
    assert "no workers left" not in message, message


def _wait_probed(ex, address: str, seconds: float = 90.0) -> None:
    deadline = time.monotonic() + seconds
    while address not in ex._probe.workers and time.monotonic() < deadline:
        time.sleep(0.1)
    assert address in ex._probe.workers, f"{address} never reported its probe"


def _capped_isa() -> str:
    """An instruction set below this machine's best that XLA can be capped at: AVX2 on an
    AVX-512 machine, AVX on an AVX2 one (either drops the fused multiply-add or wider
    vectors, so the bits change)."""
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    return "AVX2" if "avx512f" in flags else "AVX"


def test_worker_on_another_cpu_is_named(netcluster):
    """XLA's target capped below this machine's instruction set on one host makes it
    another CPU as far as the bits go: named in a warning when the executor is made, and
    a host that joins later with another target is found by its probe at join; a like
    one is not."""
    isa = _capped_isa()
    cluster = netcluster({"threads": 1}, {"threads": 1, "xla_flags": f"--xla_cpu_max_isa={isa}"})
    other = cluster.workers()[1].address
    with pytest.warns(RuntimeWarning, match=rf"1 worker\(s\) compute other bits.*"
                                            rf"{other.replace('.', r'[.]')}.*max_isa={isa}"):
        ex = pb.DaskExecutor(address=cluster.address, timeout=30)
    with ex, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert set(ex._probe.differ) == {other}
        late = cluster.add_worker(threads=1, xla_flags="--xla_cpu_max_isa=SSE4_2")
        like = cluster.add_worker(threads=1)
        _wait_probed(ex, late.address)
        _wait_probed(ex, like.address)
        assert set(ex._probe.differ) == {other, late.address}
    # The joiner's warning comes from the client's event thread, when its probe arrives.
    texts = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any(late.address in t and "SSE4_2" in t for t in texts), texts
    assert not any(like.address in t for t in texts), texts


def test_scheduler_cut_off_for_seconds_during_nuts(netcluster, x64):
    """The scheduler's host unreachable (its cable out) while NUTS runs: the executor
    messages the workers directly and asks the scheduler only after a failure, so the run
    goes on through the outage and draws SerialExecutor's draws."""
    from benchmarks.netcluster import net

    data = make_data(6000)
    ref = run_nuts(model, pb.SerialExecutor(), data, warmup=30, samples=30)
    cluster = netcluster({"threads": 1}, {"threads": 2, "rtt_ms": 1.0})
    with pb.DaskExecutor(address=cluster.address, dispatch="host", timeout=30) as ex:
        seen = {}

        def cut_when_running():
            deadline = time.monotonic() + 240
            while ex.stats()["calls"] < 20 and time.monotonic() < deadline:
                time.sleep(0.005)
            seen["before"] = ex.stats()["calls"]
            # The cable out until 100 more evaluations went through (at most 5 s), then back.
            net.set_link_up("s", False)
            try:
                t_end = time.monotonic() + 5
                while ex.stats()["calls"] < seen["before"] + 100 and time.monotonic() < t_end:
                    time.sleep(0.005)
                seen["seconds"] = 5 - (t_end - time.monotonic())
            finally:
                net.set_link_up("s", True)
            seen["after"] = ex.stats()["calls"]

        t = threading.Thread(target=cut_when_running, daemon=True)
        t.start()
        got = run_nuts(model, ex, data, warmup=30, samples=30)
        t.join(10)
        end = ex.stats()["calls"]
    assert "after" in seen, "the cut never happened"
    assert seen["after"] > seen["before"], f"no evaluation during the outage: {seen}"
    assert end > seen["after"], f"the run ended before the cable was back: {seen}, {end}"
    for k in ref:
        assert np.array_equal(ref[k], got[k]), f"draws of {k} differ from SerialExecutor's"


@pytest.mark.parametrize("reach", ["all", "scheduler"])
def test_scheduler_host_lost_fails_fast_and_the_checkpoint_finishes_the_run(netcluster, tmp_path,
                                                                           reach, x64):
    """The scheduler's host dies while ``pb.sample`` checkpoints on the cluster: the run fails
    within seconds with an error naming the scheduler, the checkpoint is kept, and calling
    ``pb.sample`` again (here on ``SerialExecutor``) finishes with the uninterrupted draws.
    Also where every message goes through that scheduler."""
    data = make_data(6000)
    run = {"num_warmup": 30, "num_samples": 30, "num_chains": 1, "seed": 5,
           "progress_bar": False}
    ref = pb.sample(model, data, executor=pb.SerialExecutor(), **run)
    path = tmp_path / "run.nc"
    cluster = netcluster({"threads": 2, "rtt_ms": 1.0}, reach=reach)
    address = cluster.address
    killed = []

    def kill_after_a_checkpoint():
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline:
            if path.exists() and ex.stats()["calls"] > 150:
                cluster.kill("s")
                killed.append(time.monotonic())
                return
            time.sleep(0.01)

    with pb.DaskExecutor(address=address, dispatch="host", timeout=5) as ex:
        t = threading.Thread(target=kill_after_a_checkpoint, daemon=True)
        t.start()
        # A ConnectionError raised in JAX's host callback: it reaches here wrapped in
        # JAX's runtime error, with its message.
        with pytest.raises(Exception) as info:
            pb.sample(model, data, executor=ex, checkpoint=path, checkpoint_every=5, **run)
        failed = time.monotonic()
        t.join(5)
    assert killed, "the scheduler's host was never killed"
    assert failed - killed[0] < 30, f"failed {failed - killed[0]:.1f} s after the host died"
    assert f"lost the scheduler at {address}" in str(info.value), str(info.value)
    assert path.exists()
    done = pb.sample(model, data, executor=pb.SerialExecutor(), checkpoint=path,
                     checkpoint_every=5, **run)
    for k in ("alpha", "beta", "sigma", "gamma", "delta"):
        assert np.array_equal(done.posterior[k].values, ref.posterior[k].values), k
