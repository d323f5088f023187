"""A sender its reducer left out of a round: the group's average, replayed from a groupmate, instead of a retry.

A reducer leaves a sender out when the sender's parts come too late (hivemind's next_chunk_timeout: a peer starved
of CPU, a slow uplink): it bans the sender for the round, averages its span without it, and either ends the
sender's reply stream short ("sent 3 parts, but we expected 4") or answers INTERNAL_ERROR. Every other member of
the group has the whole average and steps on it. The sender, left with its own values for that span, saw a "lost
reducer"; hivemind's retry then matched it again in an epoch its group had already left, and it found nobody (or
only the others left out), stepped on its own gradients and re-synced by a download: at 32 peers on 2 cores, 14
peers at once, and the swarm broke into seven groups for the next epoch.

Only the reducer knows whether it left one late sender out of a round its group made, or failed its whole round
(its runner failed or was cancelled; or it gave up on most senders, as a starved reducer did at 32 peers on 2 cores:
31 of 32 lost it, and their retry without it was right). So the reducer says it (`TellsLeftOut`): its answer to a
sender it banned ends with INTERNAL_ERROR marked LEFT_OUT (`AveragingData.peer_id`, a field hivemind neither sets
nor reads there) when its own round has not failed and it banned fewer than half the senders, so most of the group
has its whole span; and collab.averaging.known_groups answers a part that comes after such a round ended here the
same way. A sender told so ends its round at once (no retry in an epoch its group has left) and asks its groupmates
for the round they applied (collab.averaging.round_replay). Any other lost reducer is hivemind's retry, as before.
A peer of an older collab sees INTERNAL_ERROR, a lost reducer, as before.

A groupmate's served round is untrusted. Besides round_replay's checks (shape, finite, norm), it must agree with
every part this peer did get from the group's other reducers (`disagreement`): only the span of the reducer that
left this peer out is taken on the donor's word, and the reducers that left it out are never asked.
"""

from __future__ import annotations

from typing import AsyncIterator, Optional

import torch
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from collab.hivemind_hooks.allreduce import RunnerHooks

LEFT_OUT = b"collab:left-out"  # on a reducer's INTERNAL_ERROR: "I left you out; the group has the round"
AGREEMENT = 1e-4  # a served value may differ from this peer's by this much of the tensor's largest value (rounding)


class LeftOutOfRound(MatchmakingException):
    """This peer's parts reached a live reducer too late and it was left out of that span; the rest of its group
    averaged without it. `members`: the groupmates who may have the round (base58); `by`: the reducers that left this
    peer out (never asked for it)."""

    def __init__(self, message: str, members=(), by=()):
        super().__init__(message)
        self.members, self.by = list(members), list(by)

    def __reduce__(self):  # (it crosses from the averager's process to the trainer's in an MPFuture)
        return type(self), (str(self), self.members, self.by)


def leaves_few_out(runner) -> bool:
    """Whether `runner`, as a reducer, banned fewer than half its senders: the rest of its group has its span."""
    return 2 * len(runner.banned_senders) < len(runner.sender_peer_ids)


def leaves_out(runner, sender) -> bool:
    """Whether `runner` (this peer's all-reduce, as a reducer) left `sender` out of a round its group still makes:
    banned, its own round not failed, and fewer than half the senders banned."""
    future = runner._future
    failed = future.done() and (future.cancelled() or future.exception() is not None)
    return sender in runner.banned_senders and not failed and leaves_few_out(runner)


def left_out_answer() -> averaging_pb2.AveragingData:
    return averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR, peer_id=LEFT_OUT)


class TellsLeftOut(RunnerHooks):
    """An AllReduceRunner mixin: as a reducer, says which senders it left out of a round its group makes, and fails
    the round for all when it left out most of them; as a sender, notes the reducers that say so (`left_us_out`:
    peer indices)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.left_us_out: set[int] = set()

    def replies_from(self, stream: AsyncIterator, peer_index: int) -> AsyncIterator:
        return self._read_left_out(super().replies_from(stream, peer_index), peer_index)

    async def _read_left_out(self, stream: AsyncIterator, peer_index: int) -> AsyncIterator:
        async for message in stream:
            if message.code != averaging_pb2.AVERAGED_PART and message.peer_id == LEFT_OUT:
                self.left_us_out.add(peer_index)
            yield message

    async def serve_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                   ) -> AsyncIterator[averaging_pb2.AveragingData]:
        replies, other, sender = 0, False, context.remote_id
        async for message in super().serve_aggregate_part(stream, context):
            if message.code == averaging_pb2.AVERAGED_PART:
                replies += 1
                if replies == self.tensor_part_reducer.num_parts and not leaves_few_out(self):
                    # most senders were left out and run the round again without this reducer: the few it kept must
                    # too, not step on a span only they have (its last reply withheld: a lost reducer to them)
                    message = averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
            elif message.code == averaging_pb2.INTERNAL_ERROR and leaves_out(self, sender):
                message.peer_id = LEFT_OUT  # (hivemind's answer to a sender whose next part timed out)
            other = other or message.code != averaging_pb2.AVERAGED_PART
            yield message
        # hivemind's reducer ends a banned sender's stream short, with no word: say why
        if not other and replies < self.tensor_part_reducer.num_parts and leaves_out(self, sender):
            yield left_out_answer()


def left_out_error(peer_ids: list, me, left_us_out: set[int]) -> LeftOutOfRound:
    """The failure of a round the reducers at `left_us_out` (indices into the group's `peer_ids`) left `me` out of."""
    by = sorted(peer_ids[i].to_base58() for i in left_us_out)
    members = [peer.to_base58() for peer in peer_ids if peer != me and peer.to_base58() not in by]
    return LeftOutOfRound(f"reducer(s) {', '.join('...' + peer[-6:] for peer in by)} left this peer out of the round "
                          "(its parts came after next_chunk_timeout: a busy CPU or a slow uplink); its group averaged "
                          "without it", members, by)


def disagreement(served: list[torch.Tensor], partial: list[torch.Tensor], got: list[torch.Tensor]) -> Optional[str]:
    """Why a served round cannot be the one this peer's group made (None: it can be). `partial`: this peer's
    tensors plus the updates it received; `got`: where it received an average (a reducer that answered)."""
    if len(served) != len(partial):
        return "an average of the wrong shape"
    for index, (value, mine, mask) in enumerate(zip(served, partial, got)):
        if value.shape != mine.shape:
            return "an average of the wrong shape"
        scale = float(mine.abs().max()) if mine.numel() else 0.0  # (not the served value's: a forger's to inflate)
        off = (value.float() - mine.float()).abs()[mask]
        if off.numel() and float(off.max()) > AGREEMENT * scale:
            return f"an average that differs from the parts this peer's group sent it (tensor {index})"
    return None
