"""Where in the run's token shards this peer reads, and from where it gets them.

A peer of a run whose manifest lists token shards reads them through a ShardFeed (collab.data.feed). Its place
(start on the ring of shards, position = windows read) comes, in order, from its checkpoint, from the place it last
saved for this corpus and identity (a peer restarted without a checkpoint resumes too), or, for a new peer, from the
largest gap between the starts the others published (collab.data.order.start_in_largest_gap), so concurrent peers
read different text. A new peer publishes its start at once, under the run's claims key (its metrics record carries it
only from its first epoch on), then looks again: peers that joined at the same moment saw the same gaps and took the
same point, and now spread out (collab.data.order.spread_twins). A volunteer's feed fetches what it lacks from the
swarm (collab.run.shard_fetch).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from hivemind.utils.timed_storage import get_dht_time

from collab.data.cache import cache_dir, write_atomically
from collab.data.feed import ShardFeed
from collab.data.order import spread_twins, start_for_peer, start_in_largest_gap
from collab.records.untrusted import signed_values
from collab.run.shard_fetch import CLAIMS_SUFFIX, ShardFetcher
from collab.run.sharer import SharedRun
from collab.swarm.state import read_run_state

PLACE_KEY = "data"  # in a checkpoint's training state
CLAIM_LIFETIME = 300.0  # seconds: by then the peer's metrics record carries its start
# the second look waits twice as long as this peer's own claim took to store (a twin that chose at the same moment has
# stored its own by then), within these bounds (seconds)
SECOND_LOOK_WAIT = (0.2, 3.0)


@dataclass
class DataPlace:
    start: float
    position: int
    came_from: str  # "checkpoint", "saved", "largest gap", "own hash" or "spread from a twin"

    def as_dict(self) -> dict:
        return {"start": self.start, "position": self.position}

    @staticmethod
    def parse(value, came_from: str) -> Optional["DataPlace"]:
        """A place read back from a file or checkpoint, or None if it is not one."""
        if not isinstance(value, dict):
            return None
        start, position = value.get("start"), value.get("position")
        if not isinstance(start, float) or not 0.0 <= start < 1.0:
            return None
        if not isinstance(position, int) or isinstance(position, bool) or position < 0:
            return None
        return DataPlace(start, position, came_from)


class PeerData:
    """The feed of one peer of a run with token shards, and the bookkeeping around it."""

    def __init__(self, shared: SharedRun, stop: threading.Event):
        self.shared, self.shards = shared, shared.shards
        self.feed = ShardFeed(self.shards.folder, self.shards.infos, start=0.0, cache=self.shards.cache, interrupt=stop,
                              notify=lambda message: print(message, flush=True))
        self.fetcher: Optional[ShardFetcher] = None
        self.place: Optional[DataPlace] = None
        self.refusals: list[tuple[str, str]] = []  # (peer, why) not yet counted by the trainer's RejectionLog
        self._lock = threading.Lock()
        self._saved_file: Optional[Path] = None
        # windows trained on: the feed's own position, or a data worker's (collab.train.pipeline), whose feed reads ahead
        self.position: Callable[[], int] = lambda: self.feed.position

    def place_on(self, swarm, resume: Optional[dict]) -> DataPlace:
        """Set the feed's start and position (before the first window is read) and, on a volunteer, its fetcher."""
        run_id, peer_id = swarm.peer.run_id, swarm.peer_id
        # per corpus and identity: a peer restarted into a run re-made on the same data (a quick start) resumes too
        self._saved_file = cache_dir() / "runs" / f"place-{self.feed.seed:016x}-{peer_id}.json"
        place = DataPlace.parse((resume or {}).get(PLACE_KEY), "checkpoint") or self._read_saved()
        if place is None:
            own = start_for_peer(self.feed.seed, peer_id)
            bad: dict[str, str] = {}  # (read twice, counted once)
            taken = published_starts(swarm.dht, run_id, peer_id, bad.setdefault)
            place = DataPlace(start_in_largest_gap(list(taken.values()), own), 0,
                              "largest gap" if taken else "own hash")
            waited = claim_start(swarm, place.start)
            time.sleep(min(max(2 * waited, SECOND_LOOK_WAIT[0]), SECOND_LOOK_WAIT[1]))
            seen = {**published_starts(swarm.dht, run_id, peer_id, bad.setdefault), peer_id: place.start}
            for peer, why in bad.items():
                self._refused(peer, why)
            start = spread_twins(peer_id, seen)
            if start != place.start:
                place = DataPlace(start, 0, "spread from a twin")
                claim_start(swarm, start)
        else:  # a joiner sees it before this peer's first record does
            claim_start(swarm, place.start, wait=False)
        self.feed.start, self.feed.position, self.place = place.start, place.position, place
        if self.shards.cache is not None:
            self.fetcher = ShardFetcher(swarm.dht, run_id, peer_id, self.shards.data,
                                        known=swarm.peer.initial_peer_ids, url=self.shards.data.url,
                                        on_refused=self._refused)
            self.feed.fetch = self.fetcher
        return place

    def _refused(self, peer: str, why: str) -> None:
        with self._lock:
            self.refusals.append((peer, why))

    def settle(self, rejections) -> None:
        """Count the bad shards refused since the last call against their senders, like bad gradients
        (collab.records.rejections.RejectionLog), and save this peer's place."""
        with self._lock:
            taken, self.refusals = self.refusals, []
        for peer, why in taken:
            rejections.add(peer, why, "data")
        self.save()

    def record_fields(self) -> dict:
        """This peer's place, for its signed metrics record."""
        return {"data_start": self.feed.start, "data_position": self.position()}

    def _read_saved(self) -> Optional[DataPlace]:
        try:
            return DataPlace.parse(json.loads(self._saved_file.read_text()), "saved")
        except (OSError, ValueError):
            return None

    def save(self) -> None:
        """Remember this peer's place for this run (also without a checkpoint, a restart resumes from it)."""
        if self._saved_file is not None:
            write_atomically(self._saved_file, json.dumps(self.now()).encode())

    def now(self) -> dict:
        return {"start": self.feed.start, "position": self.position()}

    def report(self) -> dict:
        """For the peer's summary: its place, and what it fetched from whom."""
        fetcher = self.fetcher
        return {**self.now(), "came_from": self.place.came_from if self.place else None,
                "shards_fetched": self.feed.fetched, "waited_seconds": round(self.feed.waited, 1),
                "bytes_from": dict(fetcher.served) if fetcher else {},
                "shards_from": [list(pair) for pair in fetcher.got[-1000:]] if fetcher else [],
                "refused_from": dict(fetcher.refused) if fetcher else {}}

    def close(self) -> None:
        self.feed.close()
        if self.fetcher is not None:
            self.fetcher.close()
        self.save()


def claim_start(swarm, start: float, wait: bool = True) -> float:
    """Store this peer's start on the ring of shards under the run's claims key, signed; the seconds it took."""
    began = time.monotonic()
    future = swarm.dht.store(key=swarm.peer.run_id + CLAIMS_SUFFIX, subkey=swarm.public_key, value=start,
                             expiration_time=get_dht_time() + CLAIM_LIFETIME, return_future=True)
    if wait:
        try:
            future.result(timeout=SECOND_LOOK_WAIT[1])
        except Exception:  # not stored (yet): the metrics record will carry the start
            pass
    return time.monotonic() - began


BAD_CLAIM = "claimed a data start that is not a signed number in [0, 1)"


def published_starts(dht, run_id: str, but: str, refused: Callable[[str, str], None]) -> dict[str, float]:
    """Peer id -> start on the ring of shards, for every peer but `but`: from the online peers' metrics records and
    the run's claims (a claim wins: it is there first, and after a move it is the newer). A claim must be signed by
    the peer it names and be a number in [0, 1); `refused(peer or "unsigned", why)` is told of any other."""
    starts = {p.peer_id: p.data_start for p in read_run_state(dht, run_id).peers
              if p.online and p.data_start is not None}
    for signer, value in signed_values(dht.get(run_id + CLAIMS_SUFFIX, latest=True)):
        if signer is not None and isinstance(value, float) and 0.0 <= value < 1.0:
            starts[signer] = value
        else:
            refused(signer or "unsigned", BAD_CLAIM)
    starts.pop(but, None)
    return starts
