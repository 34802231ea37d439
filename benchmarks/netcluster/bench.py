"""Measurements on the simulated cluster (issue 40): what separate hosts add to a
``DaskExecutor`` evaluation, and NUTS end to end on the HMM against ``SerialExecutor``.

    python -m benchmarks.netcluster.bench overhead --out benchmarks/results/netcluster_overhead.jsonl
    python -m benchmarks.netcluster.bench hosts --out benchmarks/results/netcluster_hosts.jsonl
    python -m benchmarks.netcluster.bench unequal --out benchmarks/results/netcluster_unequal.jsonl
    python -m benchmarks.netcluster.bench nuts --out benchmarks/results/netcluster_nuts.jsonl

``overhead``: for each added round trip (0, proxy only, 1, 5 ms), one cluster of a
1-thread and a 2-thread worker host (the scheduler behind the same link); for each
bandwidth (uncapped veth, 1 Gbit/s, 100 Mbit/s, set live with ``tc``) and each problem,
seconds per jitted value-and-gradient (median of ``--calls``), bytes sent per evaluation
and data sent once; ``SerialExecutor`` and plain JAX on the same problem in this process.
Problems: the HMM (parameters only travel) and a per-row random effect (a traced data
leaf: its rows travel every evaluation and its gradient comes back).

``hosts``: the same evaluation against the number of one-thread worker hosts (1, 2, 4,
8), each behind a 1 ms round trip: what one more host costs the client per evaluation.

``unequal``: a 1-thread and a 2-thread host, the first behind a slower link: what one
slow host costs every evaluation, with the data placed by threads (``rebalance=False``)
and weighed by measured round trips and compute (the default), on the same cluster.

``nuts``: the seed's HMM (``parallel-backend demo``'s model and settings) with NUTS, on
``SerialExecutor`` and on the cluster, in the same run; the draws are compared bitwise.

Every line of output is one JSON record. The simulated hosts share this machine's cores:
these numbers measure what the network adds, not what more machines would gain.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time

import numpy as np


def _spread(t) -> dict:
    """Median and 10th/90th percentiles of the timed calls ``t`` (seconds)."""
    return {"seconds_median": float(np.median(t)), "seconds_p10": float(np.percentile(t, 10)),
            "seconds_p90": float(np.percentile(t, 90))}


def _emit(rec: dict, out) -> None:
    """Print one record (a JSON line) and append it to ``out`` when given."""
    print(json.dumps(rec), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(rec) + "\n")


def _cpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _env() -> dict:
    import jax

    return {"cpu": _cpu(), "cores": os.cpu_count(), "host": socket.gethostname(),
            "python": platform.python_version(), "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load1": os.getloadavg()[0]}


def _time(f, args, calls: int, budget: float) -> list[float]:
    import jax

    times = []
    t_end = time.perf_counter() + budget
    while len(times) < calls and (len(times) < 5 or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return times


def _warm(f, args, n: int = 3) -> None:
    import jax

    for _ in range(n):
        jax.block_until_ready(f(*args))


def ping(client, address: str, payload: int = 0, n: int = 20) -> float:
    """Median seconds of one trivial request and reply to the worker at ``address``, on
    the connection the executor uses (dask's ``run`` handler): the round trip as the
    executor sees it, proxy and scheduling on this machine included."""
    import cloudpickle

    from parallel_backend.plugins.dask import internals

    function = cloudpickle.dumps(lambda *a: 0)
    args = cloudpickle.dumps((np.zeros(payload // 4, np.float32),) if payload else ())

    async def once():
        pool = internals.connection_pool(client)
        comm = await pool.connect(address, timeout=10)
        t0 = time.perf_counter()
        await internals.request(comm, op="run", function=function, args=args, wait=True)
        dt = time.perf_counter() - t0
        pool.reuse(address, comm)
        return dt

    client.sync(once)
    return float(np.median([client.sync(once) for _ in range(n)]))


def _problems(sequences: int, effects: int, hmm_block: int = 250):
    """``name -> (make_fn(executor), args, argnums)`` for the two problems."""
    import jax
    import jax.numpy as jnp

    import parallel_backend as pb
    from parallel_backend.plugins.cli.demo import hmm_init, hmm_loglik, make_hmm_data

    obs, _ = make_hmm_data(sequences)
    init = hmm_init(obs)
    hmm_args = (jnp.log(jnp.asarray(init["trans"], jnp.float32)),
                jnp.asarray(init["mu0"] + np.concatenate([[0.0], np.cumsum(init["gaps"])]),
                            jnp.float32),
                jnp.asarray(init["sigma"], jnp.float32))

    def hmm(executor):
        def f(log_trans, mu, sigma):
            if executor is None:
                return hmm_loglik(obs, log_trans, mu, sigma).sum()
            return pb.reduce_sum(hmm_loglik, obs, log_trans, mu, sigma, executor=executor,
                                 block_rows=hmm_block)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

    rng = np.random.default_rng(1)
    y = rng.normal(size=effects).astype(np.float32)
    u = jnp.asarray(rng.normal(size=effects).astype(np.float32) * 0.1)

    def effect_rows(rows, mu, tau):
        return (-0.5 * ((rows["y"] - mu - rows["u"]) ** 2)
                - 0.5 * (rows["u"] / tau) ** 2 - jnp.log(tau))

    def effects_fn(executor):
        def f(u, mu, tau):
            data = {"y": y, "u": u}
            if executor is None:
                return effect_rows(data, mu, tau).sum()
            return pb.reduce_sum(effect_rows, data, mu, tau, executor=executor,
                                 block_rows=2048)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

    return {f"hmm_{sequences}": (hmm, hmm_args),
            f"effects_{effects}": (effects_fn, (u, jnp.float32(0.1), jnp.float32(1.0)))}


def overhead(args) -> None:
    import parallel_backend as pb

    from .cluster import NetCluster

    env = _env()
    problems = _problems(args.sequences, args.effects)
    local = {}
    for name, (make, fargs) in problems.items():
        for label, ex in (("plain", None), ("serial", pb.SerialExecutor())):
            f = make(ex)
            _warm(f, fargs)
            t = _time(f, fargs, args.calls, args.budget)
            local[(name, label)] = float(np.median(t))
    rtts = [float(x) for x in args.rtts.split(",")]
    rates = [None if r == "none" else r for r in args.rates.split(",")]
    for rtt in rtts:
        workers = [{"threads": 1, "rtt_ms": rtt}, {"threads": 2, "rtt_ms": rtt}]
        with NetCluster(workers, scheduler_rtt_ms=rtt, lifetime=900) as c, \
                pb.DaskExecutor(address=c.address, dispatch="host", timeout=30) as ex:
            fns, data_once = {}, {}
            for name, (make, fargs) in problems.items():
                before = ex.stats()["data_bytes_sent"]
                fns[name] = make(ex)
                _warm(fns[name], fargs)
                data_once[name] = ex.stats()["data_bytes_sent"] - before
            for rate in rates:
                for h in c.hosts:
                    c.set_rate(h, rate)
                pings = {w.name: ping(ex.client, w.address) for w in c.workers()}
                pings_200k = {w.name: ping(ex.client, w.address, 200_000) for w in c.workers()}
                for name, (_, fargs) in problems.items():
                    _warm(fns[name], fargs, 1)
                    s0 = ex.stats()
                    t = _time(fns[name], fargs, args.calls, args.budget)
                    s1 = ex.stats()
                    n = s1["calls"] - s0["calls"]
                    rec = {"bench": "netcluster_overhead", "problem": name, "rtt_ms": rtt,
                           "proxy": rtt > 0, "rate": rate or "veth", "workers": ex.workers,
                           "hosts": len(c.workers()), "calls": len(t),
                           **_spread(t),
                           "serial_seconds": local[(name, "serial")],
                           "plain_seconds": local[(name, "plain")],
                           "bytes_per_eval": (s1["bytes_sent"] - s0["bytes_sent"]) / max(n, 1),
                           "data_bytes_once": data_once[name],
                           "ping_seconds": pings, "ping_200kB_seconds": pings_200k, **env}
                    _emit(rec, args.out)


def hosts(args) -> None:
    """Overhead against the number of worker hosts (one thread each): the client sends one
    message per host per evaluation."""
    import parallel_backend as pb

    from .cluster import NetCluster

    env = _env()
    # Small blocks, so that every host gets a shard (the HMM's blocks are its tiles).
    name, (make, fargs) = next(iter(_problems(args.sequences, 1000, args.block).items()))
    serial = make(pb.SerialExecutor())
    _warm(serial, fargs)
    serial_s = float(np.median(_time(serial, fargs, args.calls, args.budget)))
    for w in [int(x) for x in args.hosts.split(",")]:
        workers = [{"threads": 1, "rtt_ms": args.rtt}] * w
        with NetCluster(workers, scheduler_rtt_ms=args.rtt, lifetime=900) as c, \
                pb.DaskExecutor(address=c.address, dispatch="host", timeout=60) as ex:
            f = make(ex)
            _warm(f, fargs)
            pings = {h.name: ping(ex.client, h.address) for h in c.workers()}
            s0 = ex.stats()
            cpu0 = time.process_time()
            t = _time(f, fargs, args.calls, args.budget)
            cpu = (time.process_time() - cpu0) / len(t)
            s1 = ex.stats()
            n = s1["calls"] - s0["calls"]
            rec = {"bench": "netcluster_hosts", "client_cpu_seconds": cpu, "problem": name, "block_rows": args.block,
                   "serial_seconds": serial_s, "proxy": args.rtt > 0, "rtt_ms": args.rtt,
                   "rate": "veth", "hosts": w, "workers": ex.workers, "calls": len(t),
                   **_spread(t),
                   "bytes_per_eval": (s1["bytes_sent"] - s0["bytes_sent"]) / max(n, 1),
                   "ping_seconds": pings, **env}
            _emit(rec, args.out)


def unequal(args) -> None:
    """One evaluation when one host is behind a slower link: a 1-thread host and a 2-thread
    host, both at 0 ms, then the 1-thread host at ``--rtt`` ms, then both at ``--rtt``;
    on each cluster every ``--placement`` (``threads``: data by threads, never moved;
    ``weighted``: moved after measuring), alternated ``--rounds`` times."""
    import parallel_backend as pb
    from parallel_backend.plugins.dask import placement as weigh

    from .cluster import NetCluster

    env = _env()
    name, (make, fargs) = next(iter(_problems(args.sequences, 1000).items()))
    serial = make(pb.SerialExecutor())
    _warm(serial, fargs)
    serial_s = float(np.median(_time(serial, fargs, args.calls, args.budget)))
    # Past the first placement's measuring window and a re-placement's settling: the
    # timed calls see the layout the executor settled on.
    warm = 2 * (weigh.SETTLE + weigh.WINDOW) + weigh.SETTLE
    cases = [(0.0, 0.0), (args.rtt, 0.0), (args.rtt, args.rtt)]
    if args.cases:
        cases = [cases[int(i)] for i in args.cases.split(",")]
    for slow_rtt, fast_rtt in cases:
        workers = [{"threads": 1, "rtt_ms": slow_rtt}, {"threads": 2, "rtt_ms": fast_rtt}]
        with NetCluster(workers, lifetime=900) as c:
            addresses = {h.address: h.name for h in c.workers()}
            for _ in range(args.rounds):
                for variant in args.placement.split(","):
                    with pb.DaskExecutor(address=c.address, dispatch="host", timeout=60,
                                         rebalance=variant == "weighted") as ex:
                        f = make(ex)
                        _warm(f, fargs, warm)
                        pings = {h.name: ping(ex.client, h.address) for h in c.workers()}
                        t = _time(f, fargs, args.calls, args.budget)
                        s = ex.stats()
                        held = {addresses.get(a, a): n for a, n in s["blocks_per_worker"].items()}
                        rec = {"bench": "netcluster_unequal", "problem": name, "rate": "veth",
                               "placement": variant, "replacements": s["replacements"],
                               "blocks_per_host": held,
                               "rtt_ms": {"w1": slow_rtt, "w2": fast_rtt},
                               "threads": {"w1": 1, "w2": 2}, "hosts": 2,
                               "workers": ex.workers, "calls": len(t), **_spread(t),
                               "serial_seconds": serial_s, "ping_seconds": pings, **env}
                        _emit(rec, args.out)


def nuts(args) -> None:
    import jax
    from numpyro.infer import MCMC, NUTS

    import parallel_backend as pb
    from parallel_backend.plugins.cli.demo import (
        hmm_nuts_kwargs,
        hmm_parallel,
        hmm_plain,
        make_hmm_data,
    )

    from .cluster import NetCluster

    env = _env()

    def run(model, obs, executor=None):
        """Two identical runs: the first compiles (here and on the workers), the second's
        wall time is the sampling alone."""
        kw = hmm_nuts_kwargs(obs)
        mcmc = MCMC(NUTS(model, **kw), num_warmup=args.warmup, num_samples=args.samples,
                    progress_bar=False)
        margs = (obs,) if executor is None else (obs, executor)
        walls = []
        for _ in range(2):
            t0 = time.perf_counter()
            mcmc.warmup(jax.random.PRNGKey(0), *margs, collect_warmup=True,
                        extra_fields=("num_steps",))
            steps = int(np.asarray(mcmc.get_extra_fields()["num_steps"]).sum())
            mcmc.run(mcmc.post_warmup_state.rng_key, *margs, extra_fields=("num_steps",))
            jax.block_until_ready(mcmc.get_samples())
            walls.append(time.perf_counter() - t0)
            steps += int(np.asarray(mcmc.get_extra_fields()["num_steps"]).sum())
        return walls, steps, {k: np.asarray(v) for k, v in mcmc.get_samples().items()}

    workers = [{"threads": 1, "rtt_ms": args.rtt}, {"threads": 2, "rtt_ms": args.rtt}]
    for size in [int(s) for s in args.sizes.split(",")]:
        obs, _ = make_hmm_data(size)
        results = {"plain": run(hmm_plain, obs),
                   "serial": run(hmm_parallel, obs, pb.SerialExecutor())}
        with NetCluster(workers, scheduler_rtt_ms=args.rtt, lifetime=1800) as c, \
                pb.DaskExecutor(address=c.address, dispatch="host", timeout=60) as ex:
            results["netcluster"] = run(hmm_parallel, obs, ex)
            stats = ex.stats()
        ref = results["serial"][2]
        for label, (walls, steps, draws) in results.items():
            wall = walls[1]
            rec = {"bench": "netcluster_nuts", "model": "hmm", "sequences": size,
                   "executor": label, "rtt_ms": args.rtt if label == "netcluster" else None,
                   "warmup": args.warmup, "samples": args.samples, "seconds": wall,
                   "first_run_seconds": walls[0],
                   "leapfrog_steps": steps, "seconds_per_step": wall / max(steps, 1),
                   "bitwise_equal_serial": all(np.array_equal(draws[k], ref[k]) for k in ref),
                   **env}
            if label == "netcluster":
                rec.update(workers=ex.workers, hosts=2, calls=stats["calls"],
                           bytes_sent=stats["bytes_sent"],
                           data_bytes_once=stats["data_bytes_sent"])
            _emit(rec, args.out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.netcluster.bench")
    sub = ap.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("overhead")
    o.add_argument("--rtts", default="0,0.01,1,5", help="ms; 0 means no proxy")
    o.add_argument("--rates", default="none,1gbit,100mbit")
    o.add_argument("--sequences", type=int, default=500)
    o.add_argument("--effects", type=int, default=50_000)
    o.add_argument("--calls", type=int, default=40)
    o.add_argument("--budget", type=float, default=4.0, help="seconds per point at most")
    o.add_argument("--out")
    h = sub.add_parser("hosts")
    h.add_argument("--hosts", default="1,2,4,8")
    h.add_argument("--rtt", type=float, default=1.0)
    h.add_argument("--sequences", type=int, default=400)
    h.add_argument("--block", type=int, default=50)
    h.add_argument("--calls", type=int, default=40)
    h.add_argument("--budget", type=float, default=4.0)
    h.add_argument("--out")
    u = sub.add_parser("unequal")
    u.add_argument("--rtt", type=float, default=5.0)
    u.add_argument("--sequences", type=int, default=3000)
    u.add_argument("--calls", type=int, default=30)
    u.add_argument("--budget", type=float, default=4.0)
    u.add_argument("--placement", default="threads,weighted",
                   help="threads (data by threads, never moved), weighted (measured)")
    u.add_argument("--rounds", type=int, default=1, help="times each placement is measured")
    u.add_argument("--cases", help="which links, e.g. 1 for the slow host only (0: both at "
                                   "0 ms, 1: w1 at --rtt, 2: both at --rtt)")
    u.add_argument("--out")
    n = sub.add_parser("nuts")
    n.add_argument("--sizes", default="1000,3000")
    n.add_argument("--warmup", type=int, default=30)
    n.add_argument("--samples", type=int, default=30)
    n.add_argument("--rtt", type=float, default=1.0)
    n.add_argument("--out")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # tear the cluster down on TERM too
    {"overhead": overhead, "hosts": hosts, "unequal": unequal, "nuts": nuts}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
