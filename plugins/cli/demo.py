"""The demo: the question this project started from, answered on built-in data.

"Can the 50,000 sequences of my hidden Markov model be parallelised?" The default
model is a Gaussian-emission HMM (4 states, 100 steps per sequence; the log-space
forward algorithm is each sequence's log-density), fitted by NUTS with plain
NumPyro and with ``pb.factor`` on a :class:`~parallel_backend.ThreadExecutor`:
same model, data, seed and settings. ``--model negbin`` fits a negative-binomial
regression instead, written with ``pb.observe`` against a plate and an observed site
(XLA already spreads its elementwise work over the cores, so there is little to win
there on few cores; the demo says what it measured).

Both fits start from the same place and sample with the same mass matrix: the MAP and
the Laplace approximation there (:func:`laplace_start`, computed once through
parallel_backend before either fit). The data are simulated, so the demo knows the
truth: it judges each fit against it, with effective sample sizes and (two chains or
more) split r-hat, and says ``NOT CONVERGED`` where the rule (:func:`rule`) fails.

Imports numpy, the standard library and its siblings :mod:`.laplace` (the start) and
:mod:`.diagnostics` (the verdict) at module level; numpyro, jax and the facade inside the
functions. Never changes global JAX settings: the command line does that (``--float64``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from .diagnostics import diagnose, format_summary, rule, verdict
from .laplace import Start, chain_inits, laplace_start, precision_note

__all__ = ["MODELS", "make_hmm_data", "make_negbin_data", "run_demo"]

#: The HMM's true parameters (states ordered by their means).
HMM_TRUTH = {"trans": np.array([[0.85, 0.05, 0.05, 0.05],
                                [0.05, 0.85, 0.05, 0.05],
                                [0.05, 0.05, 0.85, 0.05],
                                [0.05, 0.05, 0.05, 0.85]]),
             "mu": np.array([-3.0, -1.0, 1.0, 3.0]), "sigma": 1.0}


# -- the HMM -----------------------------------------------------------------------------


def make_hmm_data(n_sequences: int = 3000, n_steps: int = 100, seed: int = 0, dtype=np.float32):
    """Simulated sequences ``(n_sequences, n_steps)`` of the 4-state HMM, and the truth."""
    rng = np.random.default_rng(seed)
    trans, mu, sigma = HMM_TRUTH["trans"], HMM_TRUTH["mu"], HMM_TRUTH["sigma"]
    k = len(mu)
    states = np.empty((n_sequences, n_steps), np.int64)
    states[:, 0] = rng.integers(0, k, size=n_sequences)
    cum = np.cumsum(trans, axis=1)
    for t in range(1, n_steps):
        u = rng.random(n_sequences)[:, None]
        states[:, t] = np.minimum((u > cum[states[:, t - 1]]).sum(axis=1), k - 1)
    obs = (mu[states] + sigma * rng.normal(size=states.shape)).astype(dtype)
    return obs, dict(HMM_TRUTH)


def hmm_loglik(obs, log_trans, mu, sigma):
    """Log-density of each sequence (a row of ``obs``): the forward algorithm in log space,
    uniform initial state."""
    import jax
    import jax.numpy as jnp
    from jax.scipy.special import logsumexp

    k = mu.shape[0]

    def emit(y):  # (rows,) -> (rows, states)
        z = (y[:, None] - mu) / sigma
        return -0.5 * z * z - jnp.log(sigma) - 0.5 * jnp.log(2 * jnp.pi)

    def step(alpha, y):
        return logsumexp(alpha[:, :, None] + log_trans, axis=1) + emit(y), None

    alpha, _ = jax.lax.scan(step, emit(obs[:, 0]) - jnp.log(k), obs[:, 1:].T)
    return logsumexp(alpha, axis=-1)


def _hmm_priors(k: int = 4):
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist

    trans = numpyro.sample("trans", dist.Dirichlet(jnp.ones(k)).expand([k]).to_event(1))
    mu0 = numpyro.sample("mu0", dist.Normal(-3.0, 2.0))
    gaps = numpyro.sample("gaps", dist.HalfNormal(3.0).expand([k - 1]).to_event(1))
    # Ordered state means (no label switching between chains).
    mu = numpyro.deterministic("mu", mu0 + jnp.concatenate([jnp.zeros(1), jnp.cumsum(gaps)]))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    return jnp.log(trans), mu, sigma


def hmm_init(obs, k: int = 4) -> dict:
    """A starting point from the data alone, as k-means would give: state means at the
    data's quantiles, a common spread, sticky transitions. NUTS started at random spends
    most of a short warmup in trees of hundreds of leapfrog steps; from here it does not."""
    q = np.quantile(np.asarray(obs, np.float64), (np.arange(k) + 0.5) / k)
    trans = np.full((k, k), 0.2 / (k - 1)) + np.eye(k) * (0.8 - 0.2 / (k - 1))
    sigma = float(np.std(obs)) / k
    return {"trans": trans, "mu0": float(q[0]), "gaps": np.maximum(np.diff(q), 0.1),
            "sigma": sigma}


def hmm_nuts_kwargs(obs) -> dict:
    """The HMM's heuristic NUTS settings (the demo's ``init="heuristic"``): a dense mass
    matrix adapted in warmup (its transition probabilities are correlated), :func:`hmm_init`,
    and trees of at most 31 leapfrog steps (the warmup's first windows otherwise run trees
    of several hundred). At 50,000 sequences 50 warmup iterations from here do not reach
    the posterior; the demo's default starts from :func:`laplace_start` instead."""
    from numpyro.infer import init_to_value

    return {"dense_mass": True, "init_strategy": init_to_value(values=hmm_init(obs)),
            "max_tree_depth": 5}


def hmm_plain(obs):
    """The HMM in plain NumPyro."""
    import numpyro

    log_trans, mu, sigma = _hmm_priors()
    numpyro.factor("obs", hmm_loglik(obs, log_trans, mu, sigma).sum())


def hmm_parallel(obs, executor=None):
    """The same HMM with ``pb.factor``: the sequences are the rows."""
    import parallel_backend as pb

    log_trans, mu, sigma = _hmm_priors()
    pb.factor("obs", hmm_loglik, obs, log_trans, mu, sigma, executor=executor)


# -- the negative binomial regression -------------------------------------------------------


def make_negbin_data(n_rows: int = 200_000, n_features: int = 4, seed: int = 0, dtype=np.float32):
    """Synthetic negative-binomial regression data: ``({"X", "y"}, truth)``."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n_rows, n_features)).astype(dtype) / np.sqrt(n_features)
    beta = np.linspace(-0.5, 0.5, n_features).astype(dtype)
    alpha, phi = 1.0, 5.0
    mu = np.exp(alpha + X @ beta)
    y = rng.negative_binomial(phi, phi / (phi + mu)).astype(dtype)
    return {"X": X, "y": y}, {"alpha": alpha, "beta": beta, "phi": phi}


def negbin_dist(X, alpha, beta, phi):
    """The distribution of the rows of ``X`` (negative binomial, mean and concentration)."""
    import jax.numpy as jnp
    import numpyro.distributions as dist

    return dist.NegativeBinomial2(jnp.exp(alpha + X @ beta), phi)


def _negbin_priors(n_features):
    import numpyro
    import numpyro.distributions as dist

    alpha = numpyro.sample("alpha", dist.Normal(0.0, 2.0))
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([n_features]).to_event(1))
    phi = numpyro.sample("phi", dist.LogNormal(1.0, 1.0))
    return alpha, beta, phi


def negbin_init(data) -> dict:
    """Where the regression's MAP search starts: the priors' medians."""
    return {"alpha": 0.0, "beta": np.zeros(data["X"].shape[1]), "phi": float(np.e)}


def negbin_plain(data):
    """The regression in plain NumPyro."""
    import numpyro

    alpha, beta, phi = _negbin_priors(data["X"].shape[1])
    with numpyro.plate("rows", data["X"].shape[0]):
        numpyro.sample("y", negbin_dist(data["X"], alpha, beta, phi), obs=data["y"])


def negbin_parallel(data, executor=None):
    """The same regression with ``pb.observe``."""
    import parallel_backend as pb

    alpha, beta, phi = _negbin_priors(data["X"].shape[1])
    pb.observe("y", negbin_dist, data["X"], alpha, beta, phi, obs=data["y"], executor=executor)


class DemoModel(NamedTuple):
    """A demo model: how to make its data, the plain and the parallel model, the
    parameters the summary shows, and its NUTS settings."""

    make: Callable  #: ``make(size, dtype=...) -> (data, truth)``
    plain: Callable  #: the model in plain NumPyro
    parallel: Callable  #: the same model with parallel_backend's sites (``executor=``)
    names: tuple  #: parameters to summarise (each has a value in ``truth``)
    heuristic: Callable  #: ``heuristic(data) -> nuts_kwargs`` for ``init="heuristic"``
    map_init: Callable  #: ``map_init(data) -> values`` where the MAP search starts
    nuts_extra: dict  #: settings both starts share (``max_tree_depth``)


MODELS = {
    "hmm": DemoModel(make_hmm_data, hmm_plain, hmm_parallel, ("mu", "sigma", "trans"),
                     hmm_nuts_kwargs, hmm_init, {"max_tree_depth": 5}),
    "negbin": DemoModel(make_negbin_data, negbin_plain, negbin_parallel,
                        ("alpha", "beta", "phi"), lambda data: {}, negbin_init, {}),
}

#: How the demo starts NUTS: "laplace" (the default) or "heuristic".
INITS = ("laplace", "heuristic")


def nuts_settings(spec: DemoModel, data, start: Start | None) -> dict:
    """``nuts_kwargs`` for both fits: with a :class:`Start`, a dense mass matrix fixed at
    the Laplace approximation's covariance (warmup adapts the step size only; without a
    positive definite Hessian warmup adapts a dense mass matrix too); without one, the
    model's heuristic settings."""
    if start is None:
        return spec.heuristic(data)
    if start.inverse_mass_matrix is None:
        return {"dense_mass": True, **spec.nuts_extra}
    return {"dense_mass": True, "inverse_mass_matrix": start.inverse_mass_matrix,
            "adapt_mass_matrix": False, **spec.nuts_extra}


# -- the run --------------------------------------------------------------------------------


def _fit(model, args, kwargs, num_warmup, num_samples, num_chains, seed, progress_bar,
         nuts_kwargs, init_params):
    """NUTS through ``pb.sample`` (same harness for both): draws, wall times, gradients."""
    import parallel_backend as pb

    idata = pb.sample(model, *args, num_warmup=num_warmup, num_samples=num_samples,
                      num_chains=num_chains, seed=seed, progress_bar=progress_bar,
                      init_params=init_params, nuts_kwargs=nuts_kwargs,
                      arviz_kwargs={"log_likelihood": False}, **kwargs)
    seconds = idata.attrs["warmup_seconds"] + idata.attrs["sampling_seconds"]
    leapfrogs = int(np.asarray(idata.sample_stats["n_steps"]).max(axis=0).sum())
    return idata, seconds, idata.attrs["sampling_seconds"] / max(leapfrogs, 1)


def run_demo(model: str = "hmm", sequences: int = 3000, rows: int = 200_000,
             num_warmup: int = 50, num_samples: int = 50, num_chains: int = 1,
             workers: int | None = None, seed: int = 0, progress_bar: bool = True,
             init: str = "laplace", map_steps: int = 200, print_fn=print) -> dict:
    """Fit the demo model with plain NumPyro and with parallel_backend; report both, and
    whether each fit converged to the truth the data were simulated from.

    Parameters
    ----------
    model : {"hmm", "negbin"}
    sequences : int
        HMM sequences (rows of the HMM's data).
    rows : int
        Rows of the negative-binomial regression's data.
    num_warmup, num_samples, num_chains : int
        NUTS settings, the same for both fits (chains are vectorized).
    workers : int, optional
        Threads of the :class:`~parallel_backend.ThreadExecutor` (default: every core).
    seed : int
    progress_bar : bool
    init : {"laplace", "heuristic"}
        ``"laplace"``: both fits start from draws of the Laplace approximation at the MAP
        (:func:`laplace_start`, computed once, in parallel, before either fit; its time is
        in neither fit's) and sample with its covariance as a fixed dense mass matrix.
        ``"heuristic"``: the HMM starts from the data's quantiles, the regression from
        NumPyro's default, and warmup adapts the mass matrix.
    map_steps : int
        Adam steps of the MAP search (``init="laplace"``).
    print_fn : callable
        Where the report goes.

    Returns
    -------
    dict
        ``seconds_plain``, ``seconds_parallel`` (NUTS wall time, warmup and compilation
        included), ``speedup``, ``ms_per_gradient_plain``/``_parallel`` (sampling phase,
        wall time over leapfrog steps), ``stats`` (the executor's), ``means_plain`` and
        ``means_parallel`` (posterior means), ``truth``, ``diagnosis_plain`` and
        ``diagnosis_parallel`` (:class:`Diagnosis`), ``converged`` (both fits),
        ``start`` (the :class:`Start`, or None) and ``start_seconds``.
    """
    import jax

    import parallel_backend as pb

    if model not in MODELS:
        raise ValueError(f"run_demo: model must be one of {sorted(MODELS)}, got {model!r}")
    if init not in INITS:
        raise ValueError(f"run_demo: init must be one of {list(INITS)}, got {init!r}")
    spec = MODELS[model]
    dtype = np.float64 if jax.config.jax_enable_x64 else np.float32
    size = sequences if model == "hmm" else rows
    data, truth = spec.make(size, dtype=dtype)
    what = (f"Gaussian HMM: {sequences:,} sequences x {data.shape[1]} steps, 4 states"
            if model == "hmm" else
            f"negative-binomial regression: {rows:,} rows, {data['X'].shape[1]} features")
    print_fn(f"{what}, {np.dtype(dtype).name}; NUTS {num_warmup} warmup + {num_samples} draws, "
             f"{num_chains} {'vectorized chains' if num_chains > 1 else 'chain'}, seed {seed}")
    start, init_params = None, None
    if init == "laplace":
        with pb.ThreadExecutor(workers) as ex:
            start = laplace_start(spec.parallel, (data,), {"executor": ex},
                                  spec.map_init(data), steps=map_steps, seed=seed)
        init_params = chain_inits(start, num_chains, seed)
        mass = ("each chain starts at a draw of the Laplace approximation (sds doubled) and "
                "samples with its covariance as a fixed dense mass matrix (warmup adapts the "
                "step size)" if start.inverse_mass_matrix is not None else
                "the Hessian there is not positive definite: the chains start at the MAP and "
                "warmup adapts a dense mass matrix")
        print_fn(f"start (both fits): the MAP ({map_steps} Adam steps, then Newton steps with "
                 f"the Hessian; {np.sqrt(start.decrement):.2g} sd from the optimum) through "
                 f"parallel_backend, {start.seconds:.1f} s, in neither fit's time; {mass}")
        note = precision_note(start.potential, dtype)
        if note:
            print_fn(note)
    else:
        print_fn("start (both fits): " + ("the data's quantiles, mass matrix adapted in warmup"
                                          if model == "hmm" else "NumPyro's default"))
    nuts_kwargs = nuts_settings(spec, data, start)
    print_fn("plain NumPyro ...")
    plain, t_plain, ms_plain = _fit(spec.plain, (data,), {}, num_warmup, num_samples,
                                    num_chains, seed, progress_bar, nuts_kwargs, init_params)
    with pb.ThreadExecutor(workers) as ex:
        print_fn(f"parallel_backend, {ex!r} ...")
        fit, t_pb, ms_pb = _fit(spec.parallel, (data,), {"executor": ex}, num_warmup,
                                num_samples, num_chains, seed, progress_bar, nuts_kwargs,
                                init_params)
        stats = ex.stats()
    site = stats["sites"][0] if stats["sites"] else {}
    speedup = t_plain / t_pb
    print_fn("")
    print_fn(f"NUTS wall time, warmup and compilation included: plain NumPyro {t_plain:.1f} s, "
             f"parallel_backend {t_pb:.1f} s; speedup {speedup:.2f}x")
    print_fn(f"per gradient inside NUTS (sampling): plain {ms_plain * 1e3:.2f} ms, "
             f"parallel_backend {ms_pb * 1e3:.2f} ms ({ms_plain / ms_pb:.2f}x)")
    print_fn(f"executor: thread, {stats['workers']} workers; ran in the {site.get('dispatch')} "
             f"({'chunks on the threads' if site.get('dispatch') == 'host' else 'XLA program'})"
             f"; {site.get('form')} blocks of {site.get('block_rows')} rows, tiles of "
             f"{site.get('tile_blocks')} blocks; chunks of {stats['chunk_rows']} rows; "
             f"{stats['calls']} gradient evaluations")
    measured = site.get("measured")
    if measured:
        print_fn(f"chosen during warmup from the run's own timings: {measured['route']} "
                 f"(default {site.get('default')}; {measured['reason']})")
    names = list(spec.names)
    judged_plain = diagnose(plain, names, truth)
    judged_pb = diagnose(fit, names, truth)
    print_fn("")
    print_fn("posterior (parallel_backend's fit; plain NumPyro's mean in the last column): "
             "5%/95% quantiles, the simulated truth, dev = (mean - truth) / sd, ESS over "
             "all chains" + (", split r_hat" if judged_pb.chains >= 2 else ""))
    print_fn(format_summary(judged_pb, judged_plain))
    if judged_pb.chains < 2:
        print_fn("(r_hat needs two chains or more: --chains 2)")
    print_fn(f"rule: {rule(judged_pb.chains, judged_pb.draws)}")
    print_fn(f"plain NumPyro: {verdict(judged_plain)}")
    print_fn(f"parallel_backend: {verdict(judged_pb)}")
    means_plain = {k: np.asarray(plain.posterior[k].mean(("chain", "draw"))) for k in names}
    means_pb = {k: np.asarray(fit.posterior[k].mean(("chain", "draw"))) for k in names}
    return {"seconds_plain": t_plain, "seconds_parallel": t_pb, "speedup": speedup,
            "ms_per_gradient_plain": ms_plain * 1e3, "ms_per_gradient_parallel": ms_pb * 1e3,
            "stats": stats, "means_plain": means_plain, "means_parallel": means_pb,
            "truth": truth, "diagnosis_plain": judged_plain, "diagnosis_parallel": judged_pb,
            "converged": judged_plain.converged and judged_pb.converged, "start": start,
            "start_seconds": start.seconds if start is not None else 0.0}
