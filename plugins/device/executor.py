"""``DeviceExecutor``: the blocks of a ``reduce_sum`` call split over JAX devices.

This module owns the device layout of a call site (which blocks each device
evaluates), the data placed once on the devices, and the two ways the devices
run their blocks:

* ``dispatch="host"`` (what ``"auto"`` picks when splitting pays): one host
  callback per evaluation; each device runs its own contiguous run of blocks as a
  one-device program (the core's compiled chunk loop) on rows that stay on that
  device. The caller's program never spans several devices, so XLA compiles it
  exactly as it compiles it for ``SerialExecutor``: values, gradients and draws are
  the same bits.
* ``dispatch="graph"``: a ``shard_map`` inside the caller's XLA program, no
  callback. XLA compiles a program that spans several devices with its
  multi-device pipeline (an extra common-subexpression pass before algebraic
  simplification), which may round the caller's own arithmetic and ``fn``'s
  gradient differently in the last bit; see :class:`DeviceExecutor`.

Graph layout, for ``D`` devices and a plan of ``n_full`` full blocks and a tail
block of ``tail_rows`` rows: device ``d`` holds the full blocks
``[d * per_device, (d + 1) * per_device)`` (the last devices' slots are padded
with zero rows when ``D`` does not divide ``n_full``), followed by a tail slot of
``tail_rows`` rows that holds the real tail on the last device only. Every device
runs the same two loops as ``Site.graph_partials`` (the full blocks, then the
tail), with runtime trip counts that skip the padded slots, so padding never
enters a block's value. The per-block partials come back in block order and the
core folds them exactly as it folds ``SerialExecutor``'s.

Imports jax, numpy and the core only.
"""

from __future__ import annotations

import math
import threading
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from parallel_backend import Executor, ThreadExecutor
from parallel_backend.chunking import Chunk, even_slots, split_blocks
from parallel_backend.executors.base import row_slice

__all__ = ["DeviceExecutor", "DeviceLayout", "device_layout"]

#: The mesh axis the rows are split over; named so it cannot clash with a user's.
AXIS = "parallel_backend_blocks"


class DeviceLayout(NamedTuple):
    """How one call site's blocks are spread over the devices.

    Attributes
    ----------
    devices : int
        Devices in the mesh.
    block_rows : int
        Rows per full block (the plan's).
    n_full : int
        Full blocks in the plan.
    tail_rows : int
        Rows of the tail block (0 if none); it runs on the last device.
    per_device : int
        Full-block slots per device: ``ceil(n_full / devices)``.
    """

    devices: int
    block_rows: int
    n_full: int
    tail_rows: int
    per_device: int

    @property
    def local_rows(self) -> int:
        """Rows each device holds: its full-block slots, then the tail slot."""
        return self.per_device * self.block_rows + self.tail_rows

    @property
    def active(self) -> int:
        """Devices that evaluate at least one block."""
        return sum(1 for d in range(self.devices) if self.blocks_on(d))

    def blocks_on(self, device: int) -> int:
        """Blocks (full and tail) that device number ``device`` evaluates."""
        full = min(max(self.n_full - device * self.per_device, 0), self.per_device)
        return full + (1 if self.tail_rows and device == self.devices - 1 else 0)


def device_layout(plan, devices: int) -> DeviceLayout:
    """Spread the blocks of ``plan`` (a :class:`~parallel_backend.BlockPlan`) over devices.

    Examples
    --------
    >>> import parallel_backend as pb
    >>> lay = device_layout(pb.plan_blocks(1000, block_rows=64), 4)
    >>> lay.per_device, lay.tail_rows, [lay.blocks_on(d) for d in range(4)]
    (4, 40, [4, 4, 4, 4])
    >>> [device_layout(pb.plan_blocks(1000, block_rows=64), 2).blocks_on(d) for d in range(2)]
    [8, 8]
    """
    per_device = -(-plan.n_full // devices)
    return DeviceLayout(devices, plan.block_rows, plan.n_full, plan.tail_rows, per_device)


def spread_rows(x, layout: DeviceLayout, xp=np):
    """Rows of ``x`` (``N`` rows) in the device layout: ``devices * local_rows`` rows.

    ``xp`` is ``numpy`` for concrete data and ``jax.numpy`` for traced leaves; the
    rows are only moved, never computed on.
    """
    lay, rest = layout, tuple(np.shape(x)[1:])
    full_rows = lay.n_full * lay.block_rows
    slots = lay.devices * lay.per_device * lay.block_rows
    full = x[:full_rows]
    if slots > full_rows:
        full = xp.concatenate([full, xp.zeros((slots - full_rows,) + rest, full.dtype)])
    full = full.reshape((lay.devices, lay.per_device * lay.block_rows) + rest)
    if not lay.tail_rows:
        return full.reshape((-1,) + rest)
    tail = x[full_rows:full_rows + lay.tail_rows]
    pad = xp.zeros(((lay.devices - 1) * lay.tail_rows,) + rest, tail.dtype)
    tail = xp.concatenate([pad, tail]).reshape((lay.devices, lay.tail_rows) + rest)
    return xp.concatenate([full, tail], axis=1).reshape((-1,) + rest)


class DeviceExecutor(Executor):
    """Evaluate the blocks on several JAX devices: CPU devices or GPUs.

    Each device holds a contiguous run of the blocks' rows, placed once, and
    evaluates those blocks; the per-block partials come back in block order and are
    combined as :class:`~parallel_backend.SerialExecutor` combines them.

    Parameters
    ----------
    devices : sequence of jax.Device, optional
        The devices to split over, all of one platform; default ``jax.devices()``.
        On a CPU-only machine there are several only when the process started
        with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``.
    dispatch : {"auto", "host", "graph"}
        ``"host"``: one host callback per evaluation hands the parameters to every
        device; each device runs its blocks as a one-device program on the rows it
        keeps. The caller's program stays a one-device program, so values,
        gradients and NUTS draws are bitwise those of ``SerialExecutor``.
        ``"auto"`` (default): the same, but small or fast work (and everything when
        there is one device) stays in the caller's program on its own device, run
        as ``SerialExecutor`` runs it; which of the two is measured once per call
        site, as :class:`~parallel_backend.ThreadExecutor` measures. Bitwise too.
        ``"graph"``: a ``jax.shard_map`` over the devices inside the caller's XLA
        program, no host callback, data sharded once with a ``NamedSharding``. The
        caller's program then spans every device, and XLA compiles such programs
        with an extra common-subexpression pass that may round the caller's own
        arithmetic (and ``fn``'s gradient) differently in the last bit: values and
        gradients agree with ``SerialExecutor``'s to about 1e-15, draws of a long
        run may drift apart. Starting Python with
        ``XLA_FLAGS=--xla_disable_hlo_passes=cse`` removes the difference (for every
        program of the process).
    count_calls : bool
        Count evaluations that stay in the graph for :meth:`stats` (a tiny host
        callback per evaluation).

    Warns
    -----
    UserWarning
        With one device: it works, but nothing runs in parallel.

    Notes
    -----
    Inside ``jax.pmap`` (NumPyro's ``chain_method="parallel"``, one chain per
    device) or a user's mesh each chain already owns a device: the block loop runs
    in place there, with any ``dispatch``. Under ``jax.vmap`` (NumPyro's
    ``chain_method="vectorized"``) the whole batch runs on every device, in one
    callback.

    With ``dispatch="graph"``, JAX embeds the data that a traced function closes
    over into the compiled program; each device then holds its own rows as part of
    the executable. With ``JAX_USE_SIMPLIFIED_JAXPR_CONSTANTS=1`` in the
    environment, JAX instead passes the placed, sharded arrays to the program as
    buffers, which compiles faster for large data. Results are the same either way.

    Examples
    --------
    >>> import warnings, jax, jax.numpy as jnp, parallel_backend as pb
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")  # one CPU device here: it warns
    ...     ex = pb.DeviceExecutor(dispatch="host")
    >>> with ex:
    ...     f = lambda m: pb.reduce_sum(lambda x, m: -(x - m) ** 2, jnp.arange(4.0), m, executor=ex)
    ...     v, g = jax.value_and_grad(f)(1.0)
    ...     ex.stats()["host_calls"]
    1
    >>> float(v), float(g)
    (-6.0, 4.0)
    """

    name = "device"

    def __init__(self, devices=None, *, dispatch: str = "auto", count_calls: bool = True):
        devices = _check_devices(devices)
        super().__init__(dispatch=dispatch, count_calls=count_calls)
        self._devices = devices
        self._mesh = Mesh(np.array(devices, dtype=object), (AXIS,))
        self._sharding = NamedSharding(self._mesh, PartitionSpec(AXIS))
        self._place_lock = threading.Lock()
        self._placed: dict = {}  # site -> (layout, resident arrays on the devices): graph
        self._slots: dict = {}  # site -> [_Slot] per device: host
        self._params: dict = {}  # site -> (replicated, split) parameter bytes per call
        self._threads = ThreadExecutor(len(devices))  # starts the devices' chunks
        if len(devices) == 1:
            warnings.warn(
                f"DeviceExecutor: only one device ({devices[0]}), so the blocks run one after "
                "another. For N CPU devices start Python with "
                "XLA_FLAGS=--xla_force_host_platform_device_count=N (set before jax is "
                "imported); on GPUs make more of them visible (CUDA_VISIBLE_DEVICES).",
                UserWarning, stacklevel=2)

    @property
    def devices(self) -> tuple:
        """The devices the blocks are split over."""
        return self._devices

    @property
    def workers(self) -> int:
        return len(self._devices)

    def choose_dispatch(self, site, grainsize, data_leaves, shared_leaves) -> str:
        """As :meth:`Executor.choose_dispatch`; ``"graph"`` (in place) inside ``pmap``."""
        if _in_place():
            return "graph"
        choice = super().choose_dispatch(site, grainsize, data_leaves, shared_leaves)
        if choice == "graph":
            self._release_slots(site)  # measured, then not used: free the devices' copies
        return choice

    def _mapped(self, site) -> bool:
        """Whether ``site``'s graph path is the ``shard_map`` over the devices."""
        return self.dispatch == "graph" and site.dispatch == "graph"

    # -- the host path: one-device programs, one per device ------------------------

    def _host_slots(self, site) -> list:
        """Each device's contiguous run of blocks and its rows on that device, placed once."""
        with self._place_lock:
            slots = self._slots.get(site)
            if slots is None:
                slots = []
                for dev, chunk in zip(self._devices, even_slots(site.plan.n_blocks, len(self._devices))):
                    r0, r1 = chunk.rows(site.plan)
                    with jax.enable_x64(site.x64):
                        resident = tuple(None if r is None else jax.device_put(np.asarray(r)[r0:r1], dev)
                                         for r in site.resident)
                    slots.append(_Slot(dev, chunk, r0, r1, resident))
                self._slots[site] = slots
        return slots

    def _release_slots(self, site) -> None:
        with self._place_lock:
            slots = self._slots.pop(site, ())
        for slot in slots:
            for arr in slot.resident:
                if arr is not None:
                    arr.delete()

    def map_chunks(self, site, chunks, args):
        """Every device runs the chunks of its own blocks, on its own rows, in order."""
        traced, shared, diff_traced, diff_shared, in_axes = args
        slots = self._host_slots(site)
        per = max((c.count for c in chunks), default=site.plan.n_blocks)

        def run(slot):
            rows = row_slice(traced, in_axes, slot.r0, slot.r1)
            with jax.enable_x64(site.x64):  # numpy in, committed to this device
                tr, sh = jax.device_put((rows, tuple(np.asarray(x) for x in shared)), slot.device)
            return [site.run_chunk(c, tr, sh, diff_traced, diff_shared, in_axes,
                                   resident=slot.resident, row_offset=slot.r0)
                    for c in split_blocks(slot.chunk.count, per, slot.chunk.first)]

        # One thread per device, each running its device's chunks in order.
        return [r for results in self._threads.map(run, slots) for r in results]

    def _bytes_per_call(self, traced, shared, n_tasks: int) -> int:
        # Shared parameters go to every busy device once; per-row parameters are split.
        busy = min(n_tasks, len(self._devices))
        return (sum(np.asarray(s).nbytes for s in shared) * busy
                + sum(np.asarray(t).nbytes for t in traced))

    # -- the graph path: a shard_map inside the caller's program --------------------

    def layout(self, site) -> DeviceLayout:
        """The ``dispatch="graph"`` device layout of ``site``'s blocks."""
        return device_layout(site.plan, len(self._devices))

    def _place(self, site):
        """Lay out and place ``site``'s concrete data on the devices, once."""
        with self._place_lock:
            placed = self._placed.get(site)
            if placed is None:
                layout = self.layout(site)
                # Called while the caller's function is traced: place the data now,
                # not as an operation of that trace.
                with jax.ensure_compile_time_eval():
                    resident = tuple(
                        None if r is None else jax.device_put(
                            spread_rows(np.asarray(r), layout), self._sharding)
                        for r in site.resident)
                placed = self._placed[site] = (layout, resident)
        return placed

    def graph_partials(self, site, traced, shared, diff_traced, diff_shared):
        """Per-block partials of all blocks, inside the caller's program.

        With ``dispatch="graph"`` each device evaluates its own blocks in a
        ``shard_map``; otherwise (and inside ``pmap``) the block loop runs in place,
        as ``SerialExecutor`` runs it. Returns what ``Site.graph_partials`` returns
        (values per block, shared gradients per block, data gradients per row).
        """
        self._check_open()
        traced, shared = tuple(traced), tuple(shared)
        # Inside pmap (NumPyro's chain_method="parallel") or a user's mesh, this chain
        # already owns its device: the block loop runs in place there.
        mapped = self._mapped(site) and not _in_place()
        with self._place_lock:
            self._params[site] = _Params(sum(_nbytes(s) for s in shared),
                                         sum(_nbytes(t) for t in traced),
                                         self.layout(site).active if mapped else 1)
        if not mapped:
            return site.graph_partials(traced, shared, diff_traced, diff_shared)
        layout, resident = self._place(site)
        traced_rows = tuple(spread_rows(t, layout, jnp) for t in traced)
        run = _device_body(site, layout, diff_traced, diff_shared)
        spec = PartitionSpec(AXIS)
        mapped = jax.shard_map(run, mesh=self._mesh, in_specs=(spec, spec, PartitionSpec()),
                               out_specs=spec, check_vma=False)
        out = _gather_blocks(mapped(resident, traced_rows, shared), layout)
        if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(out)):
            # Called eagerly (no jit): hand back uncommitted arrays on the default
            # device, as any eager jax operation makes, so they mix with the caller's.
            out = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), out)
        return out

    # -- bookkeeping -----------------------------------------------------------------

    def count_graph_call(self, site, batch: int = 1) -> None:
        """One evaluation in the graph: a block run per busy device (one in place)."""
        info = self._params.get(site) or _Params(0, 0, 1)
        self._count(graph_calls=1, calls=1, chunks=info.devices, rows=site.plan.n_rows * batch,
                    bytes_sent=(info.replicated * info.devices + info.split) * batch
                    if info.devices > 1 else 0)

    def stats(self) -> dict:
        """What this executor did since it was made.

        Returns
        -------
        dict
            As :meth:`Executor.stats <parallel_backend.Executor.stats>`, plus
            ``devices``, the devices as strings, and per call site ``devices``, the
            devices that evaluate its blocks (1 where the block loop runs in place).
            ``chunks`` counts block runs: with ``dispatch="host"`` the chunks the
            devices ran, with the ``shard_map`` one per busy device per evaluation.
            ``bytes_sent`` counts the parameters handed to the devices: shared
            parameters once per busy device, per-row parameters once. With the
            ``shard_map`` a site's ``chunk_rows`` is the rows a device holds, and
            ``seconds_in_workers`` does not grow: the devices run inside the
            caller's program, where nothing times them.
        """
        out = super().stats()
        with self._lock:
            sites = list(self._sites.values())
        for entry, site in zip(out["sites"], sites):
            if self._mapped(site):
                lay = self.layout(site)
                entry["chunk_rows"] = [min(lay.local_rows, site.plan.n_rows)]
                entry["devices"] = lay.active
            elif site.dispatch == "host":
                slots = self._slots.get(site, ())
                entry["devices"] = len(slots)
                if slots:  # a chunk never spans two devices' rows
                    most = max(slot.r1 - slot.r0 for slot in slots)
                    entry["chunk_rows"] = [min(r, most) for r in entry["chunk_rows"]]
            else:
                entry["devices"] = 1
        out["chunk_rows"] = sorted({r for s in out["sites"] for r in s["chunk_rows"]})
        out["devices"] = [str(d) for d in self._devices]
        return out

    def _shutdown(self) -> None:
        self._threads.close()
        with self._place_lock:
            placed, self._placed = self._placed, {}
            slots, self._slots = self._slots, {}
            self._params.clear()
        arrays = [a for _, resident in placed.values() for a in resident]
        arrays += [a for site_slots in slots.values() for slot in site_slots for a in slot.resident]
        for arr in arrays:
            if arr is not None:
                arr.delete()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"calls={self._counts['calls']}"
        platform = self._devices[0].platform
        return (f"DeviceExecutor(devices={len(self._devices)}, platform={platform!r}, "
                f"ids={[d.id for d in self._devices]}, dispatch={self.dispatch!r}, {state})")


class _Slot(NamedTuple):
    """``dispatch="host"``: one device's contiguous run of blocks and its rows there."""

    device: object
    chunk: Chunk  # the device's blocks
    r0: int
    r1: int
    resident: tuple  # the data leaves' rows [r0, r1) on ``device`` (None where traced)


def _in_place() -> bool:
    """Inside ``pmap`` or a user's mesh: the caller's chain already owns its device."""
    return not jax.sharding.get_abstract_mesh().empty


class _Params(NamedTuple):
    """Per evaluation of one site, as traced: parameter bytes and busy devices."""

    replicated: int  # shared leaves: a copy to every device
    split: int  # traced data leaves (per-row parameters): split over the devices
    devices: int  # devices that run blocks (1 when it ran in place, inside pmap)


def _device_body(site, layout: DeviceLayout, diff_traced, diff_shared):
    """What one device runs: ``Site.graph_partials``' two loops over its own blocks."""
    lay = layout

    def run(resident, traced, shared):
        me = lax.axis_index(AXIS)
        # The same barriers as the serial graph path: XLA may neither specialise fn
        # on the data nor fuse the caller's parameter computations into the loop.
        resident, traced, shared = lax.optimization_barrier((resident, traced, shared))
        outs = []
        if lay.n_full:
            count = jnp.clip(lay.n_full - me * lay.per_device, 0, lay.per_device)
            row0, count = lax.optimization_barrier((jnp.int32(0), count.astype(jnp.int32)))
            loop = site.block_loop(lay.block_rows, lay.per_device, diff_traced, diff_shared)
            outs.append(loop(resident, traced, shared, row0, count))
        if lay.tail_rows:
            count = (me == lay.devices - 1).astype(jnp.int32)
            row0, count = lax.optimization_barrier(
                (jnp.int32(lay.per_device * lay.block_rows), count))
            loop = site.block_loop(lay.tail_rows, 1, diff_traced, diff_shared)
            outs.append(loop(resident, traced, shared, row0, count))
        return tuple(outs)

    return run


def _gather_blocks(outs, layout: DeviceLayout):
    """The devices' slots back in block order, padding dropped (only moves rows)."""
    lay = layout
    parts = []
    i = 0
    if lay.n_full:
        values, g_shared, g_data = outs[i]
        i += 1
        rows = lay.n_full * lay.block_rows
        parts.append((values[:lay.n_full], tuple(g[:lay.n_full] for g in g_shared),
                      tuple(g[:rows] for g in g_data)))
    if lay.tail_rows:
        values, g_shared, g_data = outs[i]
        last = lay.devices - 1
        start = last * lay.tail_rows
        parts.append((values[last:], tuple(g[last:] for g in g_shared),
                      tuple(g[start:] for g in g_data)))
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)


def _nbytes(x) -> int:
    return math.prod(jnp.shape(x)) * jnp.result_type(x).itemsize


def _check_devices(devices) -> tuple:
    if devices is None:
        devices = jax.devices()
    if isinstance(devices, jax.Device):
        devices = [devices]
    try:
        devices = tuple(devices)
    except TypeError:
        raise TypeError("DeviceExecutor: devices must be a sequence of jax.Device (e.g. "
                        f"jax.devices()) or None, got {type(devices).__name__}") from None
    if not devices:
        raise ValueError("DeviceExecutor: devices is empty; pass jax.devices() or None")
    bad = [d for d in devices if not isinstance(d, jax.Device)]
    if bad:
        raise TypeError("DeviceExecutor: devices must be jax.Device objects (from jax.devices()), "
                        f"got {type(bad[0]).__name__}: {bad[0]!r}")
    if len(set(devices)) != len(devices):
        raise ValueError(f"DeviceExecutor: devices lists a device twice: {list(devices)}")
    platforms = sorted({d.platform for d in devices})
    if len(platforms) > 1:
        raise ValueError(f"DeviceExecutor: devices must share one platform, got {platforms}; "
                         "pass jax.devices('cpu') or jax.devices('gpu')")
    return devices
