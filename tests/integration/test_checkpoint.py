"""``pb.sample(..., checkpoint=...)``: runs SIGKILLed in real subprocesses (mid-warmup,
mid-sampling) and continued on other executors give bitwise the draws of one
uninterrupted run; checkpoints of other runs are refused and left as they are; a dask
scheduler that dies mid-run fails the run at once with an error that says what to do,
and the run continues from its checkpoint on a new cluster.

A child process is killed by a thread of its own that watches the checkpoint file:
once a checkpoint at or past a given iteration is on disk it sends itself SIGKILL,
whatever the process is doing then (sampling, or writing the next checkpoint).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import cloudpickle
import numpy as np
import pytest

import helpers
import parallel_backend as pb
from helpers import regression_data, regression_model, run_groups
from parallel_backend.plugins.arviz import load, save
from parallel_backend.plugins.arviz.io import read_groups
from parallel_backend.plugins.sample import CheckpointError

N = 400
SITES = ("alpha", "beta", "sigma")
STATS = ("lp", "energy", "n_steps", "step_size", "diverging", "acceptance_rate")
#: Small and quick; a checkpoint every EVERY iterations.
RUN = {"num_warmup": 40, "num_samples": 40, "num_chains": 2, "seed": 11, "progress_bar": False}
EVERY = 4
TOTAL = RUN["num_warmup"] + RUN["num_samples"]

# `dask worker` processes cannot import this module or the tests' helper module: ship
# their functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(helpers)


def make_data(n=N, seed=0):
    return regression_data(n, seed)


def model(data):
    regression_model(data, block_rows=64)


def draws(idata) -> dict:
    out = {k: idata.posterior[k].values for k in SITES}
    out.update({k: idata.sample_stats[k].values for k in STATS})
    return out


@pytest.fixture(scope="module")
def uninterrupted():
    """The reference: each chain method's run in one go, no checkpoint."""
    out = {}
    with pb.SerialExecutor() as ex:
        for method in ("vectorized", "sequential"):
            out[method] = pb.sample(model, make_data(), executor=ex, chain_method=method, **RUN)
    return out


@pytest.mark.slow
def test_the_loop_is_numpyros_mcmc_bit_for_bit(uninterrupted, assert_identical):
    """pb.sample drives the kernel itself: the warmup adaptation (scheduled by the
    iteration counter in the state) and every draw of vectorized chains are MCMC.run's."""
    import jax
    from numpyro.infer import MCMC, NUTS

    from parallel_backend.plugins.arviz import HMC_EXTRA_FIELDS

    with pb.SerialExecutor() as ex, pb.use_executor(ex):
        mcmc = MCMC(NUTS(model), num_warmup=RUN["num_warmup"], num_samples=RUN["num_samples"],
                    num_chains=RUN["num_chains"], chain_method="vectorized", progress_bar=False)
        mcmc.run(jax.random.PRNGKey(RUN["seed"]), make_data(), extra_fields=HMC_EXTRA_FIELDS)
        ref = pb.to_arviz(mcmc, log_likelihood=False)
    assert_identical(draws(uninterrupted["vectorized"]), draws(ref))


# -- killed subprocesses ----------------------------------------------------------------

CHILD = textwrap.dedent("""
    import os, signal, sys, threading, time
    sys.path[:0] = [{here!r}, {tests!r}]
    import parallel_backend as pb
    from parallel_backend.plugins.arviz.io import read_groups
    from test_checkpoint import EVERY, RUN, make_data, model

    path, executor, kill_at, method = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]

    def watch():  # SIGKILL this process once a checkpoint at or past kill_at is on disk
        seen = None
        while True:
            try:
                stat = os.stat(path)
                if (stat.st_ino, stat.st_mtime_ns) != seen:
                    seen = (stat.st_ino, stat.st_mtime_ns)
                    attrs = read_groups(path)[0]
                    if sum(attrs.get("iteration", [0])) >= kill_at:
                        os.kill(os.getpid(), signal.SIGKILL)
            except Exception:  # no file yet; never let the watcher die
                pass
            time.sleep(0.002)

    threading.Thread(target=watch, daemon=True).start()
    ex = {{"serial": pb.SerialExecutor, "thread2": lambda: pb.ThreadExecutor(2, dispatch="host")
          }}[executor]()
    pb.sample(model, make_data(), executor=ex, chain_method=method, checkpoint=path,
              checkpoint_every=EVERY, **RUN)
    print("finished without being killed", flush=True)
""")


def run_killed(path, executor: str, kill_at: int, method: str) -> dict:
    """Run the child until it kills itself; return the checkpoint's attributes."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = CHILD.format(here=here, tests=os.path.dirname(here))
    proc = subprocess.run([sys.executable, "-c", code, str(path), executor, str(kill_at),
                           method], capture_output=True, check=False, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    return read_groups(path)[0]


@pytest.fixture(scope="module")
def killed_in_warmup(tmp_path_factory):
    """The checkpoint a run of vectorized chains on 2 threads left when it was killed in
    warmup (copy it before continuing it)."""
    path = tmp_path_factory.mktemp("killed") / "run.nc"
    first = run_killed(path, "thread2", 2 * 8, "vectorized")
    assert first["checkpoint_status"] == "running" and first["resume_count"] == 0
    assert 8 <= first["iteration"][0] < RUN["num_warmup"], first["iteration"]  # in warmup
    assert first["draws_done"] == [0, 0]
    return path, first


@pytest.mark.slow
def test_killed_in_warmup_and_in_sampling_then_finished_elsewhere_is_bitwise(
        tmp_path, killed_in_warmup, uninterrupted, assert_identical):
    """Vectorized chains: killed mid-warmup on 2 threads, resumed and killed mid-sampling
    on SerialExecutor, finished here on 1 thread: the draws and sample stats of one
    uninterrupted run, bit for bit, and the file then holds the whole run."""
    path = tmp_path / "run.nc"
    shutil.copy(killed_in_warmup[0], path)
    first = killed_in_warmup[1]

    second = run_killed(path, "serial", 2 * (RUN["num_warmup"] + 8), "vectorized")
    assert second["resume_count"] == 1 and second["resumed_from"] == [first["iteration"][0]]
    assert RUN["num_warmup"] + 8 <= second["iteration"][0] < TOTAL, second["iteration"]
    partial = load(path)  # an unfinished checkpoint: the draws made so far
    made = second["iteration"][0] - RUN["num_warmup"]
    assert partial.posterior.sizes["draw"] == made and "sampler_state" not in run_groups(partial)
    assert_identical(partial.posterior["alpha"].values,
                     uninterrupted["vectorized"].posterior["alpha"].values[:, :made])

    with pb.ThreadExecutor(1, dispatch="host") as ex:
        done = pb.sample(model, make_data(), executor=ex, chain_method="vectorized",
                         checkpoint=path, checkpoint_every=EVERY, **RUN)
    assert_identical(draws(done), draws(uninterrupted["vectorized"]))
    assert done.attrs["resume_count"] == 2
    assert done.attrs["resumed_from"] == [first["iteration"][0], second["iteration"][0]]
    assert done.attrs["executor"] == "thread" and done.attrs["checkpoint_status"] == "finished"
    assert done.attrs["warmup_seconds"] > 0 and done.attrs["sampling_seconds"] > 0

    back = load(path)
    assert back.attrs == done.attrs
    assert_identical(draws(back), draws(done))
    assert_identical(back.log_likelihood["y"].values, done.log_likelihood["y"].values)
    # Called again: the finished run, as it is (nothing is sampled).
    again = pb.sample(model, make_data(), chain_method="vectorized", checkpoint=path, **RUN)
    assert again.attrs == done.attrs


@pytest.mark.slow
def test_sequential_chains_killed_in_the_second_chain(tmp_path, uninterrupted,
                                                      assert_identical):
    path = tmp_path / "run.nc"
    attrs = run_killed(path, "serial", TOTAL + 12, "sequential")
    assert attrs["iteration"][0] == TOTAL and 12 <= attrs["iteration"][1] < TOTAL
    with pb.ThreadExecutor(2, dispatch="host") as ex:
        done = pb.sample(model, make_data(), executor=ex, chain_method="sequential",
                         checkpoint=path, checkpoint_every=EVERY, **RUN)
    assert_identical(draws(done), draws(uninterrupted["sequential"]))
    assert done.attrs["resumed_from"] == [attrs["iteration"][1]]
    assert done.attrs["resumed_chain"] == [1]


# -- checkpoints of other runs -------------------------------------------------------------


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished checkpoint of a short run (vectorized, the default settings here)."""
    path = tmp_path_factory.mktemp("finished") / "run.nc"
    kw = {**RUN, "num_warmup": 8, "num_samples": 8}
    pb.sample(model, make_data(), checkpoint=path, checkpoint_every=EVERY, **kw)
    return path, kw


def edited_model(data):
    """``model`` edited in place: the same name, one more latent site."""
    import numpyro
    import numpyro.distributions as dist

    numpyro.sample("extra", dist.Normal(0.0, 1.0))
    regression_model(data, block_rows=64)


edited_model.__qualname__ = model.__qualname__


def expect_refused(path, match, fn=model, data=None, **kw):
    before = Path(path).read_bytes()
    with pytest.raises(CheckpointError, match=match) as info:
        pb.sample(fn, make_data() if data is None else data, checkpoint=path, **kw)
    assert Path(path).read_bytes() == before, "a refused checkpoint was changed"
    assert "was not changed" in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("change, match", [
    ({"num_samples": 9}, r"num_samples: 8 in the checkpoint, 9 now"),
    ({"seed": 12}, r"seed: 11 in the checkpoint, 12 now"),
    ({"nuts_kwargs": {"target_accept_prob": 0.9}}, (r"kernel: NUTS\(.*target_accept_prob=0\.8"
                                                    r".* in the checkpoint, NUTS\(.*0\.9.* now")),
    ({"data": make_data(300)}, (r"model arguments: \['args'\]\[0\]\['x'\]: float32\[400\]; .* "
                                r"in the checkpoint, \['args'\]\[0\]\['x'\]: float32\[300\]")),
    ({"data": make_data(seed=1)}, r"the model's arguments have the same shapes but other values"),
    ({"fn": regression_model}, r"model: 'model' in the checkpoint, 'regression_model' now"),
])
def test_a_finished_checkpoint_of_another_run_is_refused(finished, change, match):
    path, kw = finished
    kw = {**kw, **change}
    expect_refused(path, match, **kw)


def test_another_model_under_the_same_name_is_refused_before_sampling(tmp_path,
                                                                      killed_in_warmup):
    """A running checkpoint, continued with a model edited in place: the sampler state
    differs (checked after init, before any transition)."""
    path = tmp_path / "run.nc"
    shutil.copy(killed_in_warmup[0], path)
    text = expect_refused(path, "sampler state: ", fn=edited_model, chain_method="vectorized",
                          **RUN)
    assert "extra" in text and "in the checkpoint" in text


def test_unreadable_and_foreign_files_are_refused(tmp_path, finished):
    import h5py

    other = tmp_path / "other_format.nc"
    shutil.copy(finished[0], other)
    with h5py.File(other, "r+") as f:
        f.attrs["checkpoint_format"] = 99
    text = expect_refused(other, "in checkpoint format 99", **finished[1])
    assert "reads format 1 only" in text and pb.__version__ in text

    plain = tmp_path / "plain.nc"
    idata = load(finished[0])
    for key in ("checkpoint_format", "checkpoint_fingerprint", "checkpoint_status"):
        del idata.attrs[key]
    save(idata, plain)
    expect_refused(plain, "is not a pb.sample checkpoint", **finished[1])

    junk = tmp_path / "junk.nc"
    junk.write_bytes(b"not netCDF at all")
    expect_refused(junk, "cannot be read as netCDF", **finished[1])


def test_checkpoint_argument_errors():
    with pytest.raises(ValueError, match="checkpoint_every must be an int >= 1"):
        pb.sample(model, make_data(), checkpoint="run.nc", checkpoint_every=0)
    with pytest.raises(ValueError, match="does not exist; create it first"):
        pb.sample(model, make_data(), checkpoint="/no/such/folder/run.nc")
    with pytest.raises(TypeError, match="checkpoint must be a file path"):
        pb.sample(model, make_data(), checkpoint=3)


# -- a dask scheduler that dies mid-run ----------------------------------------------------


@pytest.mark.slow
@pytest.mark.dask
@pytest.mark.timeout(300)
def test_scheduler_killed_mid_run_fails_fast_then_the_run_continues_on_a_new_cluster(
        tmp_path, uninterrupted, assert_identical):
    pytest.importorskip("distributed")
    path = tmp_path / "run.nc"
    with helpers.cli_cluster(str(tmp_path), workers=1) as (address, procs):
        killed = []

        def kill_scheduler_after_a_checkpoint():
            deadline = time.time() + 200
            while time.time() < deadline:
                with contextlib.suppress(Exception):  # no checkpoint yet; the watcher lives on
                    if sum(read_groups(path)[0]["iteration"]) >= 2 * 12:
                        procs[0].send_signal(signal.SIGKILL)
                        killed.append(time.time())
                        return
                time.sleep(0.005)

        watcher = threading.Thread(target=kill_scheduler_after_a_checkpoint, daemon=True)
        watcher.start()
        with (pb.DaskExecutor(address=address, dispatch="host", timeout=5) as ex,
              pytest.raises(Exception) as info):
            pb.sample(model, make_data(), executor=ex, chain_method="vectorized",
                      checkpoint=path, checkpoint_every=EVERY, **RUN)
        failed = time.time()
        watcher.join(5)
    assert killed, "the scheduler was never killed"
    assert failed - killed[0] < 30, "the evaluation hung after the scheduler died"
    message = str(info.value)
    assert f"lost the scheduler at {address}" in message, message
    assert "dask scheduler" in message and "checkpoint" in message
    left = read_groups(path)[0]
    assert left["checkpoint_status"] == "running" and left["iteration"][0] < TOTAL

    with (helpers.cli_cluster(str(tmp_path), workers=1) as (new_address, _),
          pb.DaskExecutor(address=new_address, dispatch="host", timeout=10) as ex):
        # (No log-likelihood: its tasks go through the scheduler, which cannot
        # import this module.)
        done = pb.sample(model, make_data(), executor=ex, chain_method="vectorized",
                         checkpoint=path, checkpoint_every=EVERY,
                         arviz_kwargs={"log_likelihood": False}, **RUN)
    assert_identical(draws(done), draws(uninterrupted["vectorized"]))
    assert done.attrs["resume_count"] == 1 and done.attrs["executor"] == "dask"


# -- across the two supported stacks ----------------------------------------------------------

#: The other stack's interpreter (a venv with this package installed): ``.ci/run`` sets it
#: for each of its two passes, so each direction runs in CI.
OTHER_PYTHON = os.environ.get("PB_OTHER_PYTHON")

OTHER_INFO = "import sys, jax, arviz; print(sys.version.split()[0], jax.__version__, arviz.__version__)"

OTHER_LOAD = textwrap.dedent("""
    import sys
    from parallel_backend.plugins.arviz import load
    run = load(sys.argv[1])
    print(type(run).__name__, dict(run.posterior.sizes)["draw"],
          float(run.posterior["alpha"].values.sum()), run.attrs["checkpoint_status"])
""")


@pytest.mark.slow  # a fit in each stack, a minute and more; CI's slow lane sets PB_OTHER_PYTHON
@pytest.mark.skipif(not OTHER_PYTHON, reason="PB_OTHER_PYTHON (the other stack's python, "
                    "set by .ci/run) is not set")
def test_a_checkpoint_moves_between_python_stacks(tmp_path, uninterrupted, assert_identical):
    """A run killed mid-sampling under the other stack (another Python, JAX and ArviZ
    major) resumes here, with a warning where the JAX versions differ; the finished file
    then loads there, and a file written there loads here."""
    other = subprocess.run([OTHER_PYTHON, "-c", OTHER_INFO], capture_output=True, check=False,
                           text=True, timeout=120)
    assert other.returncode == 0, f"PB_OTHER_PYTHON={OTHER_PYTHON} does not run: {other.stderr}"
    _, other_jax, _ = other.stdout.split()

    path = tmp_path / "run.nc"
    here = os.path.dirname(os.path.abspath(__file__))
    code = CHILD.format(here=here, tests=os.path.dirname(here))
    proc = subprocess.run([OTHER_PYTHON, "-c", code, str(path), "serial",
                           str(2 * (RUN["num_warmup"] + 8)), "vectorized"],
                          capture_output=True, check=False, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    made = read_groups(path)[0]["draws_done"][0]
    assert made >= 8

    import jax

    with pytest.warns(UserWarning, match="jax") if other_jax != jax.__version__ \
            else contextlib.nullcontext():
        done = pb.sample(model, make_data(), chain_method="vectorized", checkpoint=path,
                         checkpoint_every=EVERY, **RUN)
    assert done.attrs["resume_count"] == 1 and done.attrs["checkpoint_status"] == "finished"
    assert done.posterior["alpha"].shape == (RUN["num_chains"], RUN["num_samples"])
    assert np.isfinite(done.posterior["alpha"].values).all()
    if other_jax == jax.__version__:
        assert_identical(draws(done), draws(uninterrupted["vectorized"]))

    back = subprocess.run([OTHER_PYTHON, "-c", OTHER_LOAD, str(path)], capture_output=True,
                          check=False, text=True, timeout=300)
    assert back.returncode == 0, back.stderr
    _, n_draws, total, status = back.stdout.split()
    assert int(n_draws) == RUN["num_samples"] and status == "finished"
    np.testing.assert_allclose(float(total), float(done.posterior["alpha"].values.sum()),
                               rtol=1e-6)

    # A whole run written there, read here.
    theirs = tmp_path / "theirs.nc"
    write = ("import sys; sys.path[:0] = [{here!r}, {tests!r}]\n"
             "import parallel_backend as pb\n"
             "from test_checkpoint import RUN, make_data, model\n"
             "pb.sample(model, make_data(), checkpoint=sys.argv[1], **RUN)\n")
    made_there = subprocess.run([OTHER_PYTHON, "-c", write.format(here=here,
                                                                  tests=os.path.dirname(here)),
                                 str(theirs)], capture_output=True, check=False, text=True,
                                timeout=300)
    assert made_there.returncode == 0, made_there.stderr
    loaded = load(theirs)
    assert set(run_groups(loaded)) >= {"posterior", "sample_stats", "log_likelihood"}
    assert loaded.posterior["alpha"].shape == (RUN["num_chains"], RUN["num_samples"])
