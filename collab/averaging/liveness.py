"""Whether a peer whose progress record went quiet is still there: asked by a DHT ping.

A peer that crashes (kill -9, a pulled plug) says no goodbye: its signed progress record stays in the DHT until it
expires (metadata_expiration, 60 s), and a peer leaving at --max-epochs, seeing that record behind it, stayed on
as its state donor for all of that minute (52 s of a 69-s test here). A live peer's record is recent while it
computes (stored every half second mid-epoch), but not while it waits in a round or downloads a state (hivemind
re-stores it every 30 s): a quiet record alone says nothing. A peer whose record is quiet *and* whose DHT node
answers no ping, twice, is gone. A client-mode peer cannot be pinged (nobody can dial it): its record is trusted
until it expires, as before.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterable, Optional

from hivemind.p2p import PeerID

QUIET_SECONDS = 3.0  # a record older than this, of a peer that should be computing, is worth a ping
PING_TIMEOUT = 3.0  # hivemind's own wait for a DHT reply (DHTNode wait_timeout)
PING_EVERY = 2.0  # two pings that found nobody, this far apart, are a peer gone (not one lost packet)
MISSES_FOR_GONE = 2


async def _answers(peers: tuple, timeout: float, _dht, node) -> list[bool]:
    """In the DHT's process: whether each peer's DHT node answered a ping within `timeout` s."""

    async def one(peer: str) -> bool:
        try:
            found = await asyncio.wait_for(
                node.protocol.call_ping(PeerID.from_base58(peer), validate=False, strict=False), timeout)
        except Exception:
            return False
        return found is not None

    return list(await asyncio.gather(*(one(peer) for peer in peers)))


def ping(dht, peers: list[str], timeout: float = PING_TIMEOUT) -> dict[str, bool]:
    """Each peer id -> whether its DHT node answered; all True when the DHT itself does not answer in time (then
    nothing is known, and nobody is taken as gone)."""
    if not peers:
        return {}
    try:
        answers = dht.run_coroutine(partial(_answers, tuple(peers), timeout), return_future=True
                                    ).result(timeout=timeout + 2.0)
    except Exception:
        return {peer: True for peer in peers}
    return dict(zip(peers, answers))


@dataclass(frozen=True)
class Quiet:
    """A peer's progress record as liveness reads it."""

    peer: str
    age: float  # seconds since the peer stored it
    client_mode: bool


@dataclass
class GoneWatch:
    """Peers taken as gone: a quiet record and MISSES_FOR_GONE pings in a row that found nobody. Once gone, a peer
    stays gone for this watch (a crashed peer that restarts stores a new record, which a new watch reads)."""

    ask: Callable[[list[str]], dict[str, bool]]  # ping(dht, ...) bound to a DHT
    gone: set = field(default_factory=set)
    _misses: dict = field(default_factory=dict)
    _asked_at: dict = field(default_factory=dict)

    def update(self, records: Iterable[Quiet], now: Optional[float] = None) -> set[str]:
        """Ping the quiet, dialable peers among `records` not pinged in the last PING_EVERY s; the peers gone."""
        now, records = time.monotonic() if now is None else now, list(records)
        due = [r.peer for r in records if r.peer not in self.gone and not r.client_mode and r.age > QUIET_SECONDS
               and now - self._asked_at.get(r.peer, float("-inf")) >= PING_EVERY]
        for record in records:
            if record.age <= QUIET_SECONDS:
                self._misses.pop(record.peer, None)  # it stored a record since: it is there
        if due:
            for peer, answered in self.ask(due).items():
                self._asked_at[peer] = now
                self._misses[peer] = 0 if answered else self._misses.get(peer, 0) + 1
                if self._misses[peer] >= MISSES_FOR_GONE:
                    self.gone.add(peer)
        return set(self.gone)
