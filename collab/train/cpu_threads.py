"""One team of OpenMP threads in a peer's process when it trains on a CPU.

libgomp (torch's OpenMP) keeps a thread that waits at a barrier spinning for a while, so the next parallel op starts at
once; but as soon as the process holds more OpenMP threads than it has CPUs, it stops spinning and sleeps at every
barrier, and each of the training thread's matmuls then waits for its workers to be woken. hivemind runs the
optimizer's step and the state's averaging rounds in a thread pool of its own; the first step there made a second
team, and the training thread lost a tenth or more of its speed (benchmarks/overhead.py, 2 cores: ALBERT-tiny's plain
loop fell from 26.5-29.4 to 22.7-23.8 samples/s once another thread had run one matmul; collab's peer trained at
24-27 against the plain loop's 28-31). So on a CPU that pool computes with one thread: the optimizer's step is a few
foreach ops once an epoch, the training thread's ops are many every second.

On a GPU the training thread launches kernels and its OpenMP team is idle, so the pool keeps all the cores there.
"""

from __future__ import annotations

from functools import partial

import torch

from collab.hivemind_hooks.patches import step_pool_initializer


def one_thread_team(state_averager) -> None:
    """Make hivemind's step pool of `state_averager` (a TrainingStateAverager) compute with one thread per pool
    thread. Call it from the training thread, before the pool's first step."""
    # torch reads its thread count into each thread once, at that thread's first parallel op: fix the training
    # thread's now, before the pool's threads set the count every later thread starts with to 1
    torch.get_num_threads()
    step_pool_initializer(state_averager, partial(torch.set_num_threads, 1))
