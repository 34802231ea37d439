"""Where ``pb.sample``'s progress goes: a bar on a terminal (``test_sample.py`` runs one on
a pseudo-terminal), a bar in a Jupyter kernel, and lines on the ``parallel_backend.sample``
logger, and on standard error unless logging shows them, where no bar can be seen (a batch
job, a pipe). The notebooks of ``examples/``
show the Jupyter bar in their outputs (``test_examples.py``)."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import parallel_backend as pb
from helpers import regression_data, regression_model
from parallel_backend.plugins.sample.progress import LOGGER, Progress, display


def tick_through(bar, chains, iterations):
    for i in range(1, iterations + 1):
        bar.tick(np.full(chains, i), np.full(chains, 3), 0.1, 0.8, np.zeros(chains, bool))


def test_without_a_terminal_or_notebook_progress_is_logged_every_tenth(caplog):
    assert display(io.StringIO()) == "log"
    assert LOGGER.name == "parallel_backend.sample"
    with (caplog.at_level(logging.INFO, logger=LOGGER.name), pb.SerialExecutor() as ex,
          Progress(ex, 2, 10, 15, enabled=True, file=io.StringIO()) as bar):
        tick_through(bar, 2, 25)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER.name]
    assert lines[0] == "compiling: 2 chains x (10 warmup + 15 draws), 0 transitions done"
    assert lines[1].startswith("warmup: 6/50 transitions (12%), ")  # the first tenth passed
    assert sum("transitions (" in line for line in lines) == 10  # one per tenth, no more
    assert lines[-1].startswith("sample: 50/50 transitions (100%), ")
    assert "grad/s=" in lines[-1] and "workers=1" in lines[-1] and "div=0" in lines[-1]
    started = [line for line in lines if "started after" in line]
    assert len(started) == 1 and started[0].startswith("sample: started after ")


def test_a_run_that_ends_between_tenths_logs_its_end(caplog):
    with (caplog.at_level(logging.INFO, logger=LOGGER.name),
          Progress(None, 1, 3, 4, enabled=True, where="log") as bar):
        tick_through(bar, 1, 7)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[-1].startswith("sample: 7/7 transitions (100%)")
    assert len(lines) == len(set(lines))  # the last tenth is not written twice


def test_disabled_progress_and_bad_places_say_nothing(caplog):
    with (caplog.at_level(logging.INFO, logger=LOGGER.name),
          Progress(None, 1, 3, 4, enabled=False, where="log") as bar):
        tick_through(bar, 1, 7)
    assert not caplog.records and bar.count == 7
    with pytest.raises(ValueError, match=r"where must be one of \['terminal', 'notebook', 'log'\]"):
        Progress(None, 1, 3, 4, enabled=True, where="screen")


def test_sample_without_a_terminal_writes_progress_lines_to_the_log(caplog, capsys):
    """``pb.sample`` with stdout not a terminal (captured here, as a pipe or a batch job's
    file would be) outside Jupyter: no bar on stdout, a line on the log every tenth."""
    with caplog.at_level(logging.INFO, logger=LOGGER.name):
        pb.sample(regression_model, regression_data(400), num_warmup=40, num_samples=20,
                  num_chains=2, executor="serial", seed=3,
                  arviz_kwargs={"log_likelihood": False})
    out = capsys.readouterr()
    assert "transitions" not in out.out + out.err and "\r" not in out.out + out.err
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER.name]
    assert lines[0] == "compiling: 2 chains x (40 warmup + 20 draws), 0 transitions done"
    assert sum("transitions (" in line for line in lines) == 10
    assert lines[-1].startswith("sample: 120/120 transitions (100%)")
    assert any(line.startswith("sample: started after") for line in lines)


@pytest.mark.slow  # a subprocess with a fit of its own
def test_a_batch_job_sees_progress_on_stderr(tmp_path):
    """``python fit.py > out 2> err`` with logging left as Python starts it (nothing shows
    an INFO record): the progress lines go to standard error, as NumPyro's bar, and
    nothing to standard output. (Where logging shows the records, each line appears once,
    as its record: the test above.)"""
    script = tmp_path / "fit.py"
    script.write_text(textwrap.dedent("""
        import parallel_backend as pb
        from helpers import regression_data, regression_model
        pb.sample(regression_model, regression_data(300), num_warmup=20, num_samples=10,
                  num_chains=1, executor="serial", seed=3,
                  arviz_kwargs={"log_likelihood": False})
        print("done")
    """))
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]),
                                          os.environ.get("PYTHONPATH", "")])}
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.run([sys.executable, str(script)], stdout=out, stderr=err, env=env,
                              timeout=300, check=False)
    stdout, stderr = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    assert proc.returncode == 0, stderr[-3000:]
    assert stdout == "done\n", stdout
    lines = [ln for ln in stderr.splitlines() if "transitions (" in ln]
    assert len(lines) == 10, stderr[-3000:]
    assert lines[0].startswith("warmup: 3/30") and lines[-1].startswith("sample: 30/30"), lines


def test_log_likelihood_and_profile_show_progress_on_stderr(capsys):
    """Where no bar can be seen and logging shows nothing: a line per tenth of the draws of
    ``pb.log_likelihood``, a line per step of ``pb.profile``, on stderr; none with
    ``progress_bar=False``."""
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist

    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        pb.observe("y", lambda z, mu: dist.Normal(mu + z, 1.0), jnp.zeros(y.shape[0]), mu, obs=y)

    y = jnp.linspace(-1.0, 1.0, 50)
    pb.log_likelihood(lambda y: model(y), {"mu": jnp.zeros(20)}, y)
    err = capsys.readouterr().err
    assert "pb.log_likelihood: 20 draws" in err and "pb.log_likelihood: 20/20 draws (100%)" in err
    pb.profile(model, y, executors=[pb.SerialExecutor()], nuts=False)
    err = capsys.readouterr().err
    assert "pb.profile: 3 steps" in err and "pb.profile: 3/3 steps (100%)" in err, err
    assert "built plain NumPyro" in err, err
    pb.log_likelihood(model, {"mu": jnp.zeros(20)}, y, progress_bar=False)
    assert capsys.readouterr().err == ""
