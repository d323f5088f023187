"""The run's token shards, served by the swarm: who holds which, and fetching one from them (or from a URL).

Every peer that serves files (not a client behind NAT) lists in the DHT the indices of the shards it holds, each a
verified copy (the organizer's folder, or a cache where only shards that matched the manifest's sha256 are kept),
under its own key: nobody can speak for another. A peer that needs a shard asks the run's URL prefix first when the
manifest names one, then the holders, those that hold the fewest shards first (in random order among equals): a
peer that holds them all, the organizer's, is asked last, so its uplink serves only what no volunteer holds yet. A
copy whose sha256 is not the manifest's is refused, counted against the peer that sent it, and that peer is not
asked for shards again for BAN_SECONDS (its record is untrusted input too: indices out of range are dropped). A
holder whose ask failed otherwise (no answer in time, a reset stream) is asked once more; a shard nobody sent
fails with each holder's reason.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from hivemind.utils.timed_storage import get_dht_time

from collab.data.shard_cache import ShardCache
from collab.data.shards import HEADER, ShardInfo
from collab.errors import UserError
from collab.records.identity import signer_peer_id
from collab.run.manifest import DataManifest
from collab.run.sharing import ask_for_file, close_loop, own_p2p

HOLDINGS_SUFFIX = "_shards"
HOLDINGS_LIFETIME = 300.0  # seconds; a serving peer republishes well before
CLAIMS_SUFFIX = "_data_starts"  # where each peer stores its start on the ring of shards (collab.train.data_feed)
BAN_SECONDS = 600.0
RETRY_PAUSE = 2.0  # seconds before the holders that failed (a reset stream, a busy daemon) are asked once more
SLOWEST_UPLINK = 512 * 1024  # bytes/s (4 Mbit/s) a peer's upload may take before it is given up on for a shard
REFUSED = "served a shard that does not match the manifest's sha256"


def shard_infos(data: DataManifest) -> list[ShardInfo]:
    return [ShardInfo(name=s.name, tokens=s.tokens, sha256=s.sha256) for s in data.shards]


def ask_timeout(tokens: int) -> float:
    """Seconds one peer gets to send a shard of `tokens` tokens: a 32 MiB shard of 16-bit ids from a 2 Mbit/s
    uplink still arrives; a peer that stalls is given up on (and the next one asked) within a few minutes."""
    return 30.0 + 4 * tokens / SLOWEST_UPLINK


def max_shard_bytes(tokens: int) -> int:
    """The most bytes a shard of `tokens` tokens can be (uint32 ids, a document per token): more is refused unread."""
    return HEADER.size + 4 * tokens + 8 + 8 * tokens


@dataclass
class RunShards:
    """Where this peer keeps the run's shards: `folder`, all of them (`cache` None: the organizer's folder or a
    verified copy), or a disk cache that fetching fills."""

    data: DataManifest
    folder: Path
    cache: Optional[ShardCache] = None

    @property
    def infos(self) -> list[ShardInfo]:
        return shard_infos(self.data)

    def held(self) -> list[int]:
        if self.cache is None:
            return list(range(len(self.data.shards)))
        names = set(self.cache.held())
        return [i for i, s in enumerate(self.data.shards) if s.name in names]

    def path_if_held(self, name: str) -> Optional[Path]:
        """The file of shard `name` if this peer holds a verified copy (what it may serve)."""
        if name not in {s.name for s in self.data.shards}:
            return None
        if self.cache is not None and not self.cache.holds(name):
            return None
        path = self.folder / name
        return path if path.is_file() else None


def publish_holdings(dht, run_id: str, subkey: bytes, indices: list[int]) -> None:
    dht.store(key=run_id + HOLDINGS_SUFFIX, subkey=subkey, value=sorted(indices),
              expiration_time=get_dht_time() + HOLDINGS_LIFETIME, return_future=True)


def read_holdings(dht, run_id: str, shard_count: int) -> dict[int, list[str]]:
    """Shard index -> the peers that say they hold it, those that hold the fewest shards first (a peer that holds
    them all, the organizer's or a mirror, is asked last: its uplink serves everyone else's misses). A record that
    is not a list of indices is ignored."""
    found = dht.get(run_id + HOLDINGS_SUFFIX, latest=True)
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    held: dict[str, set[int]] = {}
    for subkey, item in entries.items():
        peer, indices = signer_peer_id(subkey), getattr(item, "value", None)
        if peer is None or not isinstance(indices, list) or len(indices) > shard_count:
            continue
        held[peer] = {i for i in indices if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < shard_count}
    order = sorted(held, key=lambda peer: (len(held[peer]), random.random()))
    holders: dict[int, list[str]] = {}
    for peer in order:
        for index in held[peer]:
            holders.setdefault(index, []).append(peer)
    return holders


class ShardFetcher:
    """`fetch(name) -> bytes`: a verified copy of shard `name`. Called from one thread (the feed's prefetcher), which
    owns the event loop and the client of p2pd this makes on first use. `known`: peers to ask when none has
    listed the shard yet (those that hold the manifest, the initial peers). `on_refused(peer, reason)`: a bad
    copy's sender, for the peer's rejection counts."""

    def __init__(self, dht, run_id: str, own_peer_id: str, data: DataManifest, known: list[str] = (),
                 url: Optional[str] = None, on_refused: Callable[[str, str], None] = lambda peer, why: None):
        self.dht, self.run_id, self.own, self.data = dht, run_id, own_peer_id, data
        self.infos = {s.name: (i, s) for i, s in enumerate(data.shards)}
        self.known, self.url, self.on_refused = [p for p in known if p != own_peer_id], url, on_refused
        self.served: dict[str, int] = {}  # who sent how many verified bytes (the URL counts as "url")
        self.got: list[tuple[str, str]] = []  # (shard, who sent it), in order
        self.refused: dict[str, int] = {}
        self.failed: dict[str, str] = {}  # peer -> why its last ask failed (not a bad copy: no answer in time, ...)
        self._banned_until: dict[str, float] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._p2p = None
        self._lock = threading.Lock()

    def __call__(self, name: str) -> bytes:
        index, entry = self.infos[name]
        limit = max_shard_bytes(entry.tokens)
        if self.url is not None:
            data = self._from_url(name, limit)
            if data is not None and self._verified("url", data, entry.sha256):
                self.got.append((name, "url"))
                return data
        listed = read_holdings(self.dht, self.run_id, len(self.infos)).get(index, [])
        peers = [p for p in dict.fromkeys(listed) if p != self.own]  # partial holders first, in random order
        peers += [p for p in self.known if p not in peers]
        now = time.monotonic()
        peers = [p for p in peers if self._banned_until.get(p, 0.0) < now]
        if not peers:
            raise UserError(f"no peer of the run holds shard {name} yet")
        with self._lock:
            for attempt in range(2):
                if attempt:
                    time.sleep(RETRY_PAUSE)
                    now = time.monotonic()
                    peers = [p for p in peers if p in self.failed and self._banned_until.get(p, 0.0) < now]
                for peer in peers:
                    self.failed.pop(peer, None)
                    try:
                        data = self._ask(peer, name, limit, ask_timeout(entry.tokens))
                    except Exception as e:  # gone, behind NAT, too slow, a reset stream: the next one
                        self.failed[peer] = f"{type(e).__name__}: {e}"[:200]
                        continue
                    if data and self._verified(peer, data, entry.sha256):
                        self.got.append((name, peer))
                        return data
                    if not data:
                        self.failed[peer] = "it does not hold it"
        why = "; ".join(f"{peer[:12]}...: {self.failed[peer]}" for peer in peers if peer in self.failed)
        raise UserError(f"none of the peers asked sent a good copy of shard {name}" + (f" ({why})" if why else ""))

    def _verified(self, source: str, data: bytes, sha256: str) -> bool:
        if hashlib.sha256(data).hexdigest() == sha256:
            self.served[source] = self.served.get(source, 0) + len(data)
            return True
        self.refused[source] = self.refused.get(source, 0) + 1
        if source != "url":
            self._banned_until[source] = time.monotonic() + BAN_SECONDS
            self.on_refused(source, REFUSED)
        return False

    def _from_url(self, name: str, limit: int) -> Optional[bytes]:
        try:
            with urllib.request.urlopen(self.url + name, timeout=60) as response:  # between bytes, not in all
                data = response.read(limit + 1)
        except (OSError, ValueError):
            return None  # unreachable, 404, ...: the swarm has it too
        return data if len(data) <= limit else None

    def _ask(self, peer: str, name: str, limit: int, timeout: float) -> bytes:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._p2p = self._loop.run_until_complete(own_p2p(self.dht))
        return self._loop.run_until_complete(asyncio.wait_for(ask_for_file(self._p2p, peer, name, limit),
                                                              timeout=timeout))

    def close(self) -> None:
        # a fetch still under way (the feed's thread gave up waiting for it) holds the lock for up to ask_timeout:
        # leaving must not wait that long; its loop then goes with the process
        if not self._lock.acquire(timeout=5.0):
            return
        try:
            if self._loop is not None:
                close_loop(self._loop, self._p2p)
                self._loop = None
        finally:
            self._lock.release()
