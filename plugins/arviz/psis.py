"""PSIS-LOO of many observations at once, as ArviZ 1.x computes it one at a time.

``arviz_stats`` smooths each observation's importance ratios in Python (one
``numpy.vectorize`` call per observation: about 0.7 ms each at 200 draws), which makes an
exact LOO of millions of rows take hours. The steps are the same for every observation
and only their data differ, so here they run over a group of observations at once, in
numpy, in ArviZ's order and with ArviZ's formulas (``arviz_stats.base.diagnostics``:
``_psislw``, ``_ps_tail``, ``_gpdfit``, ``_gpinv``, ``_loo``, arviz-stats 1.3): the tail
of the largest ratios, the generalized Pareto fit with its weakly informative prior,
the smoothed tail, the normalized log weights, then each observation's ``elpd_i``, ``p``
and Pareto ``k``. ``tests/integration/test_loo.py`` holds it equal to ``arviz.loo``.
Used on ArviZ 1.x only (ArviZ 0.x's PSIS differs in its tail length; there, ArviZ's own
function runs per group). Imports numpy and scipy.
"""

from __future__ import annotations

import numpy as np
from scipy.special import logsumexp

__all__ = ["loo_rows", "tail_length"]

#: Values of the generalized Pareto fit's grid held at once (observations x grid x tail).
FIT_VALUES = 2 ** 22


def tail_length(n_draws: int, r_eff: float) -> int:
    """Draws in the smoothed tail: ``3 sqrt(S / r_eff)`` where ``S r_eff > 225``, else
    ``S / 5`` (both floored), as ArviZ 1.x takes the right tail."""
    if n_draws * r_eff > 225:
        return int(np.floor(3 * (n_draws / r_eff) ** 0.5))
    return int(np.floor(n_draws / 5))


def loo_rows(log_lik: np.ndarray, r_eff: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(elpd_i, pareto_k, p_i)`` of each column of ``log_lik`` (draws x observations,
    the chains' draws in ArviZ's order, chain then draw).

    Raises
    ------
    ValueError
        An observation's tail values are all the same (as ArviZ raises).
    """
    n_draws = log_lik.shape[0]
    n_tail = tail_length(n_draws, r_eff)
    if n_tail < 5:
        raise ValueError("n_draws_tail must be at least 5")
    weights, khat = _smoothed_log_weights(log_lik, n_draws, n_tail)
    elpd = _columns_logsumexp(weights + log_lik)
    lppd = _columns_logsumexp(log_lik, b=1 / n_draws)
    return elpd, khat, lppd - elpd


def _columns_logsumexp(a, b=None):
    """``logsumexp`` of each column. Below float64 (where the order of a sum shows) one
    column at a time over contiguous values, as ArviZ sums one observation's draws."""
    if a.dtype == np.float64:
        return logsumexp(a, axis=0, b=b)
    # each observation's draws contiguous, reduced along the last axis: numpy sums each
    # row as it sums a 1-d array (the same pairwise order)
    return logsumexp(np.ascontiguousarray(a.T), axis=-1, b=b)


def _smoothed_log_weights(log_lik, n_draws, n_tail):
    """ArviZ's ``_psislw`` of every column: the right tail of ``-log_lik`` smoothed with a
    generalized Pareto fit, the log weights normalized; and each column's ``k``."""
    ratios = -log_lik
    ratios = ratios - np.max(ratios, axis=0)
    order = np.argsort(ratios, axis=0)
    tail_rows = order[n_draws - n_tail:]  # the tail's draws, in ascending order
    tail = np.take_along_axis(ratios, tail_rows, axis=0)
    cutoff = np.take_along_axis(ratios, order[n_draws - n_tail - 1:n_draws - n_tail], axis=0)[0]
    max_tail, min_tail = tail.max(axis=0), tail.min(axis=0)
    if np.any(np.abs(max_tail - min_tail) < np.finfo(float).tiny):
        raise ValueError("All tail values are the same")
    exp_tail, exp_cutoff = np.exp(tail), np.exp(cutoff)
    khat, sigma = _gpdfit(exp_tail - exp_cutoff)
    fit = np.isfinite(khat)
    probs = np.arange(0.5, n_tail) / n_tail
    with np.errstate(divide="ignore", invalid="ignore"):
        smoothed = np.log(_gpinv(probs, khat, sigma, exp_cutoff))
    smoothed = np.where(smoothed > max_tail, max_tail, smoothed)
    out = ratios.copy()
    # the columns whose fit is finite take their smoothed tail (cast to the ratios' dtype)
    np.put_along_axis(out, tail_rows, np.where(fit[None, :], smoothed, tail), axis=0)
    # normalized in the ratios' dtype, then float64: ArviZ's ufunc writes into float64
    return (out - _columns_logsumexp(out).astype(out.dtype)).astype(np.float64), khat


def _gpdfit(tails):
    """ArviZ's ``_gpdfit`` of every column of ``tails`` (tail x observations, ascending):
    ``(k, sigma)``, ``(nan, nan)`` where the first quartile is not above the minimum,
    ``(inf, nan)`` where ``k`` is nan."""
    n, n_obs = tails.shape
    khat, sigma = np.full(n_obs, np.nan), np.full(n_obs, np.nan)
    step = max(1, FIT_VALUES // max(n * (30 + int(n ** 0.5)), 1))
    for a in range(0, n_obs, step):
        khat[a:a + step], sigma[a:a + step] = _gpdfit_columns(tails[:, a:a + step])
    return khat, sigma


def _gpdfit_columns(x):
    prior_bs, prior_k = 3, 10
    n = x.shape[0]
    m_est = 30 + int(n ** 0.5)
    xstar = x[int((n / 4 + 0.5) - 1)]
    far = xstar <= x[0]  # far from a generalized Pareto distribution: (nan, nan)
    b = 1 - np.sqrt(m_est / (np.arange(1, m_est + 1, dtype=float) - 0.5))
    with np.errstate(divide="ignore", invalid="ignore"):
        b = b[:, None] / (prior_bs * xstar[None, :])
        b = b + 1 / x[-1][None, :]  # (grid, observations)
        k = np.mean(np.log1p(-b[:, None, :] * x[None, :, :]), axis=1)
        len_scale = n * (np.log(-b / k) - k - 1)
        w = np.exp(len_scale - logsumexp(len_scale, axis=0))
        keep = w >= 10 * np.finfo(float).eps  # negligible (or nan) weights out
        w = np.where(keep, w, 0.0)
        w = w / w.sum(axis=0)
        b_post = np.sum(np.where(keep, b * w, 0.0), axis=0)
        kappa = np.mean(np.log1p(-b_post[None, :] * x), axis=0)
        sigma = -kappa / b_post
        kappa = (n * kappa + prior_k * 0.5) / (n + prior_k)
    failed = np.isnan(kappa)  # (inf, nan), as ArviZ returns
    kappa, sigma = np.where(failed, np.inf, kappa), np.where(failed, np.nan, sigma)
    return np.where(far, np.nan, kappa), np.where(far, np.nan, sigma)


def _gpinv(probs, kappa, sigma, mu):
    """ArviZ's ``_gpinv`` (the generalized Pareto quantiles at ``probs``) of every column:
    tail x observations; nan where ``sigma <= 0`` (or the fit failed)."""
    p = probs[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(kappa == 0, mu - sigma * np.log1p(-p),
                     mu + sigma * np.expm1(-kappa * np.log1p(-p)) / kappa)
    return np.where(sigma <= 0, np.nan, q)
