"""What one executor keeps about one call site: :class:`SiteState`.

A :class:`~parallel_backend.spec.SiteSpec` is immutable and shared; the state is
per executor: the data prepared for this site (once), the devices' copies of it,
where evaluations run (``"graph"`` or ``"host"``, decided once), the adaptive
chunker and the timings that decided. Executors hold their states in a
:class:`SiteCache`, which forgets a state once the data it was made from is
garbage collected, so a dropped dataset is freed. Imports jax, numpy and the core.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import jax

from .chunking import AdaptiveChunker, Chunk
from .spec import Program, SiteSpec, host_device

__all__ = ["SiteState", "SiteCache", "Resident", "run_eagerly"]

#: Chunk views (device arrays of a run of blocks) kept per holder, least recently used
#: out first, and at most this many times the bytes of the data held.
MAX_VIEWS = 64
MAX_VIEW_COPIES = 2


def run_eagerly(fn, *args):
    """``fn(*args)`` on a thread of its own: called while the caller's function is
    traced, where every jax operation on this thread would be staged into that trace."""
    out = {}

    def target():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            out["error"] = e

    t = threading.Thread(target=target, name="parallel_backend_eager")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


class Resident:
    """Prepared blocks ``[first, first + n)`` a worker holds, as numpy arrays, with device
    copies of runs of them made once (a tile's, or the whole run's) and kept.

    Parameters
    ----------
    arrays : tuple of numpy arrays
        Each ``(n, block_rows, ...)``.
    first : int
        The first block held.
    x64 : bool
        Precision to place them in (without x64, float64 data would become float32).
    device : jax.Device, optional
        Where the views live; default: the host CPU device.
    """

    def __init__(self, arrays, first: int = 0, x64: bool = False, device=None):
        self.arrays = tuple(arrays)
        self.first = int(first)
        self.n = int(self.arrays[0].shape[0]) if self.arrays else 0
        self.x64 = bool(x64)
        self.device = device if device is not None else host_device()
        self._views: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def view(self, a: int, b: int) -> tuple:
        """Device arrays of blocks ``[a, b)`` (absolute block numbers)."""
        key = (a, b)
        with self._lock:
            view = self._views.get(key)
            if view is not None:
                self._views.move_to_end(key)
                return view
        lo, hi = a - self.first, b - self.first
        with jax.enable_x64(self.x64):
            view = tuple(jax.device_put(x[lo:hi], self.device) for x in self.arrays)
        with self._lock:
            self._views[key] = view
            budget = MAX_VIEW_COPIES * max(self.nbytes, 1)
            while len(self._views) > 1 and (len(self._views) > MAX_VIEWS
                                            or self._view_bytes() > budget):
                self._views.popitem(last=False)
        return view

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.arrays)

    def _view_bytes(self) -> int:
        return sum(a.nbytes for view in self._views.values() for a in view)

    def everything(self) -> tuple:
        """Device arrays of every block held."""
        return self.view(self.first, self.first + self.n)

    def delete(self) -> None:
        """Free the device copies now."""
        with self._lock:
            views, self._views = list(self._views.values()), OrderedDict()
        for view in views:
            for arr in view:
                try:
                    arr.delete()
                except Exception:  # noqa: BLE001 - already freed or aliased
                    pass


class SiteState:
    """One executor's record of one call site.

    Attributes
    ----------
    spec : SiteSpec
    decision : {"graph", "host"} or None
        Where this executor evaluates the site; decided once, when first traced.
    chunker : AdaptiveChunker
        Chunk sizes for ``grainsize=None`` on the host path.
    timing : dict or None
        What the decision measured (seconds per evaluation of each option).
    """

    def __init__(self, spec: SiteSpec, resident_leaves, workers: int):
        self.spec = spec
        self.decision = None
        self.timing = None
        self.chunker = AdaptiveChunker(spec.plan, workers, tiles=spec.tiles)
        self._resident_leaves = tuple(resident_leaves)
        self._lock = threading.Lock()
        self._decide_lock = threading.Lock()
        self._program = None
        self._prepared = None
        self._host = None

    @property
    def label(self) -> str:
        return self.spec.label

    def deciding(self):
        """Held while the executor decides where the site runs (concurrent traces wait)."""
        return self._decide_lock

    def settle(self, decision: str, timing=None) -> None:
        """Record where the site runs (once) and what the decision measured."""
        if decision not in ("graph", "host"):
            raise ValueError(f"decision must be 'graph' or 'host', got {decision!r}")
        self.decision, self.timing = decision, timing

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
                    self._resident_leaves = ()  # the prepared blocks replace them
        return self._prepared

    def resident(self) -> Resident:
        """The prepared data on the host CPU device (for host-path chunks here)."""
        if self._host is None:
            prepared = self.prepared()
            with self._lock:
                if self._host is None:
                    self._host = Resident(prepared, 0, self.spec.x64)
        return self._host

    def run_chunk(self, chunk: Chunk, evaluation):
        """Evaluate ``chunk`` here, on the calling thread (see :func:`host.run_chunk`)."""
        from .host import run_chunk

        return run_chunk(self.program, self.resident(), chunk, evaluation)

    def release(self) -> None:
        """Free device copies (the state stays usable: they are made again on demand)."""
        host, self._host = self._host, None
        if host is not None:
            host.delete()

    def __repr__(self) -> str:
        p = self.spec.plan
        return (f"SiteState({self.spec.label}, rows={p.n_rows}, block_rows={p.block_rows}, "
                f"blocks={p.n_blocks}, form={self.spec.form}, decision={self.decision})")


class SiteCache:
    """An executor's site states, keyed by call site and data identity.

    A state is dropped when any resident data leaf it was made from is garbage
    collected (leaves that cannot be weakly referenced are kept alive with it), and
    at most ``max_sites`` are kept, least recently used first out.
    """

    def __init__(self, max_sites: int = 256, on_forget=None):
        self.max_sites = max_sites
        self._on_forget = on_forget
        self._states: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key, make, leaves=()):
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
            while len(self._states) > self.max_sites:
                evicted.append(self._states.popitem(last=False)[1])
        for old in evicted:
            self._drop(old)
        ref = weakref.ref(self)
        for leaf in leaves:
            try:
                weakref.finalize(leaf, _forget, ref, key)
            except TypeError:  # not weakly referenceable: lives as long as the state
                pass
        return state

    def values(self) -> list:
        with self._lock:
            return list(self._states.values())

    def __len__(self) -> int:
        return len(self._states)

    def _drop(self, state) -> None:
        state.release()
        if self._on_forget is not None:
            self._on_forget(state)

    def forget(self, key) -> None:
        with self._lock:
            state = self._states.pop(key, None)
        if state is not None:
            self._drop(state)

    def clear(self) -> None:
        with self._lock:
            states, self._states = list(self._states.values()), OrderedDict()
        for state in states:
            state.release()


def _forget(ref, key) -> None:
    cache = ref()
    if cache is not None:
        cache.forget(key)

