"""PeerServices: what a trainer peer runs beside its loop starts in order and stops in reverse, also on errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from collab.train.services import PeerServices


def _swarm(stopped: list):
    return SimpleNamespace(shutdown=lambda: stopped.append("swarm"), peer=SimpleNamespace(run_id="run"))


def test_the_optimizer_leaves_first_and_the_swarm_goes_last():
    stopped = []
    with PeerServices(_swarm(stopped)) as services:
        services.start_sharer(None, on_lost=print)  # a run with no files to pass on: nothing started
        services.start_dashboard(None)
        opt = services.start_optimizer(lambda: "opt", lambda opt: stopped.append(f"leave {opt}"))
        assert opt == "opt" and services.sharer is None and services.dashboard is None
    assert stopped == ["leave opt", "swarm"]


def test_a_failed_start_or_a_failed_leave_still_shuts_the_swarm_down():
    stopped = []

    def build():
        raise MemoryError("out of GPU memory")

    with pytest.raises(MemoryError), PeerServices(_swarm(stopped)) as services:
        services.start_optimizer(build, lambda opt: stopped.append("leave"))
    assert stopped == ["swarm"]  # nothing to leave: the optimizer never started

    stopped.clear()

    def leave(opt):
        stopped.append("leave")
        raise RuntimeError("an averager would not stop")

    with pytest.raises(RuntimeError), PeerServices(_swarm(stopped)) as services:
        services.start_optimizer(lambda: "opt", leave)
    assert stopped == ["leave", "swarm"]
