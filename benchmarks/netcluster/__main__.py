"""``python -m benchmarks.netcluster up|down|status``: the simulated cluster by hand.

``up`` starts it, prints the scheduler's address and holds it until Ctrl-C or
``--hold`` seconds, then takes it down; ``down`` removes whatever a run left behind
(namespaces, links, their processes); ``status`` lists what exists now.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

from . import net
from .cluster import NetCluster


def _workers(text: str, rtt_ms: float, rate: str | None) -> list[dict]:
    return [{"threads": int(t), "rtt_ms": rtt_ms, "rate": rate} for t in text.split(",") if t]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.netcluster",
                                 description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start the cluster and hold it")
    up.add_argument("--workers", default="1,2", help="threads per worker, comma separated")
    up.add_argument("--rtt-ms", type=float, default=0.0, help="round trip of every link")
    up.add_argument("--rate", default=None, help="bandwidth of every link, e.g. 100mbit")
    up.add_argument("--hold", type=float, default=600.0, help="seconds to keep it up")
    sub.add_parser("down", help="remove everything a run left")
    sub.add_parser("status", help="what exists now")
    a = ap.parse_args(argv)
    if a.cmd in ("down", "status"):
        why = net.unavailable() if a.cmd == "down" else None
        if why:
            print(f"netcluster: {why}", file=sys.stderr)
            return 2
        if a.cmd == "down":
            print(json.dumps({"removed": net.clean()}))
        else:
            print(json.dumps({ns: {"pids": net.ns_pids(ns)} for ns in net.namespaces()}))
        return 0
    why = net.unavailable()
    if why:
        print(f"netcluster: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # SIGTERM tears down too
    hold = min(a.hold, 3600.0)
    with NetCluster(_workers(a.workers, a.rtt_ms, a.rate), scheduler_rtt_ms=a.rtt_ms,
                    scheduler_rate=a.rate, lifetime=hold + 60, keep_logs=True) as c:
        print(json.dumps({"scheduler": c.address, "hosts": c.describe(),
                          "logs": str(c.logs)}), flush=True)
        try:
            time.sleep(hold)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
