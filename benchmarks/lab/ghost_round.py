"""Reproduces, on real averagers, the client-mode race that fails a round beside a CPU hog (issue 38).

A leader (server) and a client-mode peer average one gradient. The leader accepts the client, assembles the
group and sends BEGIN_ALLREDUCE, but the client's first follower_assemble_group is made to fail as if that
message came a moment after the client stopped waiting for it. Under a CPU hog the timing does it; here it is
forced. Then:
- the leader's all-reduce waits next_chunk_timeout for the client's part and ends with its own part only:
  "Reducer: received 50.0% of input tensors", reported as a success (the average of itself);
- the client, refused by a leader busy with that group, looks until its round ends: "could not find a group".

Measured 2026-11-27 (2 cores), before collab.averaging.robust_rounds.nobody_else_sent: the leader "averaged" to its own
gradient after 4.1 s with next_chunk_timeout 4, and the client failed at 20 s, its whole timeout. In CI (hog run
22, dgc) the server's round failed instead, at its deadline (next_chunk_timeout = averaging_timeout = 30 s). Now the
leader refuses a round nobody else sent to and matches again while its round has time: both get the exact mean
(tests/swarm/test_matchmaking.py runs this).

late_start_round stages one way the race comes about: the leader begins the group after the client's wait ended
(its search's deadline plus request_timeout). Measured 2026-11-28 (2 cores), a 7 s late start: with hivemind's wait
both rounds failed after their whole 30 s ("could not find a group"; the client, accepted again and again, gave up each
time); with collab's (collab.hivemind_hooks.matchmaking.patient_followers) both got the exact mean in 7.1 s.

    python3 benchmarks/lab/ghost_round.py [NEXT_CHUNK_TIMEOUT] [STEP_TIMEOUT]
"""

from __future__ import annotations

import asyncio
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from hivemind.averaging.matchmaking import Matchmaking  # noqa: E402

from benchmarks.lab.averager_pair import start_averager_pair  # noqa: E402
from collab.averaging.aggregation import Aggregation  # noqa: E402
from collab.averaging.grad_averager import CollabGradientAverager  # noqa: E402
from collab.records.rejections import RejectionLog  # noqa: E402


MATCHMAKING_TIME, REQUEST_TIMEOUT = 3.0, 2.4


def ghost_round(next_chunk: float, step_timeout: float, peers: int = 2, client: bool = True) -> list:
    """What the leader's and the client's rounds gave: the averaged first value (the exact mean is 1.5) or the
    exception the round ended with, and the seconds it took. peers=3: three reachable peers, the third missing its
    leader's start (the exact mean of the first two is 1.5, of all three 2.0), each with a part to reduce.
    client=False: two reachable peers, each with a part to reduce (the leader waits for the other's average of
    its part, not only for its input)."""
    def begin_missed_once(original):
        calls = []

        async def begin(self, leader, message):
            calls.append(leader)
            if len(calls) == 1:
                raise asyncio.TimeoutError()  # as if BEGIN_ALLREDUCE came after the follower gave up
            return await original(self, leader, message)
        return begin

    return pair_round((peers - 1, Matchmaking, "follower_assemble_group", begin_missed_once), next_chunk,
                      step_timeout, peers, client)


def late_start_round(late_start: float, step_timeout: float) -> list:
    """The same pair, the leader starting every group it assembles `late_start` seconds after the client joined
    (a CPU-starved leader). hivemind's client waits for that start until its search's deadline
    (MATCHMAKING_TIME) plus REQUEST_TIMEOUT."""
    def late(original):
        async def assemble(self):
            await asyncio.sleep(late_start)
            return await original(self)
        return assemble

    return pair_round((0, Matchmaking, "leader_assemble_group", late), next_chunk=10.0, step_timeout=step_timeout)


def failed_start_round(next_chunk: float, step_timeout: float) -> list:
    """Three reachable peers; the third's first all-reduce fails as it starts (as a peer that dies or is stopped
    then), before it sends a part: its groupmates' streams to it break at once, but hivemind waits next_chunk_timeout
    for its parts. Each one's averaged first value (the exact mean of three is 2.0) or exception, and the seconds."""
    def fails_once(original):
        calls = []

        async def run_allreduce(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("this peer's round failed as it started")
            return await original(self, *args, **kwargs)
        return run_allreduce

    return pair_round((2, CollabGradientAverager, "run_allreduce", fails_once), next_chunk, step_timeout, peers=3)


def pair_round(patch, next_chunk: float, step_timeout: float, peers: int = 2, client: bool = True) -> list:
    """One gradient round of a leader (averager 0) and a client-mode peer (1), with `patch` (see
    start_averager_pair): each one's averaged first value (the exact mean is 1.5) or the exception its round
    ended with, and the seconds it took. peers=3: three reachable peers, 2^20 values each (every one reduces a
    part). client=False: no peer in client mode."""
    client = client and peers == 2
    # hivemind hands out whole parts of 2^17 values: 2^20 values leave each peer a part to reduce
    prefix, size = f"ghost-{time.time_ns()}_grad_averager", 64 if client else 2 ** 20
    params = [torch.nn.Parameter(torch.zeros(size)) for _ in range(peers)]
    with ExitStack() as stack:
        averagers = start_averager_pair(stack, lambda dht, i: CollabGradientAverager(
            [params[i]], dht=dht, prefix=prefix, start=True, rule=Aggregation(method="mean"),
            findings=RejectionLog().queue, target_group_size=peers, min_matchmaking_time=MATCHMAKING_TIME,
            request_timeout=REQUEST_TIMEOUT, next_chunk_timeout=next_chunk, client_mode=client and i == 1),
            patch=patch, count=peers)
        started, controls = time.monotonic(), []
        for i, averager in enumerate(averagers):
            params[i].grad = torch.full((size,), float(i + 1))  # the exact mean: 1.5 (2.0 of three)
            averager.accumulate_grads_(batch_size=1)
            controls.append(averager.step(wait=False, timeout=step_timeout))
        results = []
        for averager, control in zip(averagers, controls):
            try:
                control.result(timeout=step_timeout + 60)
                with averager.get_tensors() as averaged:
                    results.append((averaged[0][0].item(), time.monotonic() - started))
            except Exception as e:
                results.append((e, time.monotonic() - started))
        return results


def main(next_chunk: float, step_timeout: float) -> None:
    for name, (outcome, seconds) in zip(("leader", "client"), ghost_round(next_chunk, step_timeout)):
        said = (f"averaged to {outcome:g} (the exact mean: 1.5)" if isinstance(outcome, float)
                else f"failed: {outcome!r}")
        print(f"{name}: {said} after {seconds:.1f} s", flush=True)


if __name__ == "__main__":
    main(*(float(a) for a in sys.argv[1:3])) if len(sys.argv) > 2 else main(4.0, 20.0)
