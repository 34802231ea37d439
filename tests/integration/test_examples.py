"""Every example runs at a small size, and the notebook executes without a failing cell.

Examples run as scripts in subprocesses (as a user runs them); the notebook runs on
the ``python3`` kernel through ``nbclient``, with the kernel started from this
interpreter so that it sees the same environment.
"""

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


def test_logistic_regression():
    out = run_example("logistic_regression.py", "--rows", "3000", "--workers", "2", *SMALL)
    assert "speedup over plain NumPyro:" in out and "thread executor (2 workers" in out
    assert "alpha" in out and "r_hat" in out


def test_hmm():
    out = run_example("hmm.py", "--sequences", "200", "--length", "8", "--workers", "2", *SMALL)
    assert "means[0]" in out and "sigma" in out


def test_hierarchical():
    out = run_example("hierarchical.py", "--rows", "2000", "--groups", "8", "--workers", "2",
                      *SMALL)
    assert "tau" in out and "elpd_loo" in out


def test_svi():
    out = run_example("svi.py", "--rows", "4000", "--steps", "100", "--workers", "2")
    assert "speedup over plain NumPyro:" in out and "beta (guide means):" in out
    gap = float(out.split("largest relative difference of the losses:")[1].split()[0])
    assert gap < 1e-4  # float32: the same losses to round-off


@pytest.mark.dask
def test_dask_cluster():
    pytest.importorskip("distributed")
    out = run_example("dask_cluster.py", "--rows", "3000", *SMALL)
    assert "dask" in out and "alpha" in out


def test_diagnostics_notebook():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    from jupyter_client.manager import KernelManager

    nb = nbformat.read(os.path.join(EXAMPLES, "diagnostics.ipynb"), as_version=4)
    os.environ.update(PB_NB_ROWS="3000", PB_NB_WARMUP="60", PB_NB_SAMPLES="30")
    try:
        # The kernel is this interpreter (the project's venv), whatever kernelspecs exist.
        km = KernelManager(kernel_name="python3")
        km.kernel_cmd = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        client = nbclient.NotebookClient(nb, km=km, timeout=300,
                                         resources={"metadata": {"path": EXAMPLES}})
        client.execute()  # raises CellExecutionError on the first failing cell
    finally:
        for k in ("PB_NB_ROWS", "PB_NB_WARMUP", "PB_NB_SAMPLES"):
            os.environ.pop(k, None)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # the trace plot, the posterior predictive check, the speedup plot
    text = "".join(str(o.get("data", {}).get("text/plain", "")) + o.get("text", "")
                   for o in outputs)
    assert "elpd_loo" in text and "r_hat" in text
