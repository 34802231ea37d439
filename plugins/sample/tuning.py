"""Where a run's ``reduce_sum`` sites run, chosen from the run's own timings.

Values, gradients and draws are the same bits whether a site runs in the caller's
program or on its executor's workers, so the route may change between any two
segments of the compiled sampling loop (the choice is a runtime input of the loop).
:class:`Tuner` uses that: after the loop has compiled, it times a few short segments
of the sampler on each route, alternately, as seconds per gradient evaluation (the
transitions' leapfrog steps), and keeps the host route only where
:func:`parallel_backend.routes.choose` says it is faster beyond the noise. Nothing is
compiled or timed while tracing, the measured segments are real work of the run,
and a resumed run measures again. It also counts, per site, the gradient
evaluations that ran in the graph (no callback counts those), for ``stats()``.

Imports jax, numpy and the core's interface.
"""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import numpy as np

from parallel_backend.extend import HOST, GraphRoute, HostRoute, choose

__all__ = ["ROUNDS", "SEGMENT_SECONDS", "Tuner"]

class Probe:
    """The segment that times one transition, to size the timed rounds (not a route)."""

    name = "probe"


#: Paired rounds (a segment on each route) timed to choose.
ROUNDS = 3
#: Seconds a timed segment should last (about); its iterations follow from the first.
SEGMENT_SECONDS = 0.4
#: At most this share of the iterations left is spent timing.
BUDGET = 0.4


class Tuner:
    """Plans the segments of one process's part of a run and chooses the sites' routes.

    Parameters
    ----------
    segments : Segments
        The compiled loop (its ``slots`` name the sites once it is traced).
    progress : Progress
        Counts gradient evaluations (``gradients``, ``batches``) from the loop.
    enabled : bool
        Measure at all (``False``: every site stays where its executor puts it).
    """

    def __init__(self, segments, progress, enabled: bool = True):
        self.segments = segments
        self.progress = progress
        self.enabled = enabled
        self.choices: Any = None  # np.int32 array once the loop is traced
        self.decided = not enabled
        self._plan: list = []  # (iterations, route) still to time
        self._times: dict[type, list[float]] = {GraphRoute: [], HostRoute: []}
        self._iteration_seconds: Any = None  # seconds per transition, once probed
        self.segment_log: list = []  # (choices, calls, batches) per segment run

    # -- what the next segment is ---------------------------------------------------------

    def next(self, lo: int, stop: int) -> tuple[int, np.ndarray, type | None]:
        """``(hi, choices, timed route or None)`` of the segment from ``lo`` (at most to
        ``stop``, the next checkpoint or the end)."""
        if self.choices is None:  # the first segment compiles: one transition
            return min(lo + 1, stop), self.segments.default_choices(), None
        if self.decided or not self._candidates():
            self.decided = True
            return stop, self.choices, None
        if self._iteration_seconds is None:  # one transition, compiled now, to size the rest
            return min(lo + 1, stop), self.choices, Probe
        if not self._plan:
            self._finish()
            return stop, self.choices, None
        n, route = self._plan[0]
        return min(lo + n, stop), self._with(route), route

    def record(self, route, seconds: float, calls: int, batches: int, hi_lo: tuple) -> None:
        """What the segment just run measured (``route`` as :meth:`next` said)."""
        if self.choices is None:
            self.choices = self.segments.default_choices()
        if route is Probe:
            per = seconds / max(hi_lo[1] - hi_lo[0], 1)
            self._iteration_seconds = per
            self._plan_rounds(hi_lo[1])
        elif route in self._times and self._plan:
            done = hi_lo[1] - hi_lo[0]
            n, planned = self._plan.pop(0)
            if done == n and calls > 0:
                self._times[route].append(seconds / calls)
                self._shorten(seconds / done)
            else:  # cut short by a checkpoint: time it again
                self._plan.insert(0, (n, planned))

    def log(self, choices, calls: int, batches: int) -> None:
        self.segment_log.append((np.asarray(choices).copy(), int(calls), int(batches)))

    # -- internals ------------------------------------------------------------------------

    def _candidates(self) -> list:
        slots = self.segments.slots
        return [s for s in (slots.sites if slots is not None else ()) if s.slot is not None]

    def _with(self, route) -> np.ndarray:
        out = self.choices.copy()
        for site in self._candidates():
            out[site.slot] = route.slot
        return out

    def _default_route(self) -> type[GraphRoute | HostRoute]:
        """Where most candidate sites run unless told otherwise."""
        sites = self._candidates()
        hosts = sum(int(self.choices[s.slot] == HOST) for s in sites)
        return HostRoute if 2 * hosts >= len(sites) else GraphRoute

    def _plan_rounds(self, at: int) -> None:
        """Paired rounds of segments, planned of equal length: as long as
        :data:`SEGMENT_SECONDS` asks at the probe's transition, shortened (then fewer
        rounds, at least two) to stay within :data:`BUDGET` of the iterations left; none
        if even that does not fit. The first segment runs on the default route: sized
        from one probed transition, it may last far longer than asked (see
        :meth:`_shorten`), and there it costs nothing."""
        left = self.segments.num_warmup + self.segments.num_samples - at
        budget = BUDGET * left
        n = min(self._segment_length(), max(1, int(budget // (2 * ROUNDS))))
        rounds = ROUNDS
        while rounds >= 2 and 2 * rounds * n > budget:
            rounds -= 1
        if rounds < 2:
            self._plan = []
            return
        first = self._default_route()
        pair = (first, GraphRoute if first is HostRoute else HostRoute)
        self._plan = [(n, route) for r in range(rounds)
                      for route in (pair if r % 2 == 0 else pair[::-1])]

    def _shorten(self, per_iteration: float) -> None:
        """Cut the segments still planned to what :data:`SEGMENT_SECONDS` asks at the
        slowest transition timed so far. NUTS's first transitions of a warmup can be one
        gradient each and the next ones thirty: sized from the probe alone, the demo's HMM
        with four chains timed six transitions per segment, 7-18 s each instead of 0.4 s,
        and ran 450 gradients on the slower route (about 15 s of a 214 s run)."""
        self._iteration_seconds = max(self._iteration_seconds, per_iteration)
        n = self._segment_length()
        self._plan = [(min(k, n), route) for k, route in self._plan]

    def _segment_length(self) -> int:
        """Transitions that last about :data:`SEGMENT_SECONDS` at the slowest timed so far."""
        return max(1, math.ceil(SEGMENT_SECONDS / max(self._iteration_seconds, 1e-6)))

    def _finish(self) -> None:
        """Choose from what was timed and record it on every candidate site."""
        self.decided = True
        for site in self._candidates():
            default = site.executor.route(site.state)
            choice = choose(self._times[GraphRoute], self._times[HostRoute], default)
            site.state.measured = choice
            self.choices[site.slot] = choice.route.slot

    # -- counts for stats() -------------------------------------------------------------

    def count_graph_evaluations(self) -> None:
        """Hand each site's graph evaluations (from :meth:`log`) to its executor. Call it
        once, when the run has returned."""
        jax.effects_barrier()
        if self.segment_log:  # figures that reached the counter after their segment's log
            choices, c, b = self.segment_log[-1]
            logged_c = sum(x[1] for x in self.segment_log)
            logged_b = sum(x[2] for x in self.segment_log)
            self.segment_log[-1] = (choices, c + self.progress.gradients - logged_c,
                                    b + self.progress.batches - logged_b)
        slots = self.segments.slots
        for site in slots.sites if slots is not None else ():
            if site.executor.count_calls:
                continue  # a callback in the program counted them already
            calls = batches = 0
            for choices, c, b in self.segment_log:
                on_host = (site.slot is not None and choices[site.slot] == HOST) or (
                    site.slot is None and site.executor.route(site.state) is HostRoute)
                if not on_host:
                    calls, batches = calls + c, batches + b
            if calls:
                site.executor.count_sampled(site.state, calls, batches)


def timed_run(tuner, segments, state, buffers, lo: int, stop: int):
    """Run the next segment the tuner plans from ``lo``; ``(state, buffers, hi)``."""
    hi, choices, route = tuner.next(lo, stop)
    counter = tuner.progress
    g0, b0 = getattr(counter, "gradients", 0), getattr(counter, "batches", 0)
    t0 = time.perf_counter()
    state, buffers = segments.run(state, buffers, lo, hi, choices)
    if route is not None or tuner.choices is None:
        jax.block_until_ready((state, buffers))
        jax.effects_barrier()  # every transition's figures have reached the counter
    seconds = time.perf_counter() - t0
    calls = getattr(counter, "gradients", 0) - g0
    batches = getattr(counter, "batches", 0) - b0
    tuner.record(route, seconds, calls, batches, (lo, hi))
    tuner.log(choices, calls, batches)
    return state, buffers, hi
