"""How long a peer leaving at --max-epochs stays on as the state donor of peers behind it.

A peer that stepped alone at its last epoch (its gradient round failed) ends in sync only by downloading the
swarm's state, and at the end of a run the only donors are peers that are leaving too. They stay while a peer
is behind them, for as long as that peer needs: finish the epochs it is behind - alone, since the others are
done: the samples it still lacks at its own published rate, and at least twice the swarm's measured epoch time
per epoch - then give up its last gradient and state rounds, and download. A fixed wait is too short on a slow
or busy machine and far too long on a fast one.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional

EPOCHS_KEPT = 8  # the pace is the median of this many recent epochs: one stalled epoch does not set it
MOST_EPOCHS_SERVED = 2  # a peer further behind catches up by downloading at its next step: it needs no more time
SLOWEST_PEER_FACTOR = 2.0  # the peer behind may be the slowest: each of its epochs gets twice the median
MOST_SLOWER = 8.0  # a rate is the peer's own word: its epochs are taken to last at most this many of ours
MOST_COMPUTE_SECONDS = 600.0  # ... and, before this peer timed an epoch of its own, at most this long in all


@dataclass(frozen=True)
class Behind:
    """A peer behind this one, from its signed progress record."""

    epochs: int  # how many epochs behind
    samples: int  # accumulated toward its current epoch
    samples_per_second: float
    peer: str = ""
    record_age: float = 0.0  # seconds since it stored that record
    client_mode: bool = False


class EpochPace:
    """The wall time of this peer's recent epochs."""

    def __init__(self):
        self._epoch: Optional[int] = None
        self._since = 0.0
        self._durations: deque = deque(maxlen=EPOCHS_KEPT)

    def observe(self, epoch: int, now: Optional[float] = None) -> None:
        """Called with the local epoch at every step; an epoch that moved by one is timed (a download that
        jumped several epochs is not an epoch's work)."""
        now = time.monotonic() if now is None else now
        if self._epoch is not None and epoch == self._epoch:
            return
        if self._epoch is not None and epoch == self._epoch + 1:
            self._durations.append(now - self._since)
        self._epoch, self._since = epoch, now

    def seconds(self) -> Optional[float]:
        """The median epoch's wall time, or None before one epoch was timed."""
        return statistics.median(self._durations) if self._durations else None


def donor_patience(behind: Iterable[Behind], target_batch_size: int, epoch_seconds: Optional[float],
                   averaging_timeout: float, matchmaking_time: float, load_state_timeout: float) -> float:
    """Seconds a leaving donor waits for the peers `behind` it to come and download its state."""
    compute = max((_compute_seconds(b, target_batch_size, epoch_seconds) for b in behind), default=0.0)
    # then its last gradient round (given up at averaging_timeout at the latest), its state round's matchmaking,
    # and a download that may first try a peer that already left
    return compute + averaging_timeout + 3 * matchmaking_time + load_state_timeout


def _compute_seconds(behind: Behind, target_batch_size: int, epoch_seconds: Optional[float]) -> float:
    epochs = min(max(behind.epochs, 0), MOST_EPOCHS_SERVED)
    by_pace = epochs * SLOWEST_PEER_FACTOR * (epoch_seconds or 0.0)
    left = max(0.0, epochs * target_batch_size - max(behind.samples, 0))
    if not behind.samples_per_second > 0 or not left:
        return by_pace
    most = epochs * MOST_SLOWER * epoch_seconds if epoch_seconds else MOST_COMPUTE_SECONDS
    return max(by_pace, min(left / behind.samples_per_second, most))
