"""How long a peer leaving at --max-epochs stays on as the state donor of peers behind it.

A peer that stepped alone at its last epoch (its gradient round failed) ends in sync only by downloading the
swarm's state, and at the end of a run the only donors are peers that are leaving too. They stay while a peer
is behind them, for as long as that peer needs at the swarm's own pace: finish the epochs it is behind (twice
the measured epoch time each, as it may be the slowest peer), give up its last gradient and state rounds, and
download. A fixed wait is too short on a slow or busy machine and far too long on a fast one.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Optional

EPOCHS_KEPT = 8  # the pace is the median of this many recent epochs: one stalled epoch does not set it
MOST_EPOCHS_SERVED = 2  # a peer further behind catches up by downloading at its next step: it needs no more time
SLOWEST_PEER_FACTOR = 2.0  # the peer behind may be the slowest: each of its epochs gets twice the median


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


def donor_patience(gap: int, epoch_seconds: Optional[float], averaging_timeout: float, matchmaking_time: float,
                   load_state_timeout: float) -> float:
    """Seconds a leaving donor waits for a peer `gap` epochs behind it to come and download its state."""
    epochs = min(max(gap, 0), MOST_EPOCHS_SERVED) * SLOWEST_PEER_FACTOR * (epoch_seconds or 0.0)
    # its last gradient round (given up at averaging_timeout at the latest), its state round's matchmaking, and
    # a download that may first try a peer that already left
    return epochs + averaging_timeout + 3 * matchmaking_time + load_state_timeout
