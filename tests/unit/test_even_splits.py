"""An even split (16 + 16) is judged by the leader the round's own search planned (collab.averaging.round_plans
.round_leader), not one named again later from the records alone.

At 32 peers with 100-ms round trips on 2 cores, a round split 16 + 16 + ...: the half with its planned leader
(planned from the group of the round before) named the leader again a round later without that group, found one
in the other half, and the leader itself and part of its group replayed the other half's round; the peers then
planned the next round from different sets, and it split into 15 groups.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from types import SimpleNamespace

from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time

from collab.averaging.planned_leader import on_the_swarms_step, planned_leader
from collab.averaging.round_plans import KEPT_LEADERS, PlansRounds

PEERS = [PeerID(bytes([0x12, 0x20, i]) + bytes(31)).to_base58() for i in range(12)]


def _records(epoch: int) -> dict:
    return {peer: SimpleNamespace(epoch=epoch, client_mode=False) for peer in PEERS}


def _halves(records: dict, epoch: int):
    """Six peers that hold a round's planned leader other than the one the records alone name now, and the rest."""
    named_now = planned_leader(records, epoch)
    planned = next(peer for peer in PEERS if peer != named_now)
    with_plan = [planned] + [peer for peer in PEERS if peer not in (planned, named_now)][:5]
    return planned, with_plan, [peer for peer in PEERS if peer not in with_plan]


def test_the_half_with_the_leader_its_search_planned_keeps_its_step():
    from collab.modes.sync import CollabOptimizer

    records = _records(4)
    planned, with_plan, other = _halves(records, 4)
    asked = []
    averager = SimpleNamespace(epoch=4, round_leader=lambda epoch: asked.append(epoch) or planned)
    optimizer = SimpleNamespace(grad_averager=averager, tracker=SimpleNamespace(
        global_progress=SimpleNamespace(num_peers=12), records_seen=records))
    assert not CollabOptimizer._in_a_minority(optimizer, with_plan) and asked == [4]
    assert CollabOptimizer._in_a_minority(optimizer, other)
    # an averager that names none (no answer in time, or it planned none): the records' leader, as before
    averager.round_leader = lambda epoch: None
    assert CollabOptimizer._in_a_minority(optimizer, with_plan) and not CollabOptimizer._in_a_minority(optimizer, other)


def test_the_next_round_is_planned_from_the_half_with_the_rounds_own_leader():
    records = _records(4)
    planned, with_plan, other = _halves(records, 4)
    training = set(PEERS)
    assert on_the_swarms_step(records, training, frozenset(with_plan), 4, planned) == set(with_plan)
    assert on_the_swarms_step(records, training, frozenset(other), 4, planned) == training  # the furthest epoch's
    # without the round's own leader the half that had it judged itself the loser (the bug)
    assert on_the_swarms_step(records, training, frozenset(with_plan), 4) == training


def _averager(records: dict, last_group, averaged_epoch: int):
    averager = type("Averager", (PlansRounds,), {"serializer": MSGPackSerializer, "kind": "gradients",
                                                 "banned": lambda self, peer: False})()
    averager._progress_cache = {"records": records, "task": None, "read_at": time.monotonic()}
    averager._last_group, averager._averaged_epoch = frozenset(last_group), averaged_epoch
    return averager


def _plan_of(averager, epoch: int):
    averager._round_plan = (epoch, get_dht_time() + 3.0, get_dht_time() + 6.0)
    return averager._plan()[0].to_base58()


def test_an_averager_keeps_each_rounds_planned_leader_tells_the_trainer_and_plans_the_next_round_by_it():
    records = _records(4)
    planned, with_plan, other = _halves(records, 4)
    # epoch 4's round, planned from epoch 3's group (the six of with_plan): its leader is among them
    averager = _averager(records, with_plan, 3)
    assert _plan_of(averager, 4) == planned_leader(records, 4, frozenset(with_plan), frozenset(with_plan))
    # the round gathered with_plan (16 + 16 in the run above), with the leader its search planned (as this test's
    # halves are built): epoch 5's plan names a leader from it
    averager._leaders_planned, averager._averaged_epoch = {4: planned}, 4
    assert _plan_of(averager, 5) in with_plan
    fresh = _averager(records, with_plan, 4)  # an averager that kept no leader: the records' alone name another set
    assert _plan_of(fresh, 5) not in with_plan

    # the search's end notes its plan's leader (kept for KEPT_LEADERS epochs), and the trainer's process hears it
    noted = _averager(records, with_plan, 3)
    for epoch in range(4, 4 + KEPT_LEADERS + 2):
        noted._round_plan = (epoch, 0.0, 0.0)
        noted._note_round_leader()
    kept = noted._round_leaders()
    assert sorted(kept) == list(range(6, 6 + KEPT_LEADERS))
    assert all(kept[epoch] == noted._planned_leader(epoch) for epoch in kept)
    told = Future()
    asyncio.run(noted._tell_round_leader(7, told))
    assert told.result(timeout=1) == kept[7]
    untold = Future()
    asyncio.run(noted._tell_round_leader(4, untold))
    assert untold.result(timeout=1) is None
    # a state averager keeps none (its rounds name no gradient group)
    state = _averager(records, with_plan, 3)
    state.kind, state._round_plan = "state", (4, 0.0, 0.0)
    state._note_round_leader()
    assert state._round_leaders() == {}
