"""When does a cluster pay? A cost model of ``DaskExecutor`` fitted to the simulated
cluster's measurements (``benchmarks/netcluster``), checked against them, and used to
predict the seed's full problem on W machines of C cores.

One gradient evaluation on W worker hosts of C cores each costs

    t(W, C) = ping + e0 + e1 * W + 2 * B_host * W / bw_client + 2 * B_host / bw
              + c_row * b * ceil(N / b / (W * C)) * C / s(C)

- ``ping``: one request and reply between the client and a worker (the hosts are messaged
  in parallel, so one round trip per evaluation); measured on the simulated links.
- ``e0 + e1 * W``: the executor's own cost beyond that round trip: ``e1`` the client's CPU
  per host and evaluation (packing, sending and reading one message per host: the one
  serial part), measured as the slope of the client's CPU time against hosts; ``e0`` the
  rest (JAX's host callback, the workers' unpacking), fitted to the simulated points.
- ``B_host``: bytes to one host per evaluation (parameters; per-row traced leaves too),
  out and back, over the host's link ``bw`` and, W times, over the client's ``bw_client``.
- the last term: the busiest worker thread's whole blocks of ``b`` rows (250 for the HMM,
  whose looped blocks are its tiles: ``N / b`` is the most worker threads an evaluation
  can use), each thread at ``s(C) / C`` of one core's speed;
- ``c_row``: seconds per row on one core (``SerialExecutor`` inside NUTS, this machine; for
  the seed, its ratio to plain NumPyro in the same run times the seed's plain figure),
  ``s(C)``: the speedup of C threads over one on one machine (the 16-core table of
  docs/performance.md).

NUTS then takes ``iterations * steps_per_iteration`` evaluations. The cluster stops paying
where the compute per evaluation falls to the fixed part (``ping + e0 + e1 W``): below
``N / W = (ping + e0 + e1 W) * s(C) / c_row`` rows per machine it is latency-bound.

    python benchmarks/cost_model.py \\
        --overhead benchmarks/results/netcluster_overhead_2026-11-26.jsonl \\
        --hosts benchmarks/results/netcluster_hosts_2026-11-26.jsonl \\
        --nuts benchmarks/results/netcluster_nuts_2026-11-26.jsonl [--plot out.png] \\
        [--one-machine benchmarks/results/dask_16core_2026-11-26.jsonl \\
         --scaling benchmarks/results/h100_16core_after_core_2026-11-26.jsonl]

Prints markdown tables (the ones in docs/cluster.md).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

#: Threads on one machine against one thread, HMM 50k, ``ThreadExecutor(w, "host")``:
#: the 16-core Xeon table of docs/performance.md (14.2x / 2.64x at 8 and so on).
THREAD_SPEEDUP = {1: 1.0, 2: 4.09 / 2.64, 4: 7.23 / 2.64, 8: 14.2 / 2.64, 16: 22.1 / 2.64}
#: The seed's full problem.
SEED = {"sequences": 50_000, "iterations": 2000, "plain_seconds": 0.56}
#: This machine's cores (the simulated hosts share them).
CORES_HERE = 2
RATES = {"veth": None, "1gbit": 1e9, "100mbit": 1e8}


def speedup(c: int) -> float:
    keys = sorted(THREAD_SPEEDUP)
    return float(np.interp(np.log2(c), np.log2(keys), [THREAD_SPEEDUP[k] for k in keys]))


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def ping_of(rec) -> float:
    """The slowest host's measured round trip (an evaluation waits for all)."""
    return max(rec["ping_seconds"].values())


def compute_here(rec) -> float:
    """The evaluation's compute on the simulated cluster: the serial time over the cores
    the hosts share here."""
    return rec["serial_seconds"] / min(rec["workers"], CORES_HERE)


#: The simulated links' token bucket (``tbf`` burst, benchmarks/netcluster/net.py): the first
#: 64 KiB of a message pass at line speed; real links have no such allowance.
TBF_BURST = 64 * 1024


def transfer(bytes_per_eval: float, rate: float | None, share: float,
             burst: float = 0.0) -> float:
    """Out and back over the busiest host's link (its ``share`` of the bytes)."""
    return 0.0 if rate is None else 2 * max(share * bytes_per_eval - burst, 0.0) * 8 / rate


def fit(overhead, hosts_recs):
    """``e1``: the client's own CPU per evaluation and host (the slope against the number of
    hosts: one message packed, sent and read per host; the client is the one serial part);
    ``e0``: the rest of the executor's cost beyond ping, compute and ``e1 W``, the median
    over the HMM points on uncapped links. Wall-time slopes against hosts are no use here:
    every host process takes its share of the same 2 cores."""
    cpu = [(r["hosts"], r["client_cpu_seconds"]) for r in hosts_recs if "client_cpu_seconds" in r]
    e1 = float(np.polyfit(*zip(*cpu), 1)[0]) if len({h for h, _ in cpu}) > 1 else 0.0
    e1 = max(e1, 0.0)
    rest = [r["seconds_median"] - ping_of(r) - compute_here(r) - e1 * r["hosts"]
            for r in [*overhead, *hosts_recs]
            if r["rate"] == "veth" and r["problem"].startswith("hmm") and "serial_seconds" in r]
    return float(np.median(rest)), e1


def predict_here(r, e0, e1) -> float:
    """The model's time for one simulated point (the busiest host holds 2 of 3 shards)."""
    share = 2 / 3 if r["hosts"] == 2 else 1 / r["hosts"]
    comp = compute_here(r) if "serial_seconds" in r else 0.0
    return (ping_of(r) + e0 + e1 * r["hosts"] + comp
            + transfer(r["bytes_per_eval"], RATES[r["rate"]], share, TBF_BURST))


def nuts_facts(nuts):
    """``c_row`` here (this run, this machine's load), ``c_row`` for the seed (the blocked
    path's ratio to plain in the same run, times the seed's quiet-machine plain figure),
    leapfrog steps per iteration, and the largest serial record."""
    serial = [r for r in nuts if r["executor"] == "serial"]
    big = max(serial, key=lambda r: r["sequences"])
    plain = next(r for r in nuts if r["executor"] == "plain"
                 and r["sequences"] == big["sequences"])
    c_row = big["seconds_per_step"] / big["sequences"]
    ratio = big["seconds_per_step"] / plain["seconds_per_step"]
    c_row_seed = SEED["plain_seconds"] / SEED["sequences"] * ratio
    steps = big["leapfrog_steps"] / (big["warmup"] + big["samples"])
    return c_row, c_row_seed, steps, big


def compute_seconds(c_row: float, n: int, w: int, c: int, block_rows: int) -> float:
    """The busiest worker thread's share: whole blocks (the HMM's looped blocks are its
    tiles, so a shard is a run of blocks), at ``s(C) / C`` of one core's speed each."""
    blocks = -(-n // block_rows)
    per_thread = -(-blocks // (w * c))
    return per_thread * block_rows * c_row * c / speedup(c)


def seed_table(c_row, steps, e0, e1, bytes_host, rtts=(0.2e-3, 1e-3, 5e-3), bw=1e9,
               cores=(2, 16), ws=(1, 2, 4, 8, 16, 32, 64), block_rows=250):
    """Predicted minutes of the seed's full problem, and speedup against plain NumPyro on
    one 2-core machine, per (C, rtt, W)."""
    n, evals = SEED["sequences"], SEED["iterations"] * steps
    out = []
    for c in cores:
        for rtt in rtts:
            for w in ws:
                fixed = rtt + e0 + e1 * w + 2 * bytes_host * 8 * (w + 1) / bw
                comp = compute_seconds(c_row, n, w, c, block_rows)
                t = fixed + comp
                out.append({"C": c, "rtt_ms": rtt * 1e3, "W": w, "eval_ms": t * 1e3,
                            "fixed_ms": fixed * 1e3, "minutes": evals * t / 60,
                            "speedup": SEED["plain_seconds"] / t,
                            "latency_bound": fixed > comp})
    return out


def one_machine_table(dask_recs, scaling_recs, e0, e1, ping=0.1e-3, block_rows=250):
    """The model against ``DaskExecutor`` on one 16-core machine (``W`` worker processes of
    ``C`` threads over loopback, ``python -m benchmarks gradients --dask-workers W
    --dask-threads C``): all ``T = W C`` threads share the machine, so each runs at
    ``s(T) / T`` of one core; ``c_row`` is ``ThreadExecutor(1, "host")`` on one pinned core
    of the same machine (``python -m benchmarks scaling``), per row."""
    one = next(r for r in scaling_recs if r["variant"] == "thread_host"
               and r["settings"]["workers"] == 1)
    c_row = one["seconds"] / one["rows"]
    out = []
    for r in dask_recs:
        if r["variant"] != "dask_host":
            continue
        words = r["settings"]["dask"].split()  # "local, W workers[ x C threads]"
        w = int(words[1])
        c = int(words[4]) if len(words) > 4 else 1
        blocks = -(-r["rows"] // block_rows)
        per_thread = -(-blocks // (w * c))
        comp = per_thread * block_rows * c_row * (w * c) / speedup(w * c)
        fixed = ping + e0 + e1 * w
        out.append({"W": w, "C": c, "measured_ms": r["seconds"] * 1e3,
                    "model_ms": (fixed + comp) * 1e3, "fixed_ms": fixed * 1e3,
                    "plain_ratio": r["ratio"]})
    return c_row, out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--overhead", required=True)
    ap.add_argument("--hosts")
    ap.add_argument("--nuts", required=True)
    ap.add_argument("--plot")
    ap.add_argument("--one-machine", help="records of DaskExecutor W x C on one 16-core machine")
    ap.add_argument("--scaling", help="thread-scaling records of that machine (c_row)")
    a = ap.parse_args(argv)
    overhead = load(a.overhead)
    hosts_recs = load(a.hosts) if a.hosts else []
    nuts = load(a.nuts)
    e0, e1 = fit(overhead, hosts_recs)
    c_row, c_row_seed, steps, big = nuts_facts(nuts)
    hmm = [r for r in overhead if r["problem"].startswith("hmm")]
    bytes_host = float(np.median([r["bytes_per_eval"] / r["hosts"] for r in hmm]))
    print(f"fitted: e0 = {e0 * 1e3:.2f} ms, e1 = {e1 * 1e3:.2f} ms per host; c_row = "
          f"{c_row * 1e6:.2f} us per sequence on one core ({big['sequences']:,} sequences, "
          f"SerialExecutor inside NUTS, this run), {c_row_seed * 1e6:.2f} us for the seed "
          f"(SerialExecutor / plain in this run x the seed's plain "
          f"{SEED['plain_seconds'] * 1e3:.0f} ms); {steps:.1f} leapfrog steps per iteration; "
          f"{bytes_host:.0f} bytes per host per evaluation (HMM parameters)\n")

    print("| problem | added RTT | link | ping ms | measured ms | model ms | bytes/eval |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for r in overhead:
        rtt = "none" if not r["proxy"] else f"{r['rtt_ms']:g} ms"
        print(f"| {r['problem']} | {rtt} | {r['rate']} | {ping_of(r) * 1e3:.2f} | "
              f"{r['seconds_median'] * 1e3:.2f} | {predict_here(r, e0, e1) * 1e3:.2f} | "
              f"{r['bytes_per_eval']:,.0f} |")
    if hosts_recs:
        print("\n| hosts (1 thread, 1 ms) | ping ms | client CPU ms | measured ms | model ms "
              "| bytes/eval |")
        print("|---:|---:|---:|---:|---:|---:|")
        for r in hosts_recs:
            cpu = r.get("client_cpu_seconds", float("nan"))
            print(f"| {r['hosts']} | {ping_of(r) * 1e3:.2f} | {cpu * 1e3:.2f} | "
                  f"{r['seconds_median'] * 1e3:.2f} | {predict_here(r, e0, e1) * 1e3:.2f} | "
                  f"{r['bytes_per_eval']:,.0f} |")

    print("\n| HMM sequences | executor | seconds | leapfrog steps | ms per step | model ms "
          "per step (2 / 1 free cores) | draws = serial |")
    print("|---:|---|---:|---:|---:|---:|---|")
    ping_1ms = [ping_of(r) for r in overhead if r["rtt_ms"] == 1.0 and r["rate"] == "veth"]
    for r in nuts:
        model = ""
        if r["executor"] == "netcluster":
            fixed = np.median(ping_1ms) + e0 + e1 * 2
            comp = c_row * r["sequences"]
            model = f"{(fixed + comp / CORES_HERE) * 1e3:.1f} / {(fixed + comp) * 1e3:.1f}"
        print(f"| {r['sequences']:,} | {r['executor']} | {r['seconds']:.1f} | "
              f"{r['leapfrog_steps']:,} | {r['seconds_per_step'] * 1e3:.1f} | {model} | "
              f"{r['bitwise_equal_serial']} |")

    if a.one_machine and a.scaling:
        c16, rows = one_machine_table(load(a.one_machine), load(a.scaling), e0, e1)
        print(f"\nOne 16-core machine, HMM 50,000, W processes x C threads (c_row = "
              f"{c16 * 1e6:.2f} us per sequence on one of its cores; loopback ping 0.1 ms)")
        print("| W x C | measured ms | model ms | model / measured | fixed ms in the model "
              "| measured vs plain |")
        print("|---|---:|---:|---:|---:|---:|")
        for t in rows:
            print(f"| {t['W']} x {t['C']} | {t['measured_ms']:.1f} | {t['model_ms']:.1f} | "
                  f"{t['model_ms'] / t['measured_ms']:.2f} | {t['fixed_ms']:.1f} | "
                  f"{t['plain_ratio']:.2f}x |")

    table = seed_table(c_row_seed, steps, e0, e1, bytes_host)
    print(f"\nSeed's full problem: {SEED['sequences']:,} sequences, {SEED['iterations']:,} "
          f"iterations x {steps:.1f} steps; plain {SEED['plain_seconds'] * 1e3:.0f} ms per "
          f"gradient on one 2-core machine = {SEED['iterations'] * steps * 0.56 / 3600:.1f} h")
    for c in (2, 16):
        print(f"\nC = {c} cores per machine (1 Gbit/s links): minutes (speedup vs plain on "
              "2 cores); † = latency-bound")
        ws = sorted({t["W"] for t in table})
        print("| RTT | " + " | ".join(f"W={w}" for w in ws) + " |")
        print("|---" * (len(ws) + 1) + "|")
        for rtt in sorted({t["rtt_ms"] for t in table}):
            mark = {True: " †", False: ""}
            cells = [f"{t['minutes']:.1f} ({t['speedup']:.0f}x){mark[t['latency_bound']]}"
                     for t in table if t["C"] == c and t["rtt_ms"] == rtt]
            print(f"| {rtt:g} ms | " + " | ".join(cells) + " |")
    if a.plot:
        checks = [(r["seconds_median"], predict_here(r, e0, e1), "overhead") for r in overhead]
        checks += [(r["seconds_median"], predict_here(r, e0, e1), "hosts") for r in hosts_recs]
        fixed = np.median(ping_1ms) + e0 + e1 * 2
        checks += [(r["seconds_per_step"], fixed + c_row * r["sequences"] / CORES_HERE, "nuts")
                   for r in nuts if r["executor"] == "netcluster"]
        plot(a.plot, table, checks)


def plot(path, table, checks):
    """Left: the seed's predicted speedup against W. Right: the model against every
    simulated point (``checks``: (measured s, model s, kind))."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    for c, style in ((2, "-"), (16, "--")):
        for rtt, color in ((0.2, "C0"), (1.0, "C1"), (5.0, "C3")):
            pts = [t for t in table if t["C"] == c and t["rtt_ms"] == rtt]
            ax.plot([t["W"] for t in pts], [t["speedup"] for t in pts], style, color=color,
                    marker="o", ms=3, label=f"C={c}, RTT {rtt:g} ms")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("machines W (C cores each)")
    ax.set_ylabel("speedup over plain NumPyro, one 2-core machine")
    ax.set_title("Seed's HMM, 50,000 sequences: predicted")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    markers = {"overhead": ("o", "C0"), "hosts": ("s", "C2"), "nuts": ("x", "k")}
    for kind, (m, color) in markers.items():
        pts = [(a, b) for a, b, k in checks if k == kind]
        if pts:
            bx.plot([b * 1e3 for _, b in pts], [a * 1e3 for a, _ in pts], m, color=color,
                    label={"overhead": "RTT x bandwidth x problem", "hosts": "1-8 hosts",
                           "nuts": "NUTS, ms per leapfrog step"}[kind])
    lo, hi = 3, 60
    bx.plot([lo, hi], [lo, hi], "k:", lw=1, label="model = measured")
    bx.set_xscale("log")
    bx.set_yscale("log")
    bx.set_xlabel("model, ms per evaluation")
    bx.set_ylabel("measured on the simulated cluster, ms")
    bx.set_title("The model at the simulated points (2 shared cores)")
    bx.legend(fontsize=7)
    bx.grid(True, which="both", alpha=0.3)
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    for axis in (ax.yaxis, bx.xaxis, bx.yaxis):
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
