"""The demo (the main job) and the ``parallel-backend`` command, at a small size."""

import subprocess
import sys

import numpy as np
import pytest

from parallel_backend.plugins.cli.demo import hmm_loglik, make_hmm_data, run_demo


def test_hmm_loglik_is_the_forward_algorithm():
    """Against the likelihood summed over every state path, enumerated, for short sequences."""
    import itertools

    import jax.numpy as jnp

    obs, truth = make_hmm_data(3, n_steps=4, dtype=np.float64)
    trans, mu, sigma = truth["trans"], truth["mu"], truth["sigma"]
    got = np.asarray(hmm_loglik(jnp.asarray(obs, jnp.float32), jnp.log(trans), jnp.asarray(mu),
                                jnp.asarray(sigma)))
    expected = []
    for y in obs:
        total = 0.0
        for path in itertools.product(range(4), repeat=len(y)):
            p = 0.25 * np.prod([trans[a, b] for a, b in zip(path, path[1:])])
            dens = np.prod(np.exp(-0.5 * ((y - mu[list(path)]) / sigma) ** 2)
                           / (sigma * np.sqrt(2 * np.pi)))
            total += p * dens
        expected.append(np.log(total))
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def check_report(out, lines, workers=2):
    assert out["seconds_plain"] > 0 and out["seconds_parallel"] > 0
    assert out["speedup"] == out["seconds_plain"] / out["seconds_parallel"]
    assert out["ms_per_gradient_plain"] > 0 and out["ms_per_gradient_parallel"] > 0
    assert out["stats"]["calls"] > 50 and out["stats"]["workers"] == workers
    text = "\n".join(lines)
    assert "speedup" in text and "per gradient inside NUTS" in text and "truth:" in text


def demo_agreeing_with_plain(**kw):
    """``run_demo(**kw)``, its report checked, its two posteriors compared (the same
    model, data and seed: means within Monte Carlo error)."""
    lines = []
    out = run_demo(num_chains=2, workers=2, progress_bar=False, print_fn=lines.append, **kw)
    check_report(out, lines)
    for name, a in out["means_plain"].items():
        np.testing.assert_allclose(a, out["means_parallel"][name], atol=0.15, rtol=0.1)
    return out


def test_run_demo_negbin_fits_and_agrees_with_plain():
    demo_agreeing_with_plain(model="negbin", rows=3000, num_warmup=100, num_samples=100)


def test_run_demo_hmm_reports():
    """The HMM at a tiny size: short warmup leaves NUTS with deep trees, so only the
    report is checked here; the posterior against plain and the truth is the slow test."""
    lines = []
    out = run_demo(model="hmm", sequences=20, num_warmup=20, num_samples=20, num_chains=2,
                   workers=2, progress_bar=False, print_fn=lines.append)
    check_report(out, lines)
    assert set(out["means_parallel"]) == {"mu", "sigma", "trans"}
    assert np.all(np.diff(out["means_parallel"]["mu"]) > 0)  # ordered states


@pytest.mark.slow
def test_run_demo_hmm_agrees_with_plain_and_truth():
    out = demo_agreeing_with_plain(model="hmm", sequences=300, num_warmup=150, num_samples=150)
    np.testing.assert_allclose(out["means_parallel"]["mu"], out["truth"]["mu"], atol=0.3)


def test_cli_demo_runs_and_reports():
    proc = subprocess.run(
        [sys.executable, "-m", "parallel_backend.plugins.cli.main", "demo", "--sequences",
         "20", "--warmup", "15", "--samples", "15", "--workers", "2", "--no-progress"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "speedup" in proc.stdout and "r_hat" in proc.stdout


@pytest.mark.parametrize("flag", ["--rows", "--sequences", "--warmup"])
def test_cli_rejects_bad_sizes(flag):
    proc = subprocess.run([sys.executable, "-m", "parallel_backend.plugins.cli.main", "demo",
                           flag, "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and flag in proc.stderr and "positive" in proc.stderr
