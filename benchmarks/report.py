"""Turn the JSON lines of bench_gradients.py / bench_nuts.py into markdown tables.

    python benchmarks/report.py results/gradients.jsonl results/nuts.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def load(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def gradient_table(rows):
    """Per likelihood and dtype: plain (all cores, one core) and ratios of each executor."""
    by = defaultdict(dict)
    for r in rows:
        by[(r["likelihood"], r["n"], r["dtype"])][r["cores"]] = r["seconds"]
    out = ["| likelihood | N | dtype | plain ms | serial | thread (auto) | thread (host) | "
           "thread vs 1-core plain | efficiency | overhead (us, N = 1,000) |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for (name, n, dtype), per in sorted(by.items()):
        full = per.get(max(per)) if per else None
        one = per.get(1, {})
        if not full:
            continue
        plain = full["plain"]

        def ratio(k):
            return f"{plain / full[k]:.2f}x" if k in full else "-"

        thread = full.get("thread")
        if thread and "plain" in one:
            vs_one = one["plain"] / thread
            eff = f"{vs_one / max(per):.2f}"
            vs_one = f"{vs_one:.2f}x"
        else:
            vs_one = eff = "-"
        overhead = f"{(thread - plain) * 1e6:+.0f}" if thread and n <= 1_000 else "-"
        out.append(f"| {name} | {n:,} | {dtype} | {plain * 1e3:.2f} | {ratio('serial')} | "
                   f"{ratio('thread')} | {ratio('thread_host')} | {vs_one} | {eff} | {overhead} |")
    return "\n".join(out)


def nuts_table(rows):
    """Per model, size, dtype and chain count: NUTS wall time (warmup and compilation
    included) and milliseconds per gradient inside NUTS, as ratios to plain."""
    variants = ("serial", "thread", "thread_host", "plain_1core")
    out = ["| model | N | dtype | chains | plain s | "
           + " | ".join(f"{v} (wall)" for v in variants)
           + " | plain ms/grad | " + " | ".join(f"{v} (ms/grad)" for v in variants) + " |",
           "|---|---:|---|---:|---:|" + "---:|" * (2 * len(variants) + 1)]
    for r in rows:
        s, g = r["seconds"], r.get("ms_per_grad", {})

        def ratio(d, k):
            return f"{d['plain'] / d[k]:.2f}x" if k in d and "plain" in d else "-"

        out.append(f"| {r['model']} | {r['n']:,} | {r['dtype']} | {r['chains']} | "
                   f"{s['plain']:.1f} | " + " | ".join(ratio(s, v) for v in variants)
                   + f" | {g.get('plain', float('nan')):.2f} | "
                   + " | ".join(ratio(g, v) for v in variants) + " |")
    return "\n".join(out)


def scaling_table(rows):
    """Per likelihood and worker count: threads against plain pinned to one core."""
    out = ["| likelihood | N | dtype | workers | plain ms (as many cores) | threads ms | "
           "threads vs 1-core plain | efficiency | plain's own scaling |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    one = {(r["likelihood"], r["dtype"]): r["seconds"]["plain"] for r in rows if r["workers"] == 1}
    for r in rows:
        s = r["seconds"]
        base = one.get((r["likelihood"], r["dtype"]), float("nan"))
        out.append(f"| {r['likelihood']} | {r['n']:,} | {r['dtype']} | {r['workers']} | "
                   f"{s['plain'] * 1e3:.2f} | {s['threads'] * 1e3:.2f} | "
                   f"{base / s['threads']:.2f}x | {base / s['threads'] / r['workers']:.2f} | "
                   f"{base / s['plain']:.2f}x |")
    return "\n".join(out)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    for path in argv:
        rows = load(path)
        if rows and "workers" in rows[0]:
            print(scaling_table(rows))
        elif rows and "likelihood" in rows[0]:
            print(gradient_table(rows))
        elif rows:
            print(nuts_table(rows))
        print()


if __name__ == "__main__":
    main()
