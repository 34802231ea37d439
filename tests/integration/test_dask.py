"""DaskExecutor on real clusters: LocalClusters of worker processes, a cluster
started with the ``dask scheduler`` / ``dask worker`` commands, TLS, worker loss, workers
that join and leave, both transports (messages straight to the workers, and relayed by
the scheduler).

Every result is compared bitwise with :class:`SerialExecutor`'s (and values and
gradients with ``jax.value_and_grad`` of the unsplit sum).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import parallel_backend as pb
from helpers import regression_data, regression_loglik, regression_model, run_nuts

distributed = pytest.importorskip("distributed")
from distributed import Client, LocalCluster

pytestmark = pytest.mark.dask

# Workers cannot import this test module by name: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(helpers)  # the model's loglik: `dask worker` processes cannot import it

#: 20 blocks in 2 tiles (9 and 11 blocks, tiles being at least 8,192 rows): one shard
#: of the data per worker of the 2-worker clusters.
N = 20_000
BLOCK_ROWS = 1000


def _cluster(**kw):
    kw = {"n_workers": 2, "threads_per_worker": 1, "processes": True, "host": "127.0.0.1",
          "dashboard_address": None} | kw
    return LocalCluster(**kw)


@pytest.fixture(scope="module")
def client():
    with _cluster() as cluster, Client(cluster) as c:
        yield c


@pytest.fixture
def dask_host(client):
    with pb.DaskExecutor(client=client, dispatch="host") as ex:
        yield ex


# -- a model ---------------------------------------------------------------------------


def make_data(n=N, seed=0):
    return regression_data(n, seed, dtype=None)


loglik = regression_loglik


def model(data, executor=None):
    regression_model(data, executor, block_rows=BLOCK_ROWS)


def assert_same_draws(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), f"draws of {k} differ"


# -- values and gradients ----------------------------------------------------------------


def test_value_and_grad_bitwise_equal_serial(dask_host, make_problem, precision, assert_close,
                                             assert_identical):
    prob = make_problem("random_effects", n=N)
    kw = {"block_rows": BLOCK_ROWS}
    vg = jax.jit(jax.value_and_grad(prob.split(dask_host, **kw), argnums=(0, 1)))
    got = vg(*prob.args)
    ref = jax.jit(jax.value_and_grad(prob.split(pb.SerialExecutor(), **kw), argnums=(0, 1)))(*prob.args)
    assert_identical(got, ref)
    if precision == np.float64:
        exact = jax.value_and_grad(prob.unsplit(), argnums=(0, 1))(*prob.args)
        assert_close(got, exact, rtol=1e-10)
    assert got[0].dtype == precision
    assert dask_host.stats()["host_calls"] == 1


def test_vmap_over_parameter_sets(dask_host, make_problem, x64, assert_identical):
    prob = make_problem("logistic", n=N)
    kw = {"block_rows": BLOCK_ROWS}
    batch = prob.batch(4)
    got = jax.jit(jax.vmap(jax.value_and_grad(prob.split(dask_host, **kw), argnums=1)))(*batch)
    ref = jax.jit(jax.vmap(jax.value_and_grad(prob.split(pb.SerialExecutor(), **kw),
                                              argnums=1)))(*batch)
    assert_identical(got, ref)
    assert dask_host.stats()["host_calls"] == 1  # one message round for all four


def test_bytes_per_call_are_parameters_not_data(dask_host, make_problem, x64):
    prob = make_problem("logistic", n=20_000)
    f = jax.jit(jax.value_and_grad(prob.split(dask_host, block_rows=1000), argnums=1))
    jax.block_until_ready(f(*prob.args))
    s0 = dask_host.stats()
    data_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(prob.data))
    assert s0["data_bytes_sent"] >= data_bytes  # X and y went out, once
    for _ in range(5):
        jax.block_until_ready(f(*prob.args))
    s1 = dask_host.stats()
    per_call = (s1["bytes_sent"] - s0["bytes_sent"]) / 5
    param_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(prob.params))
    assert per_call <= 10 * param_bytes * s1["workers"] + 4096, per_call
    assert s1["data_bytes_sent"] == s0["data_bytes_sent"]
    # The same data in new arrays (a re-built model) is the same call site, found by its
    # content: nothing is prepared or sent again.
    copy = prob._replace(data=jax.tree.map(lambda x: jnp.array(x, copy=True), prob.data))
    g = jax.jit(jax.value_and_grad(copy.split(dask_host, block_rows=1000), argnums=1))
    jax.block_until_ready(g(*prob.args))
    s2 = dask_host.stats()
    assert len(s2["sites"]) == 1
    assert s2["data_bytes_sent"] == s0["data_bytes_sent"]


def test_timeline_names_the_dask_workers_that_ran_each_chunk(client, dask_host,
                                                            make_problem, x64):
    """``stats(timeline=True)``: each evaluation's chunks cover every block once, each
    named by the address of the dask worker that ran it, within the evaluation's span."""
    prob = make_problem("logistic", n=20_000)
    f = jax.jit(jax.value_and_grad(prob.split(dask_host, block_rows=1000), argnums=1))
    for _ in range(3):
        jax.block_until_ready(f(*prob.args))
    timeline = dask_host.stats(timeline=True)["timeline"]
    assert len(timeline) == 3
    for entry in timeline:
        covered = sorted(b for c in entry["chunks"]
                         for b in range(c["first_block"], c["first_block"] + c["blocks"]))
        assert covered == list(range(20))
        assert {c["worker"] for c in entry["chunks"]} <= set(client.nthreads())
        # clocks of processes on one machine: each chunk within the evaluation
        assert all(-0.05 <= c["start"] <= c["end"] <= entry["seconds"] + 0.05
                   for c in entry["chunks"])


def test_transports_give_the_same_bits_and_bytes(client, make_problem, x64, assert_identical):
    """The same evaluations straight to the workers and relayed by the scheduler: the same
    bits, the same bytes per call, the data sent once each; ``"auto"`` finds that this
    client reaches the workers and goes direct; ``stats()`` says which route is in use and
    what a message costs on it."""
    prob = make_problem("logistic", n=N)
    ref = jax.jit(jax.value_and_grad(prob.split(pb.SerialExecutor(), block_rows=BLOCK_ROWS),
                                     argnums=1))(*prob.args)
    seen = {}
    for transport in ("scheduler", "direct", "auto"):
        with pb.DaskExecutor(client=client, dispatch="host", transport=transport) as ex:
            assert ex.stats()["transport"] == transport  # nothing chosen before a message
            f = jax.jit(jax.value_and_grad(prob.split(ex, block_rows=BLOCK_ROWS), argnums=1))
            assert_identical(f(*prob.args), ref)
            s0 = ex.stats()
            for _ in range(4):
                assert_identical(f(*prob.args), ref)
            s1 = ex.stats()
        route = "direct" if transport == "auto" else transport
        assert s1["transport"] == route, s1
        assert set(s1["routes"]) == set(client.nthreads()), s1
        assert set(s1["routes"].values()) == {route}, s1
        assert set(s1["message_seconds"]) == {route}, s1
        assert 0 < s1["message_seconds"][route] < 1.0, s1
        assert s1["data_bytes_sent"] == s0["data_bytes_sent"] > 0, s1
        seen[transport] = ((s1["bytes_sent"] - s0["bytes_sent"]) / 4, s0["data_bytes_sent"])
    assert seen["scheduler"] == seen["direct"] == seen["auto"], seen


def test_unknown_transport_names_the_known_ones(client):
    with pytest.raises(ValueError, match=r"unknown transport 'grpc'; known: \['auto', "
                                         r"'direct', 'scheduler'\]"):
        pb.DaskExecutor(client=client, transport="grpc")


@pytest.mark.timeout(300)
def test_workers_that_join_and_leave_change_no_bit_and_are_logged(caplog, x64,
                                                                  assert_identical):
    """A cluster of one worker process grows to two while the executor runs (the newcomer
    takes a share of the data at the next evaluation) and shrinks back (the worker that
    leaves hands its share to the other); every evaluation is ``SerialExecutor``'s, and the
    ``parallel_backend.dask`` logger says what happened: the route, the data sent, the
    joiner, the worker that left and where its blocks went."""
    data = make_data()

    def f(ex):
        return jax.jit(jax.value_and_grad(lambda m: pb.reduce_sum(
            loglik, data, m, 1.0, 1.0, executor=ex, block_rows=BLOCK_ROWS)))

    ref = f(pb.SerialExecutor())(0.3)
    with (caplog.at_level(logging.INFO, logger="parallel_backend.dask"),
          _cluster(n_workers=1) as cluster, Client(cluster) as c,
          pb.DaskExecutor(client=c, dispatch="host", transport="scheduler") as ex):
        g = f(ex)
        assert_identical(g(0.3), ref)
        (first,) = c.nthreads()  # asked now (scheduler_info() is refreshed in the background)
        assert ex.stats()["blocks_per_worker"] == {first: 20}
        cluster.scale(2)
        c.wait_for_workers(2, timeout=60)
        (second,) = set(c.nthreads()) - {first}
        deadline = time.monotonic() + 60  # its probe's event tells the executor it joined
        while second not in ex._live.nthreads and time.monotonic() < deadline:
            time.sleep(0.05)
        assert_identical(g(0.3), ref)
        held = ex.stats()["blocks_per_worker"]
        assert held.get(second, 0) > 0 and held.get(first, 0) > 0, held
        cluster.scale(1)
        deadline = time.monotonic() + 60
        while len(c.nthreads()) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        (left,) = {first, second} - set(c.nthreads())
        t0 = time.monotonic()
        assert_identical(g(0.3), ref)
        assert time.monotonic() - t0 < 10  # no wait on the worker that left
        (stays,) = {first, second} - {left}
        assert ex.stats()["blocks_per_worker"].get(stays) == 20, ex.stats()
        s = ex.stats()
        # Not a line per message in the workers' logs (a job queue's output files).
        lines = [m for w in c.get_worker_logs().values() for _, m in w]
        assert any("Starting Worker plugin" in m or "Worker plugin" in m for m in lines) or lines
        assert not [m for m in lines if "out-of-band function 'evaluate'" in m
                    or "out-of-band function 'relay'" in m], lines
    assert s["transport"] == "scheduler", s
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "parallel_backend.dask")
    assert f"worker {first}: through the scheduler" in text, text
    assert "sent its spec and 1 shard(s) of data (20 blocks" in text, text
    assert f"worker(s) {second} joined" in text, text
    assert f"worker {left} left the cluster" in text, text
    assert f"now evaluated by {stays}" in text, text


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["direct", pytest.param("scheduler", marks=pytest.mark.slow)])
def test_a_worker_the_cluster_retires_mid_run_leaves_cleanly(caplog, x64, assert_identical,
                                                             transport):
    """``client.retire_workers`` (what ``adapt`` and a job queue's scale-down call) while
    gradients are evaluated: every evaluation is ``SerialExecutor``'s, no failure is
    counted, nothing is logged as lost, and nothing is sent to the worker once the
    scheduler has removed it (its chunks go to the worker left)."""
    data = make_data()

    def f(ex):
        return jax.jit(jax.value_and_grad(lambda m: pb.reduce_sum(
            loglik, data, m, 1.0, 1.0, executor=ex, block_rows=BLOCK_ROWS)))

    points = np.linspace(0.1, 0.9, 9)
    ref = [f(pb.SerialExecutor())(m) for m in points]
    sent = []
    with (caplog.at_level(logging.INFO, logger="parallel_backend.dask"),
          _cluster(n_workers=2) as cluster, Client(cluster) as c,
          pb.DaskExecutor(client=c, dispatch="host", transport=transport) as ex):
        routes_send = ex._routes.send

        async def send(addr, function, args):  # when each message left, and for whom
            sent.append((addr, time.time()))
            return await routes_send(addr, function, args)

        ex._routes.send = send
        learned = []  # when the executor heard that the cluster retired a worker
        executor_left = ex._left

        def left(addr):
            learned.append((addr, time.time()))
            return executor_left(addr)

        ex._left = left
        g = f(ex)
        assert_identical(g(points[0]), ref[0])
        first, second = sorted(c.nthreads())
        retiring = threading.Thread(target=c.retire_workers, args=([second],), daemon=True)
        for i, m in enumerate(points[1:], start=1):
            if i == 2:
                retiring.start()
            for _ in range(8):  # evaluations while the worker is retired
                assert_identical(g(m), ref[i])
        retiring.join(60)
        removed = [t for t, msg in c.get_events(second)
                   if msg.get("action") == "remove-worker"]
        assert_identical(g(points[-1]), ref[-1])
        s = ex.stats()
    assert removed, "the scheduler never removed the worker"
    assert s["worker_failures"] == 0, s
    assert s["blocks_per_worker"] == {first: 20}, s
    # The scheduler's word reaches the client a moment after the removal: a message sent
    # in between is answered "leaving" (no failure, no blocks, checked above); once the
    # executor knows, nothing more goes there.
    heard = [t for a, t in learned if a == second]
    assert heard, "the executor never heard that the worker left"
    late = [t for a, t in sent if a == second and t > heard[0]]
    assert not late, f"{len(late)} message(s) sent to {second} after the executor knew"
    assert len([t for a, t in sent if a == second and t > removed[0]]) <= 1, sent
    records = [r for r in caplog.records if r.name == "parallel_backend.dask"]
    assert not [r.getMessage() for r in records if r.levelno >= logging.WARNING], \
        [r.getMessage() for r in records]
    assert any(f"worker {second} left the cluster" in r.getMessage() for r in records)


def test_compiled_once_per_chunk_shape_on_workers(client, x64):
    data = make_data()
    with pb.DaskExecutor(client=client, dispatch="host") as ex:
        f = jax.jit(jax.grad(lambda m: pb.reduce_sum(loglik, data, m, 1.0, 1.0, executor=ex,
                                                     grainsize=BLOCK_ROWS, block_rows=BLOCK_ROWS)))
        for m in np.linspace(0.0, 1.0, 6):
            jax.block_until_ready(f(m))
        name = ex._plugin

        def traces(dask_worker=None):
            state = dask_worker.plugins[name]
            return [dict(s.traces) for s in state.sites.values()]

        per_worker = client.run(traces)
    counts = [n for sites in per_worker.values() for t in sites for n in t.values()]
    assert counts and all(n == 1 for n in counts), per_worker


CLIENT_PID = os.getpid()


def test_error_in_fn_names_type_rows_and_executor(dask_host, x64):
    x = jnp.arange(1000.0)

    def fails_on_worker(rows, m):
        if os.getpid() != CLIENT_PID:  # traced fine here; raises where the worker compiles
            raise KeyError("no such column")
        return rows * m

    f = jax.jit(lambda m: pb.reduce_sum(fails_on_worker, x, m, executor=dask_host,
                                        block_rows=250))
    with pytest.raises(Exception, match=r"KeyError.*no such column.*rows \[\d+, \d+\).*'dask'"):
        jax.block_until_ready(f(1.0))


def test_unpicklable_fn_is_named(dask_host, x64):
    lock = threading.Lock()

    def holds_a_lock(rows, m):
        with lock:
            pass
        return rows * m

    f = jax.jit(lambda m: pb.reduce_sum(holds_a_lock, jnp.arange(100.0), m, executor=dask_host))
    with pytest.raises(Exception, match="holds_a_lock.*picklable with cloudpickle"):
        jax.block_until_ready(f(1.0))


def test_nuts_draws_identical_to_serial(dask_host, x64):
    data = make_data()
    got = run_nuts(model, dask_host, data, warmup=25, samples=25)
    ref = run_nuts(model, pb.SerialExecutor(), data, warmup=25, samples=25)
    assert_same_draws(got, ref)
    s = dask_host.stats()
    assert s["calls"] > 40 and s["host_calls"] == s["calls"]


def test_map_and_registry_name(client):
    ex = pb.make_executor("dask", client=client)
    with ex:
        assert ex.map(lambda i: i * i, range(5)) == [0, 1, 4, 9, 16]
        text = repr(ex)
        assert "DaskExecutor(" in text and client.scheduler.address in text and "workers=2" in text
        s = ex.stats()
        assert s["scheduler"] == client.scheduler.address and s["workers"] == 2
    assert "closed" in repr(ex)
    assert client.status == "running"  # the user's client stays open


def test_dask_internals(client):
    """The private parts of distributed the executor relies on (``docs/layout.rst``): the
    client's connection pool, ``send_recv`` with ``op="run"``, and ``Worker.plugins``;
    a failure names the release that changed them."""

    from distributed import WorkerPlugin

    from parallel_backend.plugins.dask import internals

    where = f"distributed {distributed.__version__}"

    class Marker(WorkerPlugin):
        name = "pb-test-marker"

    client.register_plugin(Marker(), name=Marker.name)
    found = client.run(lambda dask_worker: type(internals.worker_plugin(
        dask_worker, "pb-test-marker")).__name__)
    assert set(found.values()) == {"Marker"}, (found, where)
    assert set(client.run(lambda dask_worker: internals.worker_plugin(dask_worker, "absent")
                          is None).values()) == {True}, where

    addr = min(client.nthreads())

    async def ask():
        pool = internals.connection_pool(client)
        comm = await pool.connect(addr, timeout=10)
        try:
            return await internals.request(comm, op="run", function=cloudpickle.dumps(
                lambda: 6 * 7), args=cloudpickle.dumps(()), wait=True)
        finally:
            pool.reuse(addr, comm)

    reply = client.sync(ask)
    assert isinstance(reply, dict) and reply.get("status") == "OK", (reply, where)
    assert reply["result"] == 42, (reply, where)


# -- cluster life cycle ------------------------------------------------------------------


def test_own_local_cluster_is_closed(x64):
    import multiprocessing

    before = {p.pid for p in multiprocessing.active_children()}
    ex = pb.DaskExecutor(n_workers=1, dispatch="host")
    try:
        v = pb.reduce_sum(loglik, make_data(500), 0.1, 1.0, 1.0, executor=ex)
        exact = loglik(make_data(500), 0.1, 1.0, 1.0).sum()
        np.testing.assert_allclose(v, exact, rtol=1e-10)
        assert ex.workers == 1
        assert {p.pid for p in multiprocessing.active_children()} - before  # it did start some
    finally:
        ex.close()
    deadline = time.time() + 10
    while time.time() < deadline and {p.pid for p in multiprocessing.active_children()} - before:
        time.sleep(0.1)
    assert not ({p.pid for p in multiprocessing.active_children()} - before)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_address_fails_fast_naming_it():
    address = f"tcp://127.0.0.1:{_free_port()}"
    t0 = time.time()
    with pytest.raises(ConnectionError, match=address.replace(".", r"\.")):
        pb.DaskExecutor(address=address, timeout=2)
    assert time.time() - t0 < 15


def test_client_and_address_together_is_an_error(client):
    with pytest.raises(ValueError, match="client= or address="):
        pb.DaskExecutor(client=client, address="tcp://127.0.0.1:1")


@pytest.fixture
def cli_cluster(tmp_path):
    """A scheduler and two workers started with the dask command line, on 127.0.0.1."""
    with helpers.cli_cluster(str(tmp_path)) as cluster:
        yield cluster


@pytest.mark.slow
def test_command_line_cluster_samples(cli_cluster, x64):
    address, _ = cli_cluster
    data = make_data()
    with pb.DaskExecutor(address=address, dispatch="host", timeout=30) as ex:
        assert ex.scheduler_address == address and ex.workers == 2
        got = run_nuts(model, ex, data, warmup=15, samples=15)
        assert ex.stats()["host_calls"] > 20
    assert_same_draws(got, run_nuts(model, pb.SerialExecutor(), data, warmup=15, samples=15))


def test_no_workers_left_is_a_clear_error_not_a_hang(cli_cluster, x64):
    address, procs = cli_cluster
    data = make_data(500)
    with pb.DaskExecutor(address=address, dispatch="host", timeout=3) as ex:
        f = jax.jit(lambda m: pb.reduce_sum(loglik, data, m, 1.0, 1.0, executor=ex, block_rows=125))
        jax.block_until_ready(f(0.0))
        for p in procs[1:]:  # the workers (no nanny: they stay dead)
            p.send_signal(signal.SIGKILL)
            p.wait()
        t0 = time.time()
        with pytest.raises(Exception, match="no workers left") as info:
            jax.block_until_ready(f(0.5))
        assert time.time() - t0 < 30
    message = str(info.value)
    assert f"cluster at {address}" in message and f"`dask worker {address}`" in message, message
    assert "continues from its last checkpoint" in message


def test_new_executor_on_a_scheduler_whose_workers_died_says_so(cli_cluster, x64):
    """Every worker SIGKILLed (no nanny), the scheduler still up: connecting again says
    the scheduler has no workers, and what to do, within the timeout (not a raw
    ``CommClosedError`` from the plugin registration)."""
    address, procs = cli_cluster
    for p in procs[1:]:
        p.send_signal(signal.SIGKILL)
        p.wait()
    t0 = time.time()
    with pytest.raises((ConnectionError, TimeoutError)) as info:
        pb.DaskExecutor(address=address, timeout=3)
    message = str(info.value)
    assert address in message and "no workers" in message and "dask worker" in message, message
    assert "Stream is closed" not in message
    assert time.time() - t0 < 30


# A worker killed mid-run is in the default run as test_a_worker_the_cluster_retires_mid_run
# and test_no_workers_left_is_a_clear_error_not_a_hang; a whole NUTS run (30 s) is slow.
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["direct", "scheduler"])
def test_worker_killed_during_nuts_draws_unchanged(transport, x64):
    data = make_data()
    ref = run_nuts(model, pb.SerialExecutor(), data, warmup=40, samples=40)
    with _cluster() as cluster, Client(cluster) as c:
        pids = c.run(os.getpid)
        with pb.DaskExecutor(client=c, dispatch="host", transport=transport) as ex:
            killed = threading.Event()

            def kill_when_running():
                deadline = time.time() + 120
                while ex.stats()["calls"] < 30 and time.time() < deadline:
                    time.sleep(0.005)
                # A worker that holds blocks now: the executor may have moved every block
                # off a worker it measured slower (rebalance), and killing that one would
                # test nothing.
                held = {a: n for a, n in ex.stats()["blocks_per_worker"].items() if n}
                os.kill(pids[min(held)], signal.SIGKILL)
                killed.set()

            t = threading.Thread(target=kill_when_running, daemon=True)
            t.start()
            got = run_nuts(model, ex, data, warmup=40, samples=40)
            t.join(5)
            s = ex.stats()
    assert killed.is_set()
    assert s["worker_failures"] >= 1, s
    assert s["transport"] == transport, s
    assert_same_draws(got, ref)


def test_tls_cluster(x64):
    from distributed.security import Security

    sec = Security.temporary()
    with _cluster(n_workers=1, security=sec, protocol="tls") as cluster, \
            Client(cluster, security=sec) as c:
        assert c.scheduler.address.startswith("tls://")
        with pb.DaskExecutor(client=c, dispatch="host") as ex:
            data = make_data(1000)
            g = jax.grad(lambda m: pb.reduce_sum(loglik, data, m, 1.0, 1.0, executor=ex,
                                                 block_rows=BLOCK_ROWS))(0.3)
            ref = jax.grad(lambda m: pb.reduce_sum(loglik, data, m, 1.0, 1.0,
                                                   block_rows=BLOCK_ROWS))(0.3)
            assert np.array_equal(g, ref)
            assert ex.stats()["host_calls"] == 1
