"""What a peer costs the swarm as it grows (issue 36): its matchmaking's DHT reads paced, a round's group that begins
once every training peer joined it (averaging.group_size unset), each search for a group timed, and the DHT requests
a peer's node sends counted. Each against a stand-in for the one hivemind object it wraps; the swarm tests and
benchmarks/scale.py run them in real swarms."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from hivemind.averaging.key_manager import is_valid_group
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from collab.averaging.matching_budget import MatchingBudget
from collab.averaging.robust_rounds import CheckedRounds
from collab.averaging.round_plans import PlansRounds, _peers_training
from collab.hivemind_hooks.dht_node import count_dht_requests
from collab.hivemind_hooks.matchmaking import pace_group_reads, time_matchmaking
from collab.swarm.dht_traffic import DHTRequests, known_keys


def test_group_reads_are_paced_and_a_second_pacing_adds_nothing():
    starts = []

    async def get_averagers(key, only_active):
        starts.append(time.monotonic())
        return []

    matchmaking = SimpleNamespace(group_key_manager=SimpleNamespace(get_averagers=get_averagers))
    pace_group_reads(matchmaking, every=0.2)
    pace_group_reads(matchmaking, every=5.0)  # once per Matchmaking: the first pace holds

    async def read_in_a_loop():  # what a would-be leader did: read again as soon as a read came back
        began = time.monotonic()
        for _ in range(4):
            await matchmaking.group_key_manager.get_averagers("key", only_active=True)
        return began

    began = asyncio.run(read_in_a_loop())
    assert starts[0] - began < 0.1  # the first read is not held
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(gaps) == 3 and all(0.19 <= gap < 1.0 for gap in gaps), gaps


def test_each_search_for_a_group_is_timed_whether_it_finds_one_or_fails():
    seen = []
    outcomes = iter([SimpleNamespace(peer_ids=["a", "b", "c"]), None, RuntimeError("no group")])

    async def look_for_group(step):
        await asyncio.sleep(0.05)
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    matchmaking = SimpleNamespace(look_for_group=look_for_group)
    time_matchmaking(matchmaking, lambda seconds, found: seen.append((seconds, found)))
    time_matchmaking(matchmaking, lambda seconds, found: seen.append((seconds, found)))  # once per Matchmaking
    assert asyncio.run(matchmaking.look_for_group("step")).peer_ids == ["a", "b", "c"]
    assert asyncio.run(matchmaking.look_for_group("step")) is None
    with pytest.raises(RuntimeError):
        asyncio.run(matchmaking.look_for_group("step"))
    assert [found and len(found.peer_ids) for _, found in seen] == [3, None, None], seen
    assert all(0.04 <= seconds < 1.0 for seconds, _ in seen), seen


def _fit(target_group_size, epochs: list[int]):
    averager = SimpleNamespace(_budget=None, _last_group=frozenset())
    matchmaking = SimpleNamespace(target_group_size=target_group_size, min_matchmaking_time=3.0,
                                  potential_leaders=SimpleNamespace(min_matchmaking_time=3.0))
    records = {f"peer{i}": SimpleNamespace(epoch=e) for i, e in enumerate(epochs)}
    CheckedRounds._fit_group_to_swarm(averager, matchmaking, records)
    return matchmaking.target_group_size, averager, matchmaking


def test_a_group_begins_once_every_training_peer_joined_when_no_size_is_set():
    assert _fit(None, [7, 7, 6, 7])[0] == 4
    assert _fit(None, [7, 7, 6, 2])[0] == 3  # a peer 5 epochs behind (catching up) is in no round of these
    assert _fit(None, [7])[0] is None  # alone, or no records yet: hivemind's own rule (wait out matchmaking_time)
    assert _fit(None, [])[0] is None
    assert _fit(8, [7, 7, 7])[0] == 8  # a size the run set is kept


def test_peers_that_averaged_with_this_one_count_whatever_their_late_record_says():
    # records are up to PROGRESS_REFRESH s old: in a swarm stepping every 3-4 s two of 12 showed two epochs behind
    records = {f"peer{i}": SimpleNamespace(epoch=7) for i in range(10)}
    records.update(late0=SimpleNamespace(epoch=5), late1=SimpleNamespace(epoch=5))
    assert _peers_training(records) == 10
    assert _peers_training(records, frozenset({"late0", "late1", "peer0"})) == 12
    # a groupmate whose record expired (it left) is not counted
    assert _peers_training(records, frozenset({"late0", "gone"})) == 11



def test_every_peer_names_one_planned_leader_that_can_lead_and_changes_with_the_epoch():
    from collab.averaging.planned_leader import planned_leader

    records = {f"peer{i}": SimpleNamespace(epoch=7, client_mode=False) for i in range(12)}
    leaders = {planned_leader(records, epoch) for epoch in range(20)}
    assert len(leaders) > 5  # the lead goes round (a fixed leader would be one peer, every round)
    leader = planned_leader(records, 7)
    # views a moment apart: a peer two epochs behind, a client and one more follower leave the plan as it was
    others = dict(records, slow=SimpleNamespace(epoch=5, client_mode=False),
                  nat=SimpleNamespace(epoch=7, client_mode=True))
    assert planned_leader(others, 7) == leader
    # a client never leads (it accepts no one); a peer that averaged with this one last round counts whatever its
    # record says
    assert planned_leader({peer: SimpleNamespace(epoch=7, client_mode=peer == leader) for peer in records}, 7) != leader
    assert planned_leader(dict(others, slow=others["slow"]), 7, frozenset({"slow"})) in set(records) | {"slow"}
    # no plan alone, nor when nobody can lead
    assert planned_leader({"peer0": records["peer0"]}, 7) is None
    assert planned_leader({p: SimpleNamespace(epoch=7, client_mode=True) for p in ("a", "b")}, 7) is None



def test_the_few_of_a_split_round_never_lead_the_next_and_every_peer_names_the_same_leader():
    # 32 peers; round 7 split 20 + 12: the 12 hold their records at epoch 6 until they re-sync (a state download),
    # and a planned leader among them began its round seconds late and split it again
    from collab.averaging.planned_leader import planned_leader

    many, few = [f"many{i}" for i in range(20)], [f"few{i}" for i in range(12)]
    records = {**{p: SimpleNamespace(epoch=8, client_mode=False) for p in many},
               **{p: SimpleNamespace(epoch=7, client_mode=False) for p in few}}
    led_by_the_few = 0
    for epoch in range(8, 48):
        views = {planned_leader(records, epoch, frozenset(many), frozenset(many)),  # one of the many
                 planned_leader(records, epoch, frozenset(few), frozenset(few)),  # one of the few
                 planned_leader(records, epoch, step_group=frozenset())}  # a peer with no last round (it just joined)
        assert len(views) == 1 and views <= set(many), (epoch, views)
        led_by_the_few += planned_leader(records, epoch, frozenset(many)) in few
    assert led_by_the_few > 0  # without step_group the few lead some of these epochs
    # the many's own records not read since their step yet (all show 7): their last group still says who stepped
    stale = {p: SimpleNamespace(epoch=7, client_mode=False) for p in records}
    assert {planned_leader(stale, e, frozenset(many), frozenset(many)) for e in range(8, 48)} <= set(many)
    # nobody on the step can lead (the many are clients): the plan falls back to any peer that can
    clients = dict(records, **{p: SimpleNamespace(epoch=8, client_mode=True) for p in many})
    assert planned_leader(clients, 9, frozenset(many), frozenset(many)) in few
    # the group a peer averaged with counts for the next round only: one stuck in an older round's failure, then
    # re-synced, reads the records (it named itself from a group of four epochs before, and its fellows grouped apart)
    peer = PlansRounds()
    peer._last_group, peer._averaged_epoch = frozenset(many), 7
    assert peer._step_group(8) == frozenset(many)
    assert peer._step_group(11) == frozenset()

def test_a_half_that_won_its_round_names_the_next_leader_and_a_half_that_lost_does_not():
    """12 peers' start split 6 + 3 + 3: the few replayed the six's round (taking the six's group as their step's), and
    the six, reading everyone's records still at the round's epoch, named the leader from all twelve: one of the few,
    whose search began 2.4 s after theirs, and the next round split 7 + 4 (a CI run). Half the peers training, with
    the round's planned leader, is the swarm's step."""
    from collab.averaging.planned_leader import planned_leader

    peers = [f"peer{i}" for i in range(12)]
    for round_epoch in range(0, 40):
        records = {p: SimpleNamespace(epoch=round_epoch, client_mode=False) for p in peers}  # not read since the step
        leader = planned_leader(records, round_epoch)
        won = frozenset([leader] + [p for p in peers if p != leader][:5])  # six, with the round's planned leader
        lost = frozenset(peers) - won
        # one of the six, and a few that replayed their round (its step group: the six)
        assert planned_leader(records, round_epoch + 1, won, won) in won, round_epoch
        # the half without the planned leader (6 + 6) does not name its own: it re-syncs from the other half
        assert planned_leader(records, round_epoch + 1, lost, lost) == planned_leader(records, round_epoch + 1)


def _match(prefix_before: str, gathered) -> list[str]:
    averager = type("Averager", (PlansRounds,), {"serializer": MSGPackSerializer})()
    matchmaking = SimpleNamespace(group_key_manager=SimpleNamespace(prefix=prefix_before))
    prefixes = []
    for data in gathered:
        step = SimpleNamespace(data_for_gather=MSGPackSerializer.dumps([1.0, 0, MSGPackSerializer.dumps(data)]))
        CheckedRounds._match_within_epoch(averager, matchmaking, step)
        prefixes.append(matchmaking.group_key_manager.prefix)
    return prefixes


def test_a_gradient_round_is_matched_only_among_peers_at_its_epoch():
    # a peer late for the first round joined the others' epoch-1 round with its epoch-0 gradients (its replica
    # stayed 2% off): each round is matched under its epoch's key, which hivemind's leaders check
    assert _match("run_grad_averager", [5, 6, 6]) == [
        "run_grad_averager_epoch5", "run_grad_averager_epoch6", "run_grad_averager_epoch6"]
    assert all(is_valid_group(f"{prefix}.0b") for prefix in _match("run_grad_averager", [0, 12]))
    # rounds that carry no epoch (diloco gathers [outer step, probe]; no data at all) keep the run's key
    assert _match("run_grad_averager", [7, [3, 0.5], None]) == [
        "run_grad_averager_epoch7", "run_grad_averager", "run_grad_averager"]


def test_a_round_that_gathered_fewer_than_half_the_peers_training_is_an_own_step():
    from collab.modes.sync import CollabOptimizer

    from collab.averaging.planned_leader import planned_leader

    peers = [f"peer{i}" for i in range(12)]
    records = {peer: SimpleNamespace(epoch=4, client_mode=False) for peer in peers}
    optimizer = SimpleNamespace(tracker=SimpleNamespace(global_progress=SimpleNamespace(num_peers=12),
                                                        records_seen=records), grad_averager=SimpleNamespace(epoch=4))
    assert CollabOptimizer._in_a_minority(optimizer, peers[:3])  # the 3 of a 9 + 3 split re-sync from the 9
    assert not CollabOptimizer._in_a_minority(optimizer, peers[3:])
    assert not CollabOptimizer._in_a_minority(optimizer, peers)
    # 6 + 6: the half without the round's planned leader re-syncs from the half with it; exactly one half does
    leader = planned_leader(records, 4)
    with_leader = [leader] + [p for p in peers if p != leader][:5]
    without = [p for p in peers if p not in with_leader]
    assert not CollabOptimizer._in_a_minority(optimizer, with_leader)
    assert CollabOptimizer._in_a_minority(optimizer, without)
    # the other half an epoch behind (a healed network split: it is catching up by download, and made no step at this
    # epoch): this half's step was the swarm's. Seen in a 2 + 2 split's test, where both halves then re-synced from
    # their own groupmates and stayed apart
    behind = dict(records, **{peer: SimpleNamespace(epoch=3, client_mode=False) for peer in with_leader})
    optimizer.tracker.records_seen = behind
    assert not CollabOptimizer._in_a_minority(optimizer, without)
    # ... and most of it on this epoch (one record lagging): still a split
    optimizer.tracker.records_seen = dict(records, **{with_leader[-1]: SimpleNamespace(epoch=3, client_mode=False)})
    assert CollabOptimizer._in_a_minority(optimizer, without)
    # records that name no leader (none read yet): neither half, as before
    optimizer.tracker.records_seen = {}
    assert not CollabOptimizer._in_a_minority(optimizer, without)


def test_the_group_follows_the_swarm_from_round_to_round():
    size, averager, matchmaking = _fit(None, [3, 3, 3])
    assert size == 3
    # the next round: two more peers, then one left; the unset configuration is remembered, not the last target
    records = {f"peer{i}": SimpleNamespace(epoch=4) for i in range(5)}
    CheckedRounds._fit_group_to_swarm(averager, matchmaking, records)
    assert matchmaking.target_group_size == 5
    del records["peer4"]
    CheckedRounds._fit_group_to_swarm(averager, matchmaking, records)
    assert matchmaking.target_group_size == 4


def test_a_search_waits_longer_after_a_round_that_missed_peers_and_eases_back_after_whole_ones():
    budget = MatchingBudget(configured=3.0, ceiling=15.0)
    assert budget.seconds == 6.0  # nothing measured yet: a first round waits longer
    assert budget.after_round(found=12, expected=12) == 5.4
    for _ in range(10):
        budget.after_round(found=12, expected=12)
    assert budget.seconds == 3.0  # never below the configured time
    assert budget.after_round(found=5, expected=12) == 6.0
    assert budget.after_round(found=None, expected=12) == 12.0  # no group at all
    assert budget.after_round(found=11, expected=12) == 15.0  # capped
    assert budget.after_round(found=3, expected=None) == 15.0  # nothing known to compare with: unchanged
    assert budget.after_round(found=12, expected=12) == 13.5
    for _ in range(30):
        budget.after_round(found=12, expected=12)
    assert budget.seconds == 3.0


def test_a_state_rounds_leader_begins_before_the_next_step_gives_the_round_up():
    """A state round's search begins matchmaking_time (3 s here) before its scheduled time, and the next step gives up
    one still looking matchmaking_time after it (collab.averaging.replica.give_up_matchmaking): 2 x matchmaking_time
    after the search began. With the gradient rounds' budget (2x at first, 3x after a round that missed peers) its
    leader began no sooner, and every state round of 32 peers on 2 cores was given up, none averaged."""
    from collab.averaging.round_plans import STATE_SEARCH

    records = {f"peer{i}": SimpleNamespace(epoch=3) for i in range(32)}
    for missed_rounds in (0, 1, 3):
        _, averager, matchmaking = _fit(None, [3, 3])
        for _ in range(missed_rounds):
            averager._budget.after_round(found=20, expected=32)
        CheckedRounds._fit_group_to_swarm(averager, matchmaking, records, most=STATE_SEARCH)
        assert matchmaking.min_matchmaking_time == matchmaking.potential_leaders.min_matchmaking_time
        # a leader begins at its search's end at the latest, with whoever joined: before the give-up, with time for
        # a leader that began late and a group slow to form (1-2 s each at 32 peers on 2 cores)
        assert matchmaking.min_matchmaking_time == 3.0 * STATE_SEARCH <= 2 * 3.0 - 2.0, missed_rounds
        assert matchmaking.target_group_size == 32
    # a gradient round keeps its budget
    CheckedRounds._fit_group_to_swarm(averager, matchmaking, records)
    assert matchmaking.min_matchmaking_time == 9.0


def test_a_state_round_asks_its_epochs_planned_leader_whenever_each_peer_read_the_records():
    """At 32 peers on 2 cores 49 of 64 state rounds were given up, and the rest averaged in groups of about 5: no state
    round had a planned leader, so each search found its own. Now every peer asks the leader planned for the epoch
    the round carries, from the records its state averager read last: every few epochs, each peer's at another
    moment, some before the planned leader published its step and some after."""
    from hivemind.p2p import PeerID

    from collab.averaging.planned_leader import planned_leader
    from collab.averaging.round_plans import STATE_SEARCH

    peers = [PeerID(bytes([0x12, 0x20, i]) + bytes(31)).to_base58() for i in range(32)]
    after = {p: SimpleNamespace(epoch=8, client_mode=False) for p in peers}  # read after every peer stepped to 8
    epoch = 8  # the state round that follows the step to 8 carries 8 (hivemind gathers the epoch after the step)
    leader = planned_leader(after, epoch)
    before = dict(after, **{leader: SimpleNamespace(epoch=7, client_mode=False)})  # read before the leader stepped
    # (the gradient rounds' rule for a peer with no last group, the furthest epoch only, would name another)
    assert planned_leader(before, epoch, step_group=frozenset()) != leader

    def state_round(records, gathered):
        averager = type("StateAverager", (PlansRounds,), {"serializer": MSGPackSerializer, "kind": "state",
                                                          "banned": lambda self, peer: False})()
        averager._progress_cache = {"records": records, "task": None, "read_at": time.monotonic()}
        matchmaking = SimpleNamespace(target_group_size=None, min_matchmaking_time=3.0, client_mode=False,
                                      potential_leaders=SimpleNamespace(min_matchmaking_time=3.0),
                                      group_key_manager=SimpleNamespace(prefix="run_state_averager"))
        now = get_dht_time()
        step = SimpleNamespace(data_for_gather=MSGPackSerializer.dumps([1.0, 0, MSGPackSerializer.dumps(gathered)]),
                               scheduled_time=now + 3.0, deadline=now + 60.0)
        averager._plan_state_round(matchmaking, step, records)
        return averager._plan(), matchmaking

    for records in (after, before):
        plan, matchmaking = state_round(records, epoch)
        assert plan is not None and plan[0].to_base58() == leader
        assert plan[1] <= get_dht_time() + 0.5 * STATE_SEARCH * 3.0 + 0.1  # asked for the first half of the search
        assert matchmaking.target_group_size == 32 and matchmaking.min_matchmaking_time <= STATE_SEARCH * 3.0
        # matched under the run's key: a peer an epoch behind still averages with the swarm and learns its epoch
        assert matchmaking.group_key_manager.prefix == "run_state_averager"
    assert state_round(after, None)[0] is None  # a round that carries no epoch: hivemind's search alone


def test_the_budget_sets_both_of_hiveminds_copies_leaves_time_to_the_all_reduce_and_a_fresh_read_raises_the_target():
    three = {f"peer{i}": SimpleNamespace(epoch=3) for i in range(3)}
    size, averager, matchmaking = _fit(None, [3, 3])
    assert size == 2 and averager._budget.seconds == 6.0  # nothing measured yet: twice the configured 3 s
    averager._budget.after_round(found=2, expected=3)  # a round that missed a peer: the next one waits longer
    CheckedRounds._fit_group_to_swarm(averager, matchmaking, three)
    assert matchmaking.min_matchmaking_time == matchmaking.potential_leaders.min_matchmaking_time == 9.0  # capped
    # a round with 15 s left searches for at most a third of them
    CheckedRounds._fit_group_to_swarm(averager, matchmaking, three, deadline=get_dht_time() + 15.0)
    assert 4.9 < matchmaking.min_matchmaking_time == matchmaking.potential_leaders.min_matchmaking_time <= 5.0

    # a client never leads: it searches as long as any leader may, or every leader's later deadline refuses it
    _, client_averager, client = _fit(None, [3, 3])
    client.client_mode = True
    CheckedRounds._fit_group_to_swarm(client_averager, client, three)
    assert client.min_matchmaking_time == client.potential_leaders.min_matchmaking_time == 9.0

    averager._raise_group_target = lambda mm: CheckedRounds._raise_group_target(averager, mm)
    loop = asyncio.new_event_loop()
    try:
        for records_back, target in ((5, 5), (2, 3)):  # more peers raise the target; fewer do not lower it
            read = loop.create_future()  # the read of the records started for this round, not back yet
            averager._progress_cache = {"task": read, "records": {}}
            CheckedRounds._fit_group_to_swarm(averager, matchmaking, three)
            assert matchmaking.target_group_size == 3
            averager._progress_cache["records"] = {f"peer{i}": SimpleNamespace(epoch=3) for i in range(records_back)}
            read.set_result(None)
            loop.run_until_complete(asyncio.sleep(0))  # the read's callbacks run
            assert matchmaking.target_group_size == target
    finally:
        loop.close()


def test_a_first_gradient_round_is_planned_from_the_records_its_read_brings_back():
    # its first read of the run's records has just begun as a peer's first round starts; the round waits for it
    # (at most FIRST_PLAN_WAIT) and sizes its group from it: planned from nothing, 12 peers' first rounds split
    averager = SimpleNamespace(_budget=None, _last_group=frozenset())
    matchmaking = SimpleNamespace(target_group_size=None, min_matchmaking_time=3.0,
                                  potential_leaders=SimpleNamespace(min_matchmaking_time=3.0))
    for name in ("_first_progress_read", "_fit_group_to_swarm", "_raise_group_target", "_progress_state"):
        setattr(averager, name, getattr(CheckedRounds, name).__get__(averager))
    averager._match_within_epoch = lambda mm, step: 4
    averager._plan_round = lambda mm, step, epoch: setattr(averager, "planned", (mm.target_group_size, epoch))
    step = SimpleNamespace(deadline=None)

    async def read_back_after(seconds, peers):
        await asyncio.sleep(seconds)
        cache["records"] = {f"peer{i}": SimpleNamespace(epoch=4) for i in range(peers)}
        cache["read_once"] = True

    async def first_round(seconds, peers):
        cache["task"] = asyncio.ensure_future(read_back_after(seconds, peers))
        started = time.monotonic()
        await CheckedRounds._plan_gradient_round(averager, matchmaking, step, cache["records"])
        return time.monotonic() - started

    cache = averager._progress_cache = {"records": {}, "task": None}
    assert asyncio.run(first_round(0.3, 12)) < 1.0
    assert averager.planned == (12, 4)  # without the wait: no records, hivemind's search alone (size None)
    # later rounds use the last read at once; a first read that never comes back holds a round FIRST_PLAN_WAIT
    assert asyncio.run(first_round(30.0, 12)) < 0.1 and averager.planned == (12, 4)
    cache.clear(), cache.update(records={}, task=None)
    import collab.averaging.round_plans as rounds
    waited = rounds.FIRST_PLAN_WAIT
    try:
        rounds.FIRST_PLAN_WAIT = 0.2
        assert 0.2 <= asyncio.run(first_round(30.0, 12)) < 1.0 and averager.planned == (None, 4)
    finally:
        rounds.FIRST_PLAN_WAIT = waited


def test_stores_of_the_progress_record_grow_apart_with_the_swarm_mid_epoch_and_near_its_end():
    # each store is answered with every peer's record by every node it reaches: N^2 per peer at a fixed period
    from collab.modes.tracker import (NEAR_THE_END_STORES_PER_READ, REPORT_EVERY, REPORT_EVERY_MOST,
                                      HonestProgressTracker)
    from collab.records.shared_reads import share_for

    def tracker(peers: int, stored_ago: float, eta_in: float = 60.0):
        fake = SimpleNamespace(global_progress=SimpleNamespace(num_peers=peers, samples_accumulated=100,
                                                               eta_next_epoch=get_dht_time() + eta_in),
                               target_batch_size=1000, _stored_epoch=3, _stored_at=time.monotonic() - stored_ago,
                               _reached_stored=None, local_progress=SimpleNamespace(epoch=3, samples_accumulated=0))
        fake.report_every = lambda: HonestProgressTracker.report_every(fake)  # the tracker's own periods
        fake.near_the_end_every = lambda: HonestProgressTracker.near_the_end_every(fake)
        return fake

    every = [HonestProgressTracker.report_every(tracker(peers, 0)) for peers in (0, 1, 4, 8, 12, 64)]
    assert every == [REPORT_EVERY] * 3 + [2 * REPORT_EVERY, 3 * REPORT_EVERY, REPORT_EVERY_MOST], every
    for peers, stored_ago, due in ((4, 0.6, True), (12, 0.6, False), (12, 1.6, True), (64, 2.4, False)):
        assert HonestProgressTracker._store_due(tracker(peers, stored_ago), 3, 200) is due, (peers, stored_ago)
    # near an epoch's end a record is stored a few times per read of the key (share_for(N), itself growing with N),
    # not after every micro-batch; a new epoch at once, whatever the swarm's size
    for peers, stored_ago, due in ((2, 0.1, False), (2, 0.13, True), (64, 0.5, False), (64, 0.63, True)):
        near = tracker(peers, stored_ago, eta_in=0.5)
        assert HonestProgressTracker._store_due(near, 3, 200) is due, (peers, stored_ago)
        assert HonestProgressTracker._store_due(near, 4, 0)
    assert HonestProgressTracker.near_the_end_every(tracker(64, 0)) == share_for(64) / NEAR_THE_END_STORES_PER_READ
    # the micro-batch at which this peer sees the target reached (it stops for the round) is stored at once, once
    reached = tracker(2, 0.01)  # the swarm's count 900, 150 of them this peer's, its last store 0.01 s ago
    reached.global_progress.samples_accumulated, reached.local_progress.samples_accumulated = 900, 150
    assert not HonestProgressTracker._store_due(reached, 3, 160)  # 910 with this micro-batch: not yet, too soon
    assert HonestProgressTracker._store_due(reached, 3, 260)  # 1010 with this one: reached, stored at once
    assert not HonestProgressTracker._store_due(reached, 3, 270)  # once an epoch
    assert not HonestProgressTracker._store_due(tracker(2, 0.13), 3, 200)  # mid-epoch (ETA a minute away): REPORT_EVERY


def test_scheduled_reads_of_the_progress_key_grow_apart_with_the_swarm():
    # each read brings every peer's record back: N per read, at a fixed period N per peer and second
    from collab.modes.tracker import HonestProgressTracker
    from collab.records.shared_reads import PEERS_PER_READ, READ_EVERY_MOST

    fake = SimpleNamespace(min_refresh_period=0.5)
    every = [HonestProgressTracker.read_every(fake, peers) for peers in (0, 1, PEERS_PER_READ, 12, 32, 64, 1000)]
    assert every == [0.5, 0.5, 0.5, 0.75, 2.0, READ_EVERY_MOST, READ_EVERY_MOST], every
    slow = SimpleNamespace(min_refresh_period=4.0)  # a run that reads rarely already: never more often, not rarer
    assert HonestProgressTracker.read_every(slow, 64) == 4.0


def test_a_nodes_dht_requests_are_counted_by_rpc_and_by_key_with_their_bytes():
    from hivemind.dht.routing import DHTID

    class Message:
        def __init__(self, size, keys=()):
            self.size, self.keys = size, [DHTID.generate(source=k).to_bytes() for k in keys]

        def ByteSize(self):
            return self.size

    class Stub:
        async def rpc_find(self, request, timeout=None):
            return Message(300)

        async def rpc_store(self, request, timeout=None):
            raise TimeoutError("no answer")

    protocol = SimpleNamespace(get_stub=lambda peer: Stub())
    counts = DHTRequests()
    count_dht_requests(protocol, counts.count)
    count_dht_requests(protocol, counts.count)  # once per node: not counted twice

    async def talk():
        for _ in range(3):
            await protocol.get_stub("peer").rpc_find(Message(40, ["run_progress"]), timeout=1)
        with pytest.raises(TimeoutError):
            await protocol.get_stub("peer").rpc_store(Message(500, ["run_metrics", "someone's key"]), timeout=1)
        # each epoch's gradient rounds are matched under a key of their own (grad_averager.EpochGroups): one row
        for epoch in (3, 4):
            await protocol.get_stub("peer").rpc_find(Message(10, [f"run_grad_averager_epoch{epoch}.0b"]), timeout=1)

    asyncio.run(talk())
    assert counts.report(names=known_keys("run"))["by_key"]["other"]["requests"] == 3  # no epochs named
    report = counts.report(names=known_keys("run", epochs=range(5)))
    assert report["requests"] == 6 and report["bytes_sent"] == 3 * 40 + 500 + 2 * 10
    assert report["bytes_received"] == 5 * 300
    assert report["by_rpc"]["find"] == {"requests": 5, "failed": 0, "bytes_sent": 140, "bytes_received": 1500}
    assert report["by_rpc"]["store"] == {"requests": 1, "failed": 1, "bytes_sent": 500, "bytes_received": 0}
    # by key, the heaviest first; a two-key request's bytes shared between its keys; unknown keys are "other"
    assert report["by_key"] == {"run_progress": {"requests": 3, "bytes": 1020},
                                "run_grad_averager_epoch*.0b (rounds)": {"requests": 2, "bytes": 620},
                                "run_metrics": {"requests": 1, "bytes": 250}, "other": {"requests": 1, "bytes": 250}}
    assert list(report["by_key"]) == ["run_progress", "run_grad_averager_epoch*.0b (rounds)", "run_metrics", "other"]


def test_a_rounds_matchmaking_and_all_reduce_seconds_reach_the_summary():
    from collab.averaging.traffic import TrafficLog
    from collab.train.summary import Summary

    log = TrafficLog()
    runner = SimpleNamespace(bytes_sent=100, bytes_received=100, values_moved=50)
    # PowerSGD's round: two all-reduces in one group (one search for it)
    TrafficLog.put(log.queue, runner, values_all_reduced=50, gradient_values=100, seconds=(1.5, 0.25))
    TrafficLog.put(log.queue, runner, values_all_reduced=50, gradient_values=100, seconds=(1.5, 0.5))
    time.sleep(0.5)  # both in the pipe (a queue's feeder thread sends them), as when the trainer ends the round
    first = log.end_round(wait=2.0)
    TrafficLog.put(log.queue, runner, values_all_reduced=50, gradient_values=100, seconds=(0.5, 0.25))
    log.end_round(wait=2.0)
    assert (first.matchmaking_seconds, first.allreduce_seconds) == (1.5, 0.75)
    summary = Summary()
    log.copy_to(summary)
    assert summary.round_seconds == {"rounds": 2, "matchmaking": 2.0, "allreduce": 1.0}


def test_with_wait_peers_the_first_step_waits_until_the_tracker_counts_the_others():
    from collab.modes.base import SwarmOptimizer

    counted = iter([1, 1, 2, 3])  # what each read of the swarm's progress shows

    def refresh(timeout):
        tracker.global_progress.num_peers = next(counted)
        tracker.read_at = time.monotonic()
        return True

    tracker = SimpleNamespace(global_progress=SimpleNamespace(num_peers=1), read_at=float("-inf"), refresh=refresh,
                              local_progress=SimpleNamespace(samples_accumulated=0))
    handed = []  # the trainer's view handed to the gradient averager (read_progress_soon), once all are counted
    opt = SimpleNamespace(tracker=tracker, _start_with=None, read_progress_soon=lambda: handed.append(
        tracker.global_progress.num_peers))
    opt._waiting_for_the_others = lambda: SwarmOptimizer._waiting_for_the_others(opt)
    assert not SwarmOptimizer._waiting_for_the_others(opt)  # no --wait-peers: nothing to wait for
    SwarmOptimizer.start_together(opt, 3, timeout=60.0)
    # the training loop computes until this peer has samples to report (its record is what the others count)
    assert not SwarmOptimizer.holding_for_the_others(opt)
    tracker.local_progress.samples_accumulated = 64
    waits = []
    for _ in range(4):
        tracker.read_at = float("-inf")  # (each step comes after the last read has aged)
        waits.append(SwarmOptimizer.holding_for_the_others(opt))
    assert waits == [True, True, True, False] and opt._start_with is None  # then never again
    assert handed == [3]  # the first round's plan: from the view that counted everyone
    SwarmOptimizer.start_together(opt, 5, timeout=0.0)  # the wait is bounded: after it, training goes on
    tracker.global_progress.num_peers = 1
    assert not SwarmOptimizer._waiting_for_the_others(opt)
