"""A simulated cluster of separate network hosts on this machine (issue 40).

The dask scheduler and each dask worker run in their own Linux network namespace,
joined by veth pairs to a bridge at ``10.77.0.1`` (the client's host), so all their
traffic crosses network interfaces; links get a bandwidth cap (``tc tbf``) and a round
trip (a delaying TCP proxy, :mod:`.proxy`, since this kernel has no ``netem``).

    python -m benchmarks.netcluster up --workers 1,2 --rtt-ms 1 --hold 600
    python -m benchmarks.netcluster status
    python -m benchmarks.netcluster down

From Python (tests and benchmarks)::

    with NetCluster([{"threads": 1}, {"threads": 2, "rtt_ms": 5}]) as c:
        ex = pb.DaskExecutor(address=c.address)

Needs root and iproute2 (:func:`unavailable` says why not). A benchmark helper, not part
of the package: imports the standard library, and distributed to wait for workers.
"""

from .cluster import NetCluster
from .net import clean, namespaces, unavailable

__all__ = ["NetCluster", "clean", "namespaces", "unavailable"]
