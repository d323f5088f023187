"""The gossip mode's exchanges, in the averager's process (collab.modes.gossip is the trainer's side). One exchange
is a bidirectional stream over hivemind's P2P: each side sends a `Hello` (its clock, recent loss, the exchange's
random split u) and its parameters, and receives the other's, bounded in size, count and shape before anything is
decoded into memory. Answered exchanges go to the trainer on an inbox; asked ones through the asking call's future.
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import multiprocessing as mp
from typing import AsyncIterator, Optional

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import CompressionInfo
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming
from pydantic import BaseModel, ConfigDict, Field

from collab.averaging.bounded_start import StartsWithin
from collab.averaging.compression import decode_part
from collab.averaging.members_only import MembersOnly
from collab.averaging.tidy_leave import LeavesNoSocketFile, ReadsWholeRequests

CHUNK_BYTES = 2**20
MAX_WAITING = 4  # received parameters not yet merged: a peer asked by everyone at once answers "busy" beyond this
BUSY, REFUSED = b"busy", b"refused"  # an answer's first message instead of a Hello


class Hello(BaseModel):
    """The first message of each side of an exchange (its metadata). Untrusted: bounded here and in claims_ok."""

    model_config = ConfigDict(extra="forbid")
    exchange: str = Field(max_length=64)
    clock: int = Field(ge=0, le=10**15)
    loss: Optional[float] = Field(None, ge=0, le=1e6)
    u: float = Field(ge=0, le=1)
    tensors: int = Field(ge=0, le=100_000)
    settling: bool = False  # it has stopped training (collab.modes.gossip's settle_before_leaving)


class Incomplete(Exception):
    """The other side's stream ended before all its parameters came: an exchange that failed, nothing refused."""


class Busy(Exception):
    """The asked peer has too many merges waiting: try another one next time (not a failure of the peer)."""


class GossipAverager(StartsWithin, LeavesNoSocketFile, ReadsWholeRequests, MembersOnly, DecentralizedAverager):
    """Runs in its own process (as hivemind's averagers do): serves this peer's parameter snapshot to peers that
    ask, and asks peers for theirs. Its averaged tensors are the snapshot; received parameters go to the trainer
    on `inbox` (answered exchanges) or through the asking call's future."""

    def __init__(self, snapshot, *, compression, inbox, findings, gate=None, timeout: float, **kwargs):
        self.gate, self.compression, self.inbox, self.findings = gate, compression, inbox, findings
        self.timeout = timeout
        self.expected = [tuple(t.shape) for t in snapshot]
        self.max_bytes = 8 * sum(t.numel() for t in snapshot) + 2**20  # fp32 plus framing, with room
        self.clock, self.loss = mp.Value(ctypes.c_longlong, 0), mp.Value(ctypes.c_double, math.nan)
        self.waiting = mp.Value(ctypes.c_int, 0)
        self.settling = mp.Value(ctypes.c_bool, False)
        self.bytes_sent, self.bytes_received = mp.Value(ctypes.c_double, 0.0), mp.Value(ctypes.c_double, 0.0)
        super().__init__(snapshot, allow_state_sharing=False, **kwargs)

    def _hello(self, exchange: str, u: float) -> Hello:
        loss = self.loss.value
        return Hello(exchange=exchange, clock=self.clock.value, loss=None if math.isnan(loss) else loss, u=u,
                     tensors=len(self.expected), settling=self.settling.value)

    def _messages(self, hello: Hello) -> list[averaging_pb2.DownloadData]:
        with self.get_tensors() as tensors:  # the trainer refreshes it under the same lock
            encoded = [self.compression.compress(t, CompressionInfo.from_tensor(t)) for t in tensors]
            parts = [part for t in encoded for part in split_for_streaming(t, CHUNK_BYTES)]
        messages = [averaging_pb2.DownloadData(tensor_part=part) for part in parts]
        if messages:
            messages[0].metadata = hello.model_dump_json().encode()
        else:
            messages = [averaging_pb2.DownloadData(metadata=hello.model_dump_json().encode())]
        self.bytes_sent.value += sum(m.ByteSize() for m in messages)
        return messages

    async def _receive(self, stream: AsyncIterator[averaging_pb2.DownloadData]) -> tuple[Hello, list[torch.Tensor]]:
        """The other side's hello and parameters, within bounds (a peer may send anything)."""
        hello, tensors, parts, size = None, [], [], 0
        async for message in stream:
            size += message.ByteSize()
            if size > self.max_bytes:
                raise ValueError("sent more than parameters of these shapes can take")
            if hello is None:
                if message.metadata == BUSY:
                    raise Busy()
                if message.metadata == REFUSED:
                    raise ValueError("refused by the peer")
                hello = Hello.model_validate_json(message.metadata)
            if message.tensor_part.dtype and parts:
                tensors.append(decode_part(combine_from_streaming(parts)))
                parts = []
            if message.HasField("tensor_part"):
                parts.append(message.tensor_part)
            if len(tensors) > len(self.expected):
                raise ValueError("sent more tensors than the model has")
        if parts:
            tensors.append(decode_part(combine_from_streaming(parts)))
        if hello is None or len(tensors) < hello.tensors or len(tensors) < len(self.expected):
            raise Incomplete()  # the stream ended early: a peer that left, a broken link
        self.bytes_received.value += size
        return hello, tensors

    async def rpc_gossip(self, stream: AsyncIterator[averaging_pb2.DownloadData], context: P2PContext
                         ) -> AsyncIterator[averaging_pb2.DownloadData]:
        peer = context.remote_id.to_base58()
        if not await self._allows(context.remote_id, "a gossip exchange"):
            yield averaging_pb2.DownloadData(metadata=REFUSED)
            return
        if self.waiting.value >= MAX_WAITING:
            yield averaging_pb2.DownloadData(metadata=BUSY)
            return
        try:
            hello, tensors = await asyncio.wait_for(self._receive(stream), self.timeout)
        except Exception as e:
            if not isinstance(e, (Incomplete, asyncio.TimeoutError)):
                self.findings.put((peer, f"malformed gossip exchange ({type(e).__name__})", "gossip"))
            yield averaging_pb2.DownloadData(metadata=REFUSED)
            return
        mine = self._hello(hello.exchange, hello.u)
        for message in self._messages(mine):
            yield message
        with self.waiting.get_lock():
            self.waiting.value += 1
        self.inbox.put((peer, mine.model_dump(), hello.model_dump(), tensors))

    async def _exchange(self, peer: str, exchange: str, u: float, future: MPFuture) -> None:
        try:
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)

            mine = self._hello(exchange, u)

            async def ask():
                for message in self._messages(mine):
                    yield message

            async def run():
                return await self._receive(await stub.rpc_gossip(ask()))

            hello, tensors = await asyncio.wait_for(run(), self.timeout)
            future.set_result((mine.model_dump(), hello.model_dump(), tensors))
        except BaseException as e:
            if not future.done():
                future.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))

    def exchange(self, peer: str, exchange: str, u: float) -> MPFuture:
        future = MPFuture()
        self._outer_pipe.send(("_exchange", [peer, exchange, u, future], {}))
        return future
