"""The network of the simulated cluster: one Linux network namespace per host, joined
by veth pairs to one bridge in the caller's namespace, which is the client's host.

A second topology puts the workers behind the scheduler, as a Kubernetes service, a
port-forward or a gateway does: the workers' hosts hang on a back bridge
(:data:`BACK_BRIDGE`, ``10.77.1.0/24``) that the caller's namespace has no address on,
the scheduler's host is on both bridges and forwards nothing, and the caller's route to
the back subnet is a blackhole (a packet to a worker goes nowhere, as to a pod address
from outside its cluster), so the client reaches the scheduler and no worker.

Everything made here is named with :data:`PREFIX`, so :func:`clean` finds and removes
what a crashed run left behind, and nothing else. Addresses are the project's own test
hosts, ``10.77.0.0/24``: the client's side of the bridge is ``10.77.0.1``; nothing is
routed beyond that subnet (no default route, no forwarding, the host's own interfaces
and routes untouched; the one route added, the back subnet's blackhole, is ours). Bandwidth is a ``tbf`` qdisc on both ends of a host's veth pair.
Needs root and ``ip``/``tc`` (iproute2): :func:`missing` says what is not there (cheap),
:func:`unavailable` also tries to make a namespace. Where the tools are missing, nothing
of ours can exist: :func:`clean` and :func:`namespaces` find nothing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

PREFIX = "pbnc"
BRIDGE = f"{PREFIX}-br"
SUBNET = "10.77.0"
CLIENT_IP = f"{SUBNET}.1"
#: The bridge and subnet of workers the client cannot reach (the scheduler's second leg).
BACK_BRIDGE = f"{PREFIX}-bk"
BACK_SUBNET = "10.77.1"
#: At most this many hosts (scheduler included): addresses .2 to .(2 + MAX_HOSTS - 1).
MAX_HOSTS = 40


#: The commands the simulated cluster runs, and the package of each.
TOOLS = (("ip", "iproute2"), ("tc", "iproute2"), ("timeout", "coreutils"))


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """One ``ip``/``tc`` command, bounded in time; a failure says which command and why."""
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)
    except FileNotFoundError:
        raise RuntimeError(f"netcluster: `{args[0]}` is not installed; {missing()}") from None
    if check and p.returncode != 0:
        raise RuntimeError(f"netcluster: `{' '.join(args)}` failed ({p.returncode}): "
                           f"{p.stderr.strip()}")
    return p


def missing() -> str | None:
    """What the simulated cluster needs and this machine lacks (root, the tools of
    :data:`TOOLS`), in one sentence, or ``None``."""
    absent = [(tool, package) for tool, package in TOOLS if shutil.which(tool) is None]
    lacking = [f"`{tool}` ({package})" for tool, package in absent]
    needs = (["root (network namespaces need it; this process is not root)"]
             if os.geteuid() != 0 else [])
    if lacking:
        packages = sorted({p for _, p in absent})
        needs.append(f"{', '.join(lacking)} on the PATH (install {' and '.join(packages)}, "
                     f"e.g. `apt-get install {' '.join(packages)}`)")
    return f"the simulated cluster needs {' and '.join(needs)}" if needs else None


def unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, no iproute2), or ``None``."""
    why = missing()
    if why:
        return why
    probe = f"{PREFIX}-probe"
    made = run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    run("ip", "netns", "del", probe, check=False)
    return None


def namespaces() -> list[str]:
    """Our namespaces that exist now."""
    if shutil.which("ip") is None:
        return []
    out = run("ip", "netns", "list", check=False).stdout
    return sorted(line.split()[0] for line in out.splitlines()
                  if line.startswith(f"{PREFIX}-"))


def ns_pids(ns: str) -> list[int]:
    out = run("ip", "netns", "pids", ns, check=False).stdout
    return [int(x) for x in out.split() if x.isdigit()]


def kill_namespace_processes(ns: str, wait: float = 5.0) -> None:
    """SIGKILL every process in ``ns`` (they are ours: only we start processes there)."""
    deadline = time.monotonic() + wait
    for _ in range(50):
        pids = ns_pids(ns)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            return
        time.sleep(0.1)


def clean() -> list[str]:
    """Remove every namespace and link of ours, and the processes in them; returns what
    was removed (nothing where ``ip`` is missing: then nothing of ours was made)."""
    removed = []
    if shutil.which("ip") is None:
        return removed
    for ns in namespaces():
        kill_namespace_processes(ns)
        run("ip", "netns", "del", ns, check=False)
        removed.append(ns)
    links = run("ip", "-br", "link", check=False).stdout
    for line in links.splitlines():
        name = line.split()[0].split("@")[0] if line.strip() else ""
        if name.startswith(f"{PREFIX}-"):
            run("ip", "link", "del", name, check=False)
            removed.append(name)
    if BACK_SUBNET + ".0/24" in run("ip", "route", "show", "type", "blackhole",
                                    check=False).stdout:
        run("ip", "route", "del", "blackhole", f"{BACK_SUBNET}.0/24", check=False)
        removed.append(f"blackhole {BACK_SUBNET}.0/24")
    return removed


def make_bridge() -> None:
    run("ip", "link", "add", BRIDGE, "type", "bridge")
    run("ip", "addr", "add", f"{CLIENT_IP}/24", "dev", BRIDGE)
    run("ip", "link", "set", BRIDGE, "up")


def make_back_bridge() -> None:
    """The workers' bridge of the scheduler-only topology: no address here, and a
    blackhole for its subnet, so that nothing from this namespace reaches it (nor leaks
    to the default route)."""
    run("ip", "link", "add", BACK_BRIDGE, "type", "bridge")
    run("ip", "link", "set", BACK_BRIDGE, "up")
    run("ip", "route", "add", "blackhole", f"{BACK_SUBNET}.0/24")


def host_ip(index: int, subnet: str = SUBNET) -> str:
    if not 0 <= index < MAX_HOSTS:
        raise ValueError(f"netcluster: host index must be in [0, {MAX_HOSTS}), got {index}")
    return f"{subnet}.{2 + index}"


def _leg(ns: str, outer: str, inner: str, ifname: str, ip: str, bridge: str) -> None:
    """A veth pair from ``bridge`` (``outer``) into ``ns`` as ``ifname`` at ``ip``."""
    run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
    run("ip", "link", "set", inner, "netns", ns)
    run("ip", "link", "set", outer, "master", bridge, "up")
    run("ip", "-n", ns, "link", "set", inner, "name", ifname)
    run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", ifname)
    run("ip", "-n", ns, "link", "set", ifname, "up")


def make_host(name: str, ip: str, bridge: str = BRIDGE) -> str:
    """A namespace ``pbnc-<name>`` with ``eth0`` at ``ip`` on ``bridge``; returns the
    host-side veth's name."""
    ns = f"{PREFIX}-{name}"
    outer = f"{PREFIX}-{name}h"
    if len(outer) > 15:
        raise ValueError(f"netcluster: host name {name!r} too long for a link name")
    run("ip", "netns", "add", ns)
    _leg(ns, outer, f"{PREFIX}-{name}n", "eth0", ip, bridge)
    run("ip", "-n", ns, "link", "set", "lo", "up")
    return outer


def add_back_leg(name: str, ip: str) -> None:
    """Host ``name`` also on the back bridge (``eth1`` at ``ip``), forwarding nothing
    between its two legs."""
    ns = f"{PREFIX}-{name}"
    _leg(ns, f"{PREFIX}-{name}k", f"{PREFIX}-{name}m", "eth1", ip, BACK_BRIDGE)
    # /proc/sys/net is the namespace's own (sysctl would need procps)
    run("ip", "netns", "exec", ns, "sh", "-c", "echo 0 > /proc/sys/net/ipv4/ip_forward")


def _rate_bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for u, f in units.items():
        if rate.lower().endswith(u):
            return float(rate[: -len(u)]) * f
    raise ValueError(f"netcluster: rate must look like '100mbit' or '1gbit', got {rate!r}")


def set_rate(name: str, rate: str | None) -> None:
    """Cap host ``name``'s link at ``rate`` both ways (``tbf``), or lift the cap (``None``)."""
    ns, outer = f"{PREFIX}-{name}", f"{PREFIX}-{name}h"
    if rate is None:
        run("tc", "qdisc", "del", "dev", outer, "root", check=False)
        run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        return
    # A bucket of 4 ms at the rate (at least 64 KB, one segmentation-offloaded packet).
    burst = max(64 * 1024, int(_rate_bits(rate) / 8 * 4e-3))
    args = ["root", "tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]
    run("tc", "qdisc", "replace", "dev", outer, *args)
    run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "eth0", *args)


def set_link_up(name: str, up: bool) -> None:
    """Cut (or restore) host ``name``'s cable: its bridge-side veth down (or up)."""
    run("ip", "link", "set", f"{PREFIX}-{name}h", "up" if up else "down")
