"""When does a dask cluster pay? A cost model fitted to measured numbers.

Per gradient evaluation, plain NumPyro on this machine takes ``c_plain * N``; a
cluster of ``W`` workers (each as fast as one core here) takes

    t(N) = overhead + rtt + bytes_per_call / bandwidth + c_worker * N / W

where ``overhead`` is the dask path's cost on loopback (measured at N = 1,000),
``rtt`` the network round trip beyond loopback (the workers are messaged in
parallel, so one round trip per evaluation), and ``c_worker`` the per-row time of
one worker process (measured on the 2-worker local cluster). The cluster pays
from ``N* = (overhead + rtt) / (c_plain - c_worker / W)`` rows on.

    python benchmarks/cost_model.py benchmarks/results/dask_float64.jsonl
"""

from __future__ import annotations

import argparse
import json

RTTS_MS = (0.05, 0.2, 1.0, 5.0, 30.0)
WORKERS = (2, 8, 32)
BANDWIDTH = 1e9 / 8  # bytes per second on a 1 Gbit/s link


def load(path):
    rows = [json.loads(line) for line in open(path)]
    latest = {}
    for r in rows:
        latest[r["likelihood"]] = r
    return latest


def fit(rows, small="logistic_1k"):
    base = rows[small]
    overhead = base["seconds"]["dask_host"] - base["seconds"]["plain"]
    out = {}
    for name, r in rows.items():
        if name == small:
            continue
        n, s = r["n"], r["seconds"]
        w = r["dask"]["workers"]
        c_worker = max(s["dask_host"] - overhead, 0.0) * w / n
        out[name] = dict(n=n, c_plain=s["plain"] / n, c_worker=c_worker,
                         bytes=r["dask"]["bytes_per_call"])
    return overhead, out


def fmt_rows(n):
    if n is None:
        return "never"
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    if n >= 1e3:
        return f"{n / 1e3:.0f}k"
    return f"{n:.0f}"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    args = ap.parse_args(argv)
    overhead, models = fit(load(args.results))
    print(f"overhead on loopback: {overhead * 1e3:.2f} ms per evaluation\n")
    for name, m in models.items():
        print(f"{name}: plain {m['c_plain'] * 1e9:.0f} ns/row on this machine; one worker "
              f"{m['c_worker'] * 1e9:.0f} ns/row; {m['bytes']:.0f} bytes per call\n")
        head = " | ".join(f"W={w}: break-even N / speedup at N={m['n']:,}" for w in WORKERS)
        print(f"| round trip | {head} |")
        print("|---" * (len(WORKERS) + 1) + "|")
        for rtt in RTTS_MS:
            cells = []
            fixed = overhead + rtt * 1e-3 + m["bytes"] / BANDWIDTH
            for w in WORKERS:
                gain = m["c_plain"] - m["c_worker"] / w
                n_star = fixed / gain if gain > 0 else None
                t = fixed + m["c_worker"] * m["n"] / w
                cells.append(f"{fmt_rows(n_star)} / {m['c_plain'] * m['n'] / t:.2f}x")
            print(f"| {rtt:g} ms | " + " | ".join(cells) + " |")
        print()


if __name__ == "__main__":
    main()
