"""The interface for executor authors: everything a plugin may use from the core.

An executor is a subclass of :class:`~parallel_backend.Executor` that evaluates
chunks of a call site somewhere: on threads, on dask workers, on devices, on an MPI
or Ray cluster. Plugins import from this module only (a test checks it), so the core
can change behind it. See the page "Write your own executor" (``docs/extending.rst``).

One host evaluation, as an executor sees it::

    reduce_sum --(host callback)--> host.evaluate
        -> executor.run_tasks([Task, ...])          # your code
             -> run_task(task)                      # anywhere: a thread, a process
        <- [ChunkResult, ...] in block order
    <- host.evaluate assembles them in block order --> reduce_sum

A ``Task`` is a plain value: ``task.site`` (the ``SiteState``, to find what your executor
holds for the site; ``task.site.spec`` is immutable and picklable: ship it to other
processes), ``task.program`` (the site's compiled block programs here), ``task.resident``
(the prepared data here), ``task.chunk`` (which blocks: a ``Chunk``, a run of whole
tiles) and ``task.evaluation`` (``Evaluation``: the parameters;
``evaluation.restrict(a, b)`` keeps only blocks ``[a, b)`` of the per-row ones, what a
remote worker needs to receive). ``run_task`` returns the task's ``ChunkResult``.

Elsewhere, ``Program(spec)`` rebuilds the block computations from a spec,
``Resident(arrays, first, x64)`` holds a worker's share of the prepared blocks
(``state.prepared()``: all of them, as numpy blocks) and ``run_chunk(program, resident,
chunk, evaluation)`` runs a chunk on them. Every result must come from ``run_task`` (or
``run_chunk``) on the same prepared data: that is what keeps results bitwise the same on
every executor.

An executor that runs tasks on threads of this process (a ``TaskPool``, whose threads
nothing waits for without a bound) waits for them with ``gather(futures, devices, label,
timeout, rows, executor)``: where no chunk finishes for ``timeout`` seconds (the
executor's ``stall_timeout``) it cancels what has not started and raises
``EvaluationStalled``; where the chunk programs cannot start because XLA's device has no
place left for programs in flight, it raises ``InFlightLimit`` at once.
"""

from .batching import unblock
from .blocks import (
    BlockPlan,
    TilePlan,
    accelerator,
    block_axis,
    cpu_count,
    pad_blocks,
    pad_rows,
    row_bytes,
    xla_threads,
)
from .chunking import AdaptiveChunker, Chunk, chunks_within, even_slots, split_tiles
from .errors import ChunkError, EvaluationStalled, InFlightLimit, check_count
from .executors.base import STALL_TIMEOUT, Executor, TaskPool, check_stall_timeout, site_stats
from .executors.registry import resolve_executor
from .guards import fence, gather, hide
from .internals import is_tracer
from .kernels import BATCHED, LOOPED, RowsBefore, Wrt, kernel_for
from .reduce import RowSum, reduce_rows
from .routes import (
    GRAPH,
    HOST,
    ROUTES,
    Choice,
    GraphRoute,
    HostRoute,
    Route,
    Slots,
    carried,
    choose,
)
from .site import SiteState
from .spec import Program, SiteSpec, run_eagerly
from .tasks import (
    ChunkResult,
    Evaluation,
    Resident,
    Task,
    host_device,
    run_chunk,
    run_task,
)
from .timeline import LOSSES, ChunkSpan, EvaluationSpan, Timeline, largest, losses, shares

__all__ = [
    "BATCHED",
    "GRAPH",
    "HOST",
    "LOOPED",
    "LOSSES",
    "ROUTES",
    "STALL_TIMEOUT",
    "AdaptiveChunker",
    "BlockPlan",
    "Choice",
    "Chunk",
    "ChunkError",
    "ChunkResult",
    "ChunkSpan",
    "Evaluation",
    "EvaluationSpan",
    "EvaluationStalled",
    "Executor",
    "GraphRoute",
    "HostRoute",
    "InFlightLimit",
    "Program",
    "Resident",
    "Route",
    "RowSum",
    "RowsBefore",
    "SiteSpec",
    "SiteState",
    "Slots",
    "Task",
    "TaskPool",
    "TilePlan",
    "Timeline",
    "Wrt",
    "accelerator",
    "block_axis",
    "carried",
    "check_count",
    "check_stall_timeout",
    "choose",
    "chunks_within",
    "cpu_count",
    "even_slots",
    "fence",
    "gather",
    "hide",
    "host_device",
    "is_tracer",
    "kernel_for",
    "largest",
    "losses",
    "pad_blocks",
    "pad_rows",
    "reduce_rows",
    "resolve_executor",
    "row_bytes",
    "run_chunk",
    "run_eagerly",
    "run_task",
    "shares",
    "site_stats",
    "split_tiles",
    "unblock",
    "xla_threads",
]
