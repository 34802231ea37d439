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
           "thread vs 1-core plain | efficiency | overhead (us, small N) |",
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
        overhead = f"{(thread - plain) * 1e6:+.0f}" if thread and n <= 10_000 else "-"
        out.append(f"| {name} | {n:,} | {dtype} | {plain * 1e3:.2f} | {ratio('serial')} | "
                   f"{ratio('thread')} | {ratio('thread_host')} | {vs_one} | {eff} | {overhead} |")
    return "\n".join(out)


def nuts_table(rows):
    out = ["| model | N | dtype | chains | plain s | serial | thread (auto) | thread (host) |",
           "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        s = r["seconds"]
        plain = s["plain"]

        def ratio(k):
            return f"{plain / s[k]:.2f}x" if k in s else "-"

        out.append(f"| {r['model']} | {r['n']:,} | {r['dtype']} | {r['chains']} | {plain:.1f} | "
                   f"{ratio('serial')} | {ratio('thread')} | {ratio('thread_host')} |")
    return "\n".join(out)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    for path in argv:
        rows = load(path)
        if rows and "likelihood" in rows[0]:
            print(gradient_table(rows))
        elif rows:
            print(nuts_table(rows))
        print()


if __name__ == "__main__":
    main()
