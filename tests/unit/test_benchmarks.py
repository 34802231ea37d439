"""The benchmark harness (``python -m benchmarks``): a tiny real run, its records and report.

The harness is not installed with the package: it runs from the repository root, as its
users run it, in a subprocess (``gradients`` at a tiny size, one round); the records and
the report are read in this process with the repository root on ``sys.path``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import platform
import subprocess
import sys

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def bench(monkeypatch):
    """The ``benchmarks`` package of this repository, imported from its root."""
    monkeypatch.syspath_prepend(ROOT)
    import benchmarks.records
    import benchmarks.report

    return benchmarks


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Records of ``python -m benchmarks gradients`` on two tiny likelihoods."""
    out = tmp_path_factory.mktemp("bench") / "run.jsonl"
    cmd = [sys.executable, "-m", "benchmarks", "gradients", "--likelihoods", "negbin:64,hmm:24",
           "--variants", "serial,thread", "--rounds", "1", "--loop", "2", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(out, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh], done.stdout


@pytest.mark.slow
def test_gradients_writes_one_record_per_likelihood_and_variant(run, bench):
    recs, _ = run
    assert [(r["likelihood"], r["rows"], r["variant"]) for r in recs] == [
        (m, n, v) for m, n in (("negbin", 64), ("hmm", 24)) for v in ("plain", "serial", "thread")]
    for r in recs:
        assert list(r) == list(bench.records.FIELDS)
        assert r["bench"] == "gradients" and r["dtype"] == "float32" and r["rounds"] == 1
        assert r["settings"] == {"loop": 2, "sets": 0}
        assert r["python"] == platform.python_version() and r["jax"] == jax.__version__
        assert r["cores"] >= 1 and f"{r['cores']} cores" in r["machine"]
        assert 0 < r["seconds"] < 10
    for model in ("negbin", "hmm"):
        per = {r["variant"]: r for r in recs if r["likelihood"] == model}
        assert per["plain"]["ratio"] == 1.0 and per["plain"]["info"] == {}
        for v in ("serial", "thread"):
            assert per[v]["ratio"] == pytest.approx(per["plain"]["seconds"] / per[v]["seconds"])
            assert per[v]["info"]["route"] in ("graph", "host")
        assert per["serial"]["info"]["route"] == "graph"  # SerialExecutor never leaves the graph


def test_report_renders_the_run_as_one_table(run, bench, tmp_path):
    recs, stdout = run
    path = tmp_path / "copy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    text = bench.report.render(bench.records.load([str(path)]))
    lines = text.splitlines()
    assert lines[0].startswith("**gradients** · ") and "loop 2" in lines[0]
    assert lines[2:4] == ["| likelihood | rows | plain ms | serial | thread |",
                          "|---|---:|---:|---:|---:|"]
    rows = [line for line in lines if line.startswith(("| negbin", "| hmm"))]
    assert len(rows) == 2
    for line, model in zip(rows, ("negbin", "hmm")):
        per = {r["variant"]: r for r in recs if r["likelihood"] == model}
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:2] == [model, f"{per['plain']['rows']:,}"]
        assert float(cells[2]) == pytest.approx(per["plain"]["seconds"] * 1e3, rel=1e-2, abs=1e-3)
        assert cells[3] == f"{per['serial']['ratio']:.2f}x"
        assert cells[4] == f"{per['thread']['ratio']:.2f}x ({per['thread']['info']['route']})"
    assert text.strip() in stdout  # the run printed the same table at its end


def test_report_never_mixes_settings_and_rejects_other_json(bench, tmp_path):
    env = {"machine": "m", "date": "2026-01-01", "python": "3.11.7", "jax": "0.10.2",
           "numpyro": "0.22.0", "cores": 2}
    recs = [bench.records.record(env, "gradients", "hmm", 1000, "float32", v, s, 0.01, 3,
                                 {"loop": loop, "sets": 0})
            for loop in (1, 4) for v, s in (("plain", 0.01), ("thread", 0.005))]
    tables = bench.report.tables(recs)
    assert len(tables) == 2 and all("| hmm | 1,000 | 10.00 | 2.00x |" in t for t in tables)
    bad = tmp_path / "old.jsonl"
    bad.write_text(json.dumps({"likelihood": "hmm_1k", "seconds": {"plain": 0.1}}) + "\n")
    with pytest.raises(ValueError, match=r"old.jsonl:1: not a benchmark record: missing"):
        bench.records.load([str(bad)])


def test_report_puts_stacks_side_by_side(bench):
    """``--stacks``: one table per machine, precision and settings, a group of columns per
    Python/jax stack in version order; a case one stack lacks shows "-"; ``--bench``
    keeps the kinds of run asked for."""
    rec = bench.records.record
    recs = []
    for python, jax_version, ratio in (("3.12.1", "0.12.0.1", 3.0), ("3.11.7", "0.10.2", 2.0)):
        env = {"machine": "m", "date": "2026-01-01", "python": python, "jax": jax_version,
               "numpyro": "0.22.0", "cores": 2}
        cases = [("hmm", 1000)] + ([("negbin", 2000)] if python == "3.11.7" else [])
        recs += [rec(env, "gradients", name, n, "float32", v, s, 0.01, 3,
                     {"loop": 4, "sets": 0}, {"route": "host"} if v == "thread" else {})
                 for name, n in cases for v, s in (("plain", 0.01), ("thread", 0.01 / ratio))]
        recs.append(rec(env, "device", "hmm", 1000, "float32", "plain", 0.01, 0.01, 3))
    (table,) = bench.report.tables(recs, stacks=True, benches=["gradients"])
    lines = table.splitlines()
    assert "Python 3.11.7, jax 0.10.2; Python 3.12.1, jax 0.12.0.1" in lines[0]
    assert lines[2] == ("| likelihood | rows | py3.11 plain ms | py3.11 thread | py3.12 plain ms "
                        "| py3.12 thread |")
    assert lines[4:] == ["| hmm | 1,000 | 10.00 | 2.00x (host) | 10.00 | 3.00x (host) |",
                         "| negbin | 2,000 | 10.00 | 2.00x (host) | - | - |"]
    assert len(bench.report.tables(recs)) == 4  # without --stacks: one per stack and kind


def test_plots_are_drawn_from_records(bench, tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.plots import plot

    env = {"machine": "m, 16 cores", "date": "2026-01-01", "python": "3.12.1", "jax": "0.12.0",
           "numpyro": "0.22.0", "cores": 16}
    rec = bench.records.record
    recs = [rec(env, "gradients", "hmm", n, "float32", v, s, 0.01, 3, {"loop": 4, "sets": 0})
            for n in (1000, 10_000) for v, s in (("plain", 0.01), ("serial", 0.008),
                                                 ("thread", 0.005))]
    recs += [rec(env, "scaling", "hmm", 1000, "float32", v, s / w, 0.01 / w, 3,
                 {"loop": 4, "workers": w})
             for w in (1, 2, 4) for v, s in (("plain", 0.01), ("thread_host", 0.004))]
    written = plot(recs, str(tmp_path))
    assert [os.path.basename(p) for p in written] == ["speedup_rows_hmm.png",
                                                      "speedup_cores_4.png"]
    for path in written:
        with open(path, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_harness_and_profile_share_the_timing(bench):
    import benchmarks.gradients as harness
    from benchmarks import nuts

    # The module, not the function `profile` that the plugin package exports.
    profile = importlib.import_module("parallel_backend.plugins.numpyro.profile")

    for name in ("time_interleaved", "warm_up", "medians"):
        assert getattr(harness, name) is getattr(profile, name)
    assert "StampedKernel" in inspect.getsource(nuts.run_one)


class _Settling:
    """An executor stand-in whose chunker settles after ``calls`` calls."""

    def __init__(self, calls):
        self.left = calls

    def stats(self):
        return {"sites": [{"settled": self.left <= 0}]}

    def __call__(self, x):
        self.left -= 1
        return x


def test_warm_up_waits_for_the_chunker_and_rounds_stretch_to_the_budget():
    from parallel_backend.plugins.numpyro.profile import time_interleaved, warm_up

    ex = _Settling(5)
    assert warm_up(ex, (1.0,), ex, calls=2) == 1.0 and ex.left == 0  # 5 calls, not 2
    ex = _Settling(100)
    warm_up(ex, (1.0,), ex, calls=2, most=7)
    assert ex.left == 93  # gave up at `most`
    times = time_interleaved([lambda x: x, lambda x: x], (1.0,), rounds=2)
    assert [len(t) for t in times] == [2, 2]
    slow = time_interleaved([lambda x: x], (1.0,), rounds=2, max_rounds=500, budget=1e-4)
    assert 2 < len(slow[0]) <= 500 and (sum(slow[0]) >= 1e-4 or len(slow[0]) == 500)



@pytest.mark.slow
def test_ceiling_times_two_halves_together_and_keeps_the_timeline(tmp_path):
    """``python -m benchmarks.ceiling``: one record per variant and the ceiling (two
    processes, each half the rows), ratios to plain of the same run; the threads' record
    keeps their last evaluation, which ``python -m benchmarks plot`` draws."""
    out = tmp_path / "ceiling.jsonl"
    cmd = [sys.executable, "-m", "benchmarks.ceiling", "--likelihoods", "hmm:400",
           "--rounds", "1", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "threads / ceiling" in done.stdout
    with open(out, encoding="utf-8") as fh:
        recs = [json.loads(line) for line in fh]
    assert [r["variant"] for r in recs] == ["plain", "serial", "thread", "thread_host",
                                            "ceiling"]
    plain = recs[0]["seconds"]
    assert all(r["bench"] == "ceiling" and r["ratio"] == pytest.approx(plain / r["seconds"])
               for r in recs)
    kept = [r for r in recs if r["info"].get("timeline")]
    assert [r["variant"] for r in kept] == ["thread"]
    span = kept[0]["info"]["timeline"]
    blocks = sorted((c["first_block"], c["blocks"]) for c in span["chunks"])
    covered = [b for first, n in blocks for b in range(first, first + n)]
    assert covered == list(range(-(-400 // kept[0]["info"]["block_rows"])))  # each once
    drawn = subprocess.run([sys.executable, "-m", "benchmarks", "plot", str(out), "--out",
                            str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                           timeout=300, check=False)
    assert drawn.returncode == 0, drawn.stdout + drawn.stderr
    assert (tmp_path / "timeline_hmm.png").stat().st_size > 1000
