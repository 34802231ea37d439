"""The host path, end to end: one evaluation run as chunk tasks on an executor's workers.

:func:`partials` puts a ``jax.pure_callback`` in the caller's program (for
:mod:`.reduce`); XLA calls :func:`callback` with the traced data leaves and the shared
leaves (host arrays; under ``vmap`` with leading batch axes). In order:

1. :func:`unbatch` flattens any batch axes to one and notes which leaves carry it;
2. the traced leaves are cut into blocks and the chunks are planned (the adaptive
   chunker, or the user's ``grainsize``), runs of whole tiles;
3. each chunk becomes a :class:`~parallel_backend.tasks.Task` (a plain value) and
   ``executor.run_tasks(tasks)`` runs them on the workers, each through
   :func:`~parallel_backend.tasks.run_task` (here, or in another process);
4. :func:`assemble` puts the per-block partials back in block order and the batch
   shape is restored; :mod:`.reduce` folds them.

Imports jax, numpy and the core.
"""

from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from .blocks import block_axis, pad_blocks
from .chunking import fixed_chunks
from .errors import ChunkError
from .kernels import Wrt, kernel_for
from .tasks import Evaluation, Task
from .timeline import ChunkSpan, EvaluationSpan

__all__ = ["assemble", "callback", "evaluate", "partials", "unbatch"]


def assemble(program, results, batch: tuple, traced_shapes, shared_shapes):
    """Whole-call buffers from chunk results, in block order: per-block values and shared
    gradients, per-row data gradients (``N`` rows, padding dropped)."""
    spec = program.spec
    p = spec.plan
    n_blocks = len(program.valid)
    make = np.empty if results else np.zeros  # no results: no chunk ran (a zero product)
    values = make(batch + (n_blocks,), np.dtype(spec.value_dtype))
    g_shared = [make(batch + (n_blocks,) + s, d) for s, d in shared_shapes]
    g_data = [make(batch + (n_blocks * p.block_rows,) + s, d) for s, d in traced_shapes]
    lead = (slice(None),) * len(batch)
    for res in results:
        c = res.chunk
        blocks = lead + (slice(c.first, c.first + c.count),)
        rows = lead + (slice(c.first * p.block_rows, (c.first + c.count) * p.block_rows),)
        values[blocks] = res.values
        for buf, g in zip(g_shared, res.shared_grads):
            buf[blocks] = g
        for buf, g in zip(g_data, res.data_grads):
            g = np.asarray(g)
            buf[rows] = g.reshape(g.shape[:len(batch)] + (-1,) + g.shape[len(batch) + 2:])
    g_data = [g[lead + (slice(0, p.n_rows),)] for g in g_data]
    return values, tuple(g_shared), tuple(g_data)


def partials(state, executor, grainsize, traced, shared, diff_traced, diff_shared,
             tangents=((), ())):
    """The per-block partials of one evaluation through a ``jax.pure_callback`` (traced in
    the caller's program): :func:`callback` runs :func:`evaluate` on the executor.

    With ``tangents`` (those of the traced and of the shared leaves ``diff_traced`` and
    ``diff_shared`` mark) the partials are their tangents along them: per-block
    Hessian-vector products (see :class:`~parallel_backend.tasks.Evaluation`). A batch of
    tangents (``vmap``, as ``jax.hessian`` makes) reaches one callback."""
    tan_t, tan_s = (tuple(x) for x in tangents)
    p = state.spec.plan
    shapes = (
        jax.ShapeDtypeStruct((p.n_blocks,), np.dtype(state.spec.value_dtype)),
        tuple(jax.ShapeDtypeStruct((p.n_blocks,) + jnp.shape(s), jnp.result_type(s))
              for s, d in zip(shared, diff_shared) if d),
        tuple(jax.ShapeDtypeStruct((p.n_rows,) + jnp.shape(t)[1:], jnp.result_type(t))
              for t, d in zip(traced, diff_traced) if d),
    )
    args = (*traced, *tan_t, *shared, *tan_s)
    orig_ndims = tuple(jnp.ndim(x) for x in args)
    run = functools.partial(callback, executor, state, grainsize, diff_traced, diff_shared,
                            orig_ndims, len(traced) + len(tan_t))
    return jax.pure_callback(run, shapes, *args, vmap_method="expand_dims")


def callback(executor, state, grainsize, diff_traced, diff_shared, orig_ndims, n_traced,
             *args):
    """The host callback: the arguments as XLA hands them, to :func:`evaluate`."""
    return evaluate(executor, state, grainsize, args[:n_traced], args[n_traced:],
                    diff_traced, diff_shared, orig_ndims)


def evaluate(executor, state, grainsize, traced, shared, diff_traced, diff_shared, orig_ndims,
             count: bool = True):
    """One evaluation on ``executor``'s workers: per-block partials of every block.

    Called from the host callback with host arrays (jax 0.10 hands a callback
    ``jax.Array`` values, not numpy: an executor that pickles them converts them
    first). Under ``vmap`` the arguments carry leading batch axes; every batch member
    goes in each task. The site's program and host data are plain attributes once made
    (``state.host``), so an evaluation reads them without calling into the site.
    """
    executor.check_open()
    entered = time.time()
    args = (traced, shared)  # as they crossed the callback
    parts = state.host or state.prepare_host()
    program, resident = parts
    plan = program.spec.plan
    t0 = time.perf_counter()
    traced, shared, in_axes, batch_shape = unbatch(traced, shared, orig_ndims)
    axes_t = in_axes[0] if in_axes is not None else (None,) * len(traced)
    blocked = tuple(pad_blocks(np.asarray(t), plan, axis=block_axis(ax))
                    for t, ax in zip(traced, axes_t))
    # numpy, not the callback's jax arrays: those are committed to the caller's device,
    # and a chunk may run on another (a DeviceExecutor's).
    evaluation = Evaluation(blocked, tuple(np.asarray(s) for s in shared), tuple(diff_traced),
                            tuple(diff_shared), in_axes)
    kernel = kernel_for(evaluation.order, Wrt(evaluation.diff_traced, evaluation.diff_shared))
    if not kernel.has_work(_tangents(evaluation)):
        # A product along zero: zeros, without running a chunk.
        count, results = False, []
    else:
        chunks = (state.chunker.chunks() if grainsize is None
                  else fixed_chunks(plan, grainsize, program.spec.tiles))
        tasks = [Task(state, program, resident, c, evaluation) for c in chunks]
        try:
            results = executor.run_tasks(tasks)
        except ChunkError as e:
            raise ChunkError.wrap(e, e.rows, state.label, executor.name) from e.__cause__
    wall = time.perf_counter() - t0
    busy = sum(r.seconds for r in results)
    # The chunker learns from value-and-gradient evaluations only (what sampling runs).
    if grainsize is None and results and not state.chunker.settled and kernel.in_sampling:
        overhead = max(wall * min(executor.workers, len(results)) - busy, 0.0) / len(results)
        for r in results:
            state.chunker.record(r.chunk.count, r.seconds, overhead)
    k = math.prod(batch_shape) if batch_shape else 1
    axes_s = in_axes[1] if in_axes is not None else (None,) * len(shared)
    # Shapes of the leaves, not of the tangents after them: zip stops at the flags.
    shapes_t = [(_unbatched_shape(t, a)[1:], np.asarray(t).dtype)
                for t, a, d in zip(traced, axes_t, diff_traced) if d]
    shapes_s = [(_unbatched_shape(s, a), np.asarray(s).dtype)
                for s, a, d in zip(shared, axes_s, diff_shared) if d]
    flat_batch = (k,) if in_axes is not None else ()
    out = assemble(program, results, flat_batch, shapes_t, shapes_s)
    if count:
        executor.count(host_calls=1, calls=1, chunks=len(results), rows=plan.n_rows * k,
                       seconds_in_workers=busy,
                       bytes_sent=executor.bytes_per_call(*args, len(results)),
                       bytes_received=executor.bytes_per_result(*out))
    out = _restore_batch(out, flat_batch, batch_shape)
    executor.timeline.append(EvaluationSpan(program.spec.label, entered, time.time(),
                                            tuple(ChunkSpan(r.worker, r.chunk.first,
                                                            r.chunk.count, r.started,
                                                            r.started + r.seconds)
                                                  for r in results)))
    return out


def _tangents(evaluation) -> tuple:
    """The tangents of a Hessian-vector product's evaluation (after the leaves)."""
    return (evaluation.traced[len(evaluation.diff_traced):]
            + evaluation.shared[len(evaluation.diff_shared):])


def _unbatched_shape(x, axis) -> tuple:
    shape = tuple(np.shape(x))
    return shape[1:] if axis == 0 else shape


def unbatch(traced, shared, orig_ndims):
    """Flatten the leading vmap axes of callback arguments to one batch axis.

    With ``vmap_method="expand_dims"`` every argument carries one leading axis per
    vmap level, of size 1 where that argument is not batched. Unbatched arguments
    are squeezed (and get ``in_axes=None``) so the host compiles exactly what the
    graph path would under the same ``vmap``.

    Returns ``(traced, shared, in_axes, batch_shape)``.
    """
    leaves = list(traced) + list(shared)
    if not leaves:
        return tuple(traced), tuple(shared), None, ()
    nb = np.ndim(leaves[0]) - orig_ndims[0]
    if nb == 0:
        return tuple(traced), tuple(shared), None, ()
    leads = [np.shape(x)[:nb] for x in leaves]
    batch_shape = tuple(np.broadcast_shapes(*leads))
    k = math.prod(batch_shape)
    out, axes = [], []
    for x, lead in zip(leaves, leads):
        x = np.asarray(x)
        rest = x.shape[nb:]
        if all(d == 1 for d in lead):
            out.append(x.reshape(rest))
            axes.append(None)
        else:
            out.append(np.broadcast_to(x, batch_shape + rest).reshape((k,) + rest))
            axes.append(0)
    n = len(traced)
    if all(a is None for a in axes):
        return tuple(out[:n]), tuple(out[n:]), None, batch_shape
    return tuple(out[:n]), tuple(out[n:]), (tuple(axes[:n]), tuple(axes[n:])), batch_shape


def _restore_batch(out, flat_batch, batch_shape):
    """Restore the caller's batch shape on host-path outputs."""
    values, g_shared, g_data = out
    if flat_batch == tuple(batch_shape):
        return values, g_shared, g_data

    def fix(x):
        x = np.asarray(x)
        return x.reshape(tuple(batch_shape) + x.shape[len(flat_batch):])

    return fix(values), tuple(fix(g) for g in g_shared), tuple(fix(g) for g in g_data)
