"""One planned leader for each gradient round: every peer asks the same one first.

hivemind's leader is the peer whose search ends first, and a peer learns of the others' searches only by reading
the group key from the DHT. On 2 busy cores (12 linreg peers) those reads took 0.2-3.2 s each (median 0.7), and
two peers that began searching a moment apart each saw the other too late: both led, and the round split (8 + 4,
6 + 6 and 7 + 5 in three runs of the 12-peer test). The replicas of a split part; in a 6 + 6 neither half is the
few that re-syncs from the many.

Every peer already reads the run's signed progress records (who trains, at which epoch, as a client or not), so
each can name the same leader with no read at all: among the peers training that can lead and are on the swarm's
step (not the few of a split round, who re-sync first: on_the_swarms_step), the one whose hash of (epoch, peer id)
is least. It changes each epoch, so no peer leads every round. For the first part of its search (PLAN_SHARE) a peer
asks that leader directly, again every ASK_AGAIN s while the leader is not searching yet, and the leader itself asks
no one; after that, hivemind's own search takes over, so a planned leader that is missing or slow costs part of one
search, not the round; unless the leader answered that its search is yet to begin (collab.averaging.woken_leader):
then it is asked on, up to LATE_LEADER_SHARE of the round's time. The leader, once followed, leads its whole search
(it used to begin its group at its plan's end, half-way: collab.hivemind_hooks.matchmaking.follow_a_plan). The leader
accepts a follower whose search ends up to two request_timeouts before its own (hivemind refuses any such): the
follower waits for the group's start three past its deadline (collab.hivemind_hooks.matchmaking.patient_followers). With
one, at 32 peers on 2 cores, where the planned leader began its search 5-7 s after the first peer in a third of the
rounds, it refused every peer that began more than 2.4 s before it; those grouped apart (18 + 14, the same 14 epoch
after epoch: the few end their round late and begin the next one late). Records read a moment apart can differ (a
peer just joined or left); the plan changes only if that peer's hash is the least, and a peer that planned otherwise
is brought into the group by hivemind's search and its redirects.
"""

from __future__ import annotations

import hashlib
from typing import Optional

PLAN_SHARE = 0.5  # of a search's time: how long a peer asks the planned leader before hivemind's own search
ASK_AGAIN = 0.3  # seconds between asks while the planned leader is not searching yet
LATE_LEADER_SHARE = 1 / 3  # of a round's time to its deadline: how long a leader that says it is coming is asked


def peers_training(records: dict, last_group: frozenset = frozenset()) -> set:
    """The peers (base58) the progress records show training: within an epoch of the furthest, or in this peer's last
    gradient group while their record lives. A record is up to a few seconds old plus its own publishing lag: in a
    swarm that steps every 3-4 s, two of 12 peers that had just averaged with this one showed two epochs behind. A
    peer that averaged with this one last round is on its epoch whatever its record says."""
    epochs = {peer: getattr(record, "epoch", None) for peer, record in records.items()}
    epochs = {peer: e for peer, e in epochs.items() if isinstance(e, int) and not isinstance(e, bool)}
    furthest = max(epochs.values(), default=0)
    return {peer for peer, e in epochs.items() if e >= furthest - 1 or peer in last_group}


def planned_leader(records: dict, epoch: int, last_group: frozenset = frozenset(),
                   step_group: Optional[frozenset] = None, step_leader: Optional[str] = None) -> Optional[str]:
    """The round's planned leader (base58), or None when fewer than two peers are training or none can lead (a
    client-mode peer accepts no one). `step_group` (this peer's group of the round before this one, which averaged,
    or empty): only a peer on the swarm's step leads while there is one (`on_the_swarms_step`); `step_leader`: the
    planned leader of that round as this peer's search planned it (None: not known)."""
    training = peers_training(records, last_group)
    able = [peer for peer in training if getattr(records[peer], "client_mode", False) is False]
    if len(training) < 2 or not able:
        return None
    if step_group is not None:
        on_step = on_the_swarms_step(records, training, step_group, epoch - 1, step_leader)
        able = [peer for peer in able if peer in on_step] or able
    return min(able, key=lambda peer: hashlib.sha256(f"{epoch}:{peer}".encode()).digest())


def on_the_swarms_step(records: dict, training: set, step_group: frozenset, step_epoch: int,
                       step_leader: Optional[str] = None) -> set:
    """The peers training that are surely on the swarm's step, and so begin the next round on time: the few of a split
    round re-sync first (a state download: 1.5-39 s at 32 peers on 2 cores) and lead late. At 32 peers the planned
    leader of 2 of a run's 4 split rounds had been in the few of the round before, and its own round split again (the
    same 14 of 32 apart four epochs running, in an earlier run). This peer's group of the round before, when it
    averaged (at `step_epoch`) and held more than half the peers training, or half of them and did not lose the even
    split (loses_an_even_split: it holds that round's planned leader): exact, and every peer of it names the same set.
    (Exactly half: 12 peers' start split 6 + 3 + 3 and the few replayed the six's round; the six read the few's
    records at their epoch, and one of the few, its search 2.4 s behind the six's, was named the leader: 7 + 4.)
    Not an older round's: a peer stuck 40 s in a failed round, then re-synced, named itself from a group of four
    epochs before and its fellows grouped apart with it. Otherwise (this peer was in the few, or has no such round)
    the peers whose records show the furthest epoch: the few hold their records an epoch back until they re-sync
    (collab.modes.replica_sync). A few that replayed the many's round took the many's group as its own (its donor
    names it: collab.averaging.round_replay), so it names the same set as they do."""
    group = step_group & training
    if len(group) * 2 > len(training) or \
            (len(group) * 2 == len(training) and not loses_an_even_split(records, step_epoch, group, step_leader)):
        return set(group)
    epochs = {peer: getattr(records[peer], "epoch", None) for peer in training}
    furthest = max((e for e in epochs.values() if isinstance(e, int)), default=None)
    return {peer for peer, e in epochs.items() if e == furthest}


def loses_an_even_split(records: dict, epoch: int, group, leader: Optional[str] = None) -> bool:
    """Whether this peer's gradient round at `epoch`, which gathered exactly half the peers training (`group`, base58),
    was the half without the round's planned leader: that half re-syncs from the other. `leader`: the one this
    peer's search planned (collab.averaging.round_plans.round_leader); None: named from `records` as they are now,
    without the group of the round before, which can name another. At 32 peers (100 ms round trips, 2 cores) the
    planned leader's own half of a 16 + 16 split, named so a round later, found itself without it: the leader and
    half its group replayed the other half's round, and each peer then named the next leader from another set (15
    groups). Only when most of the other half is on `epoch` too (its records say so), so that it can have made this
    epoch's step in a round of its own: after a network split heals, the other half may be an epoch behind, catching
    up by download (a 2 + 2 swarm), and then this half's step is the swarm's. Without records of the others, neither
    half re-syncs."""
    members = set(group)
    others = [record for peer, record in records.items() if peer not in members]
    on_epoch = sum(getattr(record, "epoch", None) is not None and record.epoch >= epoch for record in others)
    if not others or on_epoch * 2 < len(others):
        return False
    leader = leader if leader is not None else planned_leader(records, epoch)
    return leader is not None and leader not in members
