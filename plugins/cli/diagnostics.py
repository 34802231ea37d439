"""Is a demo fit right? Its posterior summarised scalar by scalar (mean, sd, 5%/95%
quantiles, effective sample size, split r-hat) against the truth the data were simulated
from, judged by one documented rule (:func:`rule`), and printed as a table whose
numbers keep the digits their sd needs.

Imports numpy and the standard library at module level; numpyro.diagnostics inside the
functions. Reads ArviZ's ``posterior`` and ``sample_stats`` groups through xarray's
interface only, so either ArviZ major works.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import numpy as np

__all__ = ["MAX_DEVIATION", "MAX_RHAT", "MIN_ESS", "Diagnosis", "Row", "diagnose",
           "format_summary", "rhat_limit", "rule", "verdict"]

#: The convergence rule (:func:`diagnose`; :func:`rule` says it in words).
MAX_DEVIATION = 4.0  # posterior sds between a posterior mean and the simulated truth
MIN_ESS = 10.0  # effective draws, all chains together (one chain of 50 independent draws:
# the smallest of 21 ESS estimates fell under 10 in 1 of 200 simulated runs)
MAX_RHAT = 1.05  # split r-hat, with two chains or more, for long chains (see rhat_limit)


def rhat_limit(draws: int) -> float:
    """The largest split r-hat the rule accepts with ``draws`` draws per chain:
    ``1 + max(0.05, 5 / draws)``. Split r-hat is noisy in short chains: two chains of 50
    independent draws exceed 1.05 in one of 21 parameters in a quarter of runs (300
    simulated), 1.09 in one in a hundred.

    Examples
    --------
    >>> rhat_limit(50), rhat_limit(1000)
    (1.1, 1.05)
    """
    return 1.0 + max(MAX_RHAT - 1.0, 5.0 / max(draws, 1))


def rule(chains: int = 1, draws: int = 50) -> str:
    """The convergence rule in words, with the r-hat limit for ``draws`` per chain."""
    text = (f"converged = every posterior mean within {MAX_DEVIATION:g} sd of the simulated "
            f"truth (|dev| <= {MAX_DEVIATION:g}; dev = (mean - truth) / (sd * sqrt(1 + 1/ESS)), "
            f"the sd widened by the Monte Carlo error) and every ESS >= {MIN_ESS:g}")
    if chains >= 2:
        text += (f" and every split r_hat <= {rhat_limit(draws):.2f} (1 + max(0.05, "
                 "5 / draws per chain))")
    return text


def _ess(flat):
    """numpyro.diagnostics.effective_sample_size of ``(chains, draws, k)``, capped at
    ``N log10 N`` as Stan and ArviZ cap it (an antithetic chain, as NUTS gives with a good
    mass matrix, otherwise gets a huge or negative value); nan under 4 draws."""
    from numpyro.diagnostics import effective_sample_size

    n = flat.shape[0] * flat.shape[1]
    if flat.shape[1] < 4:
        return np.full(flat.shape[2], np.nan)
    ess = effective_sample_size(flat)
    cap = n * np.log10(n)
    return np.where(np.isfinite(ess) & ((ess < 0) | (ess > cap)), cap, ess)


class Row(NamedTuple):
    """One scalar of the posterior summary."""

    name: str  #: ``"trans[0,1]"``
    mean: float
    sd: float
    low: float  #: 5% quantile
    high: float  #: 95% quantile
    ess: float  #: effective sample size, all chains (numpyro.diagnostics)
    rhat: float  #: split r-hat (nan with one chain)
    truth: float
    deviation: float  #: ``(mean - truth) / (sd * sqrt(1 + 1/ess))``


class Diagnosis(NamedTuple):
    """A fit judged against the truth it was simulated from (:func:`rule`)."""

    rows: tuple  #: of :class:`Row`
    converged: bool
    reasons: tuple  #: why not, in words (empty when converged)
    chains: int
    draws: int  #: per chain
    divergences: int  #: divergent transitions among the draws


def diagnose(run, names, truth) -> Diagnosis:
    """Summarise ``run``'s ``names`` (ArviZ's ``posterior`` group, either ArviZ major)
    scalar by scalar, with numpyro.diagnostics' effective sample size (capped, see
    :func:`_ess`) and split r-hat, and judge it by :func:`rule`."""
    from numpyro.diagnostics import split_gelman_rubin

    rows = []
    for name in names:
        x = np.asarray(run.posterior[name].transpose("chain", "draw", ...), np.float64)
        chains, draws, shape = x.shape[0], x.shape[1], x.shape[2:]
        flat = x.reshape(chains, draws, -1)
        true = np.broadcast_to(np.asarray(truth[name], np.float64), shape).reshape(-1)
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            ess = _ess(flat)
            rhat = (split_gelman_rubin(flat) if chains >= 2 and draws >= 4
                    else np.full(flat.shape[2], np.nan))
            sd = flat.std(axis=(0, 1), ddof=1) if chains * draws > 1 else np.zeros(flat.shape[2])
            mean = flat.mean(axis=(0, 1))
            # Without an ESS (under 4 draws, or a chain that never moved) the sd alone.
            widen = np.where(np.isfinite(ess) & (ess > 0), np.sqrt(1 + 1 / ess), 1.0)
            deviation = (mean - true) / (sd * widen)
        low, high = np.quantile(flat, [0.05, 0.95], axis=(0, 1))
        for i, index in enumerate(np.ndindex(*shape)):
            label = f"{name}[{','.join(map(str, index))}]" if shape else name
            rows.append(Row(label, mean[i], sd[i], low[i], high[i], float(ess[i]),
                            float(rhat[i]), true[i], float(deviation[i])))
    chains, draws = int(run.posterior.sizes["chain"]), int(run.posterior.sizes["draw"])
    reasons = []
    frozen = [r for r in rows if not r.sd > 0]
    if frozen:
        reasons.append(f"the chain did not move: {len(frozen)} of {len(rows)} parameters "
                       "have sd 0 (every proposal rejected)")
    far = [r for r in rows if r.sd > 0 and not abs(r.deviation) <= MAX_DEVIATION]
    if far:
        worst = max(far, key=lambda r: abs(r.deviation) if np.isfinite(r.deviation) else np.inf)
        reasons.append(f"{len(far)} of {len(rows)} posterior means more than "
                       f"{MAX_DEVIATION:g} sd from the truth (worst {worst.name}: "
                       f"{_fixed(worst.mean, worst.sd)} against {worst.truth:g}, "
                       f"dev {worst.deviation:+.1f})")
    thin = min(rows, key=lambda r: r.ess if np.isfinite(r.ess) else -np.inf)
    if not thin.ess >= MIN_ESS:
        reasons.append(f"ESS {thin.ess:.1f} < {MIN_ESS:g} ({thin.name})")
    if chains >= 2:
        split = max(rows, key=lambda r: r.rhat if np.isfinite(r.rhat) else np.inf)
        if not split.rhat <= rhat_limit(draws):
            reasons.append(f"r_hat {split.rhat:.3f} > {rhat_limit(draws):.2f} ({split.name})")
    diverging = int(np.asarray(run.sample_stats["diverging"]).sum())
    return Diagnosis(tuple(rows), not reasons, tuple(reasons), chains, draws, diverging)


def verdict(diagnosis: Diagnosis) -> str:
    """One line: ``converged (...)`` or ``NOT CONVERGED: <reasons>``."""
    rows = diagnosis.rows
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # all-nan columns
        ess = np.nanmin([r.ess for r in rows]) if rows else np.nan
        worst = np.nanmax([abs(r.deviation) for r in rows]) if rows else np.nan
        rhat = np.nanmax([r.rhat for r in rows]) if rows else np.nan
    figures = f"smallest ESS {ess:.0f}, largest |dev| {worst:.1f}"
    if diagnosis.chains >= 2:
        figures += f", largest r_hat {rhat:.3f}"
    figures += f", {diagnosis.divergences} divergent transitions"
    if diagnosis.converged:
        return f"converged ({figures})"
    return "NOT CONVERGED: " + "; ".join(diagnosis.reasons) + f" ({figures})"


def _decimals(sd: float) -> int:
    """Decimals that show ``sd`` to two significant digits (2 to 8)."""
    if not np.isfinite(sd) or sd <= 0:
        return 3
    return int(min(8, max(2, 1 - np.floor(np.log10(sd)))))


def _fixed(value: float, sd: float) -> str:
    return f"{value:.{_decimals(sd)}f}"


def format_summary(diagnosis: Diagnosis, other: Diagnosis | None = None,
                   other_label: str = "plain mean") -> str:
    """The posterior summary as a table: one row per scalar, its numbers to the decimals
    its sd needs (a small sd is never shown as 0.000); ``other``'s means in a last column."""
    head = ["", "mean", "sd", "5%", "95%", "truth", "dev", "ess"]
    if diagnosis.chains >= 2:
        head.append("r_hat")
    if other is not None:
        head.append(other_label)
    lines = [head]
    for i, r in enumerate(diagnosis.rows):
        d = _decimals(r.sd)
        line = [r.name, f"{r.mean:.{d}f}", f"{r.sd:.{d}f}", f"{r.low:.{d}f}", f"{r.high:.{d}f}",
                f"{r.truth:g}", f"{r.deviation:+.1f}", f"{r.ess:.0f}"]
        if diagnosis.chains >= 2:
            line.append(f"{r.rhat:.3f}")
        if other is not None:
            line.append(f"{other.rows[i].mean:.{d}f}")
        lines.append(line)
    widths = [max(len(line[j]) for line in lines) for j in range(len(head))]
    return "\n".join(" ".join(cell.ljust(w) if j == 0 else cell.rjust(w)
                              for j, (cell, w) in enumerate(zip(line, widths))).rstrip()
                     for line in lines)
