"""The demo (the main job) and the ``parallel-backend`` command, at a small size."""

import subprocess
import sys

import numpy as np

from parallel_backend.demo import run_demo


def test_run_demo_fits_both_and_agrees():
    lines = []
    out = run_demo(n_rows=3000, num_warmup=150, num_samples=150, workers=2,
                   progress_bar=False, print_fn=lines.append)
    assert out["seconds_plain"] > 0 and out["seconds_parallel"] > 0
    assert out["speedup"] == out["seconds_plain"] / out["seconds_parallel"]
    assert out["stats"]["calls"] > 100 and out["stats"]["workers"] == 2
    text = "\n".join(lines)
    assert "speedup" in text and "chunks of" in text
    # The same model and seed: both posteriors sit on the truth's side of the prior.
    for name in ("alpha", "beta", "phi"):
        a, b = np.asarray(out["means_plain"][name]), np.asarray(out["means_parallel"][name])
        np.testing.assert_allclose(a, b, atol=0.15, rtol=0.1)


def test_cli_demo_runs_and_reports():
    proc = subprocess.run(
        [sys.executable, "-m", "parallel_backend.cli", "demo", "--rows", "2000", "--warmup", "40",
         "--samples", "40", "--workers", "2", "--no-progress"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "speedup" in proc.stdout and "r_hat" in proc.stdout


def test_cli_rejects_bad_sizes():
    proc = subprocess.run([sys.executable, "-m", "parallel_backend.cli", "demo", "--rows", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--rows" in proc.stderr
