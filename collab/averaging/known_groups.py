"""Parts sent for a group this peer is not in are answered at once, not held until its next round.

hivemind's handler of a sender's parts, finding the parts' group not among this averager's running groups, waits
until this averager registers its next group: made for a follower whose leader's start is a moment late while its
groupmates already send. But a peer that a leader counted in after the peer had stopped waiting for that leader's
start (a CPU-starved moment; collab.hivemind_hooks.matchmaking.patient_followers makes it rarer) never registers that
group. Its groupmates' parts then waited there until its next round, and each groupmate's round for the sender's
patience (reducer_timeout, 2 x next_chunk_timeout: 60 s, a whole averaging_timeout, in a run of the SwAV swarm
test) before it failed, while the peer they waited for looked for them and found nobody.

Here a part for an unknown group waits only while that group can still come to this peer: this peer was accepted
by a leader whose start may be on its way, or its search found that group and its round has not registered it yet
(a found group waits for the trainer's trigger). Otherwise the sender hears BAD_GROUP_ID after
UNKNOWN_GROUP_GRACE, and its runner (collab.averaging.robust_rounds) leaves this peer out as a sender as well:
the round runs again at once without it, while it still has time, and the peer it left out is still looking.

A part for a group whose all-reduce ended here, with most of its senders, comes from a sender too late for it (this
peer's reducer left it out after next_chunk_timeout): it hears so at once (collab.averaging.left_out: it then
replays its group's round), not after its whole patience and BAD_GROUP_ID.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import AsyncIterator, Optional

from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, as_aiter

from collab.averaging.left_out import left_out_answer
from collab.hivemind_hooks.averager import AveragerHooks

UNKNOWN_GROUP_GRACE = 1.0  # seconds a part's group may be unknown and not on its way before the sender is told
LOOK_EVERY = 0.1  # seconds between looks at whether the group came
WAIT_FALLBACK = 60.0  # seconds the longest wait for a group on its way, when no reducer_timeout is set
FOUND_KEPT = 4  # the last groups this peer's searches found (a found group may never start: a cancelled step)
BAD_GROUP = averaging_pb2.MessageCode.Name(averaging_pb2.BAD_GROUP_ID)


class KnownGroupsOnly(AveragerHooks):
    """A DecentralizedAverager mixin: a part for a group this peer is not in, and will not be in, gets BAD_GROUP_ID
    within UNKNOWN_GROUP_GRACE (see the module). Call `group_found` with each group a search finds."""

    def _found_groups(self) -> deque:
        if not hasattr(self, "_groups_found"):
            self._groups_found = deque(maxlen=FOUND_KEPT)
        return self._groups_found

    def _groups_ended(self) -> dict:
        if not hasattr(self, "_ended_groups"):
            self._ended_groups = {}
        return self._ended_groups

    def group_ended(self, group_id: bytes, tell_late: bool) -> None:
        """This averager's all-reduce for `group_id` has ended, its reductions done; `tell_late`: a sender whose parts
        come after this hears that it was left out (collab.averaging.left_out)."""
        ended = self._groups_ended()
        ended[group_id] = tell_late
        while len(ended) > FOUND_KEPT:
            del ended[next(iter(ended))]

    def group_found(self, group_info: Optional[GroupInfo]) -> None:
        if group_info is not None:
            self._found_groups().append(group_info.group_id)

    def _group_may_come(self, group_id: bytes) -> bool:
        # (PowerSGD's rounds run under the group's id with a phase appended: hence startswith)
        if any(group_id.startswith(found) for found in self._found_groups()):
            return True
        matchmaking = getattr(self, "_matchmaking", None)
        if matchmaking is None:
            return False
        if matchmaking.current_leader is not None:  # accepted: its leader's start may be on its way
            return True
        assembled = matchmaking.assembled_group
        return (assembled.done() and not assembled.cancelled() and assembled.exception() is None
                and group_id.startswith(assembled.result().group_id))

    async def serve_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                   ) -> AsyncIterator[averaging_pb2.AveragingData]:
        request = await anext(stream)
        if request.group_id not in self._running_groups and self._groups_ended().get(request.group_id):
            yield left_out_answer()  # a sender too late for a round its group made here: it was left out
            return
        if request.group_id not in self._running_groups and not await self._group_came(request.group_id):
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        async for message in super().serve_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    async def _group_came(self, group_id: bytes) -> bool:
        """Whether the group registered while it could still come (see the module), at most _longest_wait()."""
        started = unknown_since = time.monotonic()
        while group_id not in self._running_groups:
            now = time.monotonic()
            if self._group_may_come(group_id):
                unknown_since = now
            elif now - unknown_since >= UNKNOWN_GROUP_GRACE:
                return False
            if now - started >= self._longest_wait():
                return False  # the sender has stopped listening by now
            await asyncio.sleep(LOOK_EVERY)
        return True

    def _longest_wait(self) -> float:
        return getattr(self, "allreduce_kwargs", {}).get("reducer_timeout") or WAIT_FALLBACK
