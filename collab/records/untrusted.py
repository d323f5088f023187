"""Other peers' DHT records, read as untrusted input: who signed each one, and whether its numbers can be true.

A record is kept only if the key that signed it is the key its peer id derives from
(collab.records.identity: a fresh key cannot take over another peer's row), its time is not in the future
beyond clock skew (a fake peer cannot stay "online" forever), its counts are within bounds, and its
epoch is not far beyond the other peers' (one fake record cannot drag the run's epoch). What is
dropped is counted by reason and by signer, and shown (`collab status`, the dashboard, Prometheus).
"""

from __future__ import annotations

import bisect
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.p2p import PeerID

from collab.records.identity import signer_peer_id
from collab.records.metrics import PROGRESS_SUFFIX
from collab.records.shared_reads import recent_or_new

CLOCK_SKEW_SECONDS = 300.0  # clocks of volunteers' machines disagree by this much at most
EPOCH_LEAD = 3  # an honest peer is at most an epoch or two ahead of the others' median
# ... unless this share of the others (one at least) is within EPOCH_LEAD of it: after a network split the half that
# trained faster is honestly ahead of the other half: in a 2 + 2 split the median of the others is the slow half's,
# the fast half's records were dropped by every reader (tests/swarm/test_faults.py's logs) and the slow half, deaf to
# it, did not re-sync from it after the heal
EPOCH_BACKERS = 0.25
VOTER_FRESH_SECONDS = 120.0  # only peers heard from this recently vote on what epoch is plausible
MAX_SAMPLES = 10**12
MAX_RATE = 1e9  # samples per second
# what a peer's record may say it refused from another that is no sign of foul play: a slow link, not an attack
# (collab.averaging.aggregation reports it; collab.swarm.state shows it but does not count it toward "suspect")
LATE_PART = "part not in time (left out of the round)"


@dataclass
class Rejections:
    """What a reader dropped: counts by reason, and by the peer id of the key that signed it."""

    by_reason: Counter = field(default_factory=Counter)
    by_signer: Counter = field(default_factory=Counter)

    def add(self, reason: str, signer: Optional[str]) -> None:
        self.by_reason[reason] += 1
        self.by_signer[signer or "unsigned"] += 1

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())


def signed_values(found) -> list[tuple[Optional[str], Any]]:
    """(signer's peer id or None, value) for each subkey of a DHT dictionary value, whatever its shape."""
    if found is None or not isinstance(getattr(found, "value", None), dict):
        return []
    return [(signer_peer_id(subkey), item.value) for subkey, item in found.value.items()
            if hasattr(item, "value") and item.value is not None]


def accept(entries: list[tuple[Optional[str], Any]], parse: Callable[[Any], Any], claimed_id: Callable[[Any], str],
           rejected: Rejections, now: Optional[float] = None) -> dict[str, Any]:
    """The entries that parse, are signed by the peer they name, and whose time and counts can be true."""
    now = time.time() if now is None else now
    kept: dict[str, Any] = {}
    for signer, value in entries:
        try:
            item = parse(value)
            claimed = claimed_id(item)
        except Exception:
            rejected.add("malformed", signer)
            continue
        if signer is None or claimed != signer:
            rejected.add("peer id is not the signer's", signer)
            continue
        if not item.time <= now + CLOCK_SKEW_SECONDS:
            rejected.add("time in the future", signer)
            continue
        if not _counts_in_bounds(item):
            rejected.add("counts out of bounds", signer)
            continue
        kept[signer] = item
    return kept


def drop_implausible_epochs(items: dict[str, Any], rejected: Rejections, now: Optional[float] = None,
                            reference: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Drop items whose epoch is more than EPOCH_LEAD beyond the median of the other peers heard from lately
    (`reference`: whose epochs vote, default `items`) and that fewer than EPOCH_BACKERS of those others back (are
    within EPOCH_LEAD of it). One forged record, or a few colluding ones, cannot drag the run's epoch; a lie needs a
    quarter of the voters. With fewer than two others nobody can tell which of two disagreeing peers is right, so
    nothing is dropped."""
    now = time.time() if now is None else now
    voters = {peer: item.epoch for peer, item in (reference if reference is not None else items).items()
              if now - item.time < VOTER_FRESH_SECONDS}
    epochs = sorted(voters.values())  # once: each peer's "others" is this list less its own epoch, if it voted
    kept = {}
    for peer, item in items.items():
        own = voters.get(peer)
        others = len(epochs) - (peer in voters)
        if others >= 2 and item.epoch > _median_high_without(epochs, own) + EPOCH_LEAD:
            near = item.epoch - EPOCH_LEAD
            backers = len(epochs) - bisect.bisect_left(epochs, near) - (own is not None and own >= near)
            if backers < max(1, math.ceil(EPOCH_BACKERS * others)):
                rejected.add("epoch far ahead of the others", peer)
                continue
        kept[peer] = item
    return kept


def _median_high_without(epochs: list, own: Optional[int]) -> int:
    """statistics.median_high of the sorted `epochs` less one occurrence of `own` (None: less nothing), in O(log n):
    a dashboard reading 5,000 peers spent 2.1 s a read rebuilding each peer's list of the others."""
    if own is None:
        return epochs[len(epochs) // 2]
    k = (len(epochs) - 1) // 2
    return epochs[k] if k < bisect.bisect_left(epochs, own) else epochs[k + 1]


def _counts_in_bounds(item) -> bool:
    samples = getattr(item, "samples_accumulated", getattr(item, "samples_contributed", 0))
    rate = item.samples_per_second
    return 0 <= samples <= MAX_SAMPLES and 0 <= rate <= MAX_RATE and item.epoch <= 10**9


def progress_records(dht, run_id: str) -> dict:
    """Each peer's training progress as hivemind's tracker published it, by peer id (untrusted ones dropped)."""
    return read_progress(dht, run_id, Rejections(), time.time())


def read_progress(dht, run_id: str, rejected: Rejections, now: float) -> dict:
    progress = accept(signed_values(recent_or_new(dht, run_id + PROGRESS_SUFFIX)), LocalTrainingProgress.parse_obj,
                      lambda item: PeerID(item.peer_id).to_base58(), rejected, now)
    return drop_implausible_epochs(progress, rejected, now)
