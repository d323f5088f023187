"""One average for the whole group: each reducer rounds its span's average once, through the run's codec, sends
every sender that rounded value itself, and keeps the same value for its own part.

hivemind's reducer sends each sender the average minus that sender's part (as received, already through the
codec), and the sender adds it to its own part as it was before the codec. Under a lossy codec (fp16, 8-bit) a
sender therefore ends with the average plus its own part's rounding plus the rounding of that difference, while
the reducer keeps the exact average: every member of a group applies a slightly different gradient. The replicas
drift apart on every round, and only state averaging brings them back (with it off, the differences grow epoch
after epoch, while exact copies of one average stay within float32's rounding of each other).

Here every member applies the one rounded average: a sender registers it minus its own part, so its replica
moves to exactly what the reducer's does (up to float32's rounding of that addition). The wire stays hivemind's.
A sender that can take the average itself marks its first part (`AveragingData.peer_id`, a field hivemind
neither sets nor reads there); a reducer that honours it marks its first reply. A peer of an older collab, on
either side, sends and gets differences as before, and its group still averages correctly.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import torch
from hivemind.averaging.partition import AllreduceException, BannedException
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import amap_in_executor

from collab.averaging.compression import decode_part, encode_part
from collab.hivemind_hooks.allreduce import RunnerHooks
from collab.hivemind_hooks.patches import before_failed_reducer

MARK = b"collab:average"  # in the first message of a stream: "send me the average" / "these are averages"


class OneAverage(RunnerHooks):
    """hivemind's all-reduce runner, every member of the group ending with the same rounded average (see the
    module). `exchange_averages=False` behaves as hivemind (and an older collab) does: differences both ways."""

    def __init__(self, *, exchange_averages: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.exchange_averages = exchange_averages
        self._averages_from: set[int] = set()  # reducers (peer index) whose replies are averages, not differences
        # hivemind keeps this peer's own values for the rest of a failed reducer's span by registering zero
        # differences: they must not be read as averages (zero minus this peer's part would zero the span)
        before_failed_reducer(self.tensor_part_container, self._averages_from.discard)

    # as a sender: ask for averages, and turn each received one into the difference hivemind's container adds

    async def parts_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        first = self.exchange_averages
        async for message in super().parts_for_peer(peer_index):
            if first:
                message.peer_id, first = MARK, False
            yield message

    def replies_from(self, stream: AsyncIterator, peer_index: int) -> AsyncIterator:
        return self._read_mark(super().replies_from(stream, peer_index), peer_index)

    async def _read_mark(self, stream: AsyncIterator, peer_index: int) -> AsyncIterator:
        first = True
        async for message in stream:
            if first and self.exchange_averages and message.code == averaging_pb2.AVERAGED_PART \
                    and message.peer_id == MARK:
                self._averages_from.add(peer_index)
            first = False
            yield message

    def as_difference(self, peer_index: int, part_index: int, received: torch.Tensor) -> torch.Tensor:
        """What a reducer returned for one part, as the difference to add to this peer's part (what hivemind's
        container applies). Called before anything checks or registers the part."""
        if peer_index not in self._averages_from:
            return received
        own = self.tensor_part_container._input_parts_by_peer[peer_index][part_index][0]
        if received.shape != own.shape:
            raise AllreduceException(f"reducer sent an average of shape {tuple(received.shape)} for a part of shape "
                                     f"{tuple(own.shape)}")
        return received.to(own.dtype) - own

    # as a reducer: round the average once and send it whole to those who asked; keep the same value for this peer

    async def exchange_with_peer(self, peer_id: PeerID):
        if peer_id != self.peer_id or not self.exchange_averages:
            return await super().exchange_with_peer(peer_id)
        peer_index, sender_index = self.ordered_peer_ids.index(peer_id), self.sender_peer_ids.index(peer_id)
        loop, codec = asyncio.get_event_loop(), self.tensor_part_container.compression
        infos = [info for _, info in self.tensor_part_container._input_parts_by_peer[peer_index]]
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, tensor_part,
                                                                      weight=self.weight)
            # through this peer's own codec for the part: the codec its groupmates' parts came in (one run, one
            # codec), so the value equals what they are sent
            rounded = await loop.run_in_executor(
                None, lambda: decode_part(codec.compress(averaged, infos[part_index])))
            self.tensor_part_container.register_processed_part(peer_index, part_index,
                                                               rounded.to(tensor_part.dtype) - tensor_part)

    async def reduce_stream(self, stream, sender_index: int):
        """hivemind's reducer loop (accumulate each part, reply as soon as its average is ready, ban a sender that
        stops short), replying with the rounded average itself to a sender that asked for it."""
        loop, part_index, wants_average = asyncio.get_event_loop(), 0, False
        try:
            async for tensor_part, weight, codec, marked in amap_in_executor(
                    lambda msg: (decode_part(msg.tensor_part), msg.weight, msg.tensor_part.compression,
                                 msg.peer_id == MARK),
                    stream, max_prefetch=self.tensor_part_container.prefetch):
                if part_index == 0:
                    wants_average = marked and self.exchange_averages
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, tensor_part,
                                                                              weight=weight)
                    part_index += 1
                except BannedException:
                    break  # this sender is banned: nothing more of it is reduced
                reply = averaged if wants_average else averaged - tensor_part
                serialized = await loop.run_in_executor(None, encode_part, reply, codec)
                message = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
                if wants_average and part_index == 1:
                    message.peer_id = MARK
                yield message
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self.ban_sender(self.sender_peer_ids[sender_index])
