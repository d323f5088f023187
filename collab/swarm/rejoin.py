"""Healing a split swarm: ask again for the peers this DHT node lost.

hivemind's DHT is Kademlia: a peer that does not answer a request is deleted from the routing table
(DHTProtocol.update_routing_table), and nothing asks for it again. After a network split (a router
reboot, a 60 s outage between two halves of the swarm) each side has deleted the other, so the run stays
two runs for good: two lineages, each with its own epochs, that never average again. Here each peer
remembers the peers its routing table ever held (and its initial peers), and pings those missing from it
now and then; one answered ping puts each side back in the other's table, and the DHT finds the rest.

p2pd dials a peer id by the addresses in its peerstore: initial peers are kept there for good, others for
a while after their connection closed, which is what REMEMBER_SECONDS follows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from typing import Optional

from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

logger = logging.getLogger(__name__)
REJOIN_EVERY = 20.0  # seconds between two passes; a pass pings only the peers missing from the routing table
REMEMBER_SECONDS = 600.0  # forget a peer not seen for this long (its address leaves p2pd's peerstore too)
MAX_PINGS = 32  # per pass: a swarm of thousands does not turn this into a ping storm


async def ping_lost_peers(initial_peers: tuple, _dht, node) -> int:
    """In the DHT process: ping remembered peers that are not in the routing table; how many answered."""
    try:
        return await _ping_lost_peers(initial_peers, node)
    except Exception as e:  # a pass that fails (the node shutting down) must not flood the log: the next one retries
        logger.debug(f"could not ping lost peers: {e!r}")
        return 0


async def _ping_lost_peers(initial_peers: tuple, node) -> int:
    table, now = node.protocol.routing_table, time.monotonic()
    seen: dict = node.__dict__.setdefault("_collab_seen", {})  # peer id -> when last in the routing table
    if not seen:
        for maddr in initial_peers:
            try:
                seen[PeerID.from_base58(Multiaddr(maddr)["p2p"])] = float("inf")  # initial peers: always
            except Exception:
                continue
    for peer_id in list(table.peer_id_to_uid):
        seen[peer_id] = max(seen.get(peer_id, now), now)
    for peer_id, last in list(seen.items()):
        if now - last > REMEMBER_SECONDS:
            del seen[peer_id]
    lost = [p for p, last in sorted(seen.items(), key=lambda item: -item[1]) if p not in table and p != node.peer_id]
    if not lost:
        return 0
    answers = await asyncio.gather(*(node.protocol.call_ping(p, validate=False, strict=False)
                                     for p in lost[:MAX_PINGS]), return_exceptions=True)
    return sum(1 for answer in answers if answer is not None and not isinstance(answer, BaseException))


class Rejoiner:
    """Called from the trainer's loop; each pass runs in the DHT process without blocking the caller."""

    def __init__(self, dht, initial_peers: list[str]):
        self.dht, self.initial_peers = dht, tuple(initial_peers)
        self.found_back = 0  # peers that answered after they had been lost
        self._last = float("-inf")
        self._pending: Optional[object] = None  # the pass in flight: an MPFuture

    def maybe_run(self) -> None:
        if self._pending is not None and self._pending.done():
            try:
                self.found_back += int(self._pending.result())
            except Exception:
                pass  # a pass that failed (the DHT is shutting down) is just skipped
            self._pending = None
        if self._pending is None and time.monotonic() - self._last > REJOIN_EVERY:
            self._last = time.monotonic()
            self._pending = self.dht.run_coroutine(partial(ping_lost_peers, self.initial_peers), return_future=True)
