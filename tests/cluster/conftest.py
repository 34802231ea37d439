"""The simulated cluster of separate network hosts (``benchmarks/netcluster``) as a
fixture: ``netcluster(*workers, **kw)`` starts one (scheduler and each worker in its own
network namespace), and every cluster a test started is taken down when it ends, also
after a failure. Skips only where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ is a folder of the checkout, not an installed package
    sys.path.insert(0, str(ROOT))

#: A 1-thread worker whose link has a 2 ms round trip, and a 2-thread worker on 100 Mbit/s.
DEFAULT_WORKERS = ({"threads": 1, "rtt_ms": 2.0}, {"threads": 2, "rate": "100mbit"})


@pytest.fixture
def netcluster():
    from benchmarks.netcluster import NetCluster, unavailable

    why = unavailable()
    if why:
        pytest.skip(f"no simulated network cluster here: {why}")
    made = []

    def make(*workers, **kw):
        kw.setdefault("lifetime", 600)
        c = NetCluster(list(workers) or list(DEFAULT_WORKERS), **kw)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()
