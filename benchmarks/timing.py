"""Timing shared by the benchmark scripts: interleaved rounds, medians.

Imports jax only when called, so a script may import this before it sets
``XLA_FLAGS`` (``bench_device.py`` does).
"""

from __future__ import annotations

import time

import numpy as np


def interleaved_medians(variants: dict, args: tuple, rounds: int, warmup: int) -> dict:
    """Median seconds of ``f(*args)`` for each ``f`` in ``variants``.

    Each variant is first called ``warmup`` times (compile, calibrate, let a chunker
    settle); then every round times each variant once, in turn, so drift on a shared
    machine hits all alike.
    """
    import jax

    for f in variants.values():
        for _ in range(warmup):
            jax.block_until_ready(f(*args))
    times = {k: [] for k in variants}
    for _ in range(rounds):
        for k, f in variants.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in times.items()}
