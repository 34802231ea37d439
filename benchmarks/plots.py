"""The plots of ``docs/performance.md`` from benchmark records: ``python -m benchmarks plot``.

Three figures, drawn from records (:mod:`.records`) and nothing typed in by hand:

- ``speedup_rows_<likelihood>.png``, from ``gradients`` records of one likelihood at
  several row counts: ``ThreadExecutor()`` (solid) and ``SerialExecutor()`` (dotted) as
  ratios to plain NumPyro in the same run, one line per Python and jax version, one panel
  per precision.
- ``speedup_cores_<cores>.png``, from ``scaling`` records: ``ThreadExecutor(w,
  dispatch="host")`` and plain NumPyro on ``w`` cores, each against plain NumPyro pinned
  to one core, one panel per likelihood.
- ``timeline_<likelihood>.png``, from the last record that keeps a timeline (``ceiling``
  records keep ``ThreadExecutor()``'s last evaluation): one evaluation as
  ``ProfileReport.plot_timeline()`` draws it, a row per worker.

The PNGs are committed (the docs build only shows them); draw them again when their
records change. Same records, same bytes: no date or version in the files' metadata.
Imports matplotlib.
"""

from __future__ import annotations

from collections import defaultdict

__all__ = ["cores_data", "draw_cores", "draw_rows", "draw_timeline", "plot", "rows_data",
           "timeline_record"]


def _when(recs) -> str:
    dates = sorted({r["date"] for r in recs})
    return dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"


def rows_data(records, likelihood=None):
    """``(likelihood, {(python, jax, dtype): {variant: [(rows, ratio)]}}, records used)``
    from the ``gradients`` records of ``likelihood`` (default: the one measured at the
    most row counts)."""
    grads = [r for r in records if r["bench"] == "gradients" and r["ratio"] is not None]
    if likelihood is None:
        sizes = defaultdict(set)
        for r in grads:
            sizes[r["likelihood"]].add(r["rows"])
        if not sizes:
            return None, {}, []
        likelihood = max(sorted(sizes), key=lambda k: len(sizes[k]))
    used = [r for r in grads if r["likelihood"] == likelihood
            and r["variant"] in ("thread", "serial") and not r["settings"].get("sets")]
    latest = {(r["python"], r["jax"], r["dtype"], r["variant"], r["rows"]): r["ratio"]
              for r in used}
    out = defaultdict(lambda: defaultdict(list))
    for (python, jax, dtype, variant, rows), ratio in sorted(latest.items()):
        out[(python, jax, dtype)][variant].append((rows, ratio))
    return likelihood, out, used


def cores_data(records):
    """``({likelihood: {workers: (plain seconds, threads seconds)}}, records used)`` from
    the ``scaling`` records."""
    used = [r for r in records if r["bench"] == "scaling"]
    out = defaultdict(dict)
    for r in used:
        w = int(r["settings"]["workers"])
        plain, threads = out[r["likelihood"], r["rows"]].get(w, (None, None))
        if r["variant"] == "plain":
            plain = r["seconds"]
        elif r["variant"] == "thread_host":
            threads = r["seconds"]
        out[r["likelihood"], r["rows"]][w] = (plain, threads)
    return ({k: v for k, v in out.items()
             if all(p and t for p, t in v.values()) and 1 in v}, used)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path):
    # No software version or date in the file: the same results give the same bytes.
    fig.savefig(path, dpi=100, metadata={"Software": None})


def draw_rows(data, path, title="", what="HMM, 4 states, 100 steps",
              xlabel="sequences (rows)"):
    plt = _pyplot()
    dtypes = ("float32", "float64")
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.2), sharey=True)
    styles = {"thread": "-", "serial": ":"}
    colors = {"3.11": "tab:blue", "3.12": "tab:orange"}
    labels = {"thread": "ThreadExecutor()", "serial": "SerialExecutor()"}
    for ax, dtype in zip(axes, dtypes):
        for (python, jax, dt), per in sorted(data.items()):
            python = ".".join(python.split(".")[:2])
            if dt != dtype:
                continue
            for variant in ("thread", "serial"):
                points = per[variant]
                ax.plot([n for n, _ in points], [r for _, r in points], styles[variant],
                        marker="o", markersize=3.5, color=colors.get(python, "gray"),
                        label=f"{labels[variant]}, Python {python} (jax {jax})")
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=0.8, label="plain NumPyro")
        ax.set_xscale("log")
        ax.set_title(f"{what}, {dtype}", fontsize=9)
        ax.set_xlabel(xlabel)
        ax.grid(True, which="major", linewidth=0.3)
    axes[0].set_ylabel("speedup over plain NumPyro, per gradient")
    axes[0].set_ylim(bottom=0)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=3, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    _save(fig, path)
    plt.close(fig)


def draw_cores(data, path, title="", dtype="float32"):
    plt = _pyplot()
    names = {"hmm": "HMM, {:,} sequences", "negbin": "negative binomial, {:,} rows"}
    fig, axes = plt.subplots(1, len(data), figsize=(9, 3.6), sharey=True, squeeze=False)
    for ax, ((name, rows), per) in zip(axes[0], sorted(data.items())):
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
        ticks = [t for t in (1, 2, 4, 8, 16, 32, 64, 128) if t <= 2 * max(workers)]
        ax.set_yticks(ticks, [str(t) for t in ticks])
        label = names.get(name, name + ", {:,} rows").format(rows)
        ax.set_title(f"{label}, {dtype}", fontsize=9)
        ax.set_xlabel("w = workers = cores")
        ax.grid(True, which="major", linewidth=0.3)
    axes[0][0].set_ylabel("speedup over plain NumPyro on 1 core")
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def timeline_record(records):
    """The last record that keeps an evaluation's timeline (``info["timeline"]``), or
    ``None``."""
    kept = [r for r in records if r["info"].get("timeline")]
    return kept[-1] if kept else None


def draw_timeline(rec, path):
    """``rec``'s evaluation as ``pb.profile``'s report draws it
    (``profile.draw_evaluation``): a row per worker, its chunks as bars, the callback and
    the caller's program around it (to the record's seconds per gradient), the largest
    loss in the title."""
    plt = _pyplot()
    from parallel_backend.plugins.numpyro.profile import draw_evaluation
    from parallel_backend.timeline import EvaluationSpan, shares

    span = EvaluationSpan.from_dict(rec["info"]["timeline"])
    workers = int(rec["info"]["workers"])
    name = {"hmm": "HMM"}.get(rec["likelihood"], rec["likelihood"])
    label = f"ThreadExecutor(), {name}, {rec['rows']:,} rows, {rec['dtype']}"
    ax = draw_evaluation(span, label, workers, rec["seconds"],
                         shares([span], workers, rec["seconds"]))
    ax.figure.suptitle(f"{rec['machine']}, {rec['date']}", fontsize=8, x=0.99, ha="right")
    ax.figure.tight_layout()
    _save(ax.figure, path)
    plt.close(ax.figure)


def plot(records, out, likelihood=None) -> list:
    """Draw every figure ``records`` hold data for into the folder ``out``; returns the
    paths written."""
    import os

    os.makedirs(out, exist_ok=True)
    written = []
    name, rows, used = rows_data(records, likelihood)
    if rows:
        r = used[0]
        title = f"{r['machine']}, {_when(used)}"
        what = {"hmm": "HMM, 4 states, 100 steps"}.get(name, name)
        xlabel = "sequences (rows)" if name == "hmm" else "rows"
        written.append(os.path.join(out, f"speedup_rows_{name}.png"))
        draw_rows(rows, written[-1], title, what, xlabel)
    cores, used = cores_data(records)
    if cores:
        most = max(int(r["settings"]["workers"]) for r in used)
        title = f"{used[0]['machine']}, {_when(used)}"
        written.append(os.path.join(out, f"speedup_cores_{most}.png"))
        draw_cores(cores, written[-1], title, used[0]["dtype"])
    rec = timeline_record(records)
    if rec is not None:
        written.append(os.path.join(out, f"timeline_{rec['likelihood']}.png"))
        draw_timeline(rec, written[-1])
    if not written:
        raise SystemExit("plot: no gradients records at several row counts, no scaling "
                         "records with one worker and no timeline among the records given")
    return written
