"""A gradient's timeline: every host evaluation's chunks by worker, kept for the last few
evaluations only, and the split of the workers' time into chunks and losses."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallel_backend as pb
from helpers import scan_loglik
from parallel_backend.timeline import (
    KEEP,
    LOSSES,
    ChunkSpan,
    EvaluationSpan,
    Timeline,
    largest_loss,
    losses,
    shares,
)


def test_every_block_once_per_evaluation_on_the_workers_that_ran_it():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4_000, 20)), jnp.float32)
    with pb.ThreadExecutor(2, dispatch="host") as ex:
        f = jax.jit(jax.value_and_grad(
            lambda a: pb.reduce_sum(scan_loglik, x, a, executor=ex, block_rows=250)))
        for a in np.linspace(0.1, 0.9, KEEP + 4):
            jax.block_until_ready(f(jnp.float32(a)))
        stats = ex.stats(timeline=True)
        spans = ex.timeline.last()
    assert "timeline" not in ex.stats()  # asked for only
    # the last KEEP evaluations only: a long run's memory does not grow
    assert len(stats["timeline"]) == len(spans) == KEEP
    n_blocks = 16
    for span, entry in zip(spans, stats["timeline"]):
        blocks = sorted((c.first, c.blocks) for c in span.chunks)
        covered = [b for first, count in blocks for b in range(first, first + count)]
        assert covered == list(range(n_blocks)), blocks  # every block, once
        assert all(span.start <= c.start <= c.end <= span.end for c in span.chunks)
        # the executor's two threads, named
        assert {c.worker.split("/")[-1] for c in span.chunks} <= {
            "parallel_backend-0", "parallel_backend-1"}
        assert entry["workers"] == 2 and entry["seconds"] == pytest.approx(span.wall)
        assert [c["blocks"] for c in entry["chunks"]] == [c.blocks for c in span.chunks]
        assert all(0 <= c["start"] <= c["end"] <= entry["seconds"] for c in entry["chunks"])
        parts = losses(span, 2, span.wall * 1.5)
        # the parts add up to the workers' time over the whole gradient
        assert sum(parts.values()) == pytest.approx(2 * span.wall * 1.5)
        assert parts["caller's program"] == pytest.approx(2 * span.wall * 0.5)
        assert parts["chunks"] == pytest.approx(sum(c.end - c.start for c in span.chunks))
        # a record keeps it as JSON and reads the same span back
        back = EvaluationSpan.from_dict(json.loads(json.dumps(span.as_dict())))
        assert (back.site, back.start) == (span.site, span.start)
        assert back.wall == pytest.approx(span.wall, abs=1e-6)
        assert [(c.worker, c.first, c.blocks) for c in back.chunks] == [
            (c.worker, c.first, c.blocks) for c in span.chunks]
        assert [c.end - c.start for c in back.chunks] == pytest.approx(
            [c.end - c.start for c in span.chunks], abs=1e-6)


def test_the_graph_route_leaves_no_timeline():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2_000, 5)), jnp.float32)
    with pb.SerialExecutor() as ex:
        jax.jit(jax.grad(lambda a: pb.reduce_sum(scan_loglik, x, a, executor=ex)))(0.5)
        assert ex.timeline.last() == [] and ex.stats(timeline=True)["timeline"] == []


def span(*chunks, end=1.0):
    return EvaluationSpan("f", 0.0, end, tuple(ChunkSpan(*c) for c in chunks))


def test_losses_name_where_the_time_went():
    # one worker busy all along, the other done at half time: load imbalance
    imbalanced = span(("a", 0, 2, 0.0, 1.0), ("b", 2, 2, 0.0, 0.5))
    assert losses(imbalanced, 2)["load imbalance"] == pytest.approx(0.5)
    assert largest_loss([imbalanced], 2) == ("load imbalance", pytest.approx(0.25))
    # both start late (messages, a thread to wake): dispatch
    late = span(("a", 0, 2, 0.4, 1.0), ("b", 2, 2, 0.4, 1.0))
    assert largest_loss([late], 2)[0] == "dispatch"
    # both done early, the callback still busy: assembly
    assembling = span(("a", 0, 2, 0.0, 0.6), ("b", 2, 2, 0.0, 0.6))
    assert largest_loss([assembling], 2)[0] == "assembly"
    # one worker never used
    alone = span(("a", 0, 4, 0.0, 1.0))
    assert largest_loss([alone], 2) == ("idle workers", pytest.approx(0.5))
    # a gradient three times the callback: the caller's program
    assert largest_loss([late], 2, 3.0)[0] == "caller's program"
    # a product along zero runs no chunk: all of it overhead
    assert losses(span(), 2)["assembly"] == pytest.approx(2.0)
    assert set(losses(alone, 2)) == {"chunks", *LOSSES}


def test_shares_over_evaluations_add_up_to_one():
    two = [span(("a", 0, 2, 0.0, 1.0), ("b", 2, 2, 0.0, 0.5)),
           span(("a", 0, 2, 0.25, 1.0), ("b", 2, 2, 0.0, 1.0))]
    share = shares(two, 2)
    assert sum(share.values()) == pytest.approx(1.0)
    # (1 + 0.5) + (0.75 + 1) worker-seconds of chunks in 4 of capacity
    assert share["chunks"] == pytest.approx(0.8125)
    assert largest_loss(two, 2) == ("load imbalance", pytest.approx(share["load imbalance"]))
    assert shares([], 2) is None and shares([span(end=0.0)], 2) is None


def test_a_timeline_keeps_the_last_evaluations():
    t = Timeline(keep=3)
    for i in range(5):
        t.append(EvaluationSpan(f"s{i}", float(i), i + 0.5, ()))
    assert [s.site for s in t.last()] == ["s2", "s3", "s4"]
    assert [s.site for s in t.last(1)] == ["s4"]
    t.clear()
    assert t.last() == []
