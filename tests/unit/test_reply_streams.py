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


def _sent_parts(wrap: bool, fail_at: int = 1, each: float = 0.0):
    """A sender with no share of the reduce: hivemind waits for its parts to end before it reads its replies. The
    writer is hivemind's (P2P._iterate_protobuf_stream_handler's _write_to_stream): `async for` over the parts, a
    send each; a send that raises leaves the parts as they are. When that wait ended (None: not in 2 s), and the parts
    sent."""
    from hivemind.utils.asyncio import attach_event_on_finished

    async def scenario():
        done_sending, sent = asyncio.Event(), []

        async def parts():
            for i in range(5):
                yield i

        inputs = attach_event_on_finished(parts(), done_sending)  # as hivemind's _communicate_with_peer makes them
        stream = reply_streams._ended_when_stalled(inputs, patience=0.3) if wrap else inputs

        async def write_to_stream():
            async for part in stream:
                if part == fail_at:
                    raise ConnectionResetError("the reducer is gone")
                await asyncio.sleep(each)
                sent.append(part)

        writer = asyncio.create_task(write_to_stream())
        started = time.monotonic()
        try:
            await asyncio.wait_for(done_sending.wait(), timeout=2)
            ended = time.monotonic() - started
        except asyncio.TimeoutError:
            ended = None
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
        return ended, sent

    return asyncio.run(scenario())


def test_a_failed_send_ends_the_parts_so_a_sender_without_a_share_reads_its_replies():
    # hivemind's own: the wait for the parts' end never ends (a lab process held its tensors' lock past 300 s)
    assert _sent_parts(wrap=False)[0] is None
    ended, sent = _sent_parts(wrap=True)
    assert ended is not None and 0.25 < ended < 1.5 and sent == [0]


def test_a_writer_that_keeps_taking_parts_sends_them_all():
    # 0.1 s a part, under the 0.3 s patience: nothing is cut short
    ended, sent = _sent_parts(wrap=True, fail_at=-1, each=0.1)
    assert sent == [0, 1, 2, 3, 4] and ended is not None and ended >= 0.45


def test_collab_runners_watch_the_parts_of_a_sender_without_a_share_only():
    from collab.averaging.robust_rounds import _CheckedRunner

    async def parts():
        yield 0

    runner = object.__new__(_CheckedRunner)  # (its parts_sent_to reads these three)
    runner.peer_id, runner.reducer_timeout = "this peer", 5.0
    for no_share in (True, False):
        runner.should_delay_results = lambda peer, no_share=no_share: no_share and peer == "this peer"
        inputs = parts()
        sent = runner.parts_sent_to(inputs, 0)
        assert (sent is not inputs and sent.ag_code.co_name == "_ended_when_stalled") if no_share else sent is inputs
    runner.reducer_timeout = None  # hivemind's default: no timeouts, nothing to be patient by
    inputs = parts()
    assert runner.parts_sent_to(inputs, 0) is inputs
