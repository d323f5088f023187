"""What a peer of a run does for the others while it trains: keeps its copy of the signed manifest in the DHT,
serves the run's files (collab.run.sharing) and the token shards it holds (collab.run.shard_fetch), and, in a private run, watches who may still take part
(collab.run.watch)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from collab.run.shard_fetch import HOLDINGS_LIFETIME, RunShards, publish_holdings
from collab.run.sharing import MANIFEST_EXPIRATION, TOKENIZER_NAME, RunFileServer, publish_manifest
from collab.run.watch import AccessWatch, PrivateRun


@dataclass
class SharedRun:
    """What every peer of a run holds and passes on: the signed manifest and the run's files."""

    signed: bytes
    fingerprint: str
    tokenizer_file: Optional[Path]
    private: Optional[PrivateRun] = None  # a private run's membership; None: an open run
    organizer_key: object = None  # the run's private key, on the organizer's peer only (it signs batch plans)
    shards: Optional[RunShards] = None  # the run's token shards, where this peer keeps them; None: the run lists none


class RunSharer:
    """Keeps this peer's copy of the manifest in the DHT and serves the run's files while the peer runs."""

    def __init__(self, swarm, shared: SharedRun, on_lost: Optional[Callable[[str], None]] = None):
        self.swarm, self.shared = swarm, shared
        self.on_lost = on_lost if on_lost is not None else (lambda why: None)
        self.server: Optional[RunFileServer] = None
        self.watch: Optional[AccessWatch] = None
        self._published = float("-inf")  # never: time.monotonic() counts from boot, and a fresh VM is at < 200
        self._holdings: list[int] = []
        self._holdings_published = float("-inf")

    def start(self) -> "RunSharer":
        private = self.shared.private
        if private is not None:  # members known and revocations applied before this peer averages with anyone
            self.watch = AccessWatch(self.swarm, private, self.on_lost).start()
        files = {TOKENIZER_NAME: self.shared.tokenizer_file} if self.shared.tokenizer_file is not None else {}
        shards = self.shared.shards
        if (files or private is not None or shards) and not self.swarm.peer.client_mode:  # nobody can dial a client
            access = private.access if private is not None else None
            lookup = shards.path_if_held if shards is not None else None
            self.server = RunFileServer(self.swarm.dht, files, access, shards=lookup).start()
        self.refresh()
        return self

    def refresh(self) -> None:
        """Republish this peer's copy of the manifest before it expires, and the shards it serves when they changed."""
        now, run_id = time.monotonic(), self.swarm.peer.run_id
        if now - self._published > MANIFEST_EXPIRATION / 3:
            publish_manifest(self.swarm.dht, run_id, self.swarm.public_key, self.shared.signed)
            self._published = now
        if self.server is not None and self.shared.shards is not None:
            held = self.shared.shards.held()
            if held and (held != self._holdings or now - self._holdings_published > HOLDINGS_LIFETIME / 3):
                publish_holdings(self.swarm.dht, run_id, self.swarm.public_key, held)
                self._holdings, self._holdings_published = held, now

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        if self.server is not None:
            self.server.stop()
