"""Averaging with the run's members only: a DecentralizedAverager mixin that enforces collab.run.gate's member
list on every averaging RPC (join_group, aggregate_part, download_state) and in every group it averages in.

hivemind's averaging RPCs carry no auth, but libp2p authenticates the remote peer id of each stream, and
hivemind hands it to the handler: that peer id is checked against the members read from the DHT.
"""

from __future__ import annotations

from typing import AsyncIterator, Optional

from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2

from collab.averaging.reply_streams import replies_in_flight
from collab.hivemind_hooks.averager import AveragerHooks
from collab.hivemind_hooks.patches import donors_reached_through
from collab.run.gate import MemberGate

REPLY_DRAIN = 3.0  # seconds a leaving averager waits for groupmates to read the averaged parts it holds


class _NoState:
    """A donor that is not asked: its download yields nothing."""

    async def rpc_download_state(self, _request):
        async def nothing():
            return
            yield

        return nothing()


class NotAMember(MatchmakingException):
    """A group that holds a non-member: hivemind's averager gives this round up (and retries, time permitting)."""


class MembersOnly(AveragerHooks):
    """A DecentralizedAverager mixin: with a `gate`, averaging only with the run's members."""

    gate: Optional[MemberGate] = None

    async def _allows(self, peer_id: PeerID, what: str, refresh: bool = True) -> bool:
        return self.gate is None or peer_id == self.peer_id or await self.gate.allows(self.dht, peer_id, what, refresh)

    async def serve_join_request(self, request: averaging_pb2.JoinRequest, context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if not await self._allows(context.remote_id, "a join request"):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().serve_join_request(request, context):
            yield message

    async def serve_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                   ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if self.gate is not None and not await self._groupmate(context.remote_id):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().serve_aggregate_part(stream, context):
            yield message

    async def _groupmate(self, peer_id: PeerID) -> bool:
        # a groupmate of a running round was checked with its group (aggregate_with_group), unless revoked since
        in_group = any(peer_id in runner.ordered_peer_ids for runner in self._runners())
        return (in_group and self.gate.access.allows(peer_id.to_base58())) or \
            await self._allows(peer_id, "tensor parts", refresh=False)

    async def serve_state_download(self, request: averaging_pb2.DownloadRequest, context: P2PContext
                                   ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if not await self._allows(context.remote_id, "a state download"):
            return  # nothing: the asker moves on to the next donor
        async for message in super().serve_state_download(request, context):
            yield message

    async def aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        # as a follower this checks the leader's member list before sending a byte; as a leader, its own group
        for peer_id in group_info.peer_ids:
            if not await self._allows(peer_id, "a place in an averaging group", refresh=False):
                raise NotAMember(f"the group holds {peer_id}, who is not a member of this private run")
        return await super().aggregate_with_group(group_info, min_vector_size, **kwargs)

    async def download_state(self, future, timeout=None):
        # hivemind picks donors from the DHT's list of averagers, which may still hold a revoked peer's entry:
        # download only from members
        if self.gate is None:
            return await super().download_state(future, timeout=timeout)
        await self.gate.refresh(self.dht)
        with donors_reached_through(self, self._donor_stub):
            return await super().download_state(future, timeout=timeout)

    def _donor_stub(self, inner, p2p, peer: PeerID, namespace=None):
        verdict = self.gate.access.verdict(peer.to_base58())
        if verdict == "member":
            return inner(p2p, peer, namespace=namespace)
        self.gate.refuse(peer.to_base58(), "an offer of its state", verdict)
        return _NoState()  # hivemind hears "no state" and asks the next donor

    async def _apply_revocations(self, revocations) -> None:
        """Sent by the trainer (through hivemind's pipe to this averager's process) when the organizer revokes
        someone: refuse them now, not at the next re-read, and end a round in flight that holds them (it would
        stall until its timeout: its members refuse the revoked peer's parts)."""
        if self.gate is None or not self.gate.access.apply(revocations):
            return
        for runner in self._runners():
            revoked = [str(p) for p in runner.ordered_peer_ids if str(p) in self.gate.access.revoked]
            if revoked:
                runner.finalize(exception=NotAMember(f"the group holds {revoked[0]}, whose invite was revoked"))

    def _runners(self) -> list:
        futures = list(getattr(self, "_running_groups", {}).values())
        return [f.result() for f in futures if f.done() and not f.cancelled() and f.exception() is None]

    async def shut_down_in_process(self, timeout) -> None:
        # hivemind's shutdown iterates over the running groups with `.finalize(cancel=True)`, but each is an
        # asyncio.Future holding the AllReduceRunner, and finalize returns None: a shutdown mid-round raised
        # AttributeError (then TypeError) in its thread. End them here, and hand it none. First, briefly, let
        # the groupmates read the averaged parts this peer still holds for them (p2pd goes with this peer)
        await replies_in_flight(min(REPLY_DRAIN, timeout / 2) if timeout else REPLY_DRAIN)
        for runner in self._runners():
            runner.finalize(cancel=True)
        self._running_groups.clear()
        await super().shut_down_in_process(timeout)
