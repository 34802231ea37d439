"""``DeviceExecutor``: the blocks of a ``reduce_sum`` call as a ``shard_map`` over devices.

This module owns the device layout of a call site (which blocks each device
evaluates), the data placed once on the devices with a ``NamedSharding``, and
the ``shard_map`` that runs the core's block loop on every device inside the
caller's XLA program (no host callback). It imports jax, numpy and the core's
public names only.

Layout, for ``D`` devices and a plan of ``n_full`` full blocks and a tail block
of ``tail_rows`` rows: device ``d`` holds the full blocks
``[d * per_device, (d + 1) * per_device)`` (the last devices' slots are padded
with zero rows when ``D`` does not divide ``n_full``), followed by a tail slot of
``tail_rows`` rows that holds the real tail on the last device only. Every device
runs the same two loops as ``Site.graph_partials`` (the full blocks, then the
tail), with runtime trip counts that skip the padded slots, so padding never
enters a block's value. The per-block partials come back in block order and the
core folds them exactly as it folds ``SerialExecutor``'s: the results are the
same bits.
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

from parallel_backend import Executor

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
    """Evaluate the blocks on several JAX devices with ``jax.shard_map``.

    The rows of ``data`` are split over a one-axis mesh of ``devices``; each device
    runs the same block loop as :class:`~parallel_backend.SerialExecutor` over its
    blocks, inside the caller's XLA program (no host callback), and the per-block
    partials are combined in block order. Values, gradients and NUTS draws are
    therefore bitwise those of ``SerialExecutor`` on the same platform.

    Data that is concrete when the model is traced is laid out and placed on the
    devices once per call site (a ``NamedSharding``); parameters are replicated to
    every device per evaluation, per-row parameters (traced data leaves) are split
    like the data. Under ``jax.vmap`` (NumPyro's ``chain_method="vectorized"``) the
    whole batch runs on every device. Inside ``jax.pmap`` (NumPyro's
    ``chain_method="parallel"``, one chain per device) each chain already owns a
    device, so the block loop runs in place on that device.

    Parameters
    ----------
    devices : sequence of jax.Device, optional
        The devices to split over, all of one platform; default ``jax.devices()``.
        On a CPU-only machine there are several only when the process started
        with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``.
    count_calls : bool
        Count evaluations for :meth:`stats` (a tiny host callback per evaluation).

    Warns
    -----
    UserWarning
        With one device: it works, but nothing runs in parallel.

    Notes
    -----
    JAX embeds the data that a traced function closes over into the compiled
    program; each device then holds its own rows as part of the executable. With
    ``JAX_USE_SIMPLIFIED_JAXPR_CONSTANTS=1`` in the environment, JAX instead passes
    the placed, sharded arrays to the program as buffers, which compiles faster
    for large data. Results are the same either way.

    Examples
    --------
    >>> import warnings, jax, jax.numpy as jnp, parallel_backend as pb
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")  # one CPU device here: it warns
    ...     ex = pb.DeviceExecutor()
    >>> with ex:
    ...     f = lambda m: pb.reduce_sum(lambda x, m: -(x - m) ** 2, jnp.arange(4.0), m, executor=ex)
    ...     v, g = jax.value_and_grad(f)(1.0)
    ...     ex.stats()["calls"]
    1
    >>> float(v), float(g)
    (-6.0, 4.0)
    """

    name = "device"

    def __init__(self, devices=None, *, count_calls: bool = True):
        devices = _check_devices(devices)
        super().__init__(dispatch="graph", count_calls=count_calls)
        self._devices = devices
        self._mesh = Mesh(np.array(devices, dtype=object), (AXIS,))
        self._sharding = NamedSharding(self._mesh, PartitionSpec(AXIS))
        self._place_lock = threading.Lock()
        self._placed: dict = {}  # site -> (layout, resident arrays on the devices)
        self._params: dict = {}  # site -> (replicated, split) parameter bytes per call
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
        """Always ``"graph"``: the devices run inside the caller's program."""
        return "graph"

    # -- the device map ------------------------------------------------------------

    def layout(self, site) -> DeviceLayout:
        """The device layout of ``site``'s blocks."""
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
        """Per-block partials of all blocks, each device evaluating its own blocks.

        Returns what ``Site.graph_partials`` returns (values per block, shared
        gradients per block, data gradients per row), bitwise.
        """
        self._check_open()
        traced, shared = tuple(traced), tuple(shared)
        # Inside pmap (NumPyro's chain_method="parallel") or a user's mesh, this chain
        # already owns its device: the block loop runs in place there.
        in_place = not jax.sharding.get_abstract_mesh().empty
        with self._place_lock:
            self._params[site] = _Params(sum(_nbytes(s) for s in shared),
                                         sum(_nbytes(t) for t in traced),
                                         1 if in_place else self.layout(site).active)
        if in_place:
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
        """One evaluation: a block run per busy device; parameters replicated to each."""
        info = self._params.get(site) or _Params(0, 0, self.layout(site).active)
        self._count(graph_calls=1, calls=1, chunks=info.devices, rows=site.plan.n_rows * batch,
                    bytes_sent=(info.replicated * info.devices + info.split) * batch)

    def stats(self) -> dict:
        """What this executor did since it was made.

        Returns
        -------
        dict
            As :meth:`Executor.stats <parallel_backend.Executor.stats>`, where
            ``chunks`` counts block runs (one per busy device per evaluation),
            ``bytes_sent`` the parameter bytes handed to the devices (shared
            parameters once per device, per-row parameters once), and each site's
            ``chunk_rows`` is the rows a device holds; plus ``devices``, the
            devices as strings. ``seconds_in_workers`` stays 0: the devices run
            inside the caller's program, where nothing times them.
        """
        out = super().stats()
        with self._lock:
            sites = list(self._sites.values())
        for entry, site in zip(out["sites"], sites):
            lay = self.layout(site)
            entry["chunk_rows"] = [min(lay.local_rows, site.plan.n_rows)]
            entry["devices"] = lay.active
        out["chunk_rows"] = sorted({r for s in out["sites"] for r in s["chunk_rows"]})
        out["devices"] = [str(d) for d in self._devices]
        return out

    def _shutdown(self) -> None:
        with self._place_lock:
            placed, self._placed = self._placed, {}
            self._params.clear()
        for _, resident in placed.values():
            for arr in resident:
                if arr is not None:
                    arr.delete()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"calls={self._counts['calls']}"
        platform = self._devices[0].platform
        return (f"DeviceExecutor(devices={len(self._devices)}, platform={platform!r}, "
                f"ids={[d.id for d in self._devices]}, {state})")


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
