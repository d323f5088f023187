"""What this peer refused from others, counted and attributed, and who it thinks is suspect.

The averager processes (collab.averaging.robust_rounds) put each finding - (peer id, reason, "gradients" | "state") -
on a multiprocessing queue; the trainer drains it when it publishes its metrics record, which carries the
counts (bounded: the most-reported peers and reasons only) for `collab status` and the dashboard. A peer's
own word about others is untrusted too, so "suspect" is decided by the reader (collab.dashboard.collector) from
how many peers report hard evidence against it, not by any one report.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
from typing import Optional

from collab.records.metrics import MAX_PEERS_IN_RECORD, MAX_REASONS_PER_PEER

# what only a broken or hostile peer does. Not an implausible returned average: an honest reducer returns one
# when a poisoned part outweighs the rest (a group of two, where no rule can tell which part is honest)
# when the parts a reducer combined were three or more and it clipped them, though, an honest reducer's result
# lies within the honest parts' spread, and one far outside it is evidence
HARD_EVIDENCE = ("part not finite", "weight not a finite number >= 0", "part of the wrong shape",
                 "returned a non-finite average", "returned an implausible average of a clipped group",
                 "served a shard that does not match the manifest's sha256")  # collab.run.shard_fetch.REFUSED


class RejectionLog:
    def __init__(self, context: Optional[mp.context.BaseContext] = None):
        self.queue = (context or mp.get_context()).Queue()
        self.counts: dict[str, dict[str, int]] = {}  # peer id -> reason -> count
        self._caught: list[str] = []  # peers caught with hard evidence, not yet taken by `take_caught`
        self._ever_caught: set[str] = set()

    def add(self, peer: str, reason: str, what: str) -> None:
        """A finding of this process (the averagers' come through `queue`)."""
        self._count(peer, reason, what)

    def drain(self) -> dict[str, dict[str, int]]:
        while True:
            try:
                peer, reason, what = self.queue.get_nowait()
            except queue.Empty:
                break
            except (OSError, ValueError, EOFError):  # the queue was closed at shutdown
                break
            self._count(peer, reason, what)
        return self.counts

    def _count(self, peer, reason: str, what: str) -> None:
        key = f"{reason} ({what})"
        if reason in HARD_EVIDENCE and str(peer) not in self._ever_caught:
            self._ever_caught.add(str(peer))
            self._caught.append(str(peer))
        by_reason = self.counts.setdefault(str(peer)[:128], {})
        by_reason[key] = by_reason.get(key, 0) + 1

    def take_caught(self) -> list[str]:
        """Peers caught with hard evidence since the last call: the state averager never takes a state from them
        (the gradient averager, which caught them, runs in another process)."""
        self.drain()
        caught, self._caught = self._caught, []
        return [peer for peer in caught if not peer.startswith("(")]  # "(the group)", "(this peer's own ...)"

    def caught_ever(self) -> set[str]:
        """Every peer caught with hard evidence so far (a leaving peer does not stay on as its state donor)."""
        self.drain()
        return set(self._ever_caught)

    def for_record(self) -> dict[str, dict[str, int]]:
        """The most-reported peers and reasons, within the metrics record's bounds."""
        counts = self.drain()
        top = sorted(counts.items(), key=lambda item: -sum(item[1].values()))[:MAX_PEERS_IN_RECORD]
        return {peer: dict(sorted(reasons.items(), key=lambda r: -r[1])[:MAX_REASONS_PER_PEER])
                for peer, reasons in top}

    def total(self) -> int:
        return sum(sum(reasons.values()) for reasons in self.drain().values())
