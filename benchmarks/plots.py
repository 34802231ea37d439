"""Draw the plots of docs/performance.md from the results files they summarize.

    python benchmarks/plots.py            # writes docs/_static/speedup_*.png

Two figures, each read from the raw output that the benchmark run saved in
``benchmarks/results/`` (nothing typed in by hand):

- ``speedup_rows_hmm.png``: the HMM's value and gradient per evaluation against the
  number of sequences, ``ThreadExecutor()`` and ``SerialExecutor()`` as ratios to plain
  NumPyro on the same 2 cores, on both supported stacks, float32 and float64
  (``bench_gradients.py`` lines of ``hmm_ynn_xeon_2026-11-26.txt`` and
  ``hmm_200k_xeon_2026-11-26.txt``).
- ``speedup_cores_16.png``: thread scaling on 16 cores, the threads and plain NumPyro
  each against plain NumPyro pinned to one core (``bench_scaling.py``'s JSON lines in
  ``device_h100_16core_2026-11-26.txt``).

The PNGs are committed (the docs build only shows them); run this again when those
results files change. Same input, same bytes: no date or version in the files.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
STATIC = os.path.join(os.path.dirname(HERE), "docs", "_static")

HMM_FILES = ("hmm_ynn_xeon_2026-11-26.txt", "hmm_200k_xeon_2026-11-26.txt")
SCALING_FILE = "device_h100_16core_2026-11-26.txt"

# "# python3.11 jax 0.10.2 float32" heads a block; "(py3.12, jax 0.12.0.1) hmm_200k ..."
# names its stack on the line itself.
_BLOCK = re.compile(r"^# python(3\.\d+) jax ([\d.]+)")
_PREFIX = re.compile(r"^\(py(3\.\d+), jax ([\d.]+)\)\s*")
_LINE = re.compile(r"^hmm_\w+\s+N=\s*([\d,]+)\s+(float32|float64)\s+cores=(\d+)\s+plain=[\d.]+ms"
                   r"\s+serial=([\d.]+)x\s+thread=([\d.]+)x")


def hmm_rows(paths):
    """{(python, jax, dtype): {variant: [(sequences, ratio to plain)]}} from bench_gradients lines."""
    out = defaultdict(lambda: defaultdict(list))
    for path in paths:
        stack = None
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                line = line.strip()
                block = _BLOCK.match(line)
                if block:
                    stack = block.groups()
                    continue
                prefix = _PREFIX.match(line)
                line_stack = prefix.groups() if prefix else stack
                match = _LINE.match(line[prefix.end():] if prefix else line)
                if not match or line_stack is None:
                    continue
                n, dtype, _, serial, thread = match.groups()
                key = (*line_stack, dtype)
                out[key]["thread"].append((int(n.replace(",", "")), float(thread)))
                out[key]["serial"].append((int(n.replace(",", "")), float(serial)))
    for per in out.values():
        for points in per.values():
            points.sort()
    return out


def scaling(path):
    """{likelihood: {workers: (plain seconds, threads seconds)}} from bench_scaling's JSON lines."""
    out = defaultdict(dict)
    inside = False
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("===="):
                inside = line.strip().endswith("cpu_scaling.jsonl")
                continue
            if inside and line.startswith("{"):
                rec = json.loads(line)
                out[rec["likelihood"]][int(rec["workers"])] = (rec["seconds"]["plain"],
                                                               rec["seconds"]["threads"])
    return out


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path):
    # No software version or date in the file: the same results give the same bytes.
    fig.savefig(path, dpi=100, metadata={"Software": None})


def draw_rows(data, path):
    plt = _pyplot()
    dtypes = ("float32", "float64")
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.2), sharey=True)
    styles = {"thread": "-", "serial": ":"}
    colors = {"3.11": "tab:blue", "3.12": "tab:orange"}
    labels = {"thread": "ThreadExecutor()", "serial": "SerialExecutor()"}
    for ax, dtype in zip(axes, dtypes):
        for (python, jax, dt), per in sorted(data.items()):
            if dt != dtype:
                continue
            for variant in ("thread", "serial"):
                points = per[variant]
                ax.plot([n for n, _ in points], [r for _, r in points], styles[variant],
                        marker="o", markersize=3.5, color=colors.get(python, "gray"),
                        label=f"{labels[variant]}, Python {python} (jax {jax})")
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=0.8, label="plain NumPyro")
        ax.set_xscale("log")
        ax.set_title(f"HMM, 4 states, 100 steps, {dtype}", fontsize=9)
        ax.set_xlabel("sequences (rows)")
        ax.grid(True, which="major", linewidth=0.3)
    axes[0].set_ylabel("speedup over plain NumPyro, per gradient")
    axes[0].set_ylim(bottom=0)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=3, frameon=False)
    fig.suptitle("2 cores, Intel Xeon (KVM), 2026-11-26", fontsize=9)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    _save(fig, path)
    plt.close(fig)


def draw_cores(data, path):
    plt = _pyplot()
    names = {"hmm_50k": "HMM, 50,000 sequences", "negbin_1M": "negative binomial, 1M rows"}
    fig, axes = plt.subplots(1, len(data), figsize=(9, 3.6), sharey=True, squeeze=False)
    for ax, (name, per) in zip(axes[0], sorted(data.items())):
        workers = sorted(per)
        plain_one = per[1][0]
        ax.plot(workers, [plain_one / per[w][1] for w in workers], "-o", markersize=3.5,
                color="tab:blue", label="ThreadExecutor(w), host route")
        ax.plot(workers, [plain_one / per[w][0] for w in workers], "-o", markersize=3.5,
                color="tab:gray", label="plain NumPyro on w cores")
        ax.plot(workers, workers, ":", color="black", linewidth=0.8, label="w times one core")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xticks(workers, [str(w) for w in workers])
        ticks = [1, 2, 4, 8, 16, 32]
        ax.set_yticks(ticks, [str(t) for t in ticks])
        ax.set_title(f"{names.get(name, name)}, float32", fontsize=9)
        ax.set_xlabel("w = workers = cores")
        ax.grid(True, which="major", linewidth=0.3)
    axes[0][0].set_ylabel("speedup over plain NumPyro on 1 core")
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle("16 cores, Intel Xeon (KVM), 2026-11-26", fontsize=9)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=RESULTS, help="folder of the results files")
    parser.add_argument("--out", default=STATIC, help="folder for the PNGs")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = hmm_rows([os.path.join(args.results, f) for f in HMM_FILES])
    cores = scaling(os.path.join(args.results, SCALING_FILE))
    if not rows or not cores:
        raise SystemExit(f"no data read from {args.results}: rows {bool(rows)}, cores {bool(cores)}")
    written = [os.path.join(args.out, "speedup_rows_hmm.png"),
               os.path.join(args.out, "speedup_cores_16.png")]
    draw_rows(rows, written[0])
    draw_cores(cores, written[1])
    print("\n".join(written))
    return written


if __name__ == "__main__":
    main()
