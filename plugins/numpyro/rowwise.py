"""One site's pointwise log-likelihood a group of rows at a time, for every draw.

:func:`pointwise_log_likelihood` (``loglik.py``) fills the whole draws x rows matrix of
every site; what it holds grows with both. Here one site's rows come in groups of
``rows_per_group``: each group's values for every draw are computed (the rows of a
``pb.factor`` or ``pb.observe`` site as row tasks on the executor, where they are, with
the same replay and evaluator), handed to the caller, and dropped before the next group
is made. So at most ``draws x rows_per_group`` values exist at once, besides what the
replay keeps per draw (the site's parameters, small; draw-dependent row data is replayed
again per group where it would not fit). A plain observed site's rows are its batch
elements, flattened in C order. Imports jax, numpy, numpyro and the modules beside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import parallel_backend as pb

from .loglik import TASK_VALUES, _Replay, _site_executor, _Task, default_chunks
from .replay import quietly

__all__ = ["RowGroups", "row_groups"]


class RowGroups(NamedTuple):
    """A site's rows, group by group.

    Attributes
    ----------
    name : str
        The site.
    shape : tuple
        Its observations' shape: ``(N,)`` for a ``pb.factor`` site, the batch shape (the
        rows first) of a ``pb.observe`` or plain observed site.
    kind : str
        ``"rows"`` (``pb.factor``/``pb.observe``) or ``"observed"`` (a plain site).
    rows : int
        What the groups cut: the site's rows, or a plain site's elements.
    groups : iterator
        ``(first, end, values)``: the rows ``[first, end)`` (of a plain site: its
        flattened elements) and their log-likelihood, ``(draws, values)``, in row order (a
        ``pb.observe`` row's later batch elements flattened after it, in C order).
    """

    name: str
    shape: tuple
    kind: str
    rows: int
    groups: Iterator[tuple[int, int, np.ndarray]]


def site_names(replay: _Replay) -> list[str]:
    """The likelihood sites of a replayed model: its ``pb.factor``/``pb.observe`` sites,
    then its plain observed ones."""
    return [*replay.names, *replay.slots[1]]


def row_groups(model: Any, samples: dict, model_args: tuple = (),
               model_kwargs: dict | None = None, *, var_name: str | None = None,
               executor: pb.Executor | str | None = None, values_per_group: int = 2 ** 24,
               stack: contextlib.ExitStack | None = None, what: str = "pb.loo") -> RowGroups:
    """The log-likelihood of one site of ``model`` at the draws ``samples`` (``{site:
    (draws, ...)}``), in groups of at most ``values_per_group`` draws x rows values.

    ``var_name`` names the site (needed where the model has several). Executors made from
    a name are closed with ``stack`` (default: when the groups are exhausted).

    Raises
    ------
    ValueError
        The model has no likelihood site, several and ``var_name`` is not given, or
        ``var_name`` names none of them.
    """
    model_kwargs = dict(model_kwargs or {})
    leaves = jax.tree.leaves(samples)
    if not leaves:
        raise ValueError(f"{what}: the run's posterior holds no draws")
    n_draws = int(np.shape(leaves[0])[0])
    samples = jax.tree.map(jnp.asarray, samples)
    outer = pb.executors.resolve_executor() if executor is None else None
    with quietly():
        replay = _Replay(model, tuple(model_args), model_kwargs, True,
                         jax.tree.map(lambda x: x[0], samples))
    names = site_names(replay)
    if not names:
        raise ValueError(f"{what}: the model has no observed site (pb.observe, pb.factor or "
                         "numpyro.sample with obs=): nothing to leave out")
    if var_name is None:
        if len(names) > 1:
            raise ValueError(f"{what}: the model has several observed sites {names}; pass "
                             "var_name= one of them")
        var_name = names[0]
    elif var_name not in names:
        raise ValueError(f"{what}: var_name={var_name!r} is not an observed site of the model; "
                         f"its observed sites are {names}")
    if var_name in replay.names:
        with quietly():
            shape = _value_shape(replay, var_name)
        kind = "rows"
    else:
        shape = replay.observed_shapes()[var_name][0]
        kind = "observed"
    # A site's rows are evaluated whole: a group is site rows (each of `width` values); a
    # plain site's groups are of its flattened elements.
    width = int(np.prod(shape[1:], dtype=np.int64)) if kind == "rows" else 1
    n_rows = shape[0] if kind == "rows" else int(np.prod(shape, dtype=np.int64))
    per_group = max(1, min(n_rows, values_per_group // max(n_draws * width, 1)))
    groups = _groups(replay, var_name, kind, samples, n_draws, n_rows, per_group, executor,
                     outer, stack)
    return RowGroups(var_name, tuple(int(s) for s in shape), kind, int(n_rows), groups)


def _value_shape(replay, name) -> tuple:
    """The shape of one draw's values of a ``pb.factor``/``pb.observe`` site: ``(N,)``, or
    the distribution's batch shape of a ``pb.observe`` site (the rows first)."""
    static, ids = replay.static[name], replay.slots[0][name]
    leaves = [jax.ShapeDtypeStruct(replay.flat_shapes[i].shape, replay.flat_shapes[i].dtype)
              for i in ids]
    data, shared = jax.tree.unflatten(static.treedef, leaves)
    return tuple(jax.eval_shape(lambda d, s: static.fn(d, *s), data, shared).shape)


def _groups(replay, name, kind, samples, n_draws, n_rows, per_group, executor, outer, stack):
    owned = contextlib.ExitStack()
    try:
        with quietly():
            ex = _site_executor(executor, replay.static[name].executor, outer,
                                stack if stack is not None else owned) \
                if kind == "rows" else None
        cd = _draw_chunk(kind, n_draws, n_rows, per_group)
        chunks = _DrawChunks(replay, samples, n_draws, cd, per_group)
        evaluators: dict = {}
        for first in range(0, n_rows, per_group):
            end = min(first + per_group, n_rows)
            out = None
            for d0, d1, dep in chunks:
                with quietly():
                    if kind == "observed":
                        part = np.asarray(replay.observed_values(dep, cd)[name])
                        part = part.reshape(part.shape[0], -1)[: d1 - d0, first:end]
                    else:
                        part = _rows(replay, name, ex, evaluators, dep, cd, first, end)
                        part = part[: d1 - d0].reshape(d1 - d0, -1)
                if out is None:
                    out = np.empty((n_draws, part.shape[1]), part.dtype)
                out[d0:d1] = part
            yield first, end, out
            del out
    finally:
        owned.close()


def _draw_chunk(kind, n_draws, n_rows, per_group) -> int:
    """Draws replayed together: :func:`default_chunks`'s for a site's rows; for a plain
    site, whose replay makes every row, as many as keep that within a group's values."""
    if kind == "rows":
        return default_chunks(n_draws, n_rows)[0]
    return max(1, min(n_draws, (per_group * n_draws) // max(n_rows, 1)))


def _rows(replay, name, ex, evaluators, dep, cd, first, end) -> np.ndarray:
    """Rows ``[first, end)`` of ``name`` at one chunk of draws: row tasks on ``ex``."""
    rows = max(1, min(end - first, TASK_VALUES // cd))
    evaluate = evaluators.get(rows)
    if evaluate is None:
        evaluate = evaluators[rows] = replay.evaluator(name, rows)
    task = _Task(evaluate, replay.site_leaves(name, dep))
    starts = list(range(first, end, rows))
    parts = ex.map(task, starts)
    out = np.empty((cd, end - first) + parts[0].shape[2:], parts[0].dtype)
    for r0, part in zip(starts, parts):
        r1 = min(r0 + rows, end)
        out[:, r0 - first:r1 - first] = part[:, : r1 - r0]
    return out


class _DrawChunks:
    """The replay's draw-dependent leaves, chunk by chunk of ``cd`` draws (the last padded
    to full size: one compiled shape): ``(d0, d1, leaves)``. Kept after the first pass
    where they take at most a group's worth of values, else replayed at every pass."""

    def __init__(self, replay, samples, n_draws, cd, per_group):
        self.replay, self.samples, self.n_draws, self.cd = replay, samples, n_draws, cd
        self.budget = per_group * n_draws
        self.kept: list | None = None

    def _make(self):
        for d0 in range(0, self.n_draws, self.cd):
            d1 = min(d0 + self.cd, self.n_draws)
            idx = np.minimum(np.arange(d0, d0 + self.cd), self.n_draws - 1)
            with quietly():
                dep = self.replay.draw_leaves(jax.tree.map(lambda x, i=idx: x[i], self.samples))
            yield d0, d1, dep

    def __iter__(self):
        if self.kept is not None:
            yield from self.kept
            return
        kept: list | None = []
        size = 0
        for item in self._make():
            if kept is not None:
                size += sum(int(np.size(x)) for x in jax.tree.leaves(item[2]))
                if size <= self.budget:
                    kept.append(item)
                else:
                    kept = None
            yield item
        self.kept = kept
