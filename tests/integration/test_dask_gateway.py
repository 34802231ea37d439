"""``pb.sample`` on a cluster made through a real dask-gateway server.

``dask-gateway-server`` runs with its local backend on 127.0.0.1 (clusters as processes
of this machine, ``benchmarks/transports.py::local_gateway``); the client gets its cluster
through ``dask_gateway.Gateway`` and reaches the scheduler only through the gateway's
proxy (a ``gateway://`` address, TLS with the gateway's own certificates). The draws are
``SerialExecutor``'s, also when a worker is killed mid-run and the gateway starts another,
and a scheduler that dies is named within seconds.

Needs the ``cluster`` extra; selected with ``pytest -n 0 -m gateway
tests/integration/test_dask_gateway.py`` (the default run deselects the marker).
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
from pathlib import Path

import cloudpickle
import numpy as np
import pytest

import helpers
import parallel_backend as pb
from helpers import regression_data, regression_model

pytestmark = [
    pytest.mark.gateway, pytest.mark.dask, pytest.mark.timeout(600),
    # dask_gateway.Gateway.__del__ closes a gateway closed already, on a stopped loop
    pytest.mark.filterwarnings("ignore:Exception ignored in. <function Gateway.__del__"
                               ":pytest.PytestUnraisableExceptionWarning"),
]

cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(helpers)  # the workers cannot import the tests' helpers

#: 20 blocks in 2 tiles: a share of the data for each of the two workers.
N, BLOCK_ROWS = 20_000, 1000
RUN = {"num_warmup": 40, "num_samples": 40, "num_chains": 1, "seed": 3, "progress_bar": False}


def model(data):
    regression_model(data, block_rows=BLOCK_ROWS)


def _gateway_modules():
    try:
        import dask_gateway
        import dask_gateway_server  # noqa: F401
    except ImportError as e:
        pytest.fail(f'the gateway tests need dask-gateway and dask-gateway-server: pip install '
                    f'-e ".[test,cluster]" ({e})')
    return dask_gateway


@pytest.fixture(scope="module")
def gateway():
    """A ``dask_gateway.Gateway`` of a gateway server on 127.0.0.1."""
    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:  # benchmarks/ is a folder of the checkout
        sys.path.insert(0, root)
    from benchmarks.transports import local_gateway

    dask_gateway = _gateway_modules()
    with local_gateway() as address:
        gw = dask_gateway.Gateway(address, auth=dask_gateway.BasicAuth("pb", "any"))
        try:
            yield gw
        finally:
            gw.close()
            del gw
            gc.collect()


@pytest.fixture(autouse=True)
def _collect_closed_gateways():
    """Every ``Gateway`` closed by a test (a cluster holds one) collected at its end, where
    the mark above filters its ``__del__``'s complaint."""
    yield
    gc.collect()


@pytest.fixture
def gateway_client(gateway):
    """A client of a new two-worker cluster of ``gateway``; the cluster is shut down after."""
    cluster = gateway.new_cluster()
    try:
        cluster.scale(2)
        with cluster.get_client(set_as_default=False) as client:
            client.wait_for_workers(2, timeout=120)
            yield client
    finally:
        cluster.shutdown()


@pytest.fixture
def reference(x64):
    """The data (float64) and ``SerialExecutor``'s run on it."""
    data = regression_data(N, dtype=None)
    return data, pb.sample(model, data, executor=pb.SerialExecutor(), **RUN)


def _same_draws(got, ref) -> None:
    for k in ("alpha", "beta", "sigma"):
        assert np.array_equal(got.posterior[k].values, ref.posterior[k].values), k


def test_sample_through_the_gateway_proxy(gateway_client, reference):
    """Every message relayed by the scheduler behind the gateway's proxy (TLS); a worker
    killed mid-run hands its blocks to the other, the gateway starts a new one, and the
    draws are ``SerialExecutor``'s."""
    data, ref = reference
    client = gateway_client
    assert client.scheduler.address.startswith("gateway://"), client.scheduler.address
    assert all(a.startswith("tls://") for a in client.scheduler_info()["workers"])
    pids = client.run(os.getpid)
    with pb.DaskExecutor(client=client, dispatch="host", transport="scheduler") as ex:
        killed = []

        def kill_when_running():
            deadline = time.monotonic() + 180
            while ex.stats()["calls"] < 30 and time.monotonic() < deadline:
                time.sleep(0.01)
            held = {a: n for a, n in ex.stats()["blocks_per_worker"].items() if n}
            if held and time.monotonic() < deadline:
                os.kill(pids[min(held)], signal.SIGKILL)
                killed.append(min(held))

        t = threading.Thread(target=kill_when_running, daemon=True)
        t.start()
        got = pb.sample(model, data, executor=ex, **RUN)
        t.join(5)
        s = ex.stats()
    assert killed, "the run ended before a worker was killed"
    assert s["worker_failures"] >= 1, s
    assert s["transport"] == "scheduler", s
    assert set(s["routes"].values()) == {"scheduler"}, s
    _same_draws(got, ref)


def test_auto_on_the_gateway(gateway_client, reference):
    """``transport="auto"`` on the same kind of cluster: the local backend's workers listen
    on this machine, so this client reaches them directly with the gateway's TLS
    credentials, and the probe finds that."""
    data, ref = reference
    with pb.DaskExecutor(client=gateway_client, dispatch="host") as ex:
        got = pb.sample(model, data, executor=ex, **RUN)
        s = ex.stats()
    assert s["transport"] == "direct", s
    _same_draws(got, ref)


def test_dead_scheduler_is_named_within_seconds(gateway, reference):
    """The scheduler of a gateway cluster killed while ``pb.sample`` runs on it: the run
    fails within seconds, naming the scheduler's address."""
    data, _ = reference
    cluster = gateway.new_cluster()
    try:
        cluster.scale(1)
        with cluster.get_client(set_as_default=False) as client:
            client.wait_for_workers(1, timeout=120)
            pid = client.run_on_scheduler(os.getpid)
            address = client.scheduler.address
            with pb.DaskExecutor(client=client, dispatch="host", transport="scheduler",
                                 timeout=5) as ex:
                killed = []

                def kill_when_running():
                    deadline = time.monotonic() + 180
                    while ex.stats()["calls"] < 30 and time.monotonic() < deadline:
                        time.sleep(0.01)
                    os.kill(pid, signal.SIGKILL)
                    killed.append(time.monotonic())

                t = threading.Thread(target=kill_when_running, daemon=True)
                t.start()
                with pytest.raises(Exception) as info:
                    pb.sample(model, data, executor=ex, **RUN)
                failed = time.monotonic()
                t.join(5)
    finally:
        cluster.shutdown()
    assert killed, "the scheduler was never killed"
    assert failed - killed[0] < 30, f"failed {failed - killed[0]:.1f} s after the kill"
    assert f"lost the scheduler at {address}" in str(info.value), str(info.value)
