"""A delaying TCP proxy: the latency of a link, where ``netem`` does not exist.

Every byte that arrives from either side is held for ``rtt / 2`` before it is written
to the other side, in order; reading goes on meanwhile, so throughput is not cut (as
``netem delay`` would do), only delayed. A connection through it sees its round trip
grow by ``rtt``. Runs as its own process inside a host's network namespace:

    python benchmarks/netcluster/proxy.py --listen 10.77.0.11:9100 \
        --target 10.77.0.11:9000 --rtt-ms 5 --max-seconds 900

Bounded in everything: connections (``--max-connections``), bytes held per direction
(reading pauses beyond ``--max-held``), and lifetime (``--max-seconds``, then it exits).
Standard library only, so any Python runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import signal
import time


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def _pump(reader, writer, delay: float, max_held: int) -> None:
    """Copy ``reader`` to ``writer``, each piece written ``delay`` seconds after it came."""
    held: collections.deque = collections.deque()
    size = 0
    arrived = asyncio.Event()
    room = asyncio.Event()
    room.set()
    done = False

    async def read() -> None:
        nonlocal size, done
        try:
            while True:
                await room.wait()
                data = await reader.read(1 << 16)
                if not data:
                    break
                held.append((time.monotonic() + delay, data))
                size += len(data)
                if size >= max_held:
                    room.clear()
                arrived.set()
        except (ConnectionError, OSError):
            pass
        finally:
            done = True
            arrived.set()

    task = asyncio.ensure_future(read())
    try:
        while True:
            if not held:
                if done:
                    break
                arrived.clear()
                await arrived.wait()
                continue
            due, data = held[0]
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            held.popleft()
            size -= len(data)
            if size < max_held:
                room.set()
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        task.cancel()
        try:
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError, RuntimeError):
            pass


async def serve(listen: str, target: str, rtt_ms: float, max_seconds: float,
                max_connections: int, max_held: int) -> None:
    delay = rtt_ms / 2e3
    slots = asyncio.Semaphore(max_connections)
    thost, tport = _hostport(target)

    async def handle(client_reader, client_writer) -> None:
        if slots.locked():  # full: refuse rather than queue without bound
            client_writer.close()
            return
        async with slots:
            try:
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection(thost, tport), timeout=10)
            except (TimeoutError, OSError):
                client_writer.close()
                return
            try:
                await asyncio.gather(_pump(client_reader, up_writer, delay, max_held),
                                     _pump(up_reader, client_writer, delay, max_held))
            finally:
                for w in (up_writer, client_writer):
                    w.close()

    host, port = _hostport(listen)
    server = await asyncio.start_server(handle, host, port, reuse_address=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        try:
            await asyncio.wait_for(stop.wait(), timeout=max_seconds)
        except TimeoutError:
            pass


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", required=True, help="host:port to listen on")
    ap.add_argument("--target", required=True, help="host:port to forward to")
    ap.add_argument("--rtt-ms", type=float, default=0.0, help="round trip added, ms")
    ap.add_argument("--max-seconds", type=float, default=1800.0, help="exit after this long")
    ap.add_argument("--max-connections", type=int, default=256)
    ap.add_argument("--max-held", type=int, default=64 << 20,
                    help="bytes held per direction before reading pauses")
    a = ap.parse_args(argv)
    asyncio.run(serve(a.listen, a.target, a.rtt_ms, a.max_seconds, a.max_connections,
                      a.max_held))


if __name__ == "__main__":
    main()
