"""A peer told to leave while its state round waits for the averaged tensors' lock does not run that round.

The lock is shared by the trainer's process (an optimizer step, a state served to a downloading peer) and the
averager's (a round's all-reduce). A leave's abort_running_rounds ends a round that has a runner and refuses one not
yet matched; one matched and waiting for the lock had neither, then ran its all-reduce with groupmates that were
leaving too, holding the lock that the leaving peer's last optimizer step waited for: "forced exit: graceful shutdown
overran" (tests/swarm/test_churn.py, once in a fresh-clone CI run).

Two real averagers (DHT, p2pd, averager processes). Without the fix the round runs once the lock is free, and both
hold the mean (0.5)."""

from __future__ import annotations

import time
from contextlib import ExitStack

import pytest
import torch
from hivemind.averaging.control import AveragingStage

from benchmarks.lab.averager_pair import StateRounds, start_averager_pair
from collab.averaging.robust_rounds import LeavingPeer


def test_a_round_waiting_for_the_lock_when_the_leave_began_never_runs(no_leftover_processes):
    sent, prefix = [torch.zeros(8), torch.ones(8)], f"leave-mid-round-{time.time_ns()}"
    with ExitStack() as stack:
        leaving, staying = start_averager_pair(stack, lambda dht, i: StateRounds(
            [sent[i].clone()], dht=dht, prefix=prefix, start=True, target_group_size=2, min_matchmaking_time=1.0,
            request_timeout=1.0, next_chunk_timeout=5.0))
        assert leaving.lock_averaged_tensors.acquire(timeout=5)  # the trainer's process holds it (a state served)
        try:
            controls = [averager.step(wait=False, timeout=20.0) for averager in (leaving, staying)]
            give_up_at = time.monotonic() + 20
            while controls[0].stage != AveragingStage.RUNNING_ALLREDUCE:
                assert time.monotonic() < give_up_at, f"no group formed: {controls[0].stage}"
                assert not controls[0].done(), controls[0].exception()
                time.sleep(0.05)
            time.sleep(0.5)  # the averager process is inside the round, waiting for the lock
            leaving.abort_running_rounds()
            time.sleep(0.5)  # (the abort travels the averager's pipe)
        finally:
            leaving.lock_averaged_tensors.release()
        with pytest.raises(LeavingPeer):
            controls[0].result(timeout=10)
        assert leaving.lock_averaged_tensors.acquire(timeout=2), "the refused round still holds the lock"
        leaving.lock_averaged_tensors.release()
        try:  # its groupmate never sends its part: the staying peer's round ends without it
            controls[1].result(timeout=60)
        except Exception:
            pass
        for averager, value in zip((leaving, staying), (0.0, 1.0)):
            with averager.get_tensors() as tensors:
                assert torch.equal(tensors[0], torch.full((8,), value)), tensors[0]
