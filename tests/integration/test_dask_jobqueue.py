"""NUTS on a dask-jobqueue cluster that grows and shrinks under ``adapt()`` while it runs.

``dask_jobqueue.local.LocalCluster`` (0.9 does not export it from the package) runs each
job as a local process: the same machinery as SLURM or PBS, without the queue. With ``adapt(minimum=1, maximum=3)`` the cluster starts
with one worker; other work on the same cluster (a burst of tasks, as a colleague's
computation would be) makes adapt start two more jobs while the chain runs, and their
workers take a share of the chain's data; when the burst is done, adapt retires those jobs'
workers, which hand their share back and leave cleanly (no failure counted, nothing logged
as lost). The draws are ``SerialExecutor``'s.

Needs the ``cluster`` extra; selected with ``pytest -n 0 -m jobqueue
tests/integration/test_dask_jobqueue.py`` (the default run deselects the marker).
"""

from __future__ import annotations

import logging
import sys
import threading
import time

import cloudpickle
import numpy as np
import pytest

import helpers
import parallel_backend as pb
from helpers import regression_data, regression_model, run_nuts

pytestmark = [pytest.mark.jobqueue, pytest.mark.dask, pytest.mark.slow,
              pytest.mark.timeout(900)]

cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(helpers)

#: 36 blocks in 4 tiles: a share of the data for each of three workers.
N, BLOCK_ROWS = 36_000, 1000


def model(data, executor=None):
    regression_model(data, executor, block_rows=BLOCK_ROWS)


def _job_cluster():
    try:
        from dask_jobqueue.local import LocalCluster
    except ImportError as e:
        pytest.fail(f'the job-queue test needs dask-jobqueue: pip install -e ".[test,cluster]" '
                    f"({e})")
    # Each job one worker of one thread; a job's worker inherits this environment.
    return LocalCluster(cores=1, processes=1, memory="2GiB", walltime="00:30:00",
                        scheduler_options={"host": "127.0.0.1", "dashboard_address": None},
                        worker_extra_args=["--host", "127.0.0.1"])


def test_adaptive_job_cluster_grows_and_shrinks_under_nuts(caplog, monkeypatch, x64):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    from distributed import Client

    data = regression_data(N, dtype=None)
    ref = run_nuts(model, pb.SerialExecutor(), data, warmup=60, samples=60)
    seen = {"holders": set(), "most": 0}
    with (caplog.at_level(logging.INFO, logger="parallel_backend.dask"),
          _job_cluster() as cluster, Client(cluster) as client):
        cluster.adapt(minimum=1, maximum=3)
        client.wait_for_workers(1, timeout=120)
        first = set(client.scheduler_info()["workers"])
        with pb.DaskExecutor(client=client, dispatch="host") as ex:
            stop = threading.Event()

            def watch():  # who holds blocks while the chain runs
                while not stop.is_set():
                    held = {a for a, n in ex.stats()["blocks_per_worker"].items() if n}
                    seen["holders"] |= held
                    seen["most"] = max(seen["most"], len(held))
                    time.sleep(0.02)

            def between():
                # Other work on the cluster: adapt starts jobs for it, and ends them after.
                # (time.sleep: every worker imports it; the job's workers cannot import
                # this module, and dask pickles a task's function by reference)
                seen["burst"] = client.map(time.sleep, [0.25] * 160, pure=False)
                deadline = time.monotonic() + 180
                while (len(client.scheduler_info()["workers"]) < 3
                       and time.monotonic() < deadline):
                    time.sleep(0.1)
                seen["grown"] = len(client.scheduler_info()["workers"])

            t = threading.Thread(target=watch, daemon=True)
            t.start()
            got = run_nuts(model, ex, data, warmup=60, samples=60, between=between)
            client.gather(seen["burst"])
            deadline = time.monotonic() + 120  # adapt ends the idle jobs
            while len(client.scheduler_info()["workers"]) > 1 and time.monotonic() < deadline:
                time.sleep(0.2)
            # A few evaluations more: the workers that left hand their blocks to the one left.
            run_nuts(model, ex, data, warmup=2, samples=2)
            stop.set()
            t.join(5)
            s = ex.stats()
            left = set(client.scheduler_info()["workers"])
    assert seen["grown"] == 3, seen
    joined = seen["holders"] - first
    assert joined, f"no worker that joined during the run took blocks: {seen}"
    assert seen["most"] >= 2, seen
    assert len(left) == 1 and set(s["blocks_per_worker"]) <= left, (left, s)
    assert sum(s["blocks_per_worker"].values()) == 36, s
    # adapt retires the idle jobs' workers: they leave cleanly, not as failures
    assert s["worker_failures"] == 0, s
    records = [r for r in caplog.records if r.name == "parallel_backend.dask"]
    text = "\n".join(r.getMessage() for r in records)
    assert "joined" in text and "left the cluster" in text, text
    assert not [r.getMessage() for r in records if r.levelno >= logging.WARNING], text
    assert ref.keys() == got.keys()
    for k in ref:
        assert np.array_equal(ref[k], got[k]), f"draws of {k} differ from SerialExecutor's"
