"""The device-map executor: ``reduce_sum`` blocks split over JAX devices.

Imports jax and the core. Found through the
``parallel_backend.executors`` entry point ``device`` and re-exported as
``pb.DeviceExecutor``.
"""

from .executor import DeviceExecutor
from .layout import DeviceLayout, device_layout

__all__ = ["DeviceExecutor", "DeviceLayout", "device_layout"]
