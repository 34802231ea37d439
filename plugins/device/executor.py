"""``DeviceExecutor``: the blocks of a ``reduce_sum`` call split over JAX devices.

This module owns the executor and the two ways the devices run their blocks:

* ``dispatch="host"`` (what ``"auto"`` picks when splitting pays): one host
  callback per evaluation; each device runs its own contiguous run of whole tiles
  as a one-device program (the core's :func:`run_task`) on data that stays on that
  device. The caller's program never spans several devices, so XLA compiles it
  exactly as it compiles it for ``SerialExecutor``: values, gradients and draws are
  the same bits.
* ``dispatch="graph"``: a ``shard_map`` inside the caller's XLA program, no
  callback (see :mod:`.layout`). XLA compiles a program that spans several devices
  with its multi-device pipeline (an extra common-subexpression pass before
  algebraic simplification), which may round the caller's own arithmetic and
  ``fn``'s gradient differently in the last bit; see :class:`DeviceExecutor`.

Imports jax, numpy and the core's interface.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from parallel_backend import ThreadExecutor
from parallel_backend.extend import (
    BATCHED,
    LOOPED,
    STALL_TIMEOUT,
    EvaluationStalled,
    Executor,
    GraphRoute,
    HostRoute,
    Resident,
    Route,
    RowsBefore,
    Task,
    Wrt,
    accelerator,
    block_axis,
    chunks_within,
    even_slots,
    fence,
    gather,
    hide,
    is_tracer,
    kernel_for,
    pad_blocks,
    pad_rows,
    run_eagerly,
    run_task,
    unblock,
)

from .layout import DeviceLayout, DeviceShare, Params, device_layout, spread_blocks
from .notes import check_devices, route_notes

if TYPE_CHECKING:
    from jax.typing import ArrayLike

    from parallel_backend.extend import ChunkResult, SiteState

__all__ = ["DeviceExecutor"]

#: The mesh axis the blocks are split over; named so it cannot clash with a user's.
AXIS = "parallel_backend_blocks"

class DeviceExecutor(Executor):
    """Evaluate the blocks on several JAX devices: CPU devices or GPUs.

    Each device holds a contiguous run of the blocks' data, placed once, and
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
        device; each device runs its blocks as a one-device program on the data it
        keeps. The caller's program stays a one-device program, so values,
        gradients and NUTS draws are bitwise those of ``SerialExecutor``. CPU
        devices only: on a GPU it stalled, so there it warns and runs ``"graph"``.
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
        ``XLA_FLAGS=--xla_disable_hlo_passes=cse`` (for every program of the process)
        removed the difference on an Intel Xeon, not on an AMD EPYC.
        On accelerators (JAX's default backend a GPU or a TPU) there are no blocks to
        run: with ``"auto"`` or ``"graph"`` each device runs plain NumPyro's program
        (``fn`` on all its rows at once) on a contiguous share of the rows, in one
        ``shard_map``; on one device that is plain's program. Values and gradients
        are plain's to rounding (each device sums its own rows), the same bits for a
        given number of devices.
    count_calls : bool
        Count evaluations that stay in the graph for :meth:`stats`.
    stall_timeout : float or None
        Seconds an evaluation on the devices' threads waits with no chunk finishing
        (see :class:`~parallel_backend.Executor`).

    Warns
    -----
    UserWarning
        Once, when made, with every reason that applies: with one device it works,
        but nothing runs in parallel; on a GPU (or another accelerator)
        ``dispatch="host"`` runs ``"graph"`` instead, and on one GPU nothing is split
        (plain NumPyro's program runs there).

    Notes
    -----
    Inside ``jax.pmap`` (NumPyro's ``chain_method="parallel"``, one chain per
    device) or a user's mesh each chain already owns a device: the blocks are
    evaluated in place there, with any ``dispatch``. Under ``jax.vmap`` (NumPyro's
    ``chain_method="vectorized"``) the whole batch runs on every device, in one
    callback.

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

    def __init__(self, devices: Sequence[jax.Device] | None = None, *, dispatch: str = "auto",
                 count_calls: bool = False, stall_timeout: float | None = STALL_TIMEOUT,
                 ) -> None:
        devices = check_devices(devices)
        dispatch, notes = route_notes(devices, dispatch)
        super().__init__(dispatch=dispatch, count_calls=count_calls,
                         stall_timeout=stall_timeout)
        self._devices = devices
        self._mesh = Mesh(np.array(devices, dtype=object), (AXIS,))
        self._sharding = NamedSharding(self._mesh, PartitionSpec(AXIS))
        self._place_lock = threading.Lock()
        # What this executor places for a site lives on the site (``state.placed``:
        # "device.placed", the graph path's layout, data and valid rows; "device.shares",
        # the host path's per-device data; "device.params", the parameters' sizes as
        # traced) and goes with it: dropped when the cache evicts the site, and kept no
        # longer than the site where a compiled program still evaluates it.
        self._threads = ThreadExecutor(len(devices))  # starts the devices' chunks
        if notes:  # one warning, however many reasons
            warnings.warn("DeviceExecutor: " + " ".join(notes), UserWarning, stacklevel=2)

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The devices the blocks are split over."""
        return self._devices

    @property
    def workers(self) -> int:
        return len(self._devices)

    def decide(self, state: SiteState) -> type[Route]:
        """As :meth:`Executor.decide`; the graph (in place) inside ``pmap``."""
        if _in_place():
            return GraphRoute
        return super().decide(state)

    def has_host_path(self, state: SiteState) -> bool:
        """Never inside ``pmap`` (in place), nor on an accelerator (see
        :data:`.notes.HOST_ROUTE_WAITS`)."""
        return self._devices[0].platform == "cpu" and not _in_place()

    def _mapped(self, state) -> bool:
        """Whether ``state``'s graph path is the ``shard_map`` over the devices: with
        ``dispatch="graph"``, and on several accelerators with ``"auto"`` too (each
        device runs plain's program on its share of the rows)."""
        if state.decision is not GraphRoute:
            return False
        return self.dispatch == "graph" or (self.dispatch == "auto" and accelerator()
                                            and len(self._devices) > 1)

    # -- the host path: one-device programs, one per device ------------------------

    def _kept(self, name: str, state):
        """What this executor placed for ``state`` under ``name`` (``"shares"``,
        ``"placed"``, ``"params"``), or ``None``. Call with ``_place_lock`` held."""
        return state.placed.get("device." + name)

    def _keep(self, name: str, state, value):
        """Keep ``value`` on ``state`` under ``name``. Call with ``_place_lock`` held."""
        state.placed["device." + name] = value
        return value

    def _host_shares(self, state) -> list:
        """Each device's run of whole tiles and its data there, placed once."""
        with self._place_lock:
            shares = self._kept("shares", state)
            if shares is None:
                prepared = state.prepared()
                shares = []
                for dev, chunk in zip(self._devices, even_slots(state.spec.tiles, len(self._devices))):
                    a, b = chunk.first, chunk.first + chunk.count
                    resident = Resident(tuple(x[a:b] for x in prepared), a, state.spec.x64, dev)
                    shares.append(DeviceShare(dev, chunk, resident))
                self._keep("shares", state, shares)
        return shares

    def run_tasks(self, tasks: Sequence[Task]) -> list[ChunkResult]:
        """Every device runs the chunks of its own tiles, on its own data, in order (a
        task that straddles two devices' shares is cut at the boundary)."""
        if not tasks:
            return []
        state, program, evaluation = tasks[0].site, tasks[0].program, tasks[0].evaluation
        shares = self._host_shares(state)
        tiles = state.spec.tiles
        per = max(1, max(t.chunk.count for t in tasks) // tiles.tile_blocks)

        def run(share):
            return [run_task(Task(state, program, share.resident, c, evaluation))
                    for c in chunks_within(tiles, share.chunk, per)]

        # One thread per device, each running its device's chunks in order; gather watches
        # that they can start (the caller's device keeps a share on CPU devices).
        pool = self._threads.task_pool()
        futures = [pool.submit(run, share) for share in shares]
        try:
            results = gather(futures, [share.device for share in shares], state.spec.label,
                             self.stall_timeout,
                             lambda: [state.spec.rows(s.chunk.first, s.chunk.count)
                                      for s in shares],
                             self.name)
        except EvaluationStalled:
            state.stalled = True
            self._threads.drop_pool(pool)
            raise
        return [r for per in results for r in per]

    def bytes_per_call(self, traced: Sequence[ArrayLike], shared: Sequence[ArrayLike],
                       n_tasks: int) -> int:
        # Shared parameters go to every busy device once; per-row parameters are split.
        busy = min(n_tasks, len(self._devices))
        return (sum(np.asarray(s).nbytes for s in shared) * busy
                + sum(np.asarray(t).nbytes for t in traced))

    # -- the graph path: a shard_map inside the caller's program --------------------

    def layout(self, state: SiteState) -> DeviceLayout:
        """The ``dispatch="graph"`` device layout of ``state``'s blocks."""
        p = state.spec.plan
        return device_layout(p.n_blocks, p.block_rows, len(self._devices))

    def _place(self, state):
        """Lay out and place ``state``'s prepared data on the devices, once."""
        with self._place_lock:
            placed = self._kept("placed", state)
            if placed is None:
                layout = self.layout(state)
                prepared = state.prepared()
                valid = state.program.valid  # spread with the data below, once

                def put():
                    with jax.enable_x64(state.spec.x64):
                        return tuple(jax.device_put(spread_blocks(np.asarray(x), layout),
                                                    self._sharding)
                                     for x in (*prepared, valid))

                # Called while the caller's function is traced: place the data now, not
                # as an operation of that trace.
                arrays = run_eagerly(put)
                placed = self._keep("placed", state, (layout, arrays[:-1], arrays[-1]))
        return placed

    def graph_partials(self, state: SiteState, traced: Sequence[ArrayLike],
                       shared: Sequence[ArrayLike], diff_traced: Sequence[bool],
                       diff_shared: Sequence[bool],
                       set_axes: tuple[Sequence[int | None], Sequence[int | None]] | None = None,
                       ) -> tuple[Any, ...]:
        """Per-block partials of all blocks, inside the caller's program.

        With ``dispatch="graph"`` each device evaluates its own blocks in a
        ``shard_map``; otherwise (and inside ``pmap``) the blocks are evaluated in
        place, as ``SerialExecutor`` evaluates them. ``set_axes``: a batch of parameter
        sets, mapped inside each device's blocks as everywhere (the block axis leads
        between devices).
        """
        self.check_open()
        traced, shared = tuple(traced), tuple(shared)
        mapped = self._mapped(state) and not _in_place()
        with self._place_lock:
            self._keep("params", state, Params(sum(_nbytes(s) for s in shared),
                                                 sum(_nbytes(t) for t in traced),
                                                 self.layout(state).active if mapped else 1))
        if not mapped:
            return super().graph_partials(state, traced, shared, diff_traced, diff_shared,
                                          set_axes)
        if accelerator():
            return self._plain_shares(state, traced, shared, diff_traced, diff_shared,
                                      set_axes)
        program, plan = state.program, state.spec.plan
        wrt = Wrt(tuple(diff_traced), tuple(diff_shared))
        kernel = kernel_for(1, wrt)
        layout, prepared, valid = self._place(state)
        axes_t = set_axes[0] if set_axes else (None,) * len(traced)
        # Blocks first (a set axis after them) to be split over the devices.
        traced_blocks = tuple(
            spread_blocks(jnp.moveaxis(pad_blocks(t, plan, block_axis(a), jnp), block_axis(a), 0),
                          layout, jnp) for t, a in zip(traced, axes_t))
        lead = 0 if set_axes is None else 1

        def run(prepared, traced, shared, valid):
            # As on the serial graph path: guards ``hide`` and ``fence``.
            prepared, valid = hide(prepared, valid)
            traced, shared = fence((traced, shared))
            if state.spec.form == "batched":
                traced = tuple(jnp.moveaxis(t, 0, block_axis(a)) for t, a in zip(traced, axes_t))
                # SPMD: the same program on every device, so every block is masked.
                out = BATCHED.partials(program, kernel, prepared, traced, shared, valid, wrt,
                                       counted=RowsBefore, set_axes=set_axes)
                out = jax.tree.map(lambda x: jnp.moveaxis(x, lead, 0), out)
            else:
                me = lax.axis_index(AXIS)
                count = jnp.clip(layout.n_blocks - me * layout.per_device, 0, layout.per_device)
                first, count = jnp.int32(0), count.astype(jnp.int32)
                out = LOOPED.partials(program, kernel, wrt, prepared, valid, first, count,
                                      layout.per_device, traced, shared)
            return fence(out)

        spec = PartitionSpec(AXIS)
        # jit: called eagerly, the map is still one compiled program.
        mapped_fn = jax.jit(jax.shard_map(run, mesh=self._mesh,
                                          in_specs=(spec, spec, PartitionSpec(), spec),
                                          out_specs=spec, check_vma=False))
        out = mapped_fn(prepared, traced_blocks, shared, valid)
        out = jax.tree.map(lambda x: jnp.moveaxis(x[:plan.n_blocks], 0, lead), out)
        values, g_shared = out.values, tuple(out.shared_grads)
        g_data = tuple(unblock(g, plan.n_rows, lead) for g in out.data_grads)
        result = (values, g_shared, g_data)
        if not any(is_tracer(x) for x in jax.tree.leaves(result)):
            # Called eagerly (no jit): hand back uncommitted arrays on the default
            # device, as any eager jax operation makes, so they mix with the caller's.
            result = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), result)
        return result

    # -- on accelerators: plain's program on each device's share of the rows ----------

    def _placed_rows(self, state):
        """``state``'s resident data as rows, padded with copies of the last row to a
        whole share per device (the layout's ``local_rows`` each) and sharded, with each
        device's count of real rows; placed once."""
        with self._place_lock:
            placed = self._kept("rows", state)
            if placed is None:
                layout = self.layout(state)
                total = layout.devices * layout.local_rows
                n = state.spec.plan.n_rows
                counts = np.clip(n - np.arange(layout.devices) * layout.local_rows, 0,
                                 layout.local_rows).astype(np.int32)

                def put():
                    with jax.enable_x64(state.spec.x64):
                        return tuple(jax.device_put(pad_rows(np.asarray(x), total, 0, np),
                                                    self._sharding)
                                     for x in (*state.resident(), counts))

                arrays = run_eagerly(put)  # called while tracing: placed now, not traced
                placed = self._keep("rows", state, (arrays[:-1], arrays[-1]))
        return placed

    def _plain_shares(self, state, traced, shared, diff_traced, diff_shared, set_axes):
        """Per-block partials where each device runs plain NumPyro's program (``fn`` on
        all its rows at once, JAX's own derivatives: :meth:`Program.plain_sums`) on its
        contiguous share of the rows, in one ``shard_map``: what the graph is on several
        accelerators, as plain's program is on one. A device's sums go to the slot of its
        first block (zeros in the others), so they combine in device order. The bits
        depend on the number of devices (each sums its own rows)."""
        plan, layout = state.spec.plan, self.layout(state)
        resident, counts = self._placed_rows(state)
        axes_t = set_axes[0] if set_axes else (None,) * len(traced)
        total = layout.devices * layout.local_rows
        # Rows first (a set axis after them) to be split over the devices.
        rows = tuple(jnp.moveaxis(pad_rows(t, total, block_axis(a), jnp), block_axis(a), 0)
                     for t, a in zip(traced, axes_t))
        wrt = Wrt(tuple(diff_traced), tuple(diff_shared))
        sums = state.program.plain_sums(wrt, kernel_for(1, wrt), set_axes)
        lead = 0 if set_axes is None else 1

        def run(resident, rows, shared, count):
            rows = tuple(jnp.moveaxis(t, 0, block_axis(a)) for t, a in zip(rows, axes_t))
            v, gs, gt = sums(resident, rows, shared, count[0])
            # The device axis first: values and shared gradients one per device, per-row
            # gradients with the rows first.
            return (v[None], tuple(g[None] for g in gs),
                    tuple(jnp.moveaxis(g, lead, 0) for g in gt))

        spec = PartitionSpec(AXIS)
        mapped_fn = jax.jit(jax.shard_map(run, mesh=self._mesh,
                                          in_specs=(spec, spec, PartitionSpec(), spec),
                                          out_specs=spec, check_vma=False))
        v, gs, gt = mapped_fn(resident, rows, tuple(shared), counts)
        slots = [d * layout.per_device for d in range(layout.devices) if layout.blocks_on(d)]

        def by_block(x):  # (devices, *sets, ...) -> (*sets, blocks, ...)
            out = jnp.zeros((plan.n_blocks,) + x.shape[1:], x.dtype)
            out = out.at[jnp.asarray(slots)].set(x[:len(slots)])
            return jnp.moveaxis(out, 0, lead)

        result = (by_block(v), tuple(map(by_block, gs)),
                  tuple(jnp.moveaxis(g[:plan.n_rows], 0, lead) for g in gt))
        if not any(is_tracer(x) for x in jax.tree.leaves(result)):
            result = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), result)
        return result

    # -- bookkeeping -----------------------------------------------------------------

    def graph_counts(self, state: SiteState, calls: int, batches: int) -> dict[str, int]:
        """Graph evaluations: a block run per busy device each (one in place)."""
        with self._place_lock:
            info = self._kept("params", state) or Params(0, 0, 1)
        out = super().graph_counts(state, calls, batches)
        out["chunks"] = calls * info.devices
        if info.devices > 1:
            out["bytes_sent"] = (info.replicated * info.devices + info.split) * batches
        return out

    def stats(self, timeline: bool = False) -> dict[str, Any]:
        """What this executor did since it was made.

        Returns
        -------
        dict
            As :meth:`Executor.stats <parallel_backend.Executor.stats>`, plus
            ``devices``, the devices as strings, and per call site ``devices``, the
            devices that evaluate its blocks (1 where the blocks are evaluated in
            place). ``chunks`` counts block runs: with ``dispatch="host"`` the chunks
            the devices ran, with the ``shard_map`` one per busy device per
            evaluation. ``bytes_sent`` counts the parameters handed to the devices:
            shared parameters once per busy device, per-row parameters once. With the
            ``shard_map`` a site's ``chunk_rows`` is the rows a device holds, and
            ``seconds_in_workers`` does not grow: the devices run inside the
            caller's program, where nothing times them.
        """
        out = super().stats(timeline)
        for entry, state in zip(out["sites"], self.sites()):
            if self._mapped(state):
                lay = self.layout(state)
                entry["chunk_rows"] = [min(lay.local_rows, state.spec.plan.n_rows)]
                entry["devices"] = lay.active
            elif state.decision is HostRoute:
                shares = state.placed.get("device.shares", ())
                entry["devices"] = len(shares)
                if shares:  # a chunk never spans two devices' data
                    most = max(s.chunk.count for s in shares) * state.spec.plan.block_rows
                    entry["chunk_rows"] = [min(r, most) for r in entry["chunk_rows"]]
            else:
                entry["devices"] = 1
        out["chunk_rows"] = sorted({r for s in out["sites"] for r in s["chunk_rows"]})
        out["devices"] = [str(d) for d in self._devices]
        return out

    def release(self) -> None:
        self._threads.close()
        # The buffers of the sites still cached are freed now; an evicted site's go
        # with the site (an evaluation still running, or a compiled program that holds
        # them as constants, keeps its own references until then).
        for state in self.sites():
            with self._place_lock:
                placed = state.placed.pop("device.placed", None)
                shares = state.placed.pop("device.shares", None) or ()
                rows = state.placed.pop("device.rows", None)
            if placed is not None:
                _, arrays, valid = placed
                for arr in (*arrays, valid):
                    arr.delete()
            if rows is not None:
                arrays, counts = rows
                for arr in (*arrays, counts):
                    arr.delete()
            for share in shares if not state.stalled else ():  # in use: left to its user
                share.resident.delete()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"calls={self.stats()['calls']}"
        platform = self._devices[0].platform
        return (f"DeviceExecutor(devices={len(self._devices)}, platform={platform!r}, "
                f"ids={[d.id for d in self._devices]}, dispatch={self.dispatch!r}, {state})")


def _in_place() -> bool:
    """Inside ``pmap`` or a user's mesh: the caller's chain already owns its device."""
    return not jax.sharding.get_abstract_mesh().empty


def _nbytes(x) -> int:
    return math.prod(jnp.shape(x)) * jnp.result_type(x).itemsize
