"""The demo (the main job) and the ``parallel-backend`` command, at a small size: its
report, its convergence verdict against the simulated truth, and its two fits agreeing."""

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from parallel_backend.plugins.cli.demo import HMM_TRUTH, hmm_loglik, make_hmm_data, run_demo
from parallel_backend.plugins.cli.diagnostics import diagnose, format_summary, rhat_limit, verdict


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
            p = 0.25 * np.prod([trans[a, b] for a, b in itertools.pairwise(path)])
            dens = np.prod(np.exp(-0.5 * ((y - mu[list(path)]) / sigma) ** 2)
                           / (sigma * np.sqrt(2 * np.pi)))
            total += p * dens
        expected.append(np.log(total))
    np.testing.assert_allclose(got, expected, rtol=1e-5)


# -- the verdict, on made-up draws (no sampling) --------------------------------------------


def fake_run(draws):
    """An object with what :func:`diagnose` reads: ``posterior`` (dims chain, draw, ...)
    and ``sample_stats.diverging``, from ``{name: array (chains, draws, ...)}``."""
    import xarray as xr

    posterior = xr.Dataset({k: (("chain", "draw") + tuple(f"{k}_dim_{i}" for i in
                                                          range(v.ndim - 2)), v)
                            for k, v in draws.items()})
    chains, n = next(iter(draws.values())).shape[:2]
    stats = xr.Dataset({"diverging": (("chain", "draw"), np.zeros((chains, n), bool))})
    return SimpleNamespace(posterior=posterior, sample_stats=stats)


def hmm_draws(chains=2, n=200, sd=0.01, seed=0):
    """Independent draws around the HMM's truth, sd ``sd``: a converged chain."""
    rng = np.random.default_rng(seed)
    return {k: np.asarray(v)[None, None] + sd * rng.standard_normal((chains, n) + np.shape(v))
            for k, v in HMM_TRUTH.items()}


def test_verdict_converged_for_draws_around_the_truth():
    d = diagnose(fake_run(hmm_draws()), ["mu", "sigma", "trans"], HMM_TRUTH)
    assert d.converged and d.reasons == ()
    assert len(d.rows) == 4 + 1 + 16 and d.rows[0].name == "mu[0]" and d.rows[4].name == "sigma"
    assert all(np.isfinite(r.ess) and r.ess > 100 and abs(r.rhat - 1) < 0.05 for r in d.rows)
    assert verdict(d).startswith("converged (smallest ESS")


def test_verdict_not_converged_when_a_mean_is_far_from_the_truth():
    """The demo at 50,000 sequences before: one chain, trans[0,0] 0.805 against 0.85 with
    a sd of 0.001 (printed as 0.000)."""
    draws = hmm_draws(chains=1, n=50, sd=0.001)
    draws["trans"][..., 0, 0] += 0.045
    d = diagnose(fake_run(draws), ["mu", "sigma", "trans"], HMM_TRUTH)
    assert not d.converged
    assert "1 of 21 posterior means more than 4 sd from the truth (worst trans[0,0]" \
        in d.reasons[0]
    assert verdict(d).startswith("NOT CONVERGED: ")
    table = format_summary(d)
    assert "0.000 " not in table and "0.0010" in table  # the sd, two significant digits
    assert "r_hat" not in table.splitlines()[0]  # one chain


def test_verdict_not_converged_for_a_stuck_or_wandering_chain():
    rng = np.random.default_rng(1)
    stuck = {"mu": np.full((1, 50, 4), HMM_TRUTH["mu"])}  # never moved: sd 0
    assert not diagnose(fake_run(stuck), ["mu"], HMM_TRUTH).converged
    walk = {"mu": HMM_TRUTH["mu"] + 0.01 * np.cumsum(rng.standard_normal((1, 50, 4)), axis=1)}
    d = diagnose(fake_run(walk), ["mu"], HMM_TRUTH)  # a random walk: a handful of draws' worth
    assert any(r.startswith("ESS ") for r in d.reasons), d.reasons


def test_verdict_not_converged_when_chains_disagree():
    draws = hmm_draws(chains=2, n=100)
    draws["mu"][1] += 0.01  # the second chain one sd off: both near the truth, r-hat high
    d = diagnose(fake_run(draws), ["mu"], HMM_TRUTH)
    assert any(r.startswith("r_hat ") for r in d.reasons), d.reasons
    assert rhat_limit(50) == pytest.approx(1.10) and rhat_limit(1000) == pytest.approx(1.05)


# -- the demo itself ------------------------------------------------------------------------


def check_report(out, lines, workers=2):
    """The report's figures are there and finite, both fits converged, and their posterior
    means agree within Monte Carlo error (4 standard errors of the difference)."""
    assert np.isfinite(out["speedup"]) and out["speedup"] > 0
    assert out["ms_per_gradient_plain"] > 0 and out["ms_per_gradient_parallel"] > 0
    assert out["stats"]["calls"] > 50 and out["stats"]["workers"] == workers
    text = "\n".join(lines)
    assert "speedup" in text and "per gradient inside NUTS" in text and "rule: converged =" in text
    assert text.count(": converged (smallest ESS") == 2, text[-3000:]
    assert "NOT CONVERGED" not in text
    plain, parallel = out["diagnosis_plain"], out["diagnosis_parallel"]
    assert out["converged"] and plain.converged and parallel.converged
    for a, b in zip(plain.rows, parallel.rows):
        assert a.name == b.name and np.isfinite([a.ess, b.ess, a.rhat, b.rhat]).all()
        error = np.hypot(a.sd / np.sqrt(a.ess), b.sd / np.sqrt(b.ess))
        assert abs(a.mean - b.mean) <= 4 * error, (a, b)


@pytest.mark.slow
def test_run_demo_hmm_converges_and_agrees_with_plain():
    """A proper small run: both fits start from the Laplace approximation (one MAP search
    through parallel_backend), two chains each, and both converge to the truth."""
    lines = []
    out = run_demo(model="hmm", sequences=100, num_warmup=50, num_samples=50, num_chains=2,
                   workers=2, progress_bar=False, print_fn=lines.append)
    check_report(out, lines)
    assert out["start"].inverse_mass_matrix is not None and out["start_seconds"] > 0
    assert lines[1].startswith("start (both fits): the MAP (200 Adam steps")
    assert np.all(np.diff(out["means_parallel"]["mu"]) > 0)  # ordered states


@pytest.mark.slow
def test_run_demo_negbin_converges_and_agrees_with_plain():
    lines = []
    out = run_demo(model="negbin", rows=3000, num_warmup=100, num_samples=100, num_chains=2,
                   workers=2, progress_bar=False, print_fn=lines.append)
    check_report(out, lines)


@pytest.mark.slow
def test_run_demo_hmm_converges_with_heuristic_start_and_long_warmup():
    """The heuristic start (the data's quantiles, mass matrix adapted in warmup) converges
    at a small size when warmup is long enough."""
    lines = []
    out = run_demo(model="hmm", sequences=300, num_warmup=150, num_samples=150, num_chains=2,
                   workers=2, init="heuristic", progress_bar=False, print_fn=lines.append)
    check_report(out, lines)


@pytest.mark.slow
def test_cli_demo_says_not_converged_for_a_too_short_run():
    """Two warmup iterations from the heuristic start: the command says so, for both fits,
    still prints the speedup, ESS and the rule, and exits with status 2."""
    proc = subprocess.run(
        [sys.executable, "-m", "parallel_backend.plugins.cli.main", "demo", "--sequences",
         "200", "--warmup", "2", "--samples", "20", "--init", "heuristic", "--workers", "2",
         "--no-progress"], check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    out = proc.stdout
    assert "speedup" in out and " ess" in out and "rule: converged =" in out
    assert "plain NumPyro: NOT CONVERGED: " in out and "parallel_backend: NOT CONVERGED: " in out


@pytest.mark.parametrize("flag", ["--rows", "--sequences", "--warmup", "--map-steps"])
def test_cli_rejects_bad_sizes(flag):
    proc = subprocess.run([sys.executable, "-m", "parallel_backend.plugins.cli.main", "demo",
                           flag, "0"], capture_output=True, check=False, text=True, timeout=120)
    assert proc.returncode != 0 and flag in proc.stderr and "positive" in proc.stderr
