"""Every chain of one ``pb.sample`` call: started or restored, run lane by lane in
segments, and snapshotted for checkpoints.

Between segments, every chain's sampler state and draws are kept on the host, stacked
on a leading chain axis (``(chains, ...)`` and ``(chains, draws, ...)``), with the
transitions each chain has made (``done``). A lane takes its chains' part to the device,
runs its segments through :class:`~.loop.Segments`, and puts it back. A fresh run
starts from ``kernel.init``'s states; a resumed one from a checkpoint's arrays, which
are the same bits. Imports jax, numpy, :mod:`.loop`, :mod:`.tuning` and the NumPyro
plugin's :mod:`~parallel_backend.plugins.numpyro.record`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..numpyro.record import Run
from .loop import Segments, init_states, to_device, to_host
from .tuning import Tuner, timed_run

__all__ = ["Chains"]


class Chains:
    """The chains of a run and the loop over their lanes and segments.

    Parameters
    ----------
    kernel : MCMCKernel
        A kernel of its own (``init`` sets it up for this run).
    lanes : Lanes
    fields : tuple of str
        The collected state fields, sample field first.
    num_chains, num_warmup, num_samples : int
    model_args, model_kwargs : tuple, dict
    tick : callable
        The progress callback, called from the compiled loop after every transition.
    """

    def __init__(self, kernel, lanes, fields, num_chains, num_warmup, num_samples,
                 model_args, model_kwargs, tick):
        self.kernel, self.lanes, self.fields = kernel, lanes, fields
        self.num_chains, self.num_warmup, self.num_samples = num_chains, num_warmup, num_samples
        self.total = num_warmup + num_samples
        self.args, self.kwargs = tuple(model_args), dict(model_kwargs)
        self.segments = Segments(kernel, lanes, fields, num_warmup, num_samples,
                                 model_args, model_kwargs, tick)
        self._fresh = None

    def start(self, key, init_params, resume: bool):
        """Initialize the kernel: every chain, or (``resume``) only what sets it up.

        Returns ``(state, draws)``: one chain's state and the shapes of one draw, the
        structure a checkpoint must have (see :meth:`restore`)."""
        states = init_states(self.kernel, key, self.lanes, self.num_chains, self.num_warmup,
                             init_params, self.args, self.kwargs,
                             chains=[0] if resume else None)
        batched = self.lanes.kind == "batched"
        self.one = jax.tree.map(lambda x: x[0], states[0]) if batched else states[0]
        self.draws = jax.eval_shape(self.segments.collect, self.one)
        self.buffers = jax.tree.map(
            lambda s: np.zeros((self.num_chains, self.num_samples) + s.shape, s.dtype),
            self.draws)
        self.done = np.zeros(self.num_chains, np.int64)
        if not resume:
            stacked = states[0] if batched else jax.tree.map(lambda *xs: jnp.stack(xs), *states)
            self.state = to_host(stacked)
            # The first lane starts from init's device arrays; no round trip.
            self._fresh = {0: stacked} if self.lanes.kind != "each" else dict(enumerate(states))
        return self.one, self.draws

    def restore(self, state_leaves, draw_leaves, done) -> None:
        """Continue from a checkpoint's arrays: the stacked state leaves and draw leaves
        in tree order (of :meth:`start`'s results), and ``done`` per chain."""
        self.state = jax.tree.unflatten(jax.tree.structure(self.one), list(state_leaves))
        self.buffers = jax.tree.unflatten(jax.tree.structure(self.draws),
                                          [np.asarray(x) for x in draw_leaves])
        self.done = np.asarray(done, np.int64).copy()
        self._fresh = {}

    def run(self, every=None, on_segment=None, tuner=None) -> None:
        """Run every lane to the end; with ``every``, in segments that end at multiples
        of ``every`` iterations (and at each lane's end), calling ``on_segment()`` after
        each with the host copies up to date. A ``tuner``
        (:class:`~.tuning.Tuner`) cuts more segments to time the sites' routes and
        picks the route of each segment (which changes no draw)."""
        if tuner is None:
            tuner = Tuner(self.segments, None, enabled=False)
        for index, chains in enumerate(self.lanes.chains(self.num_chains)):
            lo = int(self.done[chains[0]])
            if lo >= self.total:
                continue
            state, buffers = self._lane(index, chains)
            for stop in _bounds(lo, self.total, every):
                while lo < stop:
                    state, buffers, lo = timed_run(tuner, self.segments, state, buffers, lo,
                                                   stop)
                if every is not None:
                    self._put(chains, state, buffers, stop)
                    on_segment()
            if every is None:
                self._put(chains, state, buffers, self.total)

    def _lane(self, index, chains):
        fresh = self._fresh.pop(index, None)
        take = (lambda x: x[chains[0]]) if self.lanes.kind == "each" else (lambda x: x)
        buffers = to_device(jax.tree.map(take, self.buffers), self.draws)
        if fresh is not None:
            return fresh, buffers
        return to_device(jax.tree.map(take, self.state), self.one), buffers

    def _put(self, chains, state, buffers, done) -> None:
        state, buffers = to_host((state, buffers))
        if self.lanes.kind == "each":
            c = chains[0]
            for dst, src in zip(jax.tree.leaves(self.state), jax.tree.leaves(state)):
                dst[c] = src
            for dst, src in zip(jax.tree.leaves(self.buffers), jax.tree.leaves(buffers)):
                dst[c] = src
        else:
            self.state, self.buffers = state, buffers
        self.done[chains] = done

    def snapshot(self) -> tuple:
        """``(state leaves, draw leaves, done)``: host arrays, stacked on the chain axis."""
        return jax.tree.leaves(self.state), jax.tree.leaves(self.buffers), self.done.copy()

    def result(self) -> Run:
        """The finished run, as ``pb.to_arviz`` reads an ``MCMC``."""
        return Run(self.kernel, self.fields, self.buffers, self.state, self.args, self.kwargs)


def _bounds(lo: int, total: int, every):
    """Segment ends after ``lo``: the multiples of ``every`` below ``total``, then ``total``."""
    if every is None:
        return [total]
    return list(range((lo // every + 1) * every, total, every)) + [total]
