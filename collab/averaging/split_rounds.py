"""Which groups a split gradient round made, as the few of it learn them: when no group won, nobody has the round.

The few of a split round (fewer than half the peers training, collab.modes.sync) ask the many for their round
(collab.averaging.round_replay) and wait up to DONORS_WAIT for it: the many may end their round after the few. But a
round can split with no majority at all (7 + 14 + 8 + 3 of 32 peers): then every group is a few, nobody keeps the
round, and each few waited the whole 15 s for it before stepping on its own average. Now a peer among the few says so
to whoever asks it for the round: the epoch and the members of its group. The asker adds each such group, disjoint
from its own and from those it already knows, and stops waiting once the peers in no known group are too few to have
made a group that won (under half of those training; in an even split, half could have, and it waits on).

Another peer is untrusted input: a claim is taken only for the asked epoch, only if it names its sender among at most
MOST_MEMBERS distinct peer ids, none of them in the asker's own group or a group it already knows; what it refuses is
counted and attributed. A peer that lies about its group can only end the few's wait early: they step on their own
average and re-sync by a download, as they did before the wait.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

MOST_MEMBERS = 4096  # a group claimed with more members than this is no group of a run this tool runs
MOST_ID_CHARS = 128  # a base58 peer id is about 52 characters


@dataclass
class KnownGroups:
    """The groups of one epoch's round that the few know of: their own, and those other few told them of."""

    own: frozenset
    others: list = field(default_factory=list)  # frozensets of base58 peer ids, disjoint

    def members(self) -> set:
        return set(self.own).union(*self.others)

    def add(self, donor: str, claim) -> Optional[str]:
        """Adds `donor`'s claim (the members of its group, a few of this epoch's round); why it was refused, or None.
        A group already known is no news, and not refused."""
        if claim is None:
            return "a malformed claim of its round's group"
        group, why = round_group(donor, claim)
        if group is None:
            return why
        if group in self.others:
            return None
        if group & self.members():
            return "a claim of a group that overlaps another group of the same round"
        self.others.append(group)
        return None

    def no_group_won(self, peers_training: int) -> bool:
        """Whether the peers in no known group are too few to have made a group of at least half those training: no
        group won the round, and no peer will ever keep it."""
        unknown = peers_training - len(self.members())
        return unknown * 2 < peers_training

    def sizes(self) -> list[int]:
        return [len(self.own)] + [len(group) for group in self.others]


def round_group(donor: str, claim) -> tuple[Optional[frozenset], Optional[str]]:
    """The group that made a replayed round, as its donor `donor` claims it (collab.averaging.round_replay), or None,
    and why a claim was refused (None: taken, or no claim at all). The replaying peer plans the next round's leader from
    it; a lie can only make it plan another leader than the many, a split round at worst."""
    if claim is None:
        return None, None
    if not isinstance(claim, (list, tuple)) or not 0 < len(claim) <= MOST_MEMBERS or not all(
            isinstance(peer, str) and 0 < len(peer) <= MOST_ID_CHARS for peer in claim):
        return None, "a malformed claim of its round's group"
    group = frozenset(claim)
    if len(group) != len(claim) or donor not in group:
        return None, "a claim of a group it is not in, or that names a peer twice"
    return group, None
