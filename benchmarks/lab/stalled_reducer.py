"""A client-mode peer whose reducer stops reading mid-round: how long until the client's round ends.

Three real averagers (DHT, p2pd, averager processes) on 127.0.0.1, the third in client mode (a peer behind NAT: no
share of the reduce). Once their group is formed, the second's averager process is frozen (SIGSTOP): its daemon takes
the first few hundred KB of each stream, then nothing. A client reads its replies only once its parts have ended;
hivemind's stream writer never ends them when a send blocks or fails, so hivemind's own averager waits out its
allreduce_timeout (forever without one). collab's runner ends them reducer_timeout after the writer last took a
part (collab.averaging.reply_streams), and the client fails that reducer as any other peer does.

    python3 benchmarks/lab/stalled_reducer.py [--runs 2] [--allreduce-timeout 30]

Prints, per averager, the seconds from the trigger to the end of the client's round, against 2 x reducer_timeout
(the stalled send, then the replies that never come) and allreduce_timeout. tests/process/test_stalled_reducer.py
runs collab's once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import statistics
import sys
import time
from contextlib import ExitStack, suppress
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.lab.averager_pair import StateRounds, start_averager_pair  # noqa: E402

SIZE = 16_000_000  # 64 MB: the client's half to the frozen reducer is far more than the buffers on its way
SENDER_TIMEOUT, REDUCER_TIMEOUT = 3.0, 4.0


def client_round_seconds(averager_class, allreduce_timeout: float, size: int = SIZE) -> float:
    """Seconds from the trigger until the client's round ended (failed or not) with its second reducer frozen."""
    from hivemind.averaging.control import AveragingStage

    prefix = f"stalled-reducer-{time.time_ns()}"
    with ExitStack() as stack:
        full, frozen, client = start_averager_pair(stack, lambda dht, i: averager_class(
            [torch.full((size,), float(i + 1))], dht=dht, prefix=prefix, start=True, target_group_size=3,
            min_group_size=3, min_matchmaking_time=2.0, request_timeout=1.0, client_mode=i == 2,
            sender_timeout=SENDER_TIMEOUT, reducer_timeout=REDUCER_TIMEOUT, allreduce_timeout=allreduce_timeout),
            count=3)
        controls = [a.step(wait=False, require_trigger=True, timeout=30.0) for a in (full, frozen, client)]
        give_up_at = time.monotonic() + 30
        while not all(c.stage == AveragingStage.AWAITING_TRIGGER for c in controls):
            if time.monotonic() > give_up_at or any(c.done() for c in controls):
                raise RuntimeError(f"no group of three: {[c.stage for c in controls]}")
            time.sleep(0.05)
        os.kill(frozen.pid, signal.SIGSTOP)
        stack.callback(_thaw, frozen.pid)  # (before its shutdown: the stack runs backwards)
        started = time.monotonic()
        controls[0].allow_allreduce()
        controls[2].allow_allreduce()
        with suppress(Exception):  # the frozen reducer's span is lost: how the round then ends is not the question
            controls[2].result(timeout=allreduce_timeout + 30)
        took = time.monotonic() - started
        with suppress(Exception):
            controls[0].result(timeout=30)
        if not controls[2].done():
            raise RuntimeError(f"the client's round had not ended {took:.0f} s after its trigger")
        with client.get_tensors():  # the lock is free: its round really ended
            pass
        return took


def _thaw(pid: int) -> None:
    with suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def main(argv=None) -> None:
    import hivemind

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--allreduce-timeout", type=float, default=30.0)
    args = p.parse_args(argv)
    logging.getLogger("hivemind").setLevel(logging.CRITICAL)  # (each failed round's traceback; the averagers fork it)
    print(f"3 averagers on 127.0.0.1, 64 MB each, the client's reducer frozen once the group formed; "
          f"sender_timeout {SENDER_TIMEOUT:g} s, reducer_timeout {REDUCER_TIMEOUT:g} s, "
          f"allreduce_timeout {args.allreduce_timeout:g} s")
    print("averager | the client's round ended after (s) | median | vs 2 x reducer_timeout "
          "| vs allreduce_timeout")
    for name, cls in (("hivemind's DecentralizedAverager", hivemind.DecentralizedAverager),
                      ("collab's (CheckedRounds)", StateRounds)):
        seconds = [client_round_seconds(cls, args.allreduce_timeout) for _ in range(args.runs)]
        median = statistics.median(seconds)
        print(f"{name} | {', '.join(f'{s:.1f}' for s in seconds)} | {median:.1f} | "
              f"{median / (2 * REDUCER_TIMEOUT):.2f} | {median / args.allreduce_timeout:.2f}", flush=True)


if __name__ == "__main__":
    main()
