"""The progress bar of ``pb.sample``.

:class:`ProgressKernel` wraps any ``MCMCKernel``: after each transition it hands
the state's figures to the host (``jax.debug.callback``; under vectorized chains
once per chain). :class:`Progress` turns them into a tqdm bar that shows, beside
NumPyro's usual figures, gradient evaluations per second (from the executor's
``stats()["calls"]``, one per evaluation) and the executor's worker count. The
callback is always compiled in, shown or not, so ``progress_bar`` never changes
the compiled program and hence never the draws. Imports jax, numpyro, tqdm.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.infer.mcmc import MCMCKernel

__all__ = ["Progress", "ProgressKernel", "terminal"]


def terminal(stream=None) -> bool:
    """Whether ``stream`` (default ``sys.stdout``) is an interactive terminal."""
    stream = sys.stdout if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class Progress:
    """A tqdm bar over ``chains x (warmup + samples)`` transitions; a context manager.

    Parameters
    ----------
    executor : Executor
        Whose ``stats()`` give the gradient-evaluation rate and worker count.
    num_chains, num_warmup, num_samples : int
    enabled : bool
        Draw the bar (``False``: count silently).
    file : stream, optional
        Where the bar goes; default ``sys.stdout``.

    Examples
    --------
    >>> import parallel_backend as pb
    >>> with pb.SerialExecutor() as ex, Progress(ex, 2, 1, 1, enabled=False) as bar:
    ...     bar.tick(1, 3, 0.1, 0.8, False); bar.tick(1, 7, 0.1, 0.9, True)
    ...     bar.count, bar.divergences, bar.postfix()
    (2, 1, 'grad/s=0, workers=1, 7 steps of size 1.00e-01. acc. prob=0.90, div=1')
    >>> sorted(bar.seconds)
    ['sample', 'warmup']
    """

    def __init__(self, executor, num_chains: int, num_warmup: int, num_samples: int, *,
                 enabled: bool, file=None):
        self.executor = executor
        self.total = num_chains * (num_warmup + num_samples)
        self.num_chains = num_chains
        self.num_warmup = num_warmup
        #: Wall seconds spent in each phase (compilation counts as warmup).
        self.seconds = {"warmup": 0.0, "sample": 0.0}
        self.enabled = bool(enabled)
        self.file = file
        self.count = 0
        self.divergences = 0
        self._phase = "compiling"
        self._last = (0, 0.0, 0.0)
        self._lock = threading.Lock()
        self._bar = None
        self._t0 = self._last_t = time.perf_counter()
        self._calls0 = self._calls()
        self._rate = 0.0
        self._next_rate = 0.0

    def __enter__(self):
        if self.enabled:
            from tqdm import tqdm

            # A terminal that reports no size (a fresh pty) would get an empty bar.
            size = shutil.get_terminal_size((100, 20))
            self._bar = tqdm(total=self.total, file=self.file or sys.stdout, mininterval=0.2,
                             ncols=size.columns if size.columns > 0 else 100,
                             nrows=size.lines if size.lines > 0 else 20, unit="it",
                             desc=self._phase)
        return self

    def __exit__(self, *exc):
        self.close()

    def finish(self) -> None:
        """The run has returned: the time since the last transition is sampling's
        (collection, postprocessing)."""
        with self._lock:
            now = time.perf_counter()
            self.seconds["sample" if self.count else "warmup"] += now - self._last_t
            self._last_t = now

    def close(self) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(self.postfix(), refresh=False)
            self._bar.close()
            self._bar = None

    def _calls(self) -> int:
        try:
            return int(self.executor.stats()["calls"])
        except Exception:  # a closed or foreign executor: no rate, not an error
            return 0

    def _set_phase(self, name: str) -> None:
        if name != self._phase:
            self._phase = name
            self.divergences = 0
            if self._bar is not None:
                self._bar.set_description(name, refresh=False)

    def tick(self, i, num_steps, step_size, accept_prob, diverging) -> None:
        """One transition of one chain, or of a batch of chains (arrays; called from
        the compiled loop). A batch shows its largest step count: vectorized chains
        step together until the longest trajectory ends."""
        diverging = np.asarray(diverging)
        with self._lock:
            now = time.perf_counter()
            # ``i`` counts transitions from 1; without it, count them (vectorized order).
            i = int(np.max(i)) if np.size(i) and np.max(i) > 0 else (
                self.count // max(self.num_chains, 1) + 1)
            phase = "warmup" if i <= self.num_warmup else "sample"
            self.seconds[phase] += now - self._last_t
            self._last_t = now
            self._set_phase(phase)
            self.count += max(int(diverging.size), 1)
            self.divergences += int(np.sum(diverging))
            self._last = (int(np.max(num_steps)), float(np.mean(step_size)),
                          float(np.mean(accept_prob)))
            if self._bar is None:
                return
            if now >= self._next_rate:  # stats() takes the executor's lock: not every tick
                self._rate = (self._calls() - self._calls0) / max(now - self._t0, 1e-9)
                self._next_rate = now + 0.2
            self._bar.set_postfix_str(self.postfix(), refresh=False)
            self._bar.update(max(int(diverging.size), 1))

    def postfix(self) -> str:
        steps, size, acc = self._last
        return (f"grad/s={self._rate:.0f}, workers={getattr(self.executor, 'workers', 1)}, "
                f"{steps} steps of size {size:.2e}. acc. prob={acc:.2f}, "
                f"div={self.divergences}")


class ProgressKernel(MCMCKernel):
    """``kernel`` with a host callback after each transition; otherwise the same kernel.

    Every attribute not defined here (``model``, ``_sample_fn``...) is the inner
    kernel's, so ``MCMC`` and ``arviz.from_numpyro`` see the kernel they expect.
    """

    def __init__(self, kernel: MCMCKernel, progress: Progress):
        self.kernel = kernel
        self.progress = progress

    def __getattr__(self, name):
        if name in ("kernel", "progress"):  # not yet set (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.kernel, name)

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        return self.kernel.init(rng_key, num_warmup, init_params, model_args, model_kwargs)

    def sample(self, state, model_args, model_kwargs):
        new = self.kernel.sample(state, model_args, model_kwargs)
        jax.debug.callback(self._tick, *_figures(new))
        return new

    def _tick(self, *figures):
        self.progress.tick(*(np.asarray(f) for f in figures))

    def postprocess_fn(self, model_args, model_kwargs):
        return self.kernel.postprocess_fn(model_args, model_kwargs)

    @property
    def sample_field(self):
        return self.kernel.sample_field

    @property
    def default_fields(self):
        return self.kernel.default_fields

    @property
    def is_ensemble_kernel(self):
        return self.kernel.is_ensemble_kernel

    def get_diagnostics_str(self, state):
        return self.kernel.get_diagnostics_str(state)


def _figures(state):
    """``(i, num_steps, step_size, mean_accept_prob, diverging)`` where the state has them."""
    def get(name, default):
        value = getattr(state, name, None)
        return jnp.asarray(default) if value is None else jnp.asarray(value)

    adapt = getattr(state, "adapt_state", None)
    step = getattr(adapt, "step_size", None) if adapt is not None else None
    return (get("i", 0), get("num_steps", 0), jnp.asarray(0.0) if step is None else jnp.asarray(step),
            get("mean_accept_prob", get("accept_prob", 0.0)), get("diverging", False))
