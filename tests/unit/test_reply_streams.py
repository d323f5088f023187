"""collab.averaging.reply_streams: the sender closes a reply stream once it has every part it expects (the reducer
closing first lost a stream's tail in p2pd); a leaving averager waits, bounded, for the replies it holds."""

from __future__ import annotations

import asyncio
import time

from collab.averaging import reply_streams


def _stream(messages: int, closed: list):
    async def replies():
        try:
            for i in range(messages):
                yield i
            await asyncio.sleep(3600)  # a reducer that holds its end open until the sender closes
        finally:
            closed.append(True)
    return replies()


def test_the_sender_stops_at_the_expected_count_and_closes_its_end():
    async def read(expected: int, sent: int):
        closed: list = []
        got = [m async for m in reply_streams._first(_stream(sent, closed), expected)]
        return got, closed

    started = time.monotonic()
    got, closed = asyncio.run(asyncio.wait_for(read(3, 3), timeout=5))
    # without the count the sender would wait for the reducer's end of stream (here: an hour)
    assert got == [0, 1, 2] and closed == [True] and time.monotonic() - started < 1


def test_a_short_stream_ends_the_read_and_is_closed():
    # (hivemind then counts the parts, and fails that reducer)
    async def short():
        closed: list = []

        async def replies():
            try:
                yield 0
                yield 1
            finally:
                closed.append(True)
        got = [m async for m in reply_streams._first(replies(), 5)]
        return got, closed

    got, closed = asyncio.run(asyncio.wait_for(short(), timeout=5))
    assert got == [0, 1] and closed == [True]


def test_a_leaving_averager_waits_for_held_replies_but_not_forever():
    async def scenario():
        reply_streams._in_flight = 1
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, lambda: setattr(reply_streams, "_in_flight", 0))  # the groupmate read the last part
        started = time.monotonic()
        left = await reply_streams.replies_in_flight(timeout=5)
        waited = time.monotonic() - started
        reply_streams._in_flight = 1  # a groupmate that never reads
        started = time.monotonic()
        still = await reply_streams.replies_in_flight(timeout=0.3)
        bounded = time.monotonic() - started
        reply_streams._in_flight = 0
        return left, waited, still, bounded

    left, waited, still, bounded = asyncio.run(scenario())
    assert left == 0 and 0.25 < waited < 2
    assert still == 1 and 0.25 < bounded < 1
