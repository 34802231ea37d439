"""The device-map executor: ``reduce_sum`` blocks split over JAX devices with ``shard_map``.

Imports jax and the core's public names. Found through the
``parallel_backend.executors`` entry point ``device`` and re-exported as
``pb.DeviceExecutor``.
"""

from .executor import DeviceExecutor, DeviceLayout, device_layout

__all__ = ["DeviceExecutor", "DeviceLayout", "device_layout"]
