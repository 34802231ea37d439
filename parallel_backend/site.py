"""What one executor keeps about one call site: :class:`SiteState`.

A :class:`~parallel_backend.spec.SiteSpec` is immutable and shared; the state is
per executor: the data prepared for this site (once), the devices' copies of it,
where evaluations run by default (``"graph"`` or ``"host"``, a rule of the shapes)
and where ``pb.sample`` measured them faster, the adaptive chunker. Executors hold
their states in a :class:`SiteCache`, keyed by what a site is
(:func:`~parallel_backend.identity.site_key`: its function and the content of its
data, never an ``id()``), so every trace of a model finds its sites again; the cache
holds copies of the data, never the user's arrays (a NumPy array is copied when the
site is made, so what a site holds is what its key says), and is bounded (least
recently used out first). Imports jax, numpy and the core.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import jax

from .blocks import accelerator
from .chunking import AdaptiveChunker
from .identity import frozen
from .routes import ROUTES, Route
from .spec import Program, SiteSpec, run_eagerly
from .tasks import Resident, host_device

__all__ = ["MAX_SITES", "MAX_SITE_BYTES", "SiteCache", "SiteState"]

#: An executor keeps at most this many sites, and prepared data of at most this many
#: bytes (the most recent site always stays), least recently used out first.
MAX_SITES = 64
MAX_SITE_BYTES = 4 * 2 ** 30


class SiteState:
    """One executor's record of one call site.

    Attributes
    ----------
    spec : SiteSpec
    decision : type[Route] or None
        Where this executor evaluates the site where nothing was measured
        (:class:`~parallel_backend.routes.GraphRoute` or
        :class:`~parallel_backend.routes.HostRoute`: its ``dispatch``, or the rule of
        :func:`~parallel_backend.routes.default_route`); set when the site is first
        traced.
    measured : Choice or None
        What ``pb.sample`` measured on this site, and where it then ran it.
    chunker : AdaptiveChunker
        Chunk sizes for ``grainsize=None`` on the host path.
    """

    def __init__(self, spec: SiteSpec, resident_leaves, workers: int,
                 chunks_per_worker: int):
        # Made while the call that keyed the site is traced: copies of the NumPy arrays
        # it keeps (its data, and what fn closes over), so that it prepares, traces and
        # sends what its key says even if the user changes them in place afterwards.
        # ``resident_leaves`` are such copies already (reduce_sum hashed its snapshots).
        fn = frozen(spec.fn)
        self.spec = spec if fn is spec.fn else spec._replace(fn=fn)
        self.decision: type[Route] | None = None
        self.measured: Any = None  # a routes.Choice
        self.chunker = AdaptiveChunker(spec.plan, workers, tiles=spec.tiles,
                                       chunks_per_worker=chunks_per_worker)
        self._resident_leaves = tuple(resident_leaves)
        self._lock = threading.Lock()
        self._program: Program | None = None
        self._prepared: tuple | None = None
        #: ``(program, resident)`` once :meth:`prepare_host` made them, else ``None``.
        self.host: tuple[Program, Resident] | None = None
        #: What the executor placed for this site elsewhere (device buffers, what it
        #: sent to workers), by name; dropped with the site (:meth:`release`).
        self.placed: dict = {}
        #: The jitted eager calls on the host route, by ``(grainsize, "value" or "grad")``
        #: (see :meth:`eager_call`).
        self.eager: dict = {}
        #: The counter compiled into this site's graph evaluations, if any.
        self.counter: Any = None  # a routes.GraphCounter
        #: Gradient evaluations in the graph that pb.sample counted: (calls, batches).
        self.sampled = [0, 0]
        #: An evaluation stalled: chunk programs that may never end still read this
        #: site's device copies, which are then left to them (see :meth:`release`).
        self.stalled = False

    @property
    def label(self) -> str:
        return self.spec.label

    def settle(self, decision: type[Route]) -> None:
        """Record where the site runs by default (a route class)."""
        if decision not in ROUTES.values():
            raise ValueError(f"decision must be one of {list(ROUTES.values())}, "
                             f"got {decision!r}")
        self.decision = decision

    @property
    def nbytes(self) -> int:
        """Bytes of data this state holds (prepared, or still to prepare)."""
        held = self._prepared if self._prepared is not None else self._resident_leaves
        return int(sum(getattr(x, "nbytes", 0) for x in held))

    @property
    def program(self) -> Program:
        """The traced block computations (made on first use)."""
        if self._program is None:
            with self._lock:
                if self._program is None:
                    self._program = Program(self.spec)
        return self._program

    @property
    def traces(self):
        """(form, blocks) -> times a block computation of that shape was traced."""
        return self.program.traces

    def prepared(self) -> tuple:
        """The resident data as numpy blocks, with the hoisted residuals (made once)."""
        if self._prepared is None:
            program = self.program
            with self._lock:
                if self._prepared is None:
                    self._prepared = run_eagerly(program.prepare, self._resident_leaves)
                    if not accelerator():  # the prepared blocks replace them
                        self._resident_leaves = ()
        return self._prepared

    def resident(self) -> tuple:
        """The resident data leaves as the call gave them (kept where the graph evaluates
        plain's program: on an accelerator)."""
        return self._resident_leaves

    def prepare_host(self) -> tuple:
        """``(program, resident)`` for host-path tasks in this process, made once and
        kept in the plain attribute :attr:`host` (what an evaluation reads)."""
        if self.host is None:
            program, prepared = self.program, self.prepared()
            with self._lock:
                if self.host is None:
                    self.host = (program, Resident(prepared, 0, self.spec.x64, host_device()))
        return self.host

    def eager_call(self, key, make, **jit_options):
        """``make()`` compiled as one program (``jax.jit``), made once per ``key``
        and kept (:attr:`eager`), as a call that waits for its result."""
        fn = self.eager.get(key)
        if fn is None:
            fn = self.eager.setdefault(key, jax.jit(make(), **jit_options))
        return lambda *args: jax.block_until_ready(fn(*args))

    def release(self) -> None:
        """Free this process's device copies and drop what the executor placed (the state
        stays usable: everything is made again on demand)."""
        host, self.host = self.host, None
        if host is not None and not self.stalled:  # freeing a copy in use waits for its user
            host[1].delete()
        self.placed = {}
        self.eager = {}  # its programs hold this state: no cycle left behind

    def __repr__(self) -> str:
        p = self.spec.plan
        measured = f", measured={self.measured.route.name}" if self.measured else ""
        decision = None if self.decision is None else self.decision.name
        return (f"SiteState({self.spec.label}, rows={p.n_rows}, block_rows={p.block_rows}, "
                f"blocks={p.n_blocks}, form={self.spec.form}, decision={decision}"
                f"{measured})")


class SiteCache:
    """An executor's site states, keyed by what a call site is.

    At most ``max_sites`` states and ``max_bytes`` of their data are kept (the most
    recently used state always stays), least recently used first out; a state that
    leaves is released (its device copies freed) and handed to ``on_forget``.
    """

    def __init__(self, max_sites: int = MAX_SITES, max_bytes: int = MAX_SITE_BYTES,
                 on_forget=None):
        self.max_sites = max_sites
        self.max_bytes = max_bytes
        self._on_forget = on_forget
        self._states: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key, make):
        with self._lock:
            state = self._states.get(key)
            if state is not None:
                self._states.move_to_end(key)
                return state
        state = make()
        with self._lock:
            state = self._states.setdefault(key, state)
            self._states.move_to_end(key)
            evicted = []
            while len(self._states) > 1 and (
                    len(self._states) > self.max_sites
                    or sum(s.nbytes for s in self._states.values()) > self.max_bytes):
                evicted.append(self._states.popitem(last=False)[1])
        for old in evicted:
            self._drop(old)
        return state

    def values(self) -> list:
        with self._lock:
            return list(self._states.values())

    def __len__(self) -> int:
        return len(self._states)

    def _drop(self, state) -> None:
        if self._on_forget is not None:  # first: the executor reads what the site holds
            self._on_forget(state)
        state.release()

    def clear(self) -> None:
        with self._lock:
            states, self._states = list(self._states.values()), OrderedDict()
        for state in states:
            self._drop(state)
