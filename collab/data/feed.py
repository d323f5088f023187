"""The windows of the run's token shards that this peer trains on, read in its order (collab.data.order), with the
shards it needs next fetched ahead of use.

A feed reads from a store of shards: the organizer's own folder, a volunteer's verified copy, or the disk cache
(collab.data.shard_cache) that a fetcher fills. When a shard it is about to read is not there, a background thread
fetches it (`fetch(name) -> bytes`, from the swarm or a URL: collab.run.shard_fetch) together with the next few,
so training waits for the network only when the uplinks cannot keep up. Only the shard being read is mapped, so
a peer's memory does not grow with the corpus. `position` counts the windows this peer has read: with the start
it is everything needed to reproduce them, or to resume.
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Protocol

import numpy as np
import torch

from collab.data.order import WindowOrder
from collab.data.shard_cache import ShardCache, ShardRefused
from collab.data.shards import Shard, ShardInfo, read_shard_list
from collab.errors import UserError

AHEAD = 3  # shards fetched ahead of the one being read
FETCH_PATIENCE = 900.0  # seconds a peer waits for a shard nobody can send before it gives up, in one line


class FeedStopped(Exception):
    """The peer was asked to leave while it waited for a shard: not a failure, nothing was trained on it."""


def corpus_seed(infos: list[ShardInfo]) -> int:
    """The seed of the run's shard order: the same for every peer, as it is the digest of the manifest's shards."""
    digest = hashlib.sha256("".join(f"{i.name}:{i.tokens}:{i.sha256};" for i in infos).encode()).digest()
    return int.from_bytes(digest[:8], "little")


class ShardStore(Protocol):
    def holds(self, name: str) -> bool: ...

    def used(self, name: str) -> None: ...


class FolderShards:
    """Shards that are all here already (the organizer's folder, or a copy a volunteer brought and we verified)."""

    def __init__(self, folder: Path, infos: list[ShardInfo]):
        self.folder, self.infos = Path(folder), {i.name: i for i in infos}

    def holds(self, name: str) -> bool:
        try:
            return len(Shard(self.folder / name)) == self.infos[name].tokens
        except (OSError, ValueError):
            return False

    def used(self, name: str) -> None:
        pass


class ShardFeed:
    """Windows of `length` tokens from the shards `infos` in `folder`, for the peer that starts at `start` on the
    ring of shards and has read `position` windows so far. `fetch`: how a missing shard is got (None: all are
    in `folder`); `cache` must then be the ShardCache of `folder`."""

    def __init__(self, folder: Path, infos: list[ShardInfo], start: float, position: int = 0,
                 fetch: Optional[Callable[[str], bytes]] = None, cache: Optional[ShardCache] = None,
                 ahead: int = AHEAD, patience: float = FETCH_PATIENCE,
                 interrupt: Optional[threading.Event] = None, notify: Callable[[str], None] = lambda message: None):
        if fetch is not None and cache is None:
            raise ValueError("a feed that fetches shards needs the cache to keep them in")
        self.folder, self.infos, self.start, self.position = Path(folder), infos, start, position
        self.seed = corpus_seed(infos)
        self.fetch, self.cache, self.ahead, self.patience = fetch, cache, ahead, patience
        self.interrupt, self.notify = interrupt, notify  # the peer's stop event; how a long wait is told
        self.store: ShardStore = cache if cache is not None else FolderShards(folder, infos)
        self.fetched, self.fetch_failures = 0, 0
        self.waited = 0.0  # seconds training waited for a shard
        self.order: Optional[WindowOrder] = None
        self._wanted: list[str] = []
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.error: Optional[str] = None  # the last fetch's failure, for the wait's message

    @classmethod
    def from_folder(cls, folder: Path, start: float, position: int = 0) -> "ShardFeed":
        return cls(folder, read_shard_list(folder), start, position)

    def windows(self, length: int) -> Iterator[torch.Tensor]:
        """Every window from `position` on, as int64 tensors; `position` advances as they are taken."""
        try:
            self.order = WindowOrder([i.tokens for i in self.infos], length, self.seed, self.start)
        except ValueError:
            raise UserError(f"the run's token shards hold no sequence of {length} tokens; prepare more text with "
                            "collab init --dataset") from None
        current, shard = None, None
        for window in self.order.iterate(self.position):
            if window.shard != current:
                current, shard = window.shard, self._open(window.shard, window.position)
            tokens = torch.from_numpy(shard.tokens[window.start:window.start + length].astype(np.int64))
            self.position = window.position + 1  # handed out: a resume starts after it
            yield tokens

    def _open(self, index: int, position: int) -> Shard:
        """The shard, once it is here and whole; meanwhile the next ones are asked for."""
        name = self.infos[index].name
        self._want(position)
        began, told = time.monotonic(), False
        while not self.store.holds(name):
            if self.fetch is None:
                raise UserError(f"shard {name} is missing or damaged in {self.folder}; prepare the data again with "
                                "collab init")
            if self.interrupt is not None and self.interrupt.is_set():
                raise FeedStopped(f"stopped while waiting for shard {name}")
            if not told and time.monotonic() - began > 30.0:
                told = True
                self.notify(f"Waiting for shard {name} of the run's data: no peer sent it yet"
                            f"{f' ({self.error})' if self.error else ''}")
            if self._stop.is_set() or time.monotonic() - began > self.patience:
                why = f" (last: {self.error})" if self.error else ""
                raise UserError(f"no peer of the run sent shard {name} within {self.patience:.0f} s{why}; check "
                                "that the organizer's peer or another that holds the data is online")
            self._changed.wait(0.2)
        self.waited += time.monotonic() - began
        self.store.used(name)
        return Shard(self.folder / name)

    def _want(self, position: int) -> None:
        if self.fetch is None:
            return
        self._wanted = [self.infos[i].name for i in self.order.shards_ahead(position, self.ahead + 1)]
        if self._thread is None:
            self._thread = threading.Thread(target=self._prefetch, name="shard-prefetch", daemon=True)
            self._thread.start()
        self._changed.set()

    def _prefetch(self) -> None:
        while not self._stop.is_set():
            self._changed.clear()
            wanted = list(self._wanted)
            for name in wanted:
                if self._stop.is_set():
                    return
                try:
                    # (inside the try: this thread ending on an error would leave training waiting FETCH_PATIENCE)
                    if self.store.holds(name):
                        continue
                    self.cache.put(name, self.fetch(name), keep=wanted)
                    self.fetched += 1
                    self.error = None
                except Exception as e:  # noqa: BLE001 - any failure of one fetch (a peer gone, the DHT busy): retry
                    self.fetch_failures += 1
                    self.error = str(e) if isinstance(e, (UserError, ShardRefused)) else f"{type(e).__name__}: {e}"
                    break  # try again in a moment: the holders may change
                self._changed.set()
            if self.error is not None:
                self._stop.wait(1.0)  # nobody could send it just now: ask again soon (holders come and go)
            else:
                self._changed.wait(5.0)

    def close(self) -> None:
        self._stop.set()
        self._changed.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
