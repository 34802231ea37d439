"""Do the workers compute this process's bits? A probe block evaluated on each worker.

XLA compiles for the CPU it runs on: the vector width of its instruction set (SSE4, AVX2,
AVX-512) sets the order in which a reduction adds its terms, and fused multiply-adds
round once where separate ones round twice. Two workers on different CPU types can then
give different bits for the same block, and the draws depend on which worker evaluated
which chunk (the promise of bitwise identity holds on one platform). This module owns
the check: :func:`digest` evaluates a fixed block (reductions, ``exp``/``log``,
``logsumexp``, a matrix product; value and gradient, float32 and float64) and hashes the
bits; :func:`watch` compares every worker's digest with this process's when an executor
is made, and every worker that joins later (a ``WorkerPlugin`` evaluates it at join and
reports it as a dask event), and warns, naming the workers and their CPUs, when they
differ. The cure it names: one CPU type, or XLA's target pinned on every host
(``XLA_FLAGS=--xla_cpu_max_isa=AVX2``, here too).

Imports numpy, distributed, and jax lazily (a worker sets its XLA flags first).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import threading
import warnings

import numpy as np
from distributed import WorkerPlugin

__all__ = ["Probe", "describe", "digest", "unwatch", "watch"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=1)  # once per process: XLA's target is fixed when it starts
def digest() -> str:
    """Hash of the probe block's value and gradient bits, in float32 and float64.

    Examples
    --------
    >>> len(digest())  # the same text on every process of one CPU type and JAX version
    24
    """
    import jax
    import jax.numpy as jnp
    from jax.scipy.special import logsumexp

    rng = np.random.default_rng(20261126)  # numpy's bits are the same everywhere
    x64 = rng.normal(size=(257, 37))
    a64 = rng.normal(size=(37, 5)) * 0.3
    h = hashlib.blake2b(digest_size=12)

    def block(theta, x):
        z = x @ theta
        return (logsumexp(z, axis=1) - jnp.log1p(jnp.exp(-jnp.abs(z[:, 0])))
                + jnp.tanh(z[:, 1]) * z[:, 2]).sum()

    for dtype in (np.float32, np.float64):
        with jax.enable_x64(dtype == np.float64):
            f = jax.jit(jax.value_and_grad(block))
            v, g = f(jnp.asarray(a64.astype(dtype)), jnp.asarray(x64.astype(dtype)))
            h.update(np.asarray(v).tobytes())
            h.update(np.asarray(g).tobytes())
    return h.hexdigest()


def describe() -> dict:
    """This process's probe digest, CPU model and XLA flags.

    Examples
    --------
    >>> sorted(describe())
    ['cpu', 'digest', 'xla_flags']
    """
    return {"digest": digest(), "cpu": _cpu_model(),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


def _describe_on_worker(dask_worker=None) -> dict:
    return describe()


class _ProbeAtJoin(WorkerPlugin):
    """Evaluates the probe on a worker when it joins and reports it as an event; reports
    its leaving (closed by the scheduler, scaled down, at the end of its lifetime) too."""

    def __init__(self, topic: str):
        self.topic = topic

    def teardown(self, worker) -> None:
        worker.log_event(self.topic, {"address": worker.address, "left": True})

    def setup(self, worker) -> None:
        info = describe()
        info["address"] = worker.address
        info["nthreads"] = getattr(worker.state, "nthreads", None) or getattr(worker, "nthreads", 1)
        worker.log_event(self.topic, info)


class Probe:
    """What :func:`watch` keeps: this process's digest and what each worker reported."""

    def __init__(self, reference: dict, topic: str):
        self.reference = reference
        self.topic = topic
        self.workers: dict = {}  # address -> describe() of that worker
        self._lock = threading.Lock()

    @property
    def differ(self) -> dict:
        """The workers whose bits differ from this process's."""
        with self._lock:
            return {a: w for a, w in self.workers.items()
                    if w["digest"] != self.reference["digest"]}

    def see(self, found: dict, stacklevel: int = 2) -> None:
        with self._lock:
            new = {a: w for a, w in found.items() if a not in self.workers}
            self.workers.update(new)
        bad = {a: w for a, w in new.items() if w["digest"] != self.reference["digest"]}
        if bad:
            names = "; ".join(f"{a} (CPU {w['cpu']!r}, XLA_FLAGS {w['xla_flags']!r})"
                              for a, w in sorted(bad.items()))
            warnings.warn(
                f"DaskExecutor: {len(bad)} worker(s) compute other bits than this process "
                f"(CPU {self.reference['cpu']!r}, XLA_FLAGS {self.reference['xla_flags']!r}) "
                f"for the same probe block: {names}. Draws then depend on which worker "
                "evaluated which chunk and differ from SerialExecutor's. Run the workers on "
                "one CPU type, or pin XLA's target on every worker and here (for example "
                "XLA_FLAGS=--xla_cpu_max_isa=AVX2), then start the workers again.",
                RuntimeWarning, stacklevel=stacklevel + 1)


def watch(client, name: str, stacklevel: int = 3, on_join=None, on_leave=None) -> Probe:
    """Compare every worker's probe with this process's now, and each later joiner's when it
    joins; warn where they differ. ``name`` keys the plugin and the event topic; each
    worker's report also goes to ``on_join(address, threads)``, and a worker that closes
    calls ``on_leave(address)``, where given (on the client's event loop; the workers
    there now report too; a worker killed outright never says it left).

    Examples
    --------
    >>> probe = watch(client, "my-executor")  # doctest: +SKIP
    >>> probe.differ  # doctest: +SKIP
    {}
    """
    topic = f"{name}-probe"
    probe = Probe(describe(), topic)

    def joined(event):
        info = event[1]
        if info.get("left"):
            if on_leave is not None:
                on_leave(info["address"])
            return
        if on_join is not None:
            on_join(info["address"], info.get("nthreads", 1))
        probe.see({info["address"]: info}, stacklevel=1)

    client.subscribe_topic(topic, joined)
    client.register_plugin(_ProbeAtJoin(topic), name=topic)
    # Those already there ran the plugin at registration (reported as events too, which
    # ``see`` then skips); asking them directly makes the first check synchronous.
    probe.see(client.run(_describe_on_worker), stacklevel=stacklevel)
    return probe


def unwatch(client, probe: Probe | None) -> None:
    """Stop probing joiners (the executor is closing)."""
    if probe is None or client.status != "running":
        return
    with contextlib.suppress(Exception):  # a cluster that is gone has nothing to stop
        client.unsubscribe_topic(probe.topic)
        client.unregister_worker_plugin(probe.topic)
