"""``pb.to_arviz`` and ``pb.sample``'s run in ArviZ's format (``xarray.DataTree`` under
ArviZ 1.x, ``arviz.InferenceData`` under 0.2x; the same tests on both): groups, dims,
the shape ``arviz.from_numpyro`` gives, the pointwise log-likelihood against ``fn``
evaluated directly, LOO, save/load, and a conversion that fails after sampling.

One real NUTS run (module-scoped) of a model whose ``pb.factor`` data holds a leaf
computed from a latent site (group effects ``theta[g]``), beside an ordinary
observed site; most tests read that run.
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
from helpers import from_draws, loo_elpd, run_groups
from parallel_backend.plugins.arviz import DATATREE, HMC_EXTRA_FIELDS, load, save
from parallel_backend.plugins.numpyro import pointwise_log_likelihood
from parallel_backend.plugins.sample import ConversionError

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


@pytest.mark.slow
def test_the_container_follows_the_installed_arviz(run):
    idata, _, _ = run
    assert isinstance(idata, xr.DataTree) if DATATREE else isinstance(idata, az.InferenceData)
    assert DATATREE == (int(az.__version__.split(".")[0]) >= 1)


def test_groups_dims_and_shapes(run):
    idata, _, _ = run
    assert set(run_groups(idata)) >= {"posterior", "sample_stats", "log_likelihood",
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
    idata, _, _ = run
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


def test_loo_matches_direct_pointwise(run):
    idata, args, _ = run
    direct = from_draws(posterior={"mu": idata.posterior["mu"].values},
                        log_likelihood={"y": direct_loglik(idata, args)})
    ours, n = loo_elpd(idata, "y")
    want, _ = loo_elpd(direct, "y")
    assert n == N and np.isfinite(ours)
    np.testing.assert_allclose(ours, want, rtol=1e-5)
    if hasattr(az, "waic"):  # ArviZ 0.x only (1.x dropped WAIC)
        np.testing.assert_allclose(az.waic(idata, var_name="y").elpd_waic,
                                   az.waic(direct, var_name="y").elpd_waic, rtol=1e-5)


def test_summary_and_trace_plot(run):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    idata, _, _ = run
    summary = az.summary(idata, var_names=["mu", "beta", "sigma", "theta"], round_to="none")
    assert len(summary) == 3 + G
    assert np.isfinite(summary["r_hat"].astype(float)).all()
    plt.close("all")
    out = az.plot_trace(idata, var_names=["mu", "sigma"])
    if not DATATREE:  # ArviZ 0.x: the axes, a row per variable (1.x: a PlotCollection)
        assert out.shape == (2, 2)
    figures = [plt.figure(n) for n in plt.get_fignums()]
    assert figures and sum(len(ax.lines) for f in figures for ax in f.axes) >= 2 * CHAINS
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
    _, args, _ = run
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
    assert out.log_likelihood["z"].dims == ("chain", "draw", "z_dim_0")
    assert set(SAMPLE_STATS) <= set(out.sample_stats.data_vars)


def test_save_and_load_round_trip(run, tmp_path):
    idata, _, _ = run
    groups = run_groups(idata)
    before = {g: ds.copy(deep=True) for g, ds in groups.items()}
    attrs = dict(idata.attrs)
    back = load(save(idata, tmp_path / "run.nc"))
    assert type(back) is type(idata)
    back_groups = run_groups(back)
    assert list(back_groups) == list(groups)
    for g, ds in groups.items():
        xr.testing.assert_identical(back_groups[g], ds)
        xr.testing.assert_identical(run_groups(idata)[g], before[g])  # save changed nothing
        for v in ds.data_vars:
            assert back_groups[g][v].dtype == ds[v].dtype, (g, v)
    assert back.attrs == attrs == idata.attrs
    with pytest.raises(FileNotFoundError, match="save"):
        load(tmp_path / "missing.nc")


def test_numpyro_plugin_imports_without_arviz(tmp_path):
    """``import parallel_backend.plugins.numpyro`` works without ArviZ (the plugins depend
    one way); pb.sample, which returns ArviZ data, says what to install."""
    code = textwrap.dedent("""
        import sys
        sys.modules["arviz"] = None  # as if not installed
        import parallel_backend as pb
        import parallel_backend.plugins.numpyro as npl
        assert callable(npl.factor) and callable(pb.factor) and not hasattr(npl, "sample")
        try:
            pb.sample(lambda: None, progress_bar=False)
        except ImportError as e:
            print("ERR", e)
        try:
            import parallel_backend.plugins.sample
        except ImportError as e:
            print("ERR", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=False, text=True,
                         timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.count('pip install "parallel-backend[arviz]"') == 2, out.stdout


def plated_model(x, y=None):
    """Plain NumPyro: a vector latent, a deterministic site, an observed site in a plate."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    numpyro.deterministic("w_sum", w.sum())
    with numpyro.plate("groups", 3):  # a latent in a plate: its dims are the plate's
        numpyro.sample("u", dist.Normal(0.0, 1.0))
    with numpyro.plate("rows", x.shape[0]):
        numpyro.sample("obs", dist.Normal(w[0] + w[1] * x, sigma), obs=y)


def test_shaped_as_arviz_from_numpyro():
    """For an MCMC of a plain model, to_arviz's groups, variables, dims, coordinates and
    values are those of ArviZ's own from_numpyro(..., log_likelihood=True)."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=30), jnp.float32)
    y = jnp.asarray(0.5 + 1.5 * np.asarray(x) + rng.normal(size=30), jnp.float32)
    mcmc = numpyro.infer.MCMC(numpyro.infer.NUTS(plated_model, max_tree_depth=3), num_warmup=30,
                              num_samples=15, num_chains=2, chain_method="sequential",
                              progress_bar=False)
    mcmc.run(jax.random.PRNGKey(2), x, y, extra_fields=HMC_EXTRA_FIELDS)
    ours, theirs = run_groups(pb.to_arviz(mcmc)), run_groups(az.from_numpyro(mcmc, log_likelihood=True))
    assert set(theirs) <= set(ours), f"missing groups {set(theirs) - set(ours)}"
    for g, want in theirs.items():
        got = ours[g]
        assert list(got.data_vars) == list(want.data_vars) or set(got.data_vars) == set(want.data_vars), g
        for v in want.data_vars:
            assert got[v].dims == want[v].dims, (g, v, got[v].dims, want[v].dims)
            assert got[v].dtype == want[v].dtype, (g, v)
            if g == "log_likelihood":  # recomputed in chunks: to round-off
                np.testing.assert_allclose(got[v].values, want[v].values, rtol=1e-5, atol=1e-5)
            else:
                np.testing.assert_array_equal(got[v].values, want[v].values, err_msg=f"{g}.{v}")
        assert dict(got.coords.sizes) == dict(want.coords.sizes), g
    assert ours["log_likelihood"]["obs"].dims == ("chain", "draw", "rows")


def bad_dims_run(**kwargs):
    """A run whose conversion fails on purpose: dims that do not fit the variable ``mu``
    (a scalar) make ArviZ raise after sampling."""
    rows, g, z = make_data()
    return pb.sample(model, rows, g, z, num_warmup=30, num_samples=12, num_chains=2,
                     progress_bar=False, seed=4, executor="serial",
                     arviz_kwargs={"dims": {"mu": ["a", "b"]}}, **kwargs)


@pytest.mark.slow
def test_a_conversion_that_fails_after_sampling_loses_no_draw(tmp_path):
    """Without a checkpoint: the error names a file that holds every draw, ``load`` reads
    it, and a second pb.sample with that file as checkpoint converts without sampling;
    the draws are those of a run that converted at once."""
    with pytest.raises(ConversionError, match="Nothing is lost") as info:
        bad_dims_run()
    err = info.value
    assert err.path and os.path.exists(err.path) and err.path in str(err)
    assert isinstance(err.__cause__, Exception)
    try:
        rows, g, z = make_data()
        good = pb.sample(model, rows, g, z, num_warmup=30, num_samples=12, num_chains=2,
                         progress_bar=False, seed=4, executor="serial")
        draws = load(err.path)
        np.testing.assert_array_equal(draws.posterior["theta"].values,
                                      good.posterior["theta"].values)
        carried = np.asarray(err.run.get_samples(group_by_chain=True)["mu"])
        np.testing.assert_array_equal(carried, good.posterior["mu"].values)
        again = pb.sample(model, rows, g, z, num_warmup=30, num_samples=12, num_chains=2,
                          progress_bar=False, seed=4, checkpoint=err.path)
        np.testing.assert_array_equal(again.posterior["mu"].values, good.posterior["mu"].values)
        assert again.attrs["checkpoint_status"] == "finished"
    finally:
        os.remove(err.path)


def test_a_conversion_that_fails_keeps_the_checkpoint(tmp_path):
    """With a checkpoint: the file already holds every draw, and the error says so."""
    path = str(tmp_path / "run.nc")
    with pytest.raises(ConversionError, match="run.nc") as info:
        bad_dims_run(checkpoint=path, checkpoint_every=20)
    assert info.value.path == path
    back = load(path)
    assert back.posterior["mu"].shape == (2, 12) and back.attrs["draws_done"] == [12, 12]


@pytest.mark.slow  # a subprocess with a NUTS run of its own
def test_arviz_imported_before_numpyro(tmp_path):
    """Importing ArviZ first (ArviZ 1.x then loads numpyro lazily, and
    ``numpyro.infer`` loses its submodule attributes) does not break the conversion, which
    names the plates' dims and leaves NumPyro's modules as it found them."""
    code = textwrap.dedent("""
        import arviz
        import numpyro.infer
        import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
        import parallel_backend as pb

        def model(y):
            mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
            with numpyro.plate("groups", 2):
                numpyro.sample("u", dist.Normal(0.0, 1.0))
            with numpyro.plate("rows", 5):
                numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

        before = hasattr(numpyro.infer, "initialization")
        run = pb.sample(model, jnp.arange(5.0), num_warmup=10, num_samples=5, num_chains=1,
                        progress_bar=False)
        print(run.log_likelihood["y"].dims, run.posterior["u"].dims)
        print("unchanged", hasattr(numpyro.infer, "initialization") == before)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=False, text=True,
                         timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    assert "'rows'" in out.stdout and "('chain', 'draw', 'groups')" in out.stdout, out.stdout
    assert "unchanged True" in out.stdout, out.stdout
