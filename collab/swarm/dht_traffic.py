"""What a peer's DHT node sends the swarm: requests (find, store, ping) and their bytes, counted in the DHT's own
process (collab.hivemind_hooks.patches.count_dht_requests) and read from there with the DHT's run_coroutine.

As a swarm grows, each peer's DHT traffic is one of the costs that must not grow with it (benchmarks/scale.py reads
it from each peer's summary, per minute)."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Optional

from collab.hivemind_hooks.patches import count_dht_requests

READ_TIMEOUT = 5.0


class DHTRequests:
    """Counts per RPC: requests sent, failed (no reply), request and reply bytes; since the counting started."""

    def __init__(self):
        self.started = time.monotonic()
        self.by_rpc: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])

    def count(self, rpc: str, sent: int, received: int) -> None:
        row = self.by_rpc[rpc.removeprefix("rpc_")]
        row[0] += 1
        row[1] += received == 0
        row[2] += sent
        row[3] += received

    def report(self) -> dict:
        rows = {rpc: dict(requests=r[0], failed=r[1], bytes_sent=r[2], bytes_received=r[3])
                for rpc, r in sorted(self.by_rpc.items())}
        return {"seconds": round(time.monotonic() - self.started, 1),
                "requests": sum(r["requests"] for r in rows.values()),
                "bytes_sent": sum(r["bytes_sent"] for r in rows.values()),
                "bytes_received": sum(r["bytes_received"] for r in rows.values()),
                "by_rpc": rows}


_counting: Optional[DHTRequests] = None  # in the DHT's process


async def _start(_dht, node) -> None:
    global _counting
    if _counting is None:
        _counting = DHTRequests()
        count_dht_requests(node.protocol, _counting.count)


async def _report(_dht, _node) -> Optional[dict]:
    return _counting.report() if _counting is not None else None


def start_counting(dht) -> None:
    """From any process holding the DHT: count its node's requests from now on."""
    dht.run_coroutine(_start)


def dht_requests(dht, timeout: float = READ_TIMEOUT) -> Optional[dict]:
    """The counts so far (None if counting never started, or the DHT did not answer in time)."""
    try:
        return dht.run_coroutine(_report, return_future=True).result(timeout=timeout)
    except Exception:  # a DHT shutting down, or too busy to answer: no figures this time
        return None
