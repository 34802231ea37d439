"""Counting the evaluations that run inside the caller's program, when asked to.

A host-path evaluation is counted in Python by the host callback that runs it. An
evaluation inside the caller's XLA program has no such callback: ``pb.sample`` counts
those from the sampler's own figures (leapfrog steps), and an executor made with
``count_calls=True`` compiles a small ``jax.pure_callback`` into the program that counts
each one (tens of microseconds per evaluation, so it is opt-in). This module owns
:class:`GraphCounter`, that callback's counter. Imports jax and numpy.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["GraphCounter"]


class GraphCounter:
    """Counts the graph evaluations of one call site: calls, and parameter sets (a
    ``vmap`` batch of ``k`` is one call of ``k``)."""

    def __init__(self):
        self._counts = [0, 0]
        self._lock = threading.Lock()

    def zero(self, value):
        """A traced zero shaped like ``value`` that counts one evaluation when computed
        (the caller adds it to the value and to the gradient's cotangent, so that XLA
        keeps it wherever either is used)."""
        dtype = jnp.result_type(value)

        def count(v):
            with self._lock:
                self._counts[0] += 1
                self._counts[1] += max(int(np.size(v)), 1)
            return np.zeros(np.shape(v), dtype)

        return jax.pure_callback(count, jax.ShapeDtypeStruct(jnp.shape(value), dtype),
                                 jax.lax.stop_gradient(value), vmap_method="expand_dims")

    def counts(self) -> tuple[int, int]:
        """``(calls, parameter sets)`` counted so far."""
        with self._lock:
            return tuple(self._counts)
