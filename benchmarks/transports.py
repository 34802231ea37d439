"""What one evaluation costs on each path to a dask cluster's workers, against rows per worker.

    python -m benchmarks.transports --out benchmarks/results/cluster_transports.jsonl

Paths: ``direct`` (``DaskExecutor(transport="direct")``: the client messages each worker on
its own connection), ``scheduler`` (``transport="scheduler"``: every message relayed by the
scheduler, as a client that reaches only the scheduler must), and ``gateway`` (a cluster
made through a dask-gateway server with its local backend, reached through the gateway's
TLS proxy, ``transport="scheduler"``). Each path runs on two one-thread worker processes
on this machine, and plain JAX and ``SerialExecutor`` time the same problem in this process.
As root, ``net-direct`` and ``net-scheduler`` run the first two on the simulated hosts of
``benchmarks/netcluster`` (every link, the scheduler's included, with a 1 ms round trip;
one cluster at a time fits on a machine, so both routes run on the same one, where a
relayed message crosses the client-scheduler and scheduler-worker links as it does where
the workers are out of the client's reach).

The problem is the demo's HMM (``parallel-backend demo``), a jitted value-and-gradient at
several sizes (sequences per worker). Every cluster is up at once and the cases are timed
in interleaved rounds (each case ``--calls`` calls per round), so that load coming and
going on the machine falls on all of them alike. For each path and size: the median
seconds per call (and 10th/90th percentiles), the bytes sent per call, and
``stats()["message_seconds"]``, what a message costs beyond the workers' compute as the
executor measures it (per route, its last 64 messages). ``trivial_call`` records time a call that does nothing, by each way a client can reach
one worker of each path's cluster: straight to it (where this process can), relayed by
the scheduler, and as a task pinned to it (``client.submit``, the futures route the
executor does not take: it goes through the scheduler's task machinery and batched
streams). Every line of output is one JSON
record (``--out`` appends them to a file); the last lines are the cost model's: per path,
what an evaluation costs beyond its share of the compute, and the sequences per worker
from which the path is faster than one process.

:func:`local_gateway` is the gateway server the ``gateway`` path (and
``tests/integration/test_dask_gateway.py``) starts: ``dask-gateway-server`` with its local
backend on 127.0.0.1, clusters as processes of this machine. Needs the ``cluster`` extra.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

#: Environment of the workers the gateway starts: XLA's own pool off, as local clusters do.
WORKER_ENV = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false", "JAX_PLATFORMS": "cpu"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(address: str, proc, log: Path, timeout: float) -> None:
    """Until the gateway answers its health check through its proxy (the proxy listens
    before it has the gateway's routes)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dask-gateway-server exited ({proc.returncode}); its log ends:\n"
                               f"{log.read_text(errors='replace')[-3000:]}")
        with (contextlib.suppress(OSError, urllib.error.URLError),
              urllib.request.urlopen(f"{address}/api/health", timeout=2) as r):
            if r.status == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"dask-gateway-server did not answer at {address} within {timeout:g} s;"
                       f" its log ends:\n{log.read_text(errors='replace')[-3000:]}")


@contextlib.contextmanager
def local_gateway(workdir=None, python: str | None = None, environment: dict | None = None,
                  worker_threads: int = 1, timeout: float = 60.0):
    """A ``dask-gateway-server`` on 127.0.0.1 with its local backend; yields its address.

    Clusters it makes run as processes of this machine (``dask scheduler`` and ``dask
    worker`` of ``python``'s environment, with ``environment`` set), their traffic on TLS
    with the gateway's own certificates, reached through its proxy. The server and every
    cluster it made are stopped when the block ends, also after a failure. Connect with
    ``dask_gateway.Gateway(address, auth=dask_gateway.BasicAuth("user", "any"))``.
    """
    python = python or sys.executable
    dask = str(Path(python).with_name("dask"))
    own = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="pb-gateway-") if own else workdir)
    http, api = _free_port(), _free_port()
    env = dict(WORKER_ENV, **(environment or {}))
    config = workdir / "dask_gateway_config.py"
    config.write_text("\n".join([
        f"c.DaskGateway.address = '127.0.0.1:{api}'",
        f"c.Proxy.address = '127.0.0.1:{http}'",
        ("c.DaskGateway.backend_class = "
         "'dask_gateway_server.backends.local.UnsafeLocalBackend'"),
        "c.DaskGateway.authenticator_class = 'dask_gateway_server.auth.SimpleAuthenticator'",
        f"c.UnsafeLocalBackend.clusters_directory = {str(workdir / 'clusters')!r}",
        f"c.LocalClusterConfig.scheduler_cmd = [{dask!r}, 'scheduler']",
        f"c.LocalClusterConfig.worker_cmd = [{dask!r}, 'worker']",
        f"c.LocalClusterConfig.worker_threads = {int(worker_threads)}",
        "c.LocalClusterConfig.worker_memory = '2 G'",
        f"c.LocalClusterConfig.environment = {env!r}",
        "",
    ]))
    log = workdir / "gateway.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([python, "-m", "dask_gateway_server", "-f", str(config)],
                                cwd=str(workdir), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        address = f"http://127.0.0.1:{http}"
        _wait_healthy(address, proc, log, timeout)
        yield address
    finally:
        # SIGINT: the server stops the clusters it started, then itself.
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(2)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait(timeout=10)
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


# -- the measurement -------------------------------------------------------------------


def _env() -> dict:
    import jax

    cpu = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "jax": jax.__version__, "date": time.strftime("%Y-%m-%d", time.gmtime())}


def _problem(sequences: int, block: int):
    """``make(executor) -> jitted value-and-grad`` and its arguments: the demo's HMM, as
    the simulated cluster's benchmarks make it."""
    from benchmarks.netcluster.bench import _problems

    return _problems(sequences, 1, hmm_block=block)[f"hmm_{sequences}"]


def _calls(f, args, n: int) -> list:
    import jax

    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return times


def _trivial_calls(ex, n: int) -> dict:
    """Median seconds of a trivial call to one worker of ``ex``'s cluster by each way a
    client can reach it: dask's run handler straight to the worker (``direct``, where this
    process reaches it), the same relayed by the scheduler (``Client.run``), and a task
    pinned to that worker (``client.submit(..., workers=[it])``, then its result); where
    the client reaches the worker, also an actor's method (``submit(..., actor=True)``:
    dask's public call straight to a worker)."""
    import cloudpickle

    from parallel_backend.plugins.dask import internals
    from parallel_backend.plugins.dask import worker as remote

    c = ex.client
    addr = min(c.scheduler_info()["workers"])
    fn, args = cloudpickle.dumps(remote.ping), cloudpickle.dumps(())
    ways = {"relayed": lambda: c.run(remote.relay, fn, args, workers=[addr]),
            # int(): a builtin every worker unpickles (dask pickles a task's function by
            # reference where it can)
            "task": lambda: c.submit(int, workers=[addr], allow_other_workers=False,
                                     pure=False).result()}
    if ex.stats()["transport"] in ("direct", "direct+scheduler"):
        ways["direct"] = lambda: c.sync(internals.run_on, c, addr, fn, args, 10)

        class Pinger:  # made here: pickled by value, so any worker can build it
            def ping(self):
                return None

        async def make():
            # An actor's handle finds its client with get_client(): the executor's client
            # is not the process's default one (it must not be: no hidden global state),
            # so it is made current here.
            with c.as_current():
                return await c.submit(Pinger, workers=[addr], allow_other_workers=False,
                                      actor=True)

        # dask's public way to message one worker without the scheduler: an actor's method
        # (awaited on the client's loop, as the direct call is)
        actor = c.sync(make)

        async def ping():
            return await actor.ping()

        ways["actor"] = lambda: c.sync(ping)
    out = {}
    for name, call in ways.items():
        call()
        t = []
        for _ in range(n):
            t0 = time.perf_counter()
            call()
            t.append(time.perf_counter() - t0)
        out[name] = float(np.median(t))
    return out


@contextlib.contextmanager
def _executors(paths, workers: int, rtt_ms: float):
    """``{path: executor}``, every cluster up at once, all taken down at the end."""
    import parallel_backend as pb

    out = {"plain": None, "serial": pb.SerialExecutor()}
    with contextlib.ExitStack() as stack:
        if {"direct", "scheduler"} & set(paths):
            ex = stack.enter_context(pb.DaskExecutor(n_workers=workers, dispatch="host",
                                                     transport="direct"))
            out["direct"] = ex
            out["scheduler"] = stack.enter_context(pb.DaskExecutor(
                client=ex.client, dispatch="host", transport="scheduler"))
        if {"net-direct", "net-scheduler"} & set(paths):
            from benchmarks.netcluster import NetCluster

            # One simulated cluster at a time on a machine: both routes on it (relayed
            # messages take the client-scheduler and scheduler-worker links either way).
            c = stack.enter_context(NetCluster([{"threads": 1, "rtt_ms": rtt_ms}] * workers,
                                               scheduler_rtt_ms=rtt_ms, lifetime=3600))
            for path, transport in (("net-direct", "direct"), ("net-scheduler", "scheduler")):
                out[path] = stack.enter_context(pb.DaskExecutor(
                    address=c.address, dispatch="host", transport=transport, timeout=30))
        if "gateway" in paths:
            from dask_gateway import BasicAuth, Gateway

            gw = Gateway(stack.enter_context(local_gateway()), auth=BasicAuth("pb", "x"))
            stack.callback(gw.close)
            cluster = gw.new_cluster()
            stack.callback(cluster.shutdown)
            cluster.scale(workers)
            client = stack.enter_context(cluster.get_client(set_as_default=False))
            client.wait_for_workers(workers, timeout=120)
            out["gateway"] = stack.enter_context(pb.DaskExecutor(
                client=client, dispatch="host", transport="scheduler"))
        yield {k: v for k, v in out.items() if k in ("plain", "serial", *paths)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.transports",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--paths", default="direct,scheduler,gateway")
    ap.add_argument("--sizes", default="250,1000,4000",
                    help="HMM sequences per worker, comma separated")
    ap.add_argument("--block", type=int, default=250, help="sequences per block")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    ap.add_argument("--calls", type=int, default=10, help="timed calls per round and case")
    ap.add_argument("--rtt-ms", type=float, default=1.0,
                    help="round trip of every simulated link (net-* paths)")
    ap.add_argument("--out", default=None, help="append the records (JSON lines) here")
    a = ap.parse_args(argv)

    env = _env()
    sizes = [int(x) for x in a.sizes.split(",")]
    paths = a.paths.split(",")
    records = []

    def emit(rec):
        rec = {**rec, **env}
        records.append(rec)
        print(json.dumps(rec), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(rec) + "\n")

    with _executors(paths, a.workers, a.rtt_ms) as executors:
        cases = {}
        for r in sizes:
            make, args = _problem(r * a.workers, a.block)
            for name, ex in executors.items():
                f = make(ex)
                _calls(f, args, 3)  # compile, install data, settle the first placement
                cases[(name, r)] = (f, args)
        # Each case once per round, in the same order: load that comes and goes on the
        # machine falls on every case alike.
        times = {k: [] for k in cases}
        before = {k: executors[k[0]].stats() for k in cases if executors[k[0]] is not None}
        load = []
        for _ in range(a.rounds):
            load.append(os.getloadavg()[0])
            for k, (f, args) in cases.items():
                times[k] += _calls(f, args, a.calls)
        trivial = {name: [] for name, ex in executors.items()
                   if ex is not None and name != "serial"}
        for _ in range(a.rounds):  # the trivial calls, interleaved alike
            for name, runs in trivial.items():
                runs.append(_trivial_calls(executors[name], 20))
        for name, runs in trivial.items():
            emit({"kind": "trivial_call", "path": name,
                  "ms": {w: 1e3 * float(np.median([r[w] for r in runs])) for w in runs[0]},
                  "ms_per_round": {w: [round(1e3 * r[w], 3) for r in runs] for w in runs[0]}})
        for (name, r), t in times.items():
            ex = executors[name]
            rec = {"kind": "path" if ex is not None and name != "serial" else "local",
                   "path": name, "sequences_per_worker": r, "workers": a.workers,
                   "seconds_median": float(np.median(t)),
                   "seconds_p10": float(np.percentile(t, 10)),
                   "seconds_p90": float(np.percentile(t, 90)),
                   "load1": [round(x, 2) for x in load]}
            if rec["kind"] == "path":
                s0, s1 = before[(name, r)], ex.stats()
                n = s1["calls"] - s0["calls"]
                rec.update({
                    "transport": s1["transport"],
                    "blocks_per_worker": s1["blocks_per_worker"],
                    # parameters only: data a re-placement moved is counted on its own
                    "bytes_per_call": (s1["bytes_sent"] - s1["data_bytes_sent"]
                                       - s0["bytes_sent"] + s0["data_bytes_sent"]) / max(n, 1),
                    "message_ms": {k: 1e3 * v for k, v in s1["message_seconds"].items()},
                    "plain_seconds": float(np.median(times[("plain", r)])),
                    "serial_seconds": float(np.median(times[("serial", r)]))})
            emit(rec)
    _model(records, emit)
    return 0


def _model(records, emit) -> None:
    """Per path: what an evaluation costs beyond its share of the compute (``fixed``, at
    the smallest size, where the workers' compute competes least with everything else on
    the machine), and the sequences per worker from which ``workers`` workers of a core
    each beat one process evaluating the same blocks (``SerialExecutor``)."""
    paths = {}
    for r in records:
        if r.get("kind") == "path":
            paths.setdefault(r["path"], []).append(r)
    for path, rows in paths.items():
        # One core's seconds per sequence on the blocks the workers evaluate, from
        # SerialExecutor at the largest size.
        big = max(rows, key=lambda r: r["sequences_per_worker"])
        c_row = big["serial_seconds"] / (big["sequences_per_worker"] * big["workers"])
        small = min(rows, key=lambda r: r["sequences_per_worker"])
        fixed = small["seconds_median"] - c_row * small["sequences_per_worker"]
        w = big["workers"]
        emit({"kind": "model", "path": path, "fixed_ms": 1e3 * fixed,
              "message_ms": float(np.median([next(iter(r["message_ms"].values()), np.nan)
                                             for r in rows])),
              "bytes_per_call": float(np.median([r["bytes_per_call"] for r in rows])),
              "c_row_us": 1e6 * c_row, "workers": w,
              # fixed + c_row r < c_row r w  <=>  r > fixed / (c_row (w - 1))
              "pays_from_sequences_per_worker": fixed / (c_row * (w - 1))})


if __name__ == "__main__":
    sys.exit(main())
