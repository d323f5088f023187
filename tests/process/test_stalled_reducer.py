"""A peer with no share of the reduce (client mode: a peer behind NAT) whose reducer stops reading its parts ends its
round within its reducer_timeout, not at allreduce_timeout (collab.averaging.reply_streams._ended_when_stalled).

Such a sender reads its replies only once it has sent its last part, and hivemind's stream writer, blocked on a
reducer that no longer reads (or failed by one that is gone), never says the parts ended: the round waited until
allreduce_timeout, holding the averaged tensors' lock (without one, forever: a lab process past 300 s in CI).

Three real averagers (DHT, p2pd, averager processes), the third in client mode. Once their group is formed, the
second's averager process is frozen (SIGSTOP): its daemon takes the first few hundred KB of each stream, then nothing.
The first (a full peer) reads its replies as it sends and fails that reducer by reducer_timeout in any case."""

from __future__ import annotations

import os
import signal
import time
from contextlib import ExitStack, suppress

import torch
from hivemind.averaging.control import AveragingStage

from benchmarks.lab.averager_pair import StateRounds, start_averager_pair

SIZE = 16_000_000  # 64 MB: the client's half to the frozen reducer is far more than the buffers on its way
SENDER_TIMEOUT, REDUCER_TIMEOUT, ALLREDUCE_TIMEOUT = 3.0, 4.0, 90.0


def _thaw(pid: int) -> None:
    with suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def test_a_client_whose_reducer_stopped_reading_ends_its_round_by_reducer_timeout(no_leftover_processes):
    prefix = f"stalled-reducer-{time.time_ns()}"
    with ExitStack() as stack:
        full, frozen, client = start_averager_pair(stack, lambda dht, i: StateRounds(
            [torch.full((SIZE,), float(i))], dht=dht, prefix=prefix, start=True, target_group_size=3,
            min_group_size=3, min_matchmaking_time=2.0, request_timeout=1.0, client_mode=i == 2,
            sender_timeout=SENDER_TIMEOUT, reducer_timeout=REDUCER_TIMEOUT, allreduce_timeout=ALLREDUCE_TIMEOUT),
            count=3)
        controls = [a.step(wait=False, require_trigger=True, timeout=30.0) for a in (full, frozen, client)]
        give_up_at = time.monotonic() + 30
        while not all(c.stage == AveragingStage.AWAITING_TRIGGER for c in controls):
            assert time.monotonic() < give_up_at, f"no group of three: {[c.stage for c in controls]}"
            assert not any(c.done() for c in controls), [c.exception() for c in controls if c.done()]
            time.sleep(0.05)
        os.kill(frozen.pid, signal.SIGSTOP)
        stack.callback(_thaw, frozen.pid)  # (before its shutdown: the stack runs backwards)
        started = time.monotonic()
        controls[0].allow_allreduce()
        controls[2].allow_allreduce()
        for control in (controls[0], controls[2]):
            try:
                control.result(timeout=ALLREDUCE_TIMEOUT + 30)
            except Exception:
                pass  # (the frozen reducer's span is lost: how the round then ends is not this test's question)
        took = time.monotonic() - started
        print(f"the client's round ended {took:.1f} s after the trigger (allreduce_timeout {ALLREDUCE_TIMEOUT:g} s)")
        # the client: a reducer_timeout for its stalled send, one for the replies that never come, and the transfer
        assert controls[2].done() and took < 6 * REDUCER_TIMEOUT, f"the client's round took {took:.1f} s"
        with client.get_tensors() as tensors:  # the lock is free: its round really ended
            assert tensors[0].shape == (SIZE,)
