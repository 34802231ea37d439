"""``pb.sample``: real NUTS runs. Reproducibility (same seed, any executor), vectorized
against sequential chains, kernels and arguments, and the progress bar on a pipe and
on a terminal."""

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import textwrap

import jax
import numpy as np
import pytest
from numpyro.infer import NUTS

import parallel_backend as pb
from helpers import regression_data, regression_model

N = 400
SITES = ("alpha", "beta", "sigma")


def make_data(seed=0):
    return regression_data(N, seed)


def model(data):
    regression_model(data, block_rows=64)


@pytest.fixture(scope="module")
def data():
    return make_data()


def draws(idata):
    return {k: idata.posterior[k].values for k in SITES}


def run(data, executor, kernel=model, **kw):
    kw = {"num_warmup": 100, "num_samples": 50, "num_chains": 2, "progress_bar": False, **kw}
    return pb.sample(kernel, data, executor=executor, **kw)


@pytest.mark.slow
def test_same_seed_same_draws_on_every_executor(data, assert_identical):
    with pb.SerialExecutor() as serial, pb.ThreadExecutor(2, dispatch="host") as threads:
        a = run(data, serial, seed=3)
        c = run(data, threads, seed=jax.random.PRNGKey(3))
        d = run(data, serial, seed=4)
    # the same seed twice, once on threads through host callbacks: the same bits
    assert_identical(draws(a), draws(c))
    assert_identical(a.log_likelihood["y"].values, c.log_likelihood["y"].values)
    assert not np.array_equal(draws(a)["alpha"], draws(d)["alpha"])
    assert c.attrs["executor"] == "thread" and c.attrs["workers"] == 2


@pytest.mark.slow
def test_looped_site_same_draws_on_every_executor_with_vectorized_chains(assert_identical):
    """A looped site (the demo's HMM, a ``scan``) under 2 vectorized chains evaluates one
    chain at a time on every path: the graph, the threads, and ``ThreadExecutor()``'s
    choice between them during warmup (a ``lax.cond`` under ``vmap``)."""
    from parallel_backend.plugins.cli.demo import hmm_nuts_kwargs, hmm_parallel, make_hmm_data

    obs, _ = make_hmm_data(60, n_steps=12)
    runs = []
    for ex in (pb.SerialExecutor(), pb.ThreadExecutor(2, dispatch="host"), pb.ThreadExecutor(2)):
        with ex:
            runs.append(pb.sample(hmm_parallel, obs, executor=ex, num_warmup=30,
                                  num_samples=20, num_chains=2, seed=1, progress_bar=False,
                                  nuts_kwargs=hmm_nuts_kwargs(obs)))
            assert [site["form"] for site in ex.stats()["sites"]] == ["looped"]
    for other in runs[1:]:
        assert_identical({k: other.posterior[k].values for k in ("mu", "sigma", "trans")},
                         {k: runs[0].posterior[k].values for k in ("mu", "sigma", "trans")})


@pytest.mark.slow
def test_vectorized_and_sequential_chains_agree(data):
    """4 vectorized chains and 4 sequential chains: the same posterior within Monte
    Carlo error (means within 5 MCSE, sds within 30%)."""
    import arviz as az

    with pb.ThreadExecutor(2) as ex:
        vec = run(data, ex, num_chains=4, num_warmup=150, num_samples=150)
        seq = run(data, ex, num_chains=4, num_warmup=150, num_samples=150,
                  chain_method="sequential")
    assert vec.posterior.sizes["chain"] == seq.posterior.sizes["chain"] == 4
    assert seq.attrs["chain_method"] == "sequential"
    sv = az.summary(vec, var_names=list(SITES), round_to="none")
    ss = az.summary(seq, var_names=list(SITES), round_to="none")
    for site in SITES:
        mcse = np.hypot(sv.loc[site, "mcse_mean"], ss.loc[site, "mcse_mean"])
        assert abs(sv.loc[site, "mean"] - ss.loc[site, "mean"]) < 5 * mcse + 1e-3, site
        assert abs(sv.loc[site, "sd"] / ss.loc[site, "sd"] - 1) < 0.3, site
        assert sv.loc[site, "r_hat"] < 1.05 and ss.loc[site, "r_hat"] < 1.05, site


@pytest.mark.slow  # two NUTS runs of their own
def test_kernel_and_nuts_kwargs(data):
    with pb.SerialExecutor() as ex:
        a = run(data, ex, num_chains=1, nuts_kwargs={"target_accept_prob": 0.95,
                                                     "max_tree_depth": 6})
        b = run(data, ex, NUTS(model, target_accept_prob=0.95, max_tree_depth=6), num_chains=1)
    # the same NUTS settings either way: the same draws
    np.testing.assert_array_equal(a.posterior["alpha"].values, b.posterior["alpha"].values)
    assert int(a.sample_stats["tree_depth"].max()) <= 7


def test_executor_by_name_and_model_kwargs():
    idata = pb.sample(lambda data=None: model(data), data=make_data(), num_warmup=30,
                      num_samples=10, num_chains=1, executor="thread", progress_bar=False)
    assert idata.attrs["executor"] == "thread"
    assert idata.log_likelihood["y"].shape == (1, 10, N)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"chain_method": "vectorised"}, ValueError, "chain_method must be one of"),
    ({"num_samples": 0}, ValueError, "num_samples must be an int >= 1"),
    ({"num_chains": 2.0}, TypeError, "num_chains must be an int >= 1"),
    ({"seed": "0"}, TypeError, "seed must be an int or a jax PRNG key"),
])
def test_argument_errors(data, kwargs, error, match):
    with pytest.raises(error, match=match):
        pb.sample(model, data, progress_bar=False, **kwargs)


def test_model_errors(data):
    with pytest.raises(TypeError, match="model must be a NumPyro model"):
        pb.sample(42, data)
    with pytest.raises(ValueError, match="nuts_kwargs apply only"):
        pb.sample(NUTS(model), data, nuts_kwargs={"max_tree_depth": 3})


SCRIPT = textwrap.dedent("""
    import hashlib, sys
    sys.path[:0] = [{here!r}, {tests!r}]
    import numpy as np, parallel_backend as pb
    from test_sample import make_data, model
    print("before", flush=True)
    with pb.ThreadExecutor(2) as ex:
        idata = pb.sample(model, make_data(), num_warmup=60, num_samples=30, num_chains=2,
                          executor=ex, progress_bar={bar}, seed=7)
    digest = hashlib.sha256(np.ascontiguousarray(idata.posterior["alpha"].values)).hexdigest()
    print("after", digest[:16], flush=True)
""")


def script(bar: bool) -> list:
    here = os.path.dirname(os.path.abspath(__file__))
    return [sys.executable, "-c", SCRIPT.format(here=here, tests=os.path.dirname(here), bar=bar)]


def run_on_terminal(cmd, timeout=240) -> str:
    """Run ``cmd`` with stdout and stderr on a pseudo-terminal; return what it wrote."""
    leader, follower = pty.openpty()
    # 40 rows x 200 columns: room for the whole bar
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
    env = {**os.environ, "COLUMNS": "200", "LINES": "40"}
    proc = subprocess.Popen(cmd, stdout=follower, stderr=follower, stdin=subprocess.DEVNULL,
                            env=env)
    os.close(follower)
    out = b""
    try:
        while True:
            ready, _, _ = select.select([leader], [], [], timeout)
            if not ready:
                raise TimeoutError("no output from the subprocess")
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal closed: the process is done
                break
            if not chunk:
                break
            out += chunk
    finally:
        proc.wait(timeout=timeout)
        os.close(leader)
    assert proc.returncode == 0, out.decode(errors="replace")
    return out.decode(errors="replace")


@pytest.mark.slow
def test_progress_as_lines_on_a_pipe_and_a_bar_on_a_terminal():
    piped = subprocess.run(script(True), capture_output=True, check=False, text=True, timeout=240)
    assert piped.returncode == 0, piped.stderr
    lines = piped.stdout.splitlines()
    # progress_bar=True with both streams on pipes (a batch job): the script's own output
    # intact on stdout; progress as plain lines on stderr, as NumPyro's bar goes there,
    # with no carriage returns (no bar redrawn in a log file)
    assert lines[0] == "before" and lines[1].startswith("after ") and len(lines) == 2
    assert "\r" not in piped.stdout + piped.stderr and "grad/s" not in piped.stdout
    progress = [ln for ln in piped.stderr.splitlines() if "grad/s=" in ln]
    assert progress and any(ln.startswith("warmup") for ln in progress), piped.stderr
    assert any(ln.startswith("sample") for ln in progress), piped.stderr

    shown = run_on_terminal(script(True))
    assert "grad/s=" in shown and "workers=2" in shown and "steps of size" in shown
    assert "sample" in shown and "warmup" in shown
    # the bar never changes the draws
    assert lines[1] in shown.replace("\r", "\n").splitlines()
