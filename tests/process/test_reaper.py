"""The watcher's looks at the main process's tree: soon while it changes, rarely while it does not (each look reads
every process's /proc entry, and a machine simulating many peers runs hundreds, each peer with a watcher)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from collab.process import reaper
from collab.process.reaper import LOOK_AT_MOST_SECONDS, LOOK_EVERY_SECONDS, _Watch, next_look


def test_looks_slow_down_while_nothing_changes_and_come_soon_again_when_something_does():
    every, schedule = LOOK_EVERY_SECONDS, []
    for found_new in (False,) * 6 + (True, False):
        every = next_look(every, found_new)
        schedule.append(every)
    assert schedule == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 0.5, 1.0], schedule
    assert max(schedule) == LOOK_AT_MOST_SECONDS


def test_a_look_counts_only_processes_not_noted_before():
    watch = _Watch(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        watch.note_descendants()
        assert child.pid in watch.noted and watch.news >= 1
        news = watch.news
        watch.note_descendants()  # the same tree again: nothing new, so the next look may wait longer
        assert watch.news == news
    finally:
        child.kill()
        child.wait(timeout=10)
        if watch.pidfd is not None:
            os.close(watch.pidfd)


def test_a_child_that_dies_between_two_looks_is_counted_ended_and_reaped(monkeypatch):
    """The race a CI run lost: the child died after psutil's wait had polled it and before its status was read. It is
    a zombie then: ended, and, being this process's child, reaped on the spot (not left for the caller to find still
    "running" in psutil's eyes)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    proc = psutil.Process(child.pid)
    real_wait_procs = psutil.wait_procs

    def wait_then_die(procs, timeout):
        gone, alive = real_wait_procs(procs, timeout=timeout)
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while proc.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.01)
        return gone, alive

    monkeypatch.setattr(psutil, "wait_procs", wait_then_die)
    try:
        assert reaper.running_after([proc], timeout=5.0) == []
        assert not proc.is_running()
        with pytest.raises(ChildProcessError):
            os.waitpid(child.pid, os.WNOHANG)  # reaped already
    finally:
        if proc.is_running():
            child.kill()
            child.wait(timeout=10)
