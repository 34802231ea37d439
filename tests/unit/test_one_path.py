"""One host-path gradient evaluation, after warm-up, takes one short path through the
package: at most six of its modules, and never back into a module that is waiting on
another (A -> B -> A), on the calling thread or on the executor's workers.

Recorded with ``sys.monitoring`` (Python 3.12+), which sees every thread, also the one
XLA runs the host callback on (``sys.setprofile`` does not); CI's second stack runs it.
"""

from __future__ import annotations

import os
import sys
import threading

import jax
import numpy as np
import pytest

import parallel_backend as pb

pytestmark = pytest.mark.skipif(
    sys.version_info < (3, 12),
    reason="sys.monitoring (Python 3.12+) is what sees XLA's callback thread")

ROOT = os.path.dirname(os.path.dirname(pb.__file__))
PACKAGE_DIRS = (os.path.join(ROOT, "parallel_backend"), os.path.join(ROOT, "plugins"))


def _module(code) -> str | None:
    path = os.path.realpath(code.co_filename)
    if path.startswith(PACKAGE_DIRS):
        return os.path.relpath(path, ROOT)
    return None


def record(f, *args):
    """Per thread, the package modules entered while ``f(*args)`` runs, in order, with
    the stack of package modules below each entry."""
    mon = sys.monitoring
    tool = mon.PROFILER_ID
    entries: dict = {}
    stacks: dict = {}
    lock = threading.Lock()

    def start(code, _offset):
        m = _module(code)
        if m is None:
            return
        t = threading.current_thread().name
        with lock:
            stack = stacks.setdefault(t, [])
            entries.setdefault(t, []).append((m, code.co_name, tuple(stack)))
            stack.append(m)

    def stop(code, _offset, _value=None):
        if _module(code) is None:
            return
        with lock:
            stack = stacks.get(threading.current_thread().name)
            if stack:
                stack.pop()

    mon.use_tool_id(tool, "parallel_backend test")
    try:
        events = mon.events
        for ev, cb in ((events.PY_START, start), (events.PY_RESUME, start),
                       (events.PY_RETURN, stop), (events.PY_YIELD, stop),
                       (events.PY_UNWIND, stop)):
            mon.register_callback(tool, ev, cb)
        mon.set_events(tool, events.PY_START | events.PY_RESUME | events.PY_RETURN
                       | events.PY_YIELD | events.PY_UNWIND)
        jax.block_until_ready(f(*args))
    finally:
        mon.set_events(tool, 0)
        mon.free_tool_id(tool)
    return entries


def loglik(x, mu, sigma):
    return jax.scipy.stats.norm.logpdf(x, mu, sigma)


@pytest.mark.parametrize("make", [lambda: pb.ThreadExecutor(2, dispatch="host"),
                                  lambda: pb.SerialExecutor(dispatch="host")],
                         ids=["thread", "serial-host"])
def test_one_evaluation_enters_six_modules_and_never_comes_back(make):
    x = np.random.default_rng(0).normal(size=40_000).astype(np.float32)
    with make() as ex:
        f = jax.jit(jax.value_and_grad(
            lambda mu, s: pb.reduce_sum(loglik, x, mu, s, executor=ex, block_rows=2_000),
            argnums=(0, 1)))
        for _ in range(6):  # compile, and let the adaptive chunker settle
            jax.block_until_ready(f(0.1, 1.0))
        entries = record(f, 0.2, 1.1)
        assert ex.stats()["host_calls"] == 7
    modules = {m for per in entries.values() for m, _, _ in per}
    assert "parallel_backend/host.py" in modules and "parallel_backend/tasks.py" in modules
    assert len(modules) <= 6, sorted(modules)
    for thread, per in entries.items():
        for m, name, below in per:
            # Entering a module again while another one is between (A -> B -> A).
            assert not (below and below[-1] != m and m in below), (thread, m, name, below)
    workers = [per for t, per in entries.items() if t.startswith("parallel_backend")]
    for per in workers:  # the pool's threads run tasks, and nothing that waits on them
        assert {m for m, _, _ in per} <= {"parallel_backend/tasks.py"}, per
