"""A planned leader's search (collab.hivemind_hooks.matchmaking.follow_a_plan): with followers, it leads to its end."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time

from collab.hivemind_hooks.matchmaking import LEADER_LOOK, follow_a_plan, hear_first_answers


def _search(window: float, expires: float, followers: dict):
    """A Matchmaking as follow_a_plan wraps it: this peer is the epoch's planned leader, its plan's window ends in
    `window` s and its declared search in `expires` s. Returns it and the times hivemind's pop_next_leader was asked."""
    popped = []

    async def pop_next_leader():
        popped.append(time.monotonic())
        # what hivemind does when the averager declared itself during the plan: a timeout at once, on which a
        # leader with followers begins its group
        raise asyncio.TimeoutError("pop_next_leader was invalidated: re-declared averager in background")

    me = "leader"
    now = get_dht_time()
    leaders = SimpleNamespace(pop_next_leader=pop_next_leader, declared_expiration_time=now + expires)
    matchmaking = SimpleNamespace(potential_leaders=leaders, _check_reasons_to_reject=lambda request, context: None,
                                  peer_id=me, current_followers=followers, _servicer_type=SimpleNamespace())
    follow_a_plan(matchmaking, plan=lambda: (me, now + window, now + window), slack=1.0, ask_again=0.3)
    return matchmaking, popped


def _seconds_to_pop(matchmaking, popped) -> float:
    started = time.monotonic()
    try:
        asyncio.run(asyncio.wait_for(matchmaking.potential_leaders.pop_next_leader(), 5.0))
    except asyncio.TimeoutError:
        pass
    assert len(popped) == 1
    return popped[0] - started


def test_a_planned_leader_with_followers_leads_its_whole_search():
    """At 32 peers on 2 cores the planned leader began its group of 11 when its plan's window ended, at 2.5 s of its
    4.9-s search, and the 21 peers that began after that grouped apart (no group was a majority)."""
    matchmaking, popped = _search(window=0.2, expires=1.0, followers={"f1": object()})
    assert 1.0 - LEADER_LOOK <= _seconds_to_pop(matchmaking, popped) < 1.0 + 2 * LEADER_LOOK


def test_a_planned_leader_nobody_follows_hands_over_at_its_plans_end():
    """With no follower at its plan's end (its followers went elsewhere) it joins whoever hivemind's search finds."""
    matchmaking, popped = _search(window=0.2, expires=1.0, followers={})
    assert _seconds_to_pop(matchmaking, popped) < 0.2 + 2 * LEADER_LOOK


def test_a_planned_leader_whose_followers_leave_hands_over_then():
    followers = {"f1": object()}
    matchmaking, popped = _search(window=0.1, expires=3.0, followers=followers)

    async def leave():
        await asyncio.sleep(0.5)
        followers.clear()

    async def both():
        asyncio.get_running_loop().create_task(leave())
        try:
            await matchmaking.potential_leaders.pop_next_leader()
        except asyncio.TimeoutError:
            pass

    started = time.monotonic()
    asyncio.run(asyncio.wait_for(both(), 5.0))
    assert 0.5 <= popped[0] - started < 0.5 + 2 * LEADER_LOOK


def _follower(code, window: float = 0.1, latest: float = 1.0):
    """A follow_a_plan search of a peer whose planned leader answers each ask with `code`; hivemind's own search
    (pop_next_leader) answers "hivemind"."""
    async def pop_next_leader():
        return "hivemind"

    now = get_dht_time()
    leaders = SimpleNamespace(pop_next_leader=pop_next_leader, declared_expiration_time=now + 5.0)
    servicer = SimpleNamespace(get_stub=None)
    matchmaking = SimpleNamespace(potential_leaders=leaders, _check_reasons_to_reject=lambda request, context: None,
                                  peer_id="me", current_followers={}, _servicer_type=servicer)
    follow_a_plan(matchmaking, plan=lambda: ("leader", now + window, now + latest), slack=1.0, ask_again=0.05)
    heard = matchmaking._servicer_type.heard  # (hear_first_answers: what each ask's first answer said)

    async def asks_until_hivemind() -> tuple[int, float]:
        asked, started = 0, time.monotonic()
        while (leader := await leaders.pop_next_leader()) == "leader":
            asked += 1
            heard[leader] = (code, time.monotonic())  # as the join request's stream hears it
        return asked, time.monotonic() - started

    return asyncio.run(asyncio.wait_for(asks_until_hivemind(), 5.0))


def test_a_planned_leader_that_says_its_search_is_yet_to_begin_is_asked_on_past_the_plan():
    """At 64 peers on 2 cores the planned leader began its search 8 s after the first of its followers, whose 3-s plans
    had ended: they grouped apart in hivemind's search, 10 groups and none a majority."""
    asked, seconds = _follower(averaging_pb2.NOT_DECLARED)
    assert 0.9 <= seconds < 1.5 and asked >= 10  # asked on until `latest`, then hivemind's search
    asked, seconds = _follower(averaging_pb2.NOT_LOOKING_FOR_GROUP)  # its round is over (or it is not a leader)
    assert seconds < 0.4 and asked <= 4  # hivemind's search at the plan's end


def test_the_first_answer_of_each_join_request_is_heard():
    class Stub:
        async def rpc_join_group(self, request):
            async def stream():
                for code in (averaging_pb2.ACCEPTED, averaging_pb2.BEGIN_ALLREDUCE):
                    yield SimpleNamespace(code=code)
            return stream()

    matchmaking = SimpleNamespace(_servicer_type=SimpleNamespace(get_stub=lambda p2p, peer, namespace=None: Stub()))
    heard = hear_first_answers(matchmaking)
    assert hear_first_answers(matchmaking) is heard  # once per Matchmaking

    async def join():
        stream = await matchmaking._servicer_type.get_stub(None, "leader", namespace="x").rpc_join_group(None)
        codes = [message.code async for message in stream]
        await stream.aclose()
        return codes

    assert asyncio.run(join()) == [averaging_pb2.ACCEPTED, averaging_pb2.BEGIN_ALLREDUCE]  # passed on whole
    assert heard["leader"][0] == averaging_pb2.ACCEPTED
