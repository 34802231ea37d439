"""``pb.sample`` measures where each ``reduce_sum`` site runs and records it on the site.

The tuner (``parallel_backend.plugins.sample.tuning``) times segments of the run on each
route, chooses, and sets ``site.state.measured``; the executor's ``stats()`` report it per
site (``measured``, ``dispatch``) and the rest of the run uses the choice. That wiring
broke once and only the demo noticed: these tests fail if any link of it breaks.
"""

import numpy as np
import numpyro.distributions as dist
import pytest

import parallel_backend as pb
from helpers import regression_data, regression_loglik, regression_priors
from parallel_backend.extend import Choice, GraphRoute, HostRoute
from parallel_backend.plugins.sample import run as run_module
from parallel_backend.plugins.sample import tuning

N = 20_000  # two tiles of rows (plan_tiles): the host route can split the sites


def observed_rows(rows, alpha, beta, sigma):
    return dist.Normal(alpha + beta * rows["x"], sigma)


def two_sites(data):
    """One ``pb.factor`` and one ``pb.observe`` site, both on the caller's executor."""
    alpha, beta, sigma = regression_priors()
    pb.factor("y", regression_loglik, data, alpha, beta, sigma, block_rows=2048)
    pb.observe("z", observed_rows, {"x": data["x"]}, alpha, beta, sigma, obs=data["y"],
               block_rows=2048)


@pytest.fixture
def tuners(monkeypatch):
    """The tuner of every ``pb.sample`` call in the test, kept to look at afterwards."""
    made = []

    class Kept(tuning.Tuner):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(run_module, "Tuner", Kept)
    return made


def sample(ex, **kw):
    kw = {"num_warmup": 150, "num_samples": 100, "num_chains": 2, "progress_bar": False,
          "seed": 1, **kw}
    return pb.sample(two_sites, regression_data(N), executor=ex, **kw)


def candidates(tuner):
    return [s for s in tuner.segments.slots.sites if s.slot is not None]


@pytest.mark.slow
def test_sample_records_the_route_it_measured_for_each_site(tuners):
    with pb.ThreadExecutor(2) as ex:
        sample(ex)
        stats = ex.stats()
    (tuner,) = tuners
    sites = candidates(tuner)
    assert len(sites) == 2 and tuner.decided
    for site in sites:
        choice = site.state.measured
        # measured on the run's own segments, not the default rule without timings
        assert choice is not None and choice.route in (GraphRoute, HostRoute), choice
        assert not choice.reason.startswith("not measured") and np.isfinite(choice.ratio)
        # the rest of the run went where the choice says
        want = choice.route.slot
        assert tuner.choices[site.slot] == want
        assert tuner.segment_log[-1][0][site.slot] == want
    # what users read: stats() per site
    by_label = {s["label"]: s for s in stats["sites"]}
    assert len(by_label) == 2, list(by_label)
    for site in sites:
        entry = by_label[site.state.spec.label]
        assert entry["measured"]["route"] == site.state.measured.route.name == entry["dispatch"]
        assert entry["measured"]["reason"] == site.state.measured.reason
    # both routes ran real segments of the run while timing
    assert stats["host_calls"] > 0 and stats["graph_calls"] > 0, stats


@pytest.mark.slow
def test_the_route_chosen_is_recorded_and_runs(tuners, monkeypatch):
    """Force the choice to the route the default rule would not take: the site records
    it, ``stats()`` reports it, and the segments after the choice run there."""
    picked = []

    def choose(graph, host, default, margin=None):
        picked.append((list(graph), list(host)))
        route = HostRoute if default is GraphRoute else GraphRoute
        return Choice(route, 0.5, f"forced by the test (default {default.name})")

    monkeypatch.setattr(tuning, "choose", choose)
    with pb.ThreadExecutor(2) as ex:
        idata = sample(ex, num_chains=1)
        stats = ex.stats()
    (tuner,) = tuners
    sites = candidates(tuner)
    assert len(sites) == 2 and len(picked) == 2
    graph, host = picked[0]
    assert len(graph) == len(host) >= 2  # paired rounds, timed per gradient
    by_label = {s["label"]: s for s in stats["sites"]}
    for site in sites:
        entry = by_label[site.state.spec.label]
        forced = "host" if entry["default"] == "graph" else "graph"
        assert site.state.measured.route.name == forced
        assert entry["dispatch"] == forced and entry["measured"]["reason"].startswith("forced")
        want = site.state.measured.route.slot
        assert tuner.segment_log[-1][0][site.slot] == want
    # the draws do not depend on the route: the same run, chosen by its own timings
    monkeypatch.undo()
    with pb.ThreadExecutor(2) as ex:
        again = sample(ex, num_chains=1)
    np.testing.assert_array_equal(idata.posterior["alpha"].values,
                                  again.posterior["alpha"].values)
