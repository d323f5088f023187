"""One stream of reads of a hot DHT key per peer, shared by everything in the peer that reads it.

A peer reads the run's progress key (every peer's signed record) from several places: hivemind's tracker on its
schedule; collab's sync thread ("nobody left to join"), its donor waits and its averager processes (who is behind).
Each read walks the DHT and merges every replica of the key's N records, so with 8 linreg peers the progress key's
reads were 64% of a peer's DHT bytes, 45% of its reads not the tracker's. All of them go through the DHT's own
process; there a read of a shared key joins one already under way, or takes one made less than `share_for(N)`
seconds ago (the tracker's own least time between reads for that swarm: collab.modes.tracker), and only then
walks the DHT. So a peer's reads of the key stay about one per period whoever asks, and the bytes per peer stay
flat as the swarm grows past PEERS_PER_READ (issue 36). The metrics key (every peer's metrics record) is shared the
same way: read_run_state reads it, and a simulation's --wait-peers polled it four times a second from every peer
while the swarm started (at 24 peers on 2 cores, 65% of a peer's DHT bytes then).

A walk (hivemind's get, latest=True) asks every node of its beam and merges what each holds: the key's 5 replicas
each answer with all N records. The shared stream's reads ask the READ_REPLICAS nearest of them instead
(`NearestReads`), found by a walk that carries no values, and walk as hivemind does at least every FULL_READ_EVERY
seconds, or as soon as one of them does not answer or holds nothing.

Started for a peer's DHT (`start_sharing`, once), asked from any of its processes (`recent_or_new`). Another DHT
(the dashboard's, a test's plain hivemind.DHT) answers `recent_or_new` with a fresh read.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict
from functools import partial
from typing import Callable, Iterable, Optional

from hivemind.utils import get_dht_time

from collab.hivemind_hooks.dht_node import nearest_nodes, read_from_nodes, share_latest_reads

PEERS_PER_READ = 8  # up to this many peers, a key is read at most every MIN_REFRESH seconds
MIN_REFRESH = 0.5  # hivemind's min_refresh_period: its tracker's least time between two reads near an epoch's end
READ_EVERY_MOST = 2.5  # seconds: never longer (others' records are extrapolated for 5 s at most)
# a read asks this many of the key's nearest nodes: each holds every record stored in the last few seconds (a
# record is re-stored on the 5 nearest every few seconds), two so that one node alone cannot hide a peer's record
READ_REPLICAS = 2
FULL_READ_EVERY = 15.0  # seconds: a full walk at least this often; it finds the nearest nodes anew too


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
        self.tally: defaultdict[str, Counter] = defaultdict(Counter)  # key -> walked, served, joined

    async def read(self, key, get):
        """A fresh read (hivemind's tracker asks for one): one already under way is as fresh; else walk. `get`:
        hivemind's DHTNode.get."""
        if key not in self.keys:
            return await get(key, latest=True)
        if key in self.under_way:
            self.tally[key]["joined"] += 1
        else:
            self.tally[key]["walked"] += 1
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
                self.tally[key]["served"] += 1
                return found
        return await self.read(key, get)

    def counts(self, key: Optional[str] = None) -> dict:
        """`key`'s counts; None: summed over the shared keys."""
        return _counted(self.tally, key, ("walked", "served", "joined"))


class NearestReads:
    """In the DHT's process, the shared stream's reads of `keys` (hivemind's DHTNode.get's signature, latest=True):
    from the key's READ_REPLICAS nearest nodes where they were found less than FULL_READ_EVERY seconds ago, else a
    walk of hivemind's (`get`) beside a walk that finds them. Other keys: `get`. Counts reads of each kind, why a read fell back
    to a walk (one of the nearest did not answer, or they held nothing), the records the nearest gave, and the records they missed: a record the last walk found that had not expired yet
    and that they did not give (so a report shows whether the nearest hold what a walk finds)."""

    def __init__(self, keys: Iterable[str], node, get, clock: Callable[[], float] = time.monotonic,
                 read_from=read_from_nodes, find_nearest=nearest_nodes):
        self.keys = frozenset(keys)
        self.node, self.get, self.clock = node, get, clock
        self.read_from, self.find_nearest = read_from, find_nearest
        self.nearest: dict[str, tuple[float, dict]] = {}  # key -> (when found, its nearest nodes, nearest first)
        self.tally: defaultdict[str, Counter] = defaultdict(Counter)  # key -> the counts below
        self.last_walk: dict[str, object] = {}  # key -> what its last walk found

    async def __call__(self, key, latest: bool = True):
        if key not in self.keys:
            return await self.get(key, latest=True)
        known = self.nearest.get(key)
        if known is not None and self.clock() - known[0] < FULL_READ_EVERY:
            try:
                found, answered = await self.read_from(self.node, key, known[1])
            except Exception:  # noqa: BLE001 - a reply that broke the merge: walk instead, as below
                found, answered = None, 0
            if answered == len(known[1]) and found is not None:
                self.tally[key].update(from_nearest=1, records_from_nearest=records_in(found),
                                       records_missed=self._missed(key, found))
                return found
            # one of them left, or holds nothing yet: walk, and find them anew
            self.tally[key].update(fell_back=1, **{"unanswered" if answered < len(known[1]) else "held_nothing": 1})
        began = self.clock()
        found, nearest = await asyncio.gather(self.get(key, latest=True), self._find(key))
        self.tally[key]["full_walks"] += 1
        self.last_walk[key] = found
        if nearest:
            self.nearest[key] = (began, nearest)
        else:
            self.nearest.pop(key, None)
        return found

    async def _find(self, key) -> dict:
        try:
            return dict(await self.find_nearest(self.node, key, READ_REPLICAS))
        except Exception:  # noqa: BLE001 - a walk that failed leaves the next read a full walk
            return {}

    def _missed(self, key, found) -> int:
        walked = getattr(self.last_walk.get(key), "value", None)
        if not isinstance(walked, dict) or not isinstance(found.value, dict):
            return 0
        now = get_dht_time()
        return sum(subkey not in found.value and getattr(item, "expiration_time", 0) > now
                   for subkey, item in walked.items())

    def counts(self, key: Optional[str] = None) -> dict:
        """`key`'s counts; None: summed over the shared keys."""
        return _counted(self.tally, key, ("from_nearest", "full_walks", "fell_back", "unanswered", "held_nothing",
                                          "records_from_nearest", "records_missed"))


def _counted(tally: dict, key: Optional[str], names: tuple) -> dict:
    rows = [tally.get(key, Counter())] if key is not None else list(tally.values())
    return {name: sum(row[name] for row in rows) for name in names}


_sharing: Optional[SharedReads] = None  # in the DHT's process
_reads: Optional[NearestReads] = None  # there: the shared stream's reads


async def _start(_dht, node, keys: tuple) -> None:
    global _sharing, _reads
    if _sharing is None:
        _sharing = SharedReads(keys)
        _reads = NearestReads(keys, node, node.get)
        share_latest_reads(node, partial(_sharing.read, get=_reads))


async def _recent(_dht, node, key: str):
    if _sharing is None:
        return await node.get(key, latest=True)
    return await _sharing.recent(key, _reads)


def counts_here(key: Optional[str] = None) -> Optional[dict]:
    """In the DHT's process: its counts for `key` (walked, served, joined; the walks' kinds and records), or summed
    over its shared keys (None); None where it does not share."""
    return {**_sharing.counts(key), **_reads.counts(key)} if _sharing is not None else None


async def _counts(_dht, _node, key: Optional[str] = None) -> Optional[dict]:
    return counts_here(key)


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


def shared_counts(dht, key: Optional[str] = None) -> Optional[dict]:
    """The DHT process's counts for `key` (walked, served, joined...), or summed over its shared keys; None where it
    does not share."""
    return dht.run_coroutine(partial(_counts, key=key))
