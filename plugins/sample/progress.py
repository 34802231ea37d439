"""The progress display of ``pb.sample``, and its count of gradient evaluations.

The sampling loop (:mod:`.loop`) hands each transition's figures (:func:`figures`)
to the host (``jax.debug.callback``; under vectorized chains once per batch).
:class:`Progress` counts gradient evaluations from them (each transition's leapfrog
steps; a batch of chains evaluates together, as many times as its longest trajectory
needs), which the tuner (:mod:`.tuning`) times per gradient and ``stats()`` reports, and
shows them where the user looks (:func:`display`): a tqdm bar in a terminal, tqdm's
notebook bar in Jupyter (``tqdm.auto``; a text bar there without ipywidgets), and
otherwise (a batch job, a pipe) a line on standard error at every tenth of the run and
when sampling starts, which is also an INFO record on :data:`LOGGER`
(``plugins/numpyro/display.py``: where it goes). Beside NumPyro's usual figures it shows gradient evaluations
per second and the executor's worker count, and, for a run continued from a checkpoint,
where it was resumed. The callback is always compiled in, shown or not, so
``progress_bar`` never changes the compiled program and hence never the draws. NumPyro's
own bar (``fori_collect``'s) cannot stand in: when on, it runs the loop body from
Python, one call per iteration, another program than with it off, and it counts no
gradients. Imports jax, numpy, tqdm.
"""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np

from ..numpyro.display import DISPLAYS, Lines, display, in_notebook, notebook_tqdm, terminal

__all__ = ["DISPLAYS", "LOGGER", "Progress", "display", "figures", "in_notebook", "terminal"]

#: Where progress lines go as records when there is neither a terminal nor a notebook to
#: draw a bar in (they are written to standard error too, unless logging shows them).
LOGGER = logging.getLogger("parallel_backend.sample")


class Progress:
    """A tqdm bar over ``chains x (warmup + samples)`` transitions; a context manager.

    Parameters
    ----------
    executor : Executor
        Whose ``stats()`` give the gradient-evaluation rate and worker count.
    num_chains, num_warmup, num_samples : int
    enabled : bool
        Show progress (``False``: count silently).
    file : stream, optional
        Where the bar or the lines go; default ``sys.stderr``, as NumPyro's bar.
    where : {"terminal", "notebook", "log"}, optional
        How to show it; default :func:`display`'s answer when the display opens.
    done : int
        Transitions made before this process started (a run resumed from a checkpoint);
        the bar starts there.
    resumed_from, resume_count : int, optional
        The iteration this process resumed from and how many times the run has been
        resumed; the bar says so beside the phase.

    Examples
    --------
    >>> import parallel_backend as pb
    >>> with pb.SerialExecutor() as ex, Progress(ex, 2, 1, 1, enabled=False) as bar:
    ...     bar.tick(1, 3, 0.1, 0.8, False); bar.tick(1, 7, 0.1, 0.9, True)
    ...     bar.count, bar.divergences, bar.postfix()
    (2, 1, 'grad/s=0, workers=1, 7 steps of size 1.00e-01. acc. prob=0.90, div=1')
    >>> sorted(bar.seconds)
    ['sample', 'warmup']
    >>> Progress(None, 1, 10, 10, enabled=False, done=12, resumed_from=12,
    ...          resume_count=2).label("sample")
    'sample (resumed at iteration 12, resume 2)'
    """

    def __init__(self, executor, num_chains: int, num_warmup: int, num_samples: int, *,
                 enabled: bool, file=None, where: str | None = None, done: int = 0,
                 resumed_from=None, resume_count: int = 0):
        if where is not None and where not in DISPLAYS:
            raise ValueError(f"Progress: where must be one of {list(DISPLAYS)} or None, "
                             f"got {where!r}")
        self.executor = executor
        self.total = num_chains * (num_warmup + num_samples)
        self.num_chains = num_chains
        self.num_warmup = num_warmup
        self.num_samples = num_samples
        #: Wall seconds spent in each phase (compilation counts as warmup).
        self.seconds = {"warmup": 0.0, "sample": 0.0}
        self.enabled = bool(enabled)
        self.file = file
        self._lines = Lines(LOGGER, file)
        self.where = where
        self.done = int(done)
        self.count = self.done
        # Where the display is the log: the counts of the next line and of the last one.
        self._next_log = None
        self._logged = self.done
        self.resumed = None if resumed_from is None else (int(resumed_from), int(resume_count))
        self.divergences = 0
        self._phase = "compiling"
        self._last = (0, 0.0, 0.0)
        self._lock = threading.Lock()
        self._bar = None
        self._t0 = self._last_t = time.perf_counter()
        #: Gradient evaluations so far, and the parameter sets they carried (a batch of
        #: ``k`` chains evaluates ``k`` at once).
        self.gradients = 0
        self.batches = 0
        self._rate = 0.0

    def __enter__(self):
        if not self.enabled:
            return self
        if self.where is None:
            self.where = display(self.file)
        if self.where == "terminal":
            from tqdm import tqdm

            # A terminal that reports no size (a fresh pty) would get an empty bar.
            size = shutil.get_terminal_size((100, 20))
            self._bar = tqdm(total=self.total, file=self.file or sys.stderr, mininterval=0.2,
                             ncols=size.columns if size.columns > 0 else 100,
                             nrows=size.lines if size.lines > 0 else 20, unit="it",
                             desc=self.label(self._phase), initial=self.done)
        elif self.where == "notebook":
            self._bar = notebook_tqdm()(total=self.total, file=self.file or sys.stderr,
                                         mininterval=0.5, unit="it",
                                         desc=self.label(self._phase), initial=self.done)
        else:
            self._next_log = self._tenth_after(self.done)
            self._lines("%s: %d chains x (%d warmup + %d draws), %d transitions done",
                        self.label(self._phase), self.num_chains, self.num_warmup,
                        self.num_samples, self.done)
        return self

    def __exit__(self, *exc):
        self.close()

    def finish(self) -> None:
        """The run has returned: the time since the last transition is sampling's
        (collection, postprocessing)."""
        with self._lock:
            now = time.perf_counter()
            self.seconds["sample" if self.count > self.done else "warmup"] += now - self._last_t
            self._last_t = now

    def close(self) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(self.postfix(), refresh=False)
            self._bar.close()
            self._bar = None
        elif self.enabled and self.where == "log" and self._next_log is not None:
            self._next_log = None
            if self.count != self._logged:  # the run ended between two tenths
                self._lines("%s", self._log_line(time.perf_counter()))

    def _tenth_after(self, count: int) -> int:
        """The count of transitions at which the run reaches the tenth after ``count``'s."""
        total = max(self.total, 1)
        return -(-(count * 10 // total + 1) * total // 10)

    def _log_line(self, now: float) -> str:
        return (f"{self.label(self._phase)}: {self.count}/{self.total} transitions "
                f"({100 * self.count // max(self.total, 1)}%), "
                f"{now - self._t0:.1f} s, {self.postfix()}")

    def label(self, phase: str) -> str:
        """The bar's description: the phase, and where a resumed run was resumed."""
        if self.resumed is None:
            return phase
        return f"{phase} (resumed at iteration {self.resumed[0]}, resume {self.resumed[1]})"

    def _set_phase(self, name: str) -> None:
        if name != self._phase:
            before, self._phase = self._phase, name
            self.divergences = 0
            if self._bar is not None:
                self._bar.set_description(self.label(name), refresh=False)
            elif self.enabled and self.where == "log" and before == "warmup":
                self._lines("%s: started after %.1f s of warmup", self.label(name),
                            self.seconds["warmup"])

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
            steps = int(np.max(num_steps)) if np.size(num_steps) else 0
            self.gradients += steps
            self.batches += steps * max(int(np.size(num_steps)), 1)
            self._last = (steps, float(np.mean(step_size)), float(np.mean(accept_prob)))
            if not self.enabled:
                return
            self._rate = self.gradients / max(now - self._t0, 1e-9)
            if self._bar is not None:
                self._bar.set_postfix_str(self.postfix(), refresh=False)
                self._bar.update(max(int(diverging.size), 1))
            elif self._next_log is not None and self.count >= self._next_log:
                self._next_log = self._tenth_after(self.count)
                self._logged = self.count
                self._lines("%s", self._log_line(now))

    def postfix(self) -> str:
        steps, size, acc = self._last
        return (f"grad/s={self._rate:.0f}, workers={getattr(self.executor, 'workers', 1)}, "
                f"{steps} steps of size {size:.2e}. acc. prob={acc:.2f}, "
                f"div={self.divergences}")


def figures(state):
    """``(i, num_steps, step_size, mean_accept_prob, diverging)`` where the state has them."""
    def get(name, default):
        value = getattr(state, name, None)
        return jnp.asarray(default) if value is None else jnp.asarray(value)

    adapt = getattr(state, "adapt_state", None)
    step = getattr(adapt, "step_size", None) if adapt is not None else None
    return (get("i", 0), get("num_steps", 0),
            jnp.asarray(0.0) if step is None else jnp.asarray(step),
            get("mean_accept_prob", get("accept_prob", 0.0)), get("diverging", False))
