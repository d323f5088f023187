"""One stream of reads of a hot DHT key per peer, shared by everything in the peer that reads it.

A peer reads the run's progress key (every peer's signed record) from several places: hivemind's tracker on its
schedule; collab's sync thread ("nobody left to join"), its donor waits and its averager processes (who is behind).
Each read walks the DHT and merges every replica of the key's N records, so with 8 linreg peers the progress key's
reads were 64% of a peer's DHT bytes, 45% of its reads not the tracker's. All of them go through the DHT's own
process; there a read of a shared key joins one already under way, or takes one made less than `share_for(N)`
seconds ago (the tracker's own least time between reads for that swarm: collab.modes.tracker), and only then
walks the DHT. So a peer's reads of the key stay about one per period whoever asks, and the bytes per peer stay
flat as the swarm grows past PEERS_PER_READ (issue 36).

Started for a peer's DHT (`start_sharing`, once), asked from any of its processes (`recent_or_new`). Another DHT
(the dashboard's, a test's plain hivemind.DHT) answers `recent_or_new` with a fresh read.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Callable, Iterable, Optional

from collab.hivemind_hooks.patches import share_latest_reads

PEERS_PER_READ = 8  # up to this many peers, a key is read at most every MIN_REFRESH seconds
MIN_REFRESH = 0.5  # hivemind's min_refresh_period: its tracker's least time between two reads near an epoch's end
READ_EVERY_MOST = 2.5  # seconds: never longer (others' records are extrapolated for 5 s at most)


def share_for(peers: int, min_refresh: float = MIN_REFRESH) -> float:
    """The least seconds between two reads of the progress key in a swarm of `peers`: N records per period stays
    flat past PEERS_PER_READ peers."""
    return min(max(READ_EVERY_MOST, min_refresh), min_refresh * max(1.0, peers / PEERS_PER_READ))


def records_in(found) -> int:
    """How many subkeys (peers' records) a read of a dictionary key found."""
    value = getattr(found, "value", None)
    return len(value) if isinstance(value, dict) else 0


class SharedReads:
    """In the DHT's process: per shared key, the read under way and the last one made (when it began, what it found).
    Counts what the walks were spared: `served` answered from the last read, `joined` from one under way."""

    def __init__(self, keys: Iterable[str], clock: Callable[[], float] = time.monotonic):
        self.keys = frozenset(keys)
        self.clock = clock
        self.under_way: dict[str, asyncio.Future] = {}
        self.last: dict[str, tuple[float, object]] = {}
        self.walked = self.served = self.joined = 0

    async def read(self, key, get):
        """A fresh read (hivemind's tracker asks for one): one already under way is as fresh; else walk. `get`:
        hivemind's DHTNode.get."""
        if key not in self.keys:
            return await get(key, latest=True)
        if key in self.under_way:
            self.joined += 1
        else:
            self.walked += 1
            walk = asyncio.ensure_future(get(key, latest=True))
            self.under_way[key] = walk
            walk.add_done_callback(partial(self._walked, key, self.clock()))  # kept even if its caller gave up
        return await asyncio.shield(self.under_way[key])

    def _walked(self, key, began: float, walk: asyncio.Future) -> None:
        if self.under_way.get(key) is walk:
            del self.under_way[key]
        if walk.cancelled() or walk.exception() is not None:
            return
        if self.last.get(key, (float("-inf"),))[0] <= began:  # a slow walk does not replace a newer one's finds
            self.last[key] = (began, walk.result())

    async def recent(self, key, get):
        """A read of `key` at most share_for(N) seconds old (N: the records the last read found), else a fresh one."""
        if key in self.keys and key not in self.under_way and key in self.last:
            began, found = self.last[key]
            if self.clock() - began < share_for(records_in(found)):
                self.served += 1
                return found
        return await self.read(key, get)

    def counts(self) -> dict:
        return dict(walked=self.walked, served=self.served, joined=self.joined)


_sharing: Optional[SharedReads] = None  # in the DHT's process
_walk: Optional[Callable] = None  # there: hivemind's DHTNode.get, unshared


async def _start(_dht, node, keys: tuple) -> None:
    global _sharing, _walk
    if _sharing is None:
        _sharing, _walk = SharedReads(keys), node.get
        share_latest_reads(node, _sharing.read)


async def _recent(_dht, node, key: str):
    if _sharing is None:
        return await node.get(key, latest=True)
    return await _sharing.recent(key, _walk)


def counts_here() -> Optional[dict]:
    """In the DHT's process: its counts (walked, served, joined); None where it does not share."""
    return _sharing.counts() if _sharing is not None else None


async def _counts(_dht, _node) -> Optional[dict]:
    return counts_here()


def start_sharing(dht, keys: Iterable[str]) -> None:
    """From the process that made the DHT, before it forks any other (its averagers): latest reads of `keys` are
    shared from now on (once per DHT)."""
    dht.run_coroutine(partial(_start, keys=tuple(keys)))
    dht.reads_shared = True  # copied into the processes forked later, which then ask its process too


def recent_or_new(dht, key: str):
    """The latest values of `key` as dht.get(key, latest=True) returns them, from a read at most share_for(N)
    seconds old where this peer's DHT shares its reads of the key; else a fresh read."""
    if not getattr(dht, "reads_shared", False):
        return dht.get(key, latest=True)
    return dht.run_coroutine(partial(_recent, key=key))


def shared_counts(dht) -> Optional[dict]:
    """The DHT process's counts (walked, served, joined); None where it does not share."""
    return dht.run_coroutine(_counts)
