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
"""

from .blocks import BlockPlan, TilePlan, cpu_count, row_bytes, xla_threads
from .chunking import AdaptiveChunker, Chunk, chunks_within, even_slots, split_tiles
from .dispatch import GRAPH, HOST, Choice, Slots, carried, choose
from .errors import ChunkError, check_count
from .executors.base import Executor, site_stats
from .executors.registry import resolve_executor
from .internals import is_tracer
from .site import SiteState, run_eagerly
from .sets import block_axis, unblock
from .spec import Program, SiteSpec, host_device
from .tasks import ChunkResult, Evaluation, Resident, Task, pad_blocks, run_chunk, run_task

__all__ = [
    "Executor", "SiteState", "SiteSpec", "Program", "Resident", "Evaluation", "ChunkResult",
    "Chunk", "ChunkError", "BlockPlan", "TilePlan", "AdaptiveChunker",
    "Task", "run_task", "run_chunk", "even_slots", "split_tiles", "chunks_within", "site_stats", "resolve_executor",
    "host_device", "run_eagerly", "pad_blocks", "cpu_count", "xla_threads", "row_bytes",
    "check_count", "GRAPH", "HOST", "Slots", "carried", "choose", "Choice",
    "is_tracer", "block_axis", "unblock",
]
