"""How a call site's blocks are laid out over devices for a ``shard_map``.

Graph layout, for ``D`` devices and ``n_blocks`` blocks (each ``block_rows`` rows,
the last padded as every block plan pads it): device ``d`` holds blocks
``[d * per_device, (d + 1) * per_device)``; where ``D`` does not divide
``n_blocks`` the last devices' slots are filled with empty blocks (zero rows, zero
real rows) whose partials are dropped. Also the records of what the executor keeps per
site: a device's share of the host route, a site's parameter bytes as traced.
Imports numpy only.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["DeviceLayout", "DeviceShare", "Params", "device_layout", "spread_blocks"]


class DeviceLayout(NamedTuple):
    """How one call site's blocks are spread over the devices.

    Attributes
    ----------
    devices : int
        Devices in the mesh.
    n_blocks : int
        Blocks in the plan.
    per_device : int
        Block slots per device: ``ceil(n_blocks / devices)``.
    block_rows : int
        Rows per block.
    """

    devices: int
    n_blocks: int
    per_device: int
    block_rows: int

    @property
    def local_rows(self) -> int:
        """Rows each device holds."""
        return self.per_device * self.block_rows

    @property
    def active(self) -> int:
        """Devices that evaluate at least one block."""
        return sum(1 for d in range(self.devices) if self.blocks_on(d))

    def blocks_on(self, device: int) -> int:
        """Real blocks that device number ``device`` evaluates."""
        return min(max(self.n_blocks - device * self.per_device, 0), self.per_device)


def device_layout(n_blocks: int, block_rows: int, devices: int) -> DeviceLayout:
    """Spread ``n_blocks`` blocks over ``devices`` devices.

    Examples
    --------
    >>> lay = device_layout(16, 64, 4)
    >>> lay.per_device, [lay.blocks_on(d) for d in range(4)]
    (4, [4, 4, 4, 4])
    >>> [device_layout(15, 64, 2).blocks_on(d) for d in range(2)]
    [8, 7]
    """
    return DeviceLayout(devices, n_blocks, -(-n_blocks // devices), block_rows)


def spread_blocks(x, layout: DeviceLayout, xp=np):
    """``x`` (``(n_blocks, ...)``) padded with empty blocks to ``devices * per_device``.

    ``xp`` is ``numpy`` for concrete data and ``jax.numpy`` for traced leaves; the
    blocks are only moved, never computed on.
    """
    pad = layout.devices * layout.per_device - layout.n_blocks
    if not pad:
        return x
    return xp.concatenate([x, xp.zeros((pad,) + tuple(x.shape[1:]), x.dtype)])


class DeviceShare(NamedTuple):
    """``dispatch="host"``: one device's run of whole tiles and its data there."""

    device: object
    chunk: object  # the device's blocks, a Chunk
    resident: object  # the device's data, a Resident


class Params(NamedTuple):
    """Per evaluation of one site, as traced: parameter bytes and busy devices."""

    replicated: int  # shared leaves: a copy to every device
    split: int  # traced data leaves (per-row parameters): split over the devices
    devices: int  # devices that run blocks (1 when it ran in place, inside pmap)
