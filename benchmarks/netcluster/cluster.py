"""A dask cluster whose scheduler and workers are separate network hosts on this machine.

:class:`NetCluster` makes the network (:mod:`.net`), starts ``dask scheduler`` in one
namespace and each ``dask worker`` (no nanny: a killed host stays dead) in its own, puts
a delaying proxy (:mod:`.proxy`) in front of every host whose link has a round trip, and
takes it all down in :meth:`NetCluster.close`, also after a failure. Only one simulated
cluster exists at a time on this machine: a lock file is held while it lives, and what a
crashed run left is removed when the next one starts.

Every process runs under ``timeout`` (``lifetime`` seconds), every wait is bounded.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import net

LOCK = "/run/lock/pbnc-netcluster.lock" if os.path.isdir("/run/lock") else "/tmp/pbnc.lock"
SCHEDULER_PORT = 8786
WORKER_PORT = 9000
#: A proxied host listens here on top of its real port.
PROXY_OFFSET = 100
PROXY = str(Path(__file__).with_name("proxy.py"))
#: Eigen's own thread pool off in workers, as the dask plugin's local clusters do.
XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"


@dataclass
class Host:
    """One simulated host: its name, address, link and the processes on it."""

    name: str
    ip: str
    threads: int = 0  # 0: the scheduler
    rtt_ms: float = 0.0
    rate: str | None = None
    xla_flags: str = ""  # more XLA flags for this host's processes
    back_ip: str | None = None  # the scheduler's leg on the workers' bridge, if any
    procs: list = field(default_factory=list)
    dead: bool = False

    @property
    def port(self) -> int:
        return SCHEDULER_PORT if self.threads == 0 else WORKER_PORT

    @property
    def address(self) -> str:
        """The address others reach it at (through its proxy when its link has a delay)."""
        port = self.port + (PROXY_OFFSET if self.rtt_ms > 0 else 0)
        return f"tcp://{self.ip}:{port}"

    @property
    def namespace(self) -> str:
        return f"{net.PREFIX}-{self.name}"


def _wait_port(ip: str, port: int, deadline: float, procs, log: Path) -> None:
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"netcluster: a process for {ip}:{port} exited "
                                   f"({p.returncode}); its log ends:\n{_tail(log)}")
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((ip, port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"netcluster: nothing listens at {ip}:{port}; log ends:\n{_tail(log)}")


def _tail(log: Path, n: int = 2000) -> str:
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


class NetCluster:
    """A scheduler and workers, each in its own network namespace.

    Parameters
    ----------
    reach : {"all", "scheduler"}
        What the client (this namespace) reaches: every host, or only the scheduler
        (the workers on the back bridge, behind the scheduler's host; see :mod:`.net`).
    workers : list of dict
        One per worker: ``threads`` (default 1), ``rtt_ms`` (round trip added to its link,
        default 0), ``rate`` (``tc`` rate such as ``"100mbit"``, default none),
        ``xla_flags`` (see :meth:`add_worker`).
    scheduler_rtt_ms, scheduler_rate
        The scheduler host's link.
    python : str
        The interpreter whose ``dask`` runs the hosts (default: this one).
    lifetime : float
        Seconds after which every process of the cluster exits, whatever happens.
    lock_wait : float
        Seconds to wait for another simulated cluster on this machine to finish.
    keep_logs : bool
        Keep the processes' logs (``self.logs``) after :meth:`close`.
    """

    def __init__(self, workers=({"threads": 1}, {"threads": 2}), *, reach: str = "all",
                 scheduler_rtt_ms=0.0, scheduler_rate=None, python: str | None = None,
                 lifetime: float = 1800.0, lock_wait: float = 600.0,
                 start_timeout: float = 90.0, keep_logs: bool = False):
        if reach not in ("all", "scheduler"):
            raise ValueError(f"netcluster: reach must be 'all' or 'scheduler', got {reach!r}")
        self.reach = reach
        why = net.missing()
        if why:  # before anything is made, so there is nothing to take down
            raise RuntimeError(f"netcluster: cannot start a simulated cluster here: {why}")
        self.python = python or sys.executable
        self.keep_logs = keep_logs
        self.lifetime = float(lifetime)
        self.start_timeout = float(start_timeout)
        self.logs = Path(tempfile.mkdtemp(prefix="pbnc-logs-"))
        self.hosts: dict[str, Host] = {}
        self._next = 0
        self._lock = None
        self._take_lock(lock_wait)
        try:
            net.clean()  # a crashed run's leftovers: we hold the lock, so nobody uses them
            net.make_bridge()
            self.scheduler = self._host("s", 0, scheduler_rtt_ms, scheduler_rate)
            if reach == "scheduler":
                net.make_back_bridge()
                self.scheduler.back_ip = net.host_ip(0, net.BACK_SUBNET)
                net.add_back_leg("s", self.scheduler.back_ip)
            self._start_scheduler()
            for spec in workers:
                self.add_worker(**spec, wait=False)
            self.wait_for_workers(len(workers))
        except BaseException:
            self.close()
            raise

    # -- life cycle ----------------------------------------------------------------

    def _take_lock(self, wait: float) -> None:
        f = open(LOCK, "w")  # noqa: SIM115 - held for the cluster's life
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    f.close()
                    raise TimeoutError(f"netcluster: another simulated cluster holds {LOCK} "
                                       f"(waited {wait:g} s); `python -m benchmarks.netcluster "
                                       "down` removes one left by a crashed run") from None
                time.sleep(0.5)
        self._lock = f

    def close(self) -> None:
        """Stop every process and remove every namespace and link; safe to call twice."""
        for host in list(self.hosts.values()):
            for p in host.procs:
                with contextlib.suppress(ProcessLookupError, OSError):
                    p.kill()
        for host in list(self.hosts.values()):
            for p in host.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5)
        self.hosts.clear()
        if self._lock is not None:
            try:
                net.clean()
            finally:
                self._lock.close()
                self._lock = None
        if not self.keep_logs:  # a failure to start quotes them in its error
            shutil.rmtree(self.logs, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- hosts ---------------------------------------------------------------------

    def _host(self, name, threads, rtt_ms, rate) -> Host:
        behind = threads and self.reach == "scheduler"  # a worker the client cannot reach
        subnet, bridge = ((net.BACK_SUBNET, net.BACK_BRIDGE) if behind
                          else (net.SUBNET, net.BRIDGE))
        host = Host(name, net.host_ip(self._next, subnet), threads, float(rtt_ms), rate)
        self._next += 1
        net.make_host(name, host.ip, bridge)
        if rate:
            net.set_rate(name, rate)
        self.hosts[name] = host
        return host

    def _spawn(self, host: Host, argv: list, tag: str) -> subprocess.Popen:
        flags = " ".join(x for x in (os.environ.get("XLA_FLAGS", ""), XLA_FLAGS, host.xla_flags)
                         if x)
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", XLA_FLAGS=flags)
        log = open(self.logs / f"{host.name}-{tag}.log", "ab")  # noqa: SIM115
        with log:
            p = subprocess.Popen(
                ["ip", "netns", "exec", host.namespace, "timeout", "-k", "5",
                 str(int(self.lifetime)), *argv],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                cwd=str(Path(__file__).parents[2]))
        host.procs.append(p)
        return p

    def _proxy(self, host: Host) -> None:
        if host.rtt_ms <= 0:
            return
        p = self._spawn(host, [self.python, PROXY, "--listen",
                               f"{host.ip}:{host.port + PROXY_OFFSET}",
                               "--target", f"{host.ip}:{host.port}", "--rtt-ms",
                               str(host.rtt_ms), "--max-seconds", str(self.lifetime)], "proxy")
        if host.ip.startswith(net.BACK_SUBNET + "."):
            return  # not reachable from here to wait on; the worker's joining is waited for
        _wait_port(host.ip, host.port + PROXY_OFFSET, time.monotonic() + self.start_timeout,
                   [p], self.logs / f"{host.name}-proxy.log")

    def _dask(self) -> str:
        return str(Path(self.python).with_name("dask"))

    def _start_scheduler(self) -> None:
        h = self.scheduler
        listen = "0.0.0.0" if h.back_ip else h.ip  # both legs
        p = self._spawn(h, [self._dask(), "scheduler", "--host", listen, "--port",
                            str(h.port), "--no-dashboard"], "dask")
        _wait_port(h.ip, h.port, time.monotonic() + self.start_timeout, [p],
                   self.logs / f"{h.name}-dask.log")
        self._proxy(h)

    @property
    def address(self) -> str:
        """The scheduler's address, as the client reaches it."""
        return self.scheduler.address

    @property
    def worker_side_address(self) -> str:
        """The scheduler's address, as the workers reach it (its back leg where the
        workers are behind it)."""
        h = self.scheduler
        return f"tcp://{h.back_ip}:{h.port}" if h.back_ip else h.address

    def add_worker(self, threads: int = 1, rtt_ms: float = 0.0, rate: str | None = None,
                   xla_flags: str = "", wait: bool = True) -> Host:
        """Start one more worker host; returns it (``host.address`` is the worker's).
        ``xla_flags`` makes it another kind of CPU as XLA sees it, e.g.
        ``"--xla_cpu_max_isa=AVX2"`` (an older instruction set than this machine's)."""
        index = sum(1 for h in self.hosts.values() if h.threads) + 1  # the dead count too
        host = self._host(f"w{index}", int(threads), rtt_ms, rate)
        host.xla_flags = xla_flags
        self._proxy(host)
        self._spawn(host, [self._dask(), "worker", self.worker_side_address,
                           "--nthreads", str(threads),
                           "--no-nanny", "--no-dashboard", "--name", host.name,
                           "--memory-limit", "0", "--death-timeout", "60",
                           "--listen-address", f"tcp://{host.ip}:{host.port}",
                           "--contact-address", host.address], "dask")
        if wait:
            self.wait_for_workers(len(self.workers()))
        return host

    def workers(self) -> list[Host]:
        """The worker hosts alive (not killed)."""
        return [h for h in self.hosts.values() if h.threads and not h.dead]

    def kill(self, name: str) -> None:
        """The host ``name`` dies: every process on it SIGKILLed at once."""
        host = self.hosts[name]
        host.dead = True
        net.kill_namespace_processes(host.namespace)
        for p in host.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)

    def set_rate(self, name: str, rate: str | None) -> None:
        net.set_rate(name, rate)
        self.hosts[name].rate = rate

    def cut(self, name: str, seconds: float) -> None:
        """Host ``name`` unreachable for ``seconds`` (its cable out), then back."""
        net.set_link_up(name, False)
        try:
            time.sleep(min(float(seconds), 60.0))
        finally:
            net.set_link_up(name, True)

    def wait_for_workers(self, n: int, timeout: float | None = None) -> None:
        """Until the scheduler lists ``n`` workers (bounded by ``timeout``)."""
        from distributed import Client

        timeout = self.start_timeout if timeout is None else timeout
        try:
            with Client(self.address, timeout=timeout, set_as_default=False) as c:
                c.wait_for_workers(n, timeout=timeout)
        except Exception as e:
            logs = "\n".join(f"--- {p.name}\n{_tail(p, 800)}" for p in self.logs.glob("*.log"))
            raise RuntimeError(f"netcluster: {n} workers did not join {self.address} within "
                               f"{timeout:g} s ({type(e).__name__}: {e}); logs:\n{logs}") from e

    def describe(self) -> list[dict]:
        return [{"host": h.name, "ip": h.ip, "address": h.address, "threads": h.threads,
                 "rtt_ms": h.rtt_ms, "rate": h.rate,
                 "alive": not h.dead and any(p.poll() is None for p in h.procs)}
                for h in self.hosts.values()]
