"""The DHT's process reads whole requests from its pipe (collab.hivemind_hooks.patches.pipe_reads_take_whole_messages).

hivemind's DHT process watches the pipe with uvloop, which makes its end non-blocking, and reads a request once some
bytes have come: a request still being written failed half-read (EAGAIN), the pipe lost its framing, and the process
took no request after it. A lone linreg peer's requests filled the pipe so: its leave then blocked on a send and was
killed at the end of its grace (3 of 5 runs of scale.py's lone peer). Here a request is written in two halves, a
moment apart: a real collab DHT answers it, and the next request (without the fix the first is lost). hivemind's
averager processes read their pipes the same way, and so does a collab averager.

A request also carries its MPFuture's pipe end, which the sender's process hands over as the request is unpacked: a
sender that exited first (an averager shut down with a read in flight) failed that with EOFError, which hivemind's
loop does not catch: the DHT's process died, its p2pd's socket file left in /tmp (a CI run). It is dropped now."""

from __future__ import annotations

import multiprocessing
import os
import signal
import struct
import threading
import time
from contextlib import ExitStack
from functools import partial
from multiprocessing.reduction import ForkingPickler

import torch
from hivemind.utils.mpfuture import MPFuture

from benchmarks.lab.averager_pair import start_averager_pair
from collab.averaging.robust_rounds import CheckedRounds
from collab.swarm.node import OwnGroupDHT, shut_down_dht

PAYLOAD = 64 * 1024  # bytes


async def _length(_dht, _node, payload: bytes) -> int:
    return len(payload)


def _ask_in_two_halves(dht, payload: bytes, answers: list) -> None:
    """What hivemind's run_coroutine sends (a Connection message: its length, then the pickle), half of it first."""
    future = MPFuture()
    _send_in_two_halves(dht._outer_pipe, ("_run_coroutine", [], dict(coro=partial(_length, payload=payload),
                                                                     future=future)))
    answers.append(future.result(timeout=30))


def _send_in_two_halves(pipe, request: tuple) -> None:
    message = bytes(ForkingPickler.dumps(request))
    framed = struct.pack("!i", len(message)) + message
    fd = pipe.fileno()
    for part in (framed[:len(framed) // 2], framed[len(framed) // 2:]):
        while part:
            part = part[os.write(fd, part):]
        time.sleep(0.5)  # the process finds half a request in the pipe


def _ask(dht, payload: bytes, answers: list) -> None:
    answers.append(dht.run_coroutine(partial(_length, payload=payload), return_future=True).result(timeout=30))


def test_a_request_that_arrives_in_pieces_is_answered_and_so_is_the_next(no_leftover_processes):
    dht = OwnGroupDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        answers: list = []
        for ask, payload in ((_ask_in_two_halves, b"x" * PAYLOAD), (_ask, b"small")):
            # (in a thread: without the fix the process stops reading, and a send can block for good)
            asker = threading.Thread(target=ask, args=(dht, payload, answers), daemon=True)
            asker.start()
            asker.join(45)
            assert not asker.is_alive(), f"the DHT's process did not answer a request of {len(payload)} bytes"
        assert answers == [PAYLOAD, 5], answers
    finally:
        shut_down_dht(dht)


def test_an_averagers_process_answers_a_request_that_arrives_in_pieces_and_the_next(no_leftover_processes):
    def ask_in_two_halves(averager, answers: list) -> None:
        future = MPFuture()
        _send_in_two_halves(averager._outer_pipe, ("_get_group_bits", [], dict(future=future)))  # get_group_bits'
        answers.append(future.result(timeout=30))

    def ask(averager, answers: list) -> None:
        answers.append(averager.get_group_bits(wait=False).result(timeout=30))

    with ExitStack() as stack:
        [averager] = start_averager_pair(stack, lambda dht, i: CheckedRounds(
            [torch.zeros(8)], dht=dht, prefix=f"pipe-{time.time_ns()}", start=True, initial_group_bits="01"),
            count=1)
        answers: list = []
        for how in (ask_in_two_halves, ask):
            asker = threading.Thread(target=how, args=(averager, answers), daemon=True)
            asker.start()
            asker.join(45)
            assert not asker.is_alive(), "the averager's process did not answer"
        assert answers == ["01", "01"], answers


def _ask_and_leave(dht, sent) -> None:
    """(a forked process) A request whose answer pipe this process must hand over, which it can no longer do when the
    DHT's process asks for it (its handover given up: what an exiting process's does; then it exits)."""
    import sys
    from multiprocessing import resource_sharer

    sys.excepthook = lambda *exc: None  # (the handover thread's KeyError for the request given up)
    future = MPFuture()
    dht._outer_pipe.send(("_run_coroutine", [], dict(coro=partial(_length, payload=b"gone"), future=future)))
    resource_sharer._resource_sharer._cache.clear()
    sent.set()
    time.sleep(3)  # the DHT's process, thawed, asks for the pipe end and hears nothing: EOFError as it unpacks


def test_a_request_whose_sender_exited_before_it_was_read_is_dropped_and_the_next_answered(no_leftover_processes):
    dht = OwnGroupDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    fork = multiprocessing.get_context("fork")
    try:
        os.kill(dht.pid, signal.SIGSTOP)  # the DHT's process reads the request only once its handover is given up
        try:
            sent = fork.Event()
            sender = fork.Process(target=_ask_and_leave, args=(dht, sent))
            sender.start()
            assert sent.wait(30)
        finally:
            os.kill(dht.pid, signal.SIGCONT)
        sender.join(30)
        assert sender.exitcode == 0
        answers: list = []
        asker = threading.Thread(target=_ask, args=(dht, b"small", answers), daemon=True)
        asker.start()
        asker.join(45)
        assert answers == [5], "the DHT's process took no request after one whose sender had exited"
    finally:
        shut_down_dht(dht)
