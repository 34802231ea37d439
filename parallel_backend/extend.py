"""The interface for executor authors: everything a plugin may use from the core.

An executor is a subclass of :class:`~parallel_backend.Executor` that evaluates
chunks of a call site somewhere: on threads, on dask workers, on devices, on an MPI
or Ray cluster. Plugins import from this module only (a test checks it), so the core
can change behind it. See the page "Write your own executor" (``docs/extending.rst``).

One host evaluation, as an executor sees it::

    reduce_sum --(host callback)--> host.evaluate
        -> executor.map_chunks(state, chunks, evaluation)    # your code
             -> run_chunk(program, resident, chunk, evaluation)  # anywhere
        <- [ChunkResult, ...] in chunk order
    <- host.evaluate assembles them in block order --> reduce_sum

What a ``map_chunks`` has to work with:

* ``state`` (``SiteState``): ``state.spec`` (``SiteSpec``, immutable and
  picklable: ship it to other processes), ``state.prepared()`` (the resident data as
  numpy blocks, made once), ``state.run_chunk(chunk, evaluation)`` (evaluate here).
* ``chunks``: ``Chunk`` runs of whole tiles, in block order.
* ``evaluation`` (``Evaluation``): the traced leaves' blocks and the shared
  leaves; ``evaluation.restrict(a, b)`` keeps only blocks ``[a, b)`` (what a remote
  worker needs to receive).

Elsewhere, ``Program(spec)`` rebuilds the block computations from a spec, and
``Resident(arrays, first, x64)`` holds a worker's share of the prepared blocks.
Every result must come from ``run_chunk`` on the same prepared data: that is
what keeps results bitwise the same on every executor.
"""

from .blocks import BlockPlan, TilePlan, cpu_count, row_bytes, xla_threads
from .chunking import AdaptiveChunker, Chunk, chunks_within, even_slots, split_tiles
from .dispatch import GRAPH, HOST, Choice, Slots, carried, choose
from .errors import ChunkError, check_count
from .executors.base import Executor, site_stats
from .executors.registry import resolve_executor
from .internals import is_tracer
from .host import ChunkResult, Evaluation, run_chunk
from .site import Resident, SiteState, run_eagerly
from .sets import block_axis, unblock
from .spec import Program, SiteSpec, host_device, pad_blocks

__all__ = [
    "Executor", "SiteState", "SiteSpec", "Program", "Resident", "Evaluation", "ChunkResult",
    "Chunk", "ChunkError", "BlockPlan", "TilePlan", "AdaptiveChunker",
    "run_chunk", "even_slots", "split_tiles", "chunks_within", "site_stats", "resolve_executor",
    "host_device", "run_eagerly", "pad_blocks", "cpu_count", "xla_threads", "row_bytes",
    "check_count", "GRAPH", "HOST", "Slots", "carried", "choose", "Choice",
    "is_tracer", "block_axis", "unblock",
]
