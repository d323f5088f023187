"""One OpenMP team in a CPU peer's process (collab.train.cpu_threads): hivemind's step pool computes with one thread,
so it starts no OpenMP threads of its own beside the training thread's, and the training thread keeps its count.
Each case runs in a fresh process: torch's thread counts are per process and per thread."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace


def _threads() -> int:
    return len(list(Path("/proc/self/task").iterdir()))


def _case(fixed: bool) -> dict:
    import torch

    from collab.train.cpu_threads import one_thread_team

    torch.set_num_threads(2)
    a = torch.randn(512, 512)
    (a @ a).sum()  # the training thread's team exists
    averager = SimpleNamespace(step_executor=ThreadPoolExecutor(max_workers=1))
    if fixed:
        one_thread_team(averager)

    def step() -> int:  # what hivemind's pool runs: an optimizer step's matmuls and element-wise ops
        (a @ a).sum()
        torch.ones(1 << 21).mul_(2.0)
        return torch.get_num_threads()

    averager.step_executor.submit(lambda: None).result()  # the pool's thread, started
    before = _threads()
    in_pool = averager.step_executor.submit(step).result()
    return {"new_threads": _threads() - before, "in_pool": in_pool, "training": torch.get_num_threads()}


def _run(fixed: bool) -> dict:
    out = subprocess.run([sys.executable, __file__, "fixed" if fixed else "plain"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_the_step_pool_starts_no_second_team_and_the_training_thread_keeps_its_threads():
    plain, fixed = _run(False), _run(True)
    # without it, the pool's first parallel op starts OpenMP threads of its own: that is what stops libgomp spinning
    assert plain["new_threads"] >= 1 and plain["in_pool"] == 2, plain
    assert fixed == {"new_threads": 0, "in_pool": 1, "training": 2}, fixed


if __name__ == "__main__":
    print(json.dumps(_case(sys.argv[1] == "fixed")))
