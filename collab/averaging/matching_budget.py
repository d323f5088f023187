"""How long a gradient round's search for its group waits (hivemind's min_matchmaking_time), following what the
last rounds found rather than a number fixed in the config.

hivemind's leader is the peer whose search ends first: when its time is up it averages with whoever joined, and
peers that began searching later miss the round (each one then steps on its own gradients, and the replicas part).
How far apart peers begin depends on the swarm: its size, its latency, how busy its machines are. 12 linreg peers
on 2 cores began an epoch's round over 3 s, and a 3-s search split them into groups of 2-5. A search that waits
longer costs nothing when the whole swarm comes (with averaging.group_size unset, the leader begins as soon as
every training peer has joined: collab.averaging.robust_rounds), so after a round that found fewer peers than the
progress records show training, the next search waits longer; after a whole group, it eases back toward the
configured time. The first search, before anything is measured, waits twice the configured time: a swarm that
starts together splits its first round otherwise (the same 12 peers: groups of 2-7 in their first two rounds).
"""

from __future__ import annotations

from typing import Optional

GROW = 2.0  # after a round that missed peers: the swarm's spread is unknown, so reach it in a round or two
EASE = 0.9  # after a whole group: back toward the configured time, slowly (a busy machine stays busy)


class MatchingBudget:
    def __init__(self, configured: float, ceiling: float):
        self.configured, self.ceiling = configured, max(configured, ceiling)
        self.seconds = min(self.ceiling, configured * GROW)

    def after_round(self, found: Optional[int], expected: Optional[int]) -> float:
        """`found`: the group's size (None: no group); `expected`: the peers the records showed training (None:
        not known, e.g. before the first read, or a group size set in the config)."""
        if expected is not None and expected >= 2:
            if found is None or found < expected:
                self.seconds = min(self.ceiling, self.seconds * GROW)
            else:
                self.seconds = max(self.configured, self.seconds * EASE)
        return self.seconds
