"""What ``DeviceExecutor`` checks and says when it is made: the devices it is given, and
the warnings about routes that cannot run or cannot win on the hardware it finds.
Imports jax only."""

from __future__ import annotations

import jax

__all__ = ["HOST_ROUTE_WAITS", "ONE_ACCELERATOR", "check_devices", "route_notes"]

#: Why the host route is never taken on an accelerator. Its callback runs inside the
#: caller's program, which holds the device until the callback returns; compiling the
#: chunk programs for that device there stalled (issue 38, on an H100: stuck in XLA's
#: compilation every time, a plain JAX sum compiled the same way once in three; with
#: XLA's GPU autotuning off it finished, and ran slower than the graph route). So the
#: route is refused, not made to work.
HOST_ROUTE_WAITS = (
    "dispatch='host' cannot run on {platform} devices: its host callback runs inside the "
    "caller's program, which holds the {platform} until the callback returns, and "
    "compiling the blocks' programs for that {platform} there stalls. Using "
    "dispatch='graph' (the blocks inside the caller's program) instead.")
#: What ``DeviceExecutor`` does on one accelerator (not yet measured on a GPU; the block
#: loop it replaced was: docs/performance.md).
ONE_ACCELERATOR = (
    "on one {platform} nothing is split: a site runs plain NumPyro's program there (fn on "
    "every row at once, in the caller's program; the host route cannot run there), so "
    "expect no gain over plain NumPyro. With several {platform} devices each runs that "
    "program on its share of the rows.")


def check_devices(devices) -> tuple:
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


def route_notes(devices, dispatch: str) -> tuple[str, list]:
    """The dispatch a ``DeviceExecutor`` on ``devices`` uses for the one asked for, and
    what it warns when made (the host route refused on an accelerator, nothing split on
    one accelerator, one device that maps nothing)."""
    platform, notes = devices[0].platform, []
    if platform != "cpu" and dispatch == "host":
        notes.append(HOST_ROUTE_WAITS.format(platform=platform))
        dispatch = "graph"
    if platform != "cpu" and len(devices) == 1:
        notes.append(ONE_ACCELERATOR.format(platform=platform))
    elif len(devices) == 1:
        notes.append(
            f"only one device ({devices[0]}), so the blocks run one after "
            "another. For N CPU devices start Python with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N (set before jax is "
            "imported); on GPUs make more of them visible (CUDA_VISIBLE_DEVICES).")
    return dispatch, notes
