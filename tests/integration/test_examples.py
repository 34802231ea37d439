"""Every example runs at a small size, and the notebooks execute without a failing cell.

Examples run as scripts in subprocesses (as a user runs them); the notebooks run through
``examples/execute_notebooks.py`` (``nbclient``, a kernel started from this interpreter so
that it sees the same environment), small, their sizes set by environment variables.
"""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
SMALL = ["--warmup", "40", "--samples", "20", "--chains", "2"]


def run_example(name, *args, timeout=300):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args],
                         capture_output=True, check=False, text=True, timeout=timeout, env=env,
                         cwd=ROOT)
    assert out.returncode == 0, f"{name} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


@pytest.mark.slow
def test_logistic_regression():
    out = run_example("logistic_regression.py", "--rows", "3000", "--workers", "2", *SMALL)
    assert "speedup over plain NumPyro:" in out and "thread executor (2 workers" in out
    assert "alpha" in out and "r_hat" in out


@pytest.mark.slow
def test_hmm():
    out = run_example("hmm.py", "--sequences", "200", "--length", "8", "--workers", "2", *SMALL)
    assert "means[0]" in out and "sigma" in out


@pytest.mark.slow
def test_hierarchical():
    out = run_example("hierarchical.py", "--rows", "2000", "--groups", "8", "--workers", "2",
                      *SMALL)
    assert "tau" in out and "elpd_loo" in out


@pytest.mark.slow
def test_svi():
    out = run_example("svi.py", "--rows", "4000", "--steps", "100", "--workers", "2")
    assert "speedup over plain NumPyro:" in out and "beta (guide means):" in out
    gap = float(out.split("largest relative difference of the losses:")[1].split()[0])
    assert gap < 1e-4  # float32: the same losses to round-off


@pytest.mark.slow
@pytest.mark.dask
def test_dask_cluster():
    pytest.importorskip("distributed")
    out = run_example("dask_cluster.py", "--rows", "3000", *SMALL)
    assert "dask" in out and "alpha" in out


@pytest.mark.slow
def test_model_comparison():
    """Two models compared with pb.loo and arviz.compare, pb.loo holding less than the
    log_likelihood group would."""
    out = run_example("model_comparison.py", "--rows", "20000", "--warmup", "40", "--samples",
                      "20", "--chains", "2", "--memory", "200000")
    lines = [ln for ln in out.splitlines() if "numpy's peak" in ln]
    assert [ln.split(":")[0] for ln in lines] == ["normal", "student_t"], out
    for ln in lines:
        peak = float(ln.split("numpy's peak ")[1].split(" MiB")[0])
        group = float(ln.split("would take ")[1].split(" MiB")[0])
        assert peak < group, ln
    assert "student_t" in out.split("numpy's peak")[-1] and "normal" in out, out


def execute_notebook(name, **sizes):
    """Run ``examples/<name>`` on a fresh kernel of this interpreter with the environment
    variables ``sizes`` (a small run), through the runner that stores the notebooks'
    outputs; returns its outputs, every failing cell raising ``CellExecutionError``."""
    pytest.importorskip("nbclient")
    spec = importlib.util.spec_from_file_location(
        "execute_notebooks", os.path.join(EXAMPLES, "execute_notebooks.py"))
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    nb = runner.execute(os.path.join(EXAMPLES, name), env={**os.environ, **sizes}, timeout=300)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(str(o.get("data", {}).get("text/plain", "")) + o.get("text", "")
                   for o in outputs)
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    return text, images


@pytest.mark.slow  # executes the notebook, half a minute
def test_diagnostics_notebook():
    text, images = execute_notebook("diagnostics.ipynb", PB_NB_ROWS="3000", PB_NB_WARMUP="60",
                                    PB_NB_SAMPLES="30", PB_NB_TIMING_ROWS="20000")
    assert len(images) >= 3  # the trace plot, the posterior predictive check, the speedup plot
    assert "elpd_loo" in text and "r_hat" in text
    # pb.sample's progress bar shows in Jupyter (its stdout is not a terminal)
    assert "sample: 100%" in text and "grad/s=" in text and "workers=2" in text


@pytest.mark.slow  # executes the notebook with a local cluster, half a minute
@pytest.mark.dask
def test_dask_cluster_notebook():
    pytest.importorskip("distributed")
    text, images = execute_notebook("dask_cluster.ipynb", PB_NB_ROWS="2000", PB_NB_WARMUP="60",
                                    PB_NB_SAMPLES="30")
    assert len(images) >= 2  # the trace plot, the posterior predictive check
    assert "'executor': 'dask'" in text and "'workers': 2" in text and "r_hat" in text
    calls = int(text.split("'calls': ")[1].split(",")[0])
    assert calls > 90  # every gradient of 90 iterations ran on the cluster
