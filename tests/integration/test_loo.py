"""``pb.loo`` (API.md section 9): exact PSIS-LOO of a fitted run, its log-likelihood made
in row groups on the executor and smoothed group by group, equal to ``arviz.loo`` of the
same run's ``log_likelihood`` group on the installed ArviZ (1.x: ``arviz_stats``' result;
0.x: arviz's), on every executor, for a ``pb.observe`` site and for a plain observed site
with two batch dims, with at most ``memory`` bytes of log-likelihood held at once."""

from __future__ import annotations

import tracemalloc
import warnings

import arviz as az
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import parallel_backend as pb
from parallel_backend.plugins.arviz import DATATREE

N = 600


def model(x, y=None):
    """A robust regression (Student-t rows: some Pareto k worth reading)."""
    a = numpyro.sample("a", dist.Normal(0.0, 1.0))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    pb.observe("y", lambda x, a, b, s: dist.StudentT(3.0, a + b * x, s), x, a, b, s, obs=y)


def grouped_model(x, y, z):
    """Two observed sites: a pb.observe site over rows, and a plain one over groups x rows
    (ArviZ counts its 2 x 30 elements as observations)."""
    a = numpyro.sample("a", dist.Normal(0.0, 1.0))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    pb.observe("y", lambda x, a, b: dist.Normal(a + b * x, 1.0), x, a, b, obs=y)
    with numpyro.plate("cols", z.shape[1]), numpyro.plate("groups", z.shape[0], dim=-2):
        numpyro.sample("z", dist.Normal(a, 1.0), obs=z)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=N)
    y = 1.0 + 2.0 * x + rng.standard_t(3.0, size=N)
    return jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)


@pytest.fixture(scope="module")
def run(data):
    return pb.sample(model, *data, num_warmup=100, num_samples=100, num_chains=2, seed=1,
                     progress_bar=False, executor="serial")


def fields(result) -> dict:
    """What both majors' LOO results hold, by one set of names."""
    if DATATREE:
        return {"elpd": result.elpd, "se": result.se, "p": result.p,
                "n_samples": result.n_samples, "n_data_points": result.n_data_points,
                "warning": result.warning, "elpd_i": result.elpd_i, "pareto_k": result.pareto_k}
    return {"elpd": result["elpd_loo"], "se": result["se"], "p": result["p_loo"],
            "n_samples": result["n_samples"], "n_data_points": result["n_data_points"],
            "warning": result["warning"], "elpd_i": result.get("loo_i"),
            "pareto_k": result.get("pareto_k")}


def assert_equal_loo(got, want):
    g, w = fields(got), fields(want)
    for k in ("elpd", "se", "p"):
        np.testing.assert_allclose(g[k], w[k], rtol=1e-6, err_msg=k)
    for k in ("n_samples", "n_data_points", "warning"):
        assert g[k] == w[k], (k, g[k], w[k])
    for k in ("elpd_i", "pareto_k"):
        assert g[k].dims == w[k].dims, (k, g[k].dims, w[k].dims)
        np.testing.assert_allclose(g[k].values, w[k].values, rtol=1e-6, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("executor", ["serial", "thread", pytest.param("dask", marks=pytest.mark.dask)])
def test_loo_equals_arviz_loo_of_the_run(run, data, executor):
    """In one group and in many (a memory of about 40 rows' values): ArviZ's result."""
    want = az.loo(run, pointwise=True)
    ex = pb.DaskExecutor(n_workers=1, dispatch="host") if executor == "dask" else executor
    try:
        for memory in (None, 200 * 40 * 32):
            assert_equal_loo(pb.loo(run, model, *data, executor=ex, memory=memory,
                                    progress_bar=False), want)
    finally:
        if executor == "dask":
            ex.close()


@pytest.mark.slow  # two fits of its own
def test_a_plain_site_with_two_batch_dims_and_the_choice_of_site(data):
    """With two observed sites, ``var_name`` chooses (as ``arviz.loo`` asks); a plain site
    over groups x rows is left out element by element, on its plates' dims."""
    x, y = data
    z = jnp.asarray(np.random.default_rng(2).normal(size=(2, 30)), jnp.float32)
    fit = pb.sample(grouped_model, x, y, z, num_warmup=60, num_samples=60, num_chains=2, seed=3,
                    progress_bar=False, executor="serial")
    with pytest.raises(ValueError, match=r"several observed sites \['y', 'z'\]; pass var_name="):
        pb.loo(fit, grouped_model, x, y, z, progress_bar=False)
    for name in ("y", "z"):
        want = az.loo(fit, pointwise=True, var_name=name)
        got = pb.loo(fit, grouped_model, x, y, z, var_name=name, memory=120 * 7 * 32,
                     progress_bar=False)
        assert_equal_loo(got, want)
    assert fields(got)["elpd_i"].dims == ("groups", "cols")


def test_compare_takes_it_and_pointwise_false_keeps_only_the_totals(run, data):
    full = pb.loo(run, model, *data, progress_bar=False)
    short = pb.loo(run, model, *data, pointwise=False, progress_bar=False)
    assert fields(short)["elpd"] == fields(full)["elpd"]
    assert fields(short)["elpd_i"] is None and fields(short)["pareto_k"] is None
    table = az.compare({"pb": full, "arviz": az.loo(run, pointwise=True)})
    assert set(table.index) == {"pb", "arviz"}


@pytest.mark.slow
def test_memory_bounds_what_is_held(data):
    """The draws x rows matrix is never formed: numpy's peak while ``pb.loo`` runs over
    20,000 rows x 200 draws (16 MB of float32 values, twice that in float64) with a 1 MB
    budget stays well below it (ArviZ's own working arrays aside)."""
    x = jnp.asarray(np.random.default_rng(4).normal(size=20_000), jnp.float32)
    y = 0.5 * x + 1.0
    fit = pb.sample(model, x, y, num_warmup=30, num_samples=100, num_chains=2, seed=2,
                    progress_bar=False, executor="serial", arviz_kwargs={"log_likelihood": False})
    assert "log_likelihood" not in (fit.children if DATATREE else fit.groups())
    matrix = 200 * 20_000 * 4
    tracemalloc.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = pb.loo(fit, model, x, y, memory=2 ** 20, progress_bar=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert fields(got)["n_data_points"] == 20_000
    assert peak < matrix / 2, f"numpy's peak {peak} bytes; the matrix is {matrix}"


def test_bad_input_is_named(run, data):
    with pytest.raises(ValueError, match="memory must be a positive number of bytes, got 0"):
        pb.loo(run, model, *data, memory=0)
    with pytest.raises(ValueError, match=r"var_name='w' is not an observed site .*\['y'\]"):
        pb.loo(run, model, *data, var_name="w", progress_bar=False)
    groups = {"observed_data": run.observed_data}
    empty = (az.InferenceData(**groups) if not DATATREE else
             type(run).from_dict({"observed_data": run.observed_data.to_dataset()}))
    with pytest.raises(ValueError, match="data must be a run with a posterior group"):
        pb.loo(empty, model, *data)


def wide_model(x, y=None):
    """A pb.observe site whose distribution's batch shape is rows x 3: every element is an
    observation, as for the plain site (numpyro.infer.log_likelihood's shapes)."""
    b = numpyro.sample("b", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    pb.observe("y", lambda x, b: dist.Normal(b * x[:, None], 1.0), x, b, obs=y)


def test_an_observation_is_an_element_of_the_batch_shape_everywhere(data):
    """``pb.log_likelihood``, the run's ``log_likelihood`` group and ``pb.loo`` keep a
    ``pb.observe`` site's later batch dims, as ``numpyro.infer.log_likelihood`` does for the
    plain model (API.md sections 4 and 9)."""
    x = data[0][:40]
    y = jnp.asarray(np.random.default_rng(5).normal(size=(40, 3)), jnp.float32)

    def plain(x, y=None):
        b = numpyro.sample("b", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        with numpyro.plate("rows", x.shape[0], dim=-2), numpyro.plate("k", 3, dim=-1):
            numpyro.sample("y", dist.Normal(b * x[:, None], 1.0), obs=y)

    draws = {"b": jnp.asarray(np.random.default_rng(6).normal(size=(2, 5, 3)), jnp.float32)}
    want = numpyro.infer.log_likelihood(plain, draws, x, y, batch_ndims=2)["y"]
    got = pb.log_likelihood(wide_model, draws, x, y)["y"]
    assert got.shape == want.shape == (2, 5, 40, 3)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    fit = pb.sample(wide_model, x, y, num_warmup=50, num_samples=50, num_chains=2, seed=4,
                    progress_bar=False, executor="serial")
    assert fit.log_likelihood["y"].shape == (2, 50, 40, 3)
    result = pb.loo(fit, wide_model, x, y, memory=100 * 7 * 3 * 32, progress_bar=False)
    assert_equal_loo(result, az.loo(fit, pointwise=True))
    assert fields(result)["n_data_points"] == 120


def test_a_log_likelihood_over_the_budget_is_not_stored_and_pb_loo_is_named(data):
    """Above ``log_likelihood_budget`` bytes ``pb.sample`` stores no ``log_likelihood``
    group, says so once, naming ``pb.loo`` and what the group would take; asked for
    explicitly, it is stored whatever its size; ``pb.loo`` gives the stored group's LOO."""
    x, y = data
    run_kw = {"num_warmup": 40, "num_samples": 40, "num_chains": 2, "seed": 3,
              "progress_bar": False, "executor": "serial"}
    with pytest.warns(UserWarning, match=r"log_likelihood group would take .*not stored.*pb\.loo"
                      ) as caught:
        small = pb.sample(model, x, y, arviz_kwargs={"log_likelihood_budget": 1000}, **run_kw)
    assert sum("log_likelihood group" in str(w.message) for w in caught) == 1
    groups = small.children if DATATREE else small.groups()
    assert "log_likelihood" not in groups
    assert small.attrs["log_likelihood_not_stored_bytes"] == 2 * 40 * N * 4
    full = pb.sample(model, x, y, arviz_kwargs={"log_likelihood_budget": 1000,
                                                "log_likelihood": True}, **run_kw)
    assert full.log_likelihood["y"].shape == (2, 40, N)
    assert_equal_loo(pb.loo(small, model, x, y, progress_bar=False), az.loo(full, pointwise=True))


@pytest.mark.skipif(not DATATREE, reason="ArviZ 0.x: pb.loo runs ArviZ's own loo per row group")
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_group_smoothing_is_arviz_stats_per_observation(dtype):
    """plugins/arviz/psis.py smooths a group of observations at once: each observation's
    elpd, p and Pareto k equal arviz_stats' own (psislw, then loo with those weights), on
    heavy tails, with draws in and out of the prior's range (k near 0, large, nan, inf)."""
    import importlib

    import xarray as xr

    psis = importlib.import_module("parallel_backend.plugins.arviz.psis")
    rng = np.random.default_rng(7)
    for n_draws, reff in ((200, 1.0), (2000, 0.8), (40, 1.3)):
        ll = rng.standard_t(2, size=(n_draws, 120)) * rng.uniform(0.1, 5, size=120) - 3
        ll[:, 0] = np.linspace(-5.0, -4.0, n_draws)
        ll = ll.astype(dtype)
        da = xr.DataArray(ll.reshape(2, n_draws // 2, -1), dims=("chain", "draw", "obs"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            weights, k = da.azstats.psislw(r_eff=reff, dim=["chain", "draw"])
            want = da.azstats.loo(sample_dims=["chain", "draw"], r_eff=reff,
                                  log_weights=weights, pareto_k=k)
            got = psis.loo_rows(ll, reff)
        for name, w, g in zip(("elpd_i", "pareto_k", "p_i"), want, got):
            np.testing.assert_allclose(g, w.values, rtol=1e-10, atol=1e-12, err_msg=name)
