"""Plot speedup against worker count, one figure per likelihood, from benchmark results.

    python benchmarks/plot_speedup.py benchmarks/results --out docs/_generated

Reads every ``*.jsonl`` file (or the files given) and uses the per-gradient records,
those with a ``likelihood`` key: ``{"likelihood", "n", "dtype", "cores" (or
"workers"), "seconds": {variant: seconds}}``, as ``bench_gradients.py`` writes
them. Per likelihood it draws, for each dtype, the speedup of every variant
against the number of cores/workers the variant ran with, each relative to plain
NumPyro measured in the same run on the same cores. Writes
``speedup_<likelihood>.svg`` and a caption ``speedup_<likelihood>.txt`` beside it
(the docs build shows them). Other records (NUTS wall times) are skipped.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from collections import defaultdict

#: Legend labels of the variants that bench_gradients.py times.
LABELS = {"serial": "SerialExecutor", "thread": "ThreadExecutor (auto)",
          "thread_host": "ThreadExecutor (host)", "dask": "DaskExecutor (auto)",
          "dask_host": "DaskExecutor (host)", "device": "DeviceExecutor (auto)",
          "device_host": "DeviceExecutor (host)", "device_graph": "DeviceExecutor (shard_map)",
          "device_graph_nocse": "DeviceExecutor (shard_map, XLA CSE off)",
          "plain_nocse": "plain NumPyro (XLA CSE off)"}


def load(paths):
    """Speedups of every per-gradient record: {(likelihood, n): {dtype: {variant: {workers: [x]}}}}.

    Each speedup is the record's plain-NumPyro seconds divided by the variant's, both
    from the same run on the same cores, so records of different runs (files) are
    never divided by each other; where several give the same point, the plot shows
    their mean.
    """
    out = defaultdict(lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(list))))
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    continue
                rec = json.loads(line)
                seconds = rec.get("seconds")
                if "likelihood" not in rec or not isinstance(seconds, dict):
                    continue
                plain = seconds.get("plain")
                if not isinstance(plain, (int, float)) or plain <= 0:
                    continue
                workers = int(rec.get("workers", rec.get("cores", 1)))
                for variant, s in seconds.items():
                    if variant != "plain" and isinstance(s, (int, float)) and s > 0:
                        out[(rec["likelihood"], rec["n"])][rec["dtype"]][variant][workers].append(
                            plain / s)
    return out


def draw(name, n, per_dtype, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.hashsalt"] = "parallel_backend"
    dtypes = sorted(per_dtype)
    fig, axes = plt.subplots(1, len(dtypes), figsize=(4.2 * len(dtypes), 3.4), squeeze=False)
    most = 1
    for ax, dtype in zip(axes[0], dtypes):
        variants = per_dtype[dtype]
        if "thread" in variants and 1 in variants.get("serial", {}):
            # ThreadExecutor(1) keeps the block loop in the graph: it is SerialExecutor.
            variants["thread"].setdefault(1, variants["serial"][1])
        for variant in sorted(variants):
            points = sorted((w, sum(v) / len(v)) for w, v in variants[variant].items())
            most = max(most, *(w for w, _ in points))
            ax.plot([w for w, _ in points], [y for _, y in points], marker="o",
                    label=LABELS.get(variant, variant))
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=0.8, label="plain NumPyro")
        ax.set_title(f"{name} ({n:,} rows, {dtype})", fontsize=9)
        ax.set_xlabel("cores / workers")
        ax.set_ylabel("speedup over plain NumPyro")
        ax.legend(fontsize=7)
    for ax in axes[0]:
        ax.set_xticks(range(1, most + 1))
    fig.tight_layout()
    base = os.path.join(out_dir, f"speedup_{name}")
    # A fixed hash salt and no date: the same results give the same file.
    fig.savefig(base + ".svg", metadata={"Date": None})
    plt.close(fig)
    with open(base + ".txt", "w", encoding="utf-8") as fh:
        fh.write(f"{name}: one value-and-gradient evaluation, {n:,} rows. Speedup of each "
                 "executor over plain NumPyro on the same cores in the same run, against the "
                 "cores or workers it ran with (at one core, plain NumPyro and the block loop "
                 "both run on one core; the thread executor then keeps the loop in the graph, "
                 "as SerialExecutor); above 1 is faster.\n")
    return base + ".svg"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="result files or folders of *.jsonl")
    parser.add_argument("--out", default="docs/_generated", help="folder for the figures")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    paths = []
    for p in args.results:
        paths += sorted(glob.glob(os.path.join(p, "*.jsonl"))) if os.path.isdir(p) else [p]
    os.makedirs(args.out, exist_ok=True)
    for old in glob.glob(os.path.join(args.out, "speedup_*")):
        os.remove(old)
    written = []
    for (name, n), per_dtype in sorted(load(paths).items()):
        written.append(draw(name, n, per_dtype, args.out))
    if not args.quiet:
        print("\n".join(written))
    return written


if __name__ == "__main__":
    main()
