"""hivemind's all-reduce runner with the private steps collab extends opened under public names.

Each hivemind method here hands over to a public method whose default is hivemind's own behaviour; collab's runner
mixins (collab.averaging: byte counting, one average per group, whole reply streams, checked parts) override the
public names and call `super()`, so no class outside this package defines a private hivemind name.
"""

from __future__ import annotations

from typing import AsyncIterator

from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2


class AggregatePartHooks:
    """The handler of a sender's stream of parts, in the averager (which finds the round's runner) and in the runner
    (which reduces them): members only and whole replies, each through the public name."""

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in self.serve_aggregate_part(stream, context):
            yield message

    async def serve_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                   ) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super().rpc_aggregate_part(stream, context):
            yield message


class RunnerHooks(AggregatePartHooks, AllReduceRunner):
    """AllReduceRunner, its private steps handed to collab's public ones (see the module)."""

    # the stub a sender streams its parts through: its parts written through `parts_sent_to` (a stalled send ended),
    # its reply stream read through `replies_from` (bytes counted, replies read whole, averages taken, a reducer's
    # word that it left this peer out noted)
    def _get_peer_stub(self, peer: PeerID):
        stub, runner, peer_index = super()._get_peer_stub(peer), self, self.ordered_peer_ids.index(peer)

        class ReplyReadingStub:
            async def rpc_aggregate_part(self, inputs, *args, **kwargs):
                stream = await stub.rpc_aggregate_part(runner.parts_sent_to(inputs, peer_index), *args, **kwargs)
                return runner.replies_from(stream, peer_index)

        return ReplyReadingStub()

    def parts_sent_to(self, inputs: AsyncIterator[averaging_pb2.AveragingData], peer_index: int
                      ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """The parts this sender writes to reducer `peer_index`, as hivemind's stream writer takes them (`inputs`
        sets the event that a sender with no share of the reduce waits for before it reads its replies). A mixin
        wraps what super() returns."""
        return inputs

    def replies_from(self, stream: AsyncIterator[averaging_pb2.AveragingData], peer_index: int
                     ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """The reply stream of reducer `peer_index` as this sender reads it. A mixin wraps what super() returns, so
        the last mixin in the method order wraps the stream itself."""
        return stream

    # what a sender streams to one reducer: counted, and its first part marked "send me the average"
    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in self.parts_for_peer(peer_index):
            yield message

    async def parts_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super()._generate_input_for_peer(peer_index):
            yield message

    # one sender-reducer exchange: nothing sent to a banned reducer, this peer's own part averaged in place
    async def _communicate_with_peer(self, peer_id: PeerID):
        return await self.exchange_with_peer(peer_id)

    async def exchange_with_peer(self, peer_id: PeerID):
        return await super()._communicate_with_peer(peer_id)

    # the reducer's loop over one sender's parts: re-implemented by collab to reply with one rounded average
    async def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                          sender_index: int):
        async for message in self.reduce_stream(stream, sender_index):
            yield message

    async def reduce_stream(self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int):
        async for message in super()._accumulate_parts_streaming(stream, sender_index):
            yield message

    # (rpc_aggregate_part, the reducer's handler, comes from AggregatePartHooks: whole replies hold it open)

    async def ban_sender(self, peer_id: PeerID) -> None:
        """hivemind's ban of a sender that stopped short (collab's reducer loop calls it)."""
        await self._ban_sender(peer_id)
