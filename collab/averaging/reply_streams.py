"""Averaged parts that reach every sender whole: who closes an all-reduce reply stream, and when.

In hivemind's all-reduce each sender streams its parts of a span to that span's reducer and reads the
averaged parts back on the same stream; the sender reads until the reducer closes it. hivemind's reducer
closes it as soon as it has written its last reply. The likely loss (read in p2pd's doStreamPipe; it shows
only in a whole swarm): its two pipe goroutines close the libp2p stream and, on the read side's error,
reset it, and a reset can discard what the other side's daemon had received but not yet handed over. The
sender then sees the stream end cleanly a few parts short ("sent 14 parts, but we expected 15"): a lost
reducer for it alone, while its groupmates have the whole average. A young connection (a late joiner
reducing) is the likeliest to lose its tail, and a healthy peer can lose one too; such a peer re-runs the
round with the swarm's next one and catches up by a download.

Here the side that knows it is done closes: the sender, once it has every part it expects (it no longer
waits for the reducer's end of stream), and the reducer holds its end open until the sender has closed
(at most the sender's own patience, reducer_timeout). A peer that is leaving waits, briefly, for the
replies it is still holding (`replies_in_flight`) before its daemon goes.

A sender with no share of the reduce (client mode) reads its replies only after its last part is sent: its parts
end, at the latest, reducer_timeout after the writer last took one (`_ended_when_stalled`), so a reducer that stopped
reading costs it that, not the whole allreduce_timeout.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from collab.hivemind_hooks.allreduce import RunnerHooks

HOLD_FALLBACK = 10.0  # seconds a reducer keeps a finished reply stream open when no reducer_timeout is set
_in_flight = 0  # reply streams this process is serving now (one averager per process)


class WholeReplies(RunnerHooks):
    """An AllReduceRunner whose reply streams end when the sender has read them (see the module)."""

    def replies_from(self, stream: AsyncIterator, peer_index: int) -> AsyncIterator:
        # (last in collab's runner's method order: `stream` is the reply stream itself, which _first closes)
        expected = self.tensor_part_container.num_parts_by_peer[peer_index]
        return _first(super().replies_from(stream, peer_index), expected)

    def parts_sent_to(self, inputs: AsyncIterator, peer_index: int) -> AsyncIterator:
        inputs = super().parts_sent_to(inputs, peer_index)
        if not self.reducer_timeout or not self.should_delay_results(self.peer_id):
            return inputs  # (a sender that reads its replies as it sends hears a failed send from its reply stream)
        return _ended_when_stalled(inputs, self.reducer_timeout)

    async def serve_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                   ) -> AsyncIterator[averaging_pb2.AveragingData]:
        global _in_flight
        _in_flight += 1
        try:
            replies = 0
            async for message in super().serve_aggregate_part(stream, context):
                replies += message.code == averaging_pb2.AVERAGED_PART
                yield message
            if replies and replies == self.tensor_part_reducer.num_parts:
                # every reply written: the sender closes the stream once it has read them all, which ends this
                # wait (hivemind cancels a handler whose caller has closed). Closing first can lose replies
                await asyncio.sleep(self.reducer_timeout or HOLD_FALLBACK)
        finally:
            _in_flight -= 1


async def _ended_when_stalled(parts: AsyncIterator, patience: float) -> AsyncIterator:
    """`parts` as the stream's writer takes them, ended when it has not asked for the next one for `patience` s.

    A sender with no share of the reduce (a client-mode peer; a slow uplink, by its announced bandwidth) reads its
    replies only once it has sent its last part: hivemind waits for `parts` to end. But hivemind's stream writer
    leaves them as they are when a send fails (a reducer gone) or never completes (one that stopped reading): the wait
    had no end but allreduce_timeout (none at all without one: likely the lab process that hung past 300 s in CI).
    Closed, `parts` say they ended, and the sender reads its replies, under reducer_timeout, and fails that reducer.
    `patience` is reducer_timeout, longer than the reducer's own sender_timeout: by then it has given this sender up."""
    loop, abandoned, closing = asyncio.get_running_loop(), [], []

    def abandon():
        abandoned.append(True)
        closing.append(asyncio.ensure_future(parts.aclose()))  # (suspended where it gave its last part)

    async for part in parts:
        timer = loop.call_later(patience, abandon)
        try:
            yield part
        finally:
            timer.cancel()
        if abandoned:  # the writer came back after all: it ends here (the parts are being closed, not to be read)
            return


async def _first(stream, count: int) -> AsyncIterator:
    """The first `count` messages of a reply stream, which is then closed from this side."""
    try:
        if count > 0:
            async for message in stream:
                yield message
                count -= 1
                if count == 0:
                    break
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()


async def replies_in_flight(timeout: float) -> int:
    """Wait up to `timeout` seconds for the reply streams this process is serving to be read; how many were
    still open at the end."""
    deadline = time.monotonic() + timeout
    while _in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return _in_flight
