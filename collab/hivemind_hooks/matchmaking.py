"""The run-time patches collab makes to hivemind's matchmaking (its Matchmaking object, made per averager in the
averager's process): whom a follower asks and when, how long it waits for its group's start, how often it reads the
group key. One function each, with one line on why; each applies once per Matchmaking. Nothing here runs at import
time: collab.averaging.robust_rounds calls them. (The other patches: collab.hivemind_hooks.patches.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

from hivemind.averaging.group_info import GroupInfo
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time

_log = logging.getLogger(__name__)


def never_ask_leaders(matchmaking, refused: Callable) -> None:
    """hivemind's Matchmaking asks every leader it finds in the DHT, and any a disbanding leader suggests, through
    one private method: a leader `refused(peer_id)` names (a banned peer) is never asked. Once per Matchmaking."""
    if getattr(matchmaking, "_collab_checked", False):
        return
    request_join = matchmaking._request_join_group

    async def unless_refused(leader):
        return None if refused(leader) else await request_join(leader)

    matchmaking._request_join_group, matchmaking._collab_checked = unless_refused, True


LEADER_LOOK = 0.25  # seconds between a planned leader's looks, past its plan's window, at whether anyone follows it


def follow_a_plan(matchmaking, plan: Callable[[], Optional[tuple]], slack: float, ask_again: float,
                  what: str = "round") -> None:
    """A search that asks a planned leader first (collab.averaging.planned_leader). `plan()` says, each time hivemind
    takes its next leader to ask: None (hivemind's search), or (leader PeerID, until, latest: dht times). Before
    `until`, a peer whose planned leader is another asks it (again after `ask_again` s when it was asked a moment ago:
    not searching yet), and the planned leader asks no one; after it, hivemind's search goes on, unless the leader's
    last answer said its search is yet to begin (NOT_DECLARED: collab.averaging.woken_leader): then the peer asks on
    until `latest`. At 64 peers on 2 cores the planned leader began its search 8 s after the first of its followers,
    whose 3-s plans had ended: they grouped apart in hivemind's search (10 groups, none a majority). A planned leader
    with followers leads its whole search: it hands over to hivemind's search only at its declared expiration (then its
    group begins) or once nobody follows it. hivemind's pop_next_leader, asked at the plan's end, ended the search at
    once (the averager had declared itself meanwhile, which reads as a timeout, and a leader with followers begins on
    one): at 32 peers on 2 cores the leader began its group of 11 at 2.5 s of a 4.9-s search, and the 21 that came
    after it grouped apart. A planned leader accepts a follower whose search ends up to `slack` s before its own
    (hivemind refuses such a follower: its join request would expire first). Wraps PotentialLeaders.pop_next_leader
    and Matchmaking._check_reasons_to_reject; hears answers through hear_first_answers. Once per Matchmaking."""
    if getattr(matchmaking, "_collab_planned", False):
        return
    leaders = matchmaking.potential_leaders
    pop_next_leader, check = leaders.pop_next_leader, matchmaking._check_reasons_to_reject
    asked, heard = [float("-inf")], hear_first_answers(matchmaking)

    def coming(leader) -> bool:
        code, when = heard.get(leader, (None, float("-inf")))
        return code == averaging_pb2.NOT_DECLARED and when >= asked[0]  # (its answer to the last ask)

    async def planned_first():
        while True:
            current, now = plan(), get_dht_time()
            if current is not None and current[0] == matchmaking.peer_id:  # the planned leader waits for followers
                ends = leaders.declared_expiration_time if matchmaking.current_followers else float("-inf")
                if now < current[1] or now < ends < float("inf"):
                    await asyncio.sleep(max(0.0, min(LEADER_LOOK, max(current[1], ends) - now)))
                    continue
            if current is None or (now >= current[1] and not (now < current[2] and coming(current[0]))):
                return await pop_next_leader()
            leader = current[0]
            wait = asked[0] + ask_again - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            if now >= current[1]:
                _log.debug(f"{what}: planned leader ...{str(leader)[-6:]} has yet to begin its search: asked again "
                           f"{now - current[1]:.1f} s past the plan")
            asked[0] = time.monotonic()
            return leader

    def leniently(request, context):
        current = plan()
        declared = leaders.declared_expiration_time
        if (current is not None and current[0] == matchmaking.peer_id
                and isinstance(request.expiration, float) and declared - slack <= request.expiration < declared):
            lenient = type(request)()
            lenient.CopyFrom(request)
            lenient.expiration = declared
            return check(lenient, context)
        return check(request, context)

    leaders.pop_next_leader, matchmaking._check_reasons_to_reject = planned_first, leniently
    matchmaking._collab_planned = True


def hear_first_answers(matchmaking) -> dict:
    """hivemind's join request reads a leader's first answer and keeps only whether it was ACCEPTED. Returns a dict
    that each answer fills in: leader PeerID -> (its first answer's code, time.monotonic() when heard). Wraps the
    Matchmaking's servicer type (whose get_stub the request calls) for this Matchmaking only. Once per Matchmaking."""
    if isinstance(matchmaking._servicer_type, _HeardStubs):
        return matchmaking._servicer_type.heard
    matchmaking._servicer_type = _HeardStubs(matchmaking._servicer_type)
    return matchmaking._servicer_type.heard


class _HeardStubs:
    """A servicer type whose join-request streams tell `heard` each leader's first answer."""

    def __init__(self, servicer_type):
        self._servicer_type, self.heard = servicer_type, {}

    def __getattr__(self, name):
        return getattr(self._servicer_type, name)

    def get_stub(self, p2p, peer, *, namespace=None):
        return _HeardStub(self._servicer_type.get_stub(p2p, peer, namespace=namespace), peer, self.heard)


class _HeardStub:
    """A leader's stub whose join-request stream tells `heard` its first answer."""

    def __init__(self, stub, peer, heard: dict):
        self._stub, self._peer, self._heard = stub, peer, heard

    def __getattr__(self, name):
        return getattr(self._stub, name)

    async def rpc_join_group(self, request):
        return self._first_heard(await self._stub.rpc_join_group(request))

    async def _first_heard(self, stream):
        try:
            first = True
            async for message in stream:
                if first:
                    self._heard[self._peer], first = (message.code, time.monotonic()), False
                yield message
        finally:
            await stream.aclose()


class _AcceptedToGroup(asyncio.Event):
    """hivemind's Matchmaking.was_accepted_to_group, set from a leader's ACCEPTED until the follower's join request
    ends. While it is set, the matchmaking's request_timeout (which the wait for the group's start reads) is
    `factor` times its own; when it is cleared, `ended(leader, seconds accepted, whether the group began)`."""

    def __init__(self, matchmaking, factor: float, ended: Callable[[object, float, bool], None]):
        super().__init__()
        self._matchmaking, self._factor, self._ended = matchmaking, factor, ended
        self._own, self._since = matchmaking.request_timeout, None

    def set(self) -> None:
        self._matchmaking.request_timeout, self._since = self._own * self._factor, time.monotonic()
        super().set()

    def unscaled(self) -> None:
        """A new join request waits for its answer request_timeout, as in hivemind: also the one made, while this is
        still set, to the leader a disbanding leader suggests (patience there would slow the breaking of hivemind's
        deadlocks of peers asking each other)."""
        self._matchmaking.request_timeout = self._own

    def clear(self) -> None:
        super().clear()
        self._matchmaking.request_timeout = self._own
        if self._since is not None:
            self._ended(self._matchmaking.current_leader, time.monotonic() - self._since,
                        self._matchmaking.assembled_group.done())
            self._since = None


def patient_followers(matchmaking, factor: float, ended: Callable[[object, float, bool], None]) -> None:
    """A follower that a leader accepted waits for the group's start (hivemind's BEGIN_ALLREDUCE) until its own
    search's deadline plus `factor` x request_timeout, not plus one: a CPU-starved leader that began the group a
    moment after its follower stopped waiting counted it in, and the group's members then waited next_chunk_timeout
    for a peer that was looking for another group (a failed round, 30 s, in CI). Waiting longer costs nothing when
    the leader is gone (its stream closes) or disbands (it says so). `ended(leader, seconds, began)` hears of
    every accepted request as it ends. Once per Matchmaking, before its first search."""
    if isinstance(matchmaking.was_accepted_to_group, _AcceptedToGroup):
        return
    accepted = _AcceptedToGroup(matchmaking, factor, ended)
    request_join = matchmaking._request_join_group

    async def request(leader):
        accepted.unscaled()
        return await request_join(leader)

    matchmaking.was_accepted_to_group, matchmaking._request_join_group = accepted, request


def time_matchmaking(matchmaking, record: Callable[[float, Optional[GroupInfo]], None]) -> None:
    """Each search for a group (hivemind's Matchmaking.look_for_group, whatever it finds) is timed:
    `record(seconds, the group or None)` after it ends, so a round's matchmaking is measured apart from its
    all-reduce, and what it found is known. Once per Matchmaking."""
    if getattr(matchmaking, "_collab_timed", False):
        return
    look_for_group = matchmaking.look_for_group

    async def timed(*args, **kwargs):
        started, group = time.monotonic(), None
        try:
            group = await look_for_group(*args, **kwargs)
            return group
        finally:
            record(time.monotonic() - started, group)

    matchmaking.look_for_group, matchmaking._collab_timed = timed, True


def pace_group_reads(matchmaking, every: float) -> None:
    """hivemind's matchmaking re-reads its group key from the DHT each time its queue of leaders runs dry, and a peer
    that would lead (every other peer ranks below it) finds it dry at once, again and again: in a 2-peer swarm each
    peer sent 84 DHT finds a second, each also a round trip to the DHT's process. Start at most one read every
    `every` seconds (a follower still hears of a leader within that; a leader waits for join requests, which
    come to it directly). Once per Matchmaking."""
    keys = matchmaking.group_key_manager
    if getattr(keys, "_collab_paced", False):
        return
    get_averagers, last = keys.get_averagers, [float("-inf")]

    async def paced(*args, **kwargs):
        wait = last[0] + every - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        last[0] = time.monotonic()
        found = await get_averagers(*args, **kwargs)
        _log.debug(f"group key read: {len(found)} averager(s) in {time.monotonic() - last[0]:.2f} s")
        return found

    keys.get_averagers, keys._collab_paced = paced, True
