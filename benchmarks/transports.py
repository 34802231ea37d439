"""What one evaluation costs on each path to a dask cluster's workers, against rows per worker.

    python -m benchmarks.transports --out benchmarks/results/cluster_transports.jsonl

Paths: ``direct`` (``DaskExecutor(transport="direct")``: the client messages each worker on
its own connection), ``scheduler`` (``transport="scheduler"``: every message relayed by the
scheduler, as a client that reaches only the scheduler must), and ``gateway`` (a cluster
made through a dask-gateway server with its local backend, reached through the gateway's
TLS proxy, ``transport="scheduler"``). Each path runs on two one-thread worker processes
on this machine, and plain JAX and ``SerialExecutor`` time the same problem in this process.

The problem is the demo's HMM (``parallel-backend demo``), a jitted value-and-gradient at
several sizes (sequences per worker); for each path and size: the median seconds per call
(and 10th/90th percentiles), the bytes sent per call, and ``stats()["message_seconds"]``,
what a message costs beyond the workers' compute as the executor measures it. Every line
of output is one JSON record (``--out`` appends them to a file); the last lines are the
cost model's table: per path, that cost and the sequences per worker from which the path
is faster than one process.

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
            "jax": jax.__version__, "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "load1": round(os.getloadavg()[0], 2)}


def _problem(sequences: int, block: int):
    """``make(executor) -> jitted value-and-grad`` and its arguments: the demo's HMM."""
    import jax
    import jax.numpy as jnp

    import parallel_backend as pb
    from parallel_backend.plugins.cli.demo import hmm_init, hmm_loglik, make_hmm_data

    obs, _ = make_hmm_data(sequences)
    init = hmm_init(obs)
    args = (jnp.log(jnp.asarray(init["trans"], jnp.float32)),
            jnp.asarray(init["mu0"] + np.concatenate([[0.0], np.cumsum(init["gaps"])]),
                        jnp.float32),
            jnp.asarray(init["sigma"], jnp.float32))

    def make(executor):
        def f(log_trans, mu, sigma):
            if executor is None:
                return hmm_loglik(obs, log_trans, mu, sigma).sum()
            return pb.reduce_sum(hmm_loglik, obs, log_trans, mu, sigma, executor=executor,
                                 block_rows=block)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

    return make, args


def _time(f, args, calls: int) -> list:
    import jax

    for _ in range(3):  # compile, install data, settle the layout's first evaluations
        jax.block_until_ready(f(*args))
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return times


def _spread(t) -> dict:
    return {"seconds_median": float(np.median(t)), "seconds_p10": float(np.percentile(t, 10)),
            "seconds_p90": float(np.percentile(t, 90))}


def _measure(path: str, ex, sizes, workers: int, calls: int, block: int, local: dict, emit):
    for per_worker in sizes:
        make, args = _problem(per_worker * workers, block)
        f = make(ex)
        s0 = ex.stats()
        t = _time(f, args, calls)
        s1 = ex.stats()
        n = s1["calls"] - s0["calls"]
        emit({"kind": "path", "path": path, "transport": s1["transport"],
              "sequences_per_worker": per_worker, "workers": workers,
              "blocks_per_worker": s1["blocks_per_worker"],
              "bytes_per_call": (s1["bytes_sent"] - s0["bytes_sent"]) / max(n, 1),
              "message_ms": {k: 1e3 * v for k, v in s1["message_seconds"].items()},
              **_spread(t), "plain_seconds": local[per_worker]["plain"],
              "serial_seconds": local[per_worker]["serial"]})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.transports",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--paths", default="direct,scheduler,gateway")
    ap.add_argument("--sizes", default="250,1000,4000",
                    help="HMM sequences per worker, comma separated")
    ap.add_argument("--block", type=int, default=250, help="sequences per block")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--out", default=None, help="append the records (JSON lines) here")
    a = ap.parse_args(argv)

    import parallel_backend as pb

    env = _env()
    sizes = [int(x) for x in a.sizes.split(",")]
    records = []

    def emit(rec):
        rec = {**rec, **env}
        records.append(rec)
        print(json.dumps(rec), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(rec) + "\n")

    local = {}
    for per_worker in sizes:
        make, args = _problem(per_worker * a.workers, a.block)
        local[per_worker] = {"plain": float(np.median(_time(make(None), args, a.calls))),
                             "serial": float(np.median(_time(make(pb.SerialExecutor()),
                                                             args, a.calls)))}
    paths = a.paths.split(",")
    for path in [p for p in paths if p in ("direct", "scheduler")]:
        with pb.DaskExecutor(n_workers=a.workers, dispatch="host", transport=path) as ex:
            _measure(path, ex, sizes, a.workers, a.calls, a.block, local, emit)
    if "gateway" in paths:
        from dask_gateway import BasicAuth, Gateway

        with local_gateway() as address, Gateway(address, auth=BasicAuth("pb", "x")) as gw:
            cluster = gw.new_cluster()
            try:
                cluster.scale(a.workers)
                with cluster.get_client(set_as_default=False) as client:
                    client.wait_for_workers(a.workers, timeout=120)
                    with pb.DaskExecutor(client=client, dispatch="host",
                                         transport="scheduler") as ex:
                        _measure("gateway", ex, sizes, a.workers, a.calls, a.block, local,
                                 emit)
            finally:
                cluster.shutdown()
    _model(records, emit)
    return 0


def _model(records, emit) -> None:
    """Per path: the cost of a message beyond compute (median over sizes), and the
    sequences per worker from which ``workers`` workers beat one process."""
    paths = {}
    for r in records:
        if r.get("kind") == "path":
            paths.setdefault(r["path"], []).append(r)
    for path, rows in paths.items():
        # One core's seconds per sequence, from plain JAX at the largest size.
        big = max(rows, key=lambda r: r["sequences_per_worker"])
        c_row = big["plain_seconds"] / (big["sequences_per_worker"] * big["workers"])
        # A path's fixed cost: what an evaluation takes beyond its share of the compute.
        fixed = float(np.median([r["seconds_median"] - c_row * r["sequences_per_worker"]
                                 for r in rows]))
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
