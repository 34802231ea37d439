"""``pb.to_arviz`` and ``pb.sample``'s InferenceData: groups, dims, the pointwise
log-likelihood against ``fn`` evaluated directly, LOO, and save/load.

One real NUTS run (module-scoped) of a model whose ``pb.factor`` data holds a leaf
computed from a latent site (group effects ``theta[g]``), beside an ordinary
observed site; every test reads that run.
"""

import os
import subprocess
import sys
import textwrap

import arviz as az
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
import xarray as xr

import parallel_backend as pb
from parallel_backend.plugins.arviz import HMC_EXTRA_FIELDS, load, pointwise_log_likelihood, save

N, G, NZ = 240, 4, 15
CHAINS, DRAWS = 2, 60
SAMPLE_STATS = ("diverging", "energy", "step_size", "tree_depth", "n_steps", "lp",
                "acceptance_rate")


def make_data(seed=0):
    rng = np.random.default_rng(seed)
    g = rng.integers(0, G, N)
    x = rng.normal(size=N)
    y = 0.3 + 0.8 * x + np.linspace(-1, 1, G)[g] + 0.5 * rng.normal(size=N)
    z = rng.normal(0.3, 1.0, size=NZ)
    rows = {"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(y, jnp.float32)}
    return rows, jnp.asarray(g, jnp.int32), jnp.asarray(z, jnp.float32)


def loglik(d, mu, beta, sigma):
    return dist.Normal(mu + beta * d["x"] + d["eff"], sigma).log_prob(d["y"])


def model(rows, g, z):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    beta = numpyro.sample("beta", dist.Normal(0.0, 2.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    theta = numpyro.sample("theta", dist.Normal(0.0, 1.0).expand([G]))
    numpyro.deterministic("mu2", 2 * mu)
    numpyro.sample("z", dist.Normal(mu, 1.0), obs=z)
    # data["eff"] depends on a latent site: to_arviz must recompute it per draw.
    pb.factor("y", loglik, {**rows, "eff": theta[g]}, mu, beta, sigma, block_rows=64)


@pytest.fixture(scope="module")
def run():
    args = make_data()
    with pb.ThreadExecutor(2, dispatch="host") as ex:
        idata = pb.sample(model, *args, num_warmup=120, num_samples=DRAWS, num_chains=CHAINS,
                          executor=ex, progress_bar=False, seed=1)
        yield idata, args, ex


def direct_loglik(idata, args):
    """``fn`` evaluated on every posterior draw at once, without pb."""
    rows, g, _ = args
    post = idata.posterior
    flat = {k: jnp.asarray(post[k].values.reshape((CHAINS * DRAWS,) + post[k].shape[2:]))
            for k in ("mu", "beta", "sigma", "theta")}

    def one(mu, beta, sigma, theta):
        return loglik({**rows, "eff": theta[g]}, mu, beta, sigma)

    out = jax.vmap(one)(flat["mu"], flat["beta"], flat["sigma"], flat["theta"])
    return np.asarray(out).reshape(CHAINS, DRAWS, N)


def test_groups_dims_and_shapes(run):
    idata, _, _ = run
    assert set(idata.groups()) >= {"posterior", "sample_stats", "log_likelihood",
                                   "observed_data", "constant_data"}
    post = idata.posterior
    assert post["mu"].dims == ("chain", "draw") and post["mu"].shape == (CHAINS, DRAWS)
    assert post["theta"].shape == (CHAINS, DRAWS, G)
    assert post["mu2"].shape == (CHAINS, DRAWS)  # deterministic sites too
    for name in SAMPLE_STATS:
        assert idata.sample_stats[name].dims == ("chain", "draw"), name
    np.testing.assert_allclose(idata.sample_stats["tree_depth"],
                               np.log2(idata.sample_stats["n_steps"]).astype(int) + 1)
    ll = idata.log_likelihood
    assert ll["y"].dims == ("chain", "draw", "y_dim_0") and ll["y"].shape == (CHAINS, DRAWS, N)
    assert ll["z"].shape == (CHAINS, DRAWS, NZ)
    # the pb.factor site is not observed data (its "value" is empty); z is.
    assert list(idata.observed_data.data_vars) == ["z"]
    # data leaves given to the model: constant_data on the site's row dimension; the
    # leaf computed from theta is not data and is absent.
    cd = idata.constant_data
    assert set(cd.data_vars) == {"y_x", "y_y"} and cd["y_x"].dims == ("y_dim_0",)
    np.testing.assert_array_equal(cd["y_y"].values, np.asarray(run[1][0]["y"]))


def test_attrs(run):
    idata, _, ex = run
    a = idata.attrs
    assert a["parallel_backend_version"] == pb.__version__
    assert a["executor"] == "thread" and a["workers"] == 2
    assert a["chunk_rows"] and all(isinstance(r, int) and 0 < r <= N for r in a["chunk_rows"])
    assert a["warmup_seconds"] > 0 and a["sampling_seconds"] > 0
    assert a["gradient_evaluations"] > CHAINS and a["chain_method"] == "vectorized"
    assert idata.posterior.attrs["parallel_backend_version"] == pb.__version__


def test_log_likelihood_equals_fn_on_draws(run):
    idata, args, _ = run
    np.testing.assert_allclose(idata.log_likelihood["y"].values, direct_loglik(idata, args),
                               rtol=2e-6, atol=2e-6)
    mu = idata.posterior["mu"].values[..., None]
    want = dist.Normal(mu, 1.0).log_prob(np.asarray(args[2]))
    np.testing.assert_allclose(idata.log_likelihood["z"].values, want, rtol=2e-6, atol=2e-6)


def test_loo_and_waic_match_direct_pointwise(run):
    idata, args, _ = run
    direct = az.from_dict(posterior={"mu": idata.posterior["mu"].values},
                          log_likelihood={"y": direct_loglik(idata, args)})
    ours = az.loo(idata, var_name="y", pointwise=True)
    want = az.loo(direct, var_name="y", pointwise=True)
    assert ours.n_data_points == N
    np.testing.assert_allclose(ours.elpd_loo, want.elpd_loo, rtol=1e-5)
    np.testing.assert_allclose(ours.p_loo, want.p_loo, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(az.waic(idata, var_name="y").elpd_waic,
                               az.waic(direct, var_name="y").elpd_waic, rtol=1e-5)


def test_summary_and_trace_plot(run):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    idata, _, _ = run
    summary = az.summary(idata, var_names=["mu", "beta", "sigma", "theta"])
    assert len(summary) == 3 + G and np.isfinite(summary["r_hat"]).all()
    axes = az.plot_trace(idata, var_names=["mu", "sigma"])
    assert axes.shape == (2, 2)
    plt.close("all")


def test_log_likelihood_bitwise_same_on_every_executor(run):
    """The pointwise values do not depend on who evaluated them."""
    idata, args, _ = run
    post = idata.posterior
    flat = {k: post[k].values.reshape((CHAINS * DRAWS,) + post[k].shape[2:])
            for k in ("mu", "beta", "sigma", "theta")}
    results = []
    for make in (pb.SerialExecutor, lambda: pb.ThreadExecutor(2), lambda: pb.ThreadExecutor(3)):
        with make() as ex:
            values, plans = pointwise_log_likelihood(model, flat, *args, executor=ex,
                                                     chunk_draws=25, chunk_rows=50)
        assert plans["y"].chunk_rows == 50 and plans["y"].tasks == 5 * 5
        results.append(values["y"])
    for other in results[1:]:
        np.testing.assert_array_equal(results[0], other)
    np.testing.assert_allclose(results[0], direct_loglik(idata, args).reshape(-1, N),
                               rtol=2e-6, atol=2e-6)


def test_log_likelihood_on_an_executor_given_by_name(run):
    """A name (as for ``reduce_sum``) makes an executor for the job; same values."""
    idata, args, _ = run
    post = idata.posterior
    flat = {k: post[k].values.reshape((CHAINS * DRAWS,) + post[k].shape[2:])
            for k in ("mu", "beta", "sigma", "theta")}
    by_name, _ = pointwise_log_likelihood(model, flat, *args, executor="thread",
                                          chunk_draws=25, chunk_rows=50)
    with pb.SerialExecutor() as ex:
        ref, _ = pointwise_log_likelihood(model, flat, *args, executor=ex, chunk_draws=25,
                                          chunk_rows=50)
    np.testing.assert_array_equal(by_name["y"], ref["y"])


def test_coords_and_dims(run):
    idata, args, _ = run
    # to_arviz on a plain MCMC made by the user, with coords/dims for the rows.
    mcmc = numpyro.infer.MCMC(numpyro.infer.NUTS(model), num_warmup=30, num_samples=10,
                              progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), *args, extra_fields=HMC_EXTRA_FIELDS)
    out = pb.to_arviz(mcmc, coords={"obs": np.arange(N), "group": list("abcd")},
                      dims={"y": ["obs"], "theta": ["group"]})
    assert out.log_likelihood["y"].dims == ("chain", "draw", "obs")
    assert list(out.posterior["theta"].coords["group"].values) == list("abcd")
    assert out.constant_data["y_x"].dims == ("obs",)
    assert out.attrs["executor"] == "serial" and "warmup_seconds" not in out.attrs
    assert set(SAMPLE_STATS) <= set(out.sample_stats.data_vars)


def test_save_and_load_round_trip(run, tmp_path):
    idata, _, _ = run
    before = {g: getattr(idata, g).copy(deep=True) for g in idata.groups()}
    attrs = dict(idata.attrs)
    back = load(save(idata, tmp_path / "run.nc"))
    assert back.groups() == idata.groups()
    for g in idata.groups():
        xr.testing.assert_identical(getattr(back, g), getattr(idata, g))
        xr.testing.assert_identical(getattr(idata, g), before[g])  # save changed nothing
        for v in getattr(idata, g).data_vars:
            assert getattr(back, g)[v].dtype == getattr(idata, g)[v].dtype, (g, v)
    assert back.attrs == attrs == idata.attrs
    with pytest.raises(FileNotFoundError, match="save"):
        load(tmp_path / "missing.nc")


def test_numpyro_plugin_imports_without_arviz(tmp_path):
    """``import parallel_backend.plugins.numpyro`` works without ArviZ; pb.sample says
    what to install."""
    code = textwrap.dedent("""
        import sys
        sys.modules["arviz"] = None  # as if not installed
        import parallel_backend as pb
        import parallel_backend.plugins.numpyro as npl
        assert callable(npl.sample) and callable(pb.factor)
        try:
            pb.sample(lambda: None, progress_bar=False)
        except ImportError as e:
            print("ERR", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    assert 'pip install "parallel-backend[arviz]"' in out.stdout
