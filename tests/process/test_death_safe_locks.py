"""hivemind's process-shared locks, as a peer holds them (collab.hivemind_hooks.locks): a process killed while it held
one does not block the others for good, and they still exclude processes and threads.

In CI a test killed a hivemind process while it held MPFuture's update lock; every DHT that test worker started
after it hung in `DHT.__init__`, its process waiting for that lock (600 s each, then the next)."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import threading
import time

import hivemind
import pytest
import torch
from hivemind.utils import get_dht_time
from hivemind.utils.mpfuture import MPFuture, SharedBytes

import collab.averaging.bounded_start as bounded_start
from collab.averaging.bounded_start import AveragerDidNotStart, StartsWithin
from collab.hivemind_hooks.averager import AveragerHooks
from collab.hivemind_hooks.patches import death_safe_locks
from collab.process import child_stacks
from collab.swarm.node import shut_down_dht

FORK = mp.get_context("fork")


def _hold(lock, holding, seconds: float) -> None:
    lock.acquire()
    holding.set()
    time.sleep(seconds)
    lock.release()


def _held_by_a_child(seconds: float):
    holding = FORK.Event()
    child = FORK.Process(target=_hold, args=(MPFuture._update_lock, holding, seconds), daemon=True)
    child.start()
    assert holding.wait(20), "the child never took the lock"
    return child


def test_a_process_killed_while_it_held_the_update_lock_leaves_the_next_dht_able_to_start(no_leftover_processes):
    death_safe_locks()
    child = _held_by_a_child(seconds=60)
    assert not MPFuture._update_lock.acquire(block=False)  # held: the child has it
    child.kill()
    child.join(10)
    assert MPFuture._update_lock.acquire(block=False), "a dead holder's lock stayed held"
    MPFuture._update_lock.release()

    # the DHT's process reports it is ready through an MPFuture update: with hivemind's own lock it waited for good
    began = time.monotonic()
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=False, shutdown_timeout=1.0)
    try:
        dht.run_in_background(await_ready=True, timeout=60)
        dht.store("answered", 1, expiration_time=get_dht_time() + 30)
        assert dht.get("answered", latest=True).value == 1
    finally:
        shut_down_dht(dht)
    print(f"the DHT started and answered in {time.monotonic() - began:.1f} s")


def test_the_lock_still_excludes_other_processes_and_threads(no_leftover_processes):
    death_safe_locks()
    lock = MPFuture._update_lock
    child = _held_by_a_child(seconds=1.5)
    began = time.monotonic()
    with lock:  # waits for the child to let go
        waited = time.monotonic() - began
        # ... and, held here, another thread of this process cannot take it either
        other = []
        thread = threading.Thread(target=lambda: other.append(lock.acquire(block=False)))
        thread.start()
        thread.join(10)
        assert other == [False]
    child.join(10)
    assert waited > 0.5, f"took a lock another process held after {waited:.2f} s"
    assert lock.acquire(block=False)
    lock.release()


def _share_a_tensor() -> None:
    torch.empty(16).share_memory_()  # what hivemind's SharedBytes does for every 16th MPFuture


def test_a_child_forked_while_a_thread_shares_memory_can_share_memory(no_leftover_processes):
    """torch guards share_memory_ with a module lock it does not renew in a forked child: a child forked while another
    thread held it waited for good at its first share (collab.hivemind_hooks.patches.torch_shares_after_fork). One of
    12 peers of a scale run never started that way, its averager's process, it seems, stuck in its first MPFuture."""
    death_safe_locks()
    holding, done = threading.Event(), threading.Event()

    def sharing() -> None:  # a thread in the middle of a share, as the fork happens
        with torch.storage._share_memory_lock:
            holding.set()
            done.wait(30)
    thread = threading.Thread(target=sharing, daemon=True)
    thread.start()
    assert holding.wait(10)
    try:
        child = FORK.Process(target=_share_a_tensor, daemon=True)
        child.start()
        child.join(20)
        stuck = child.exitcode is None
        if stuck:
            child.kill()
            child.join(10)
    finally:
        done.set()
        thread.join(10)
    assert not stuck, "the child was still waiting on torch's share lock after 20 s"
    assert child.exitcode == 0


def test_a_fork_waits_until_no_thread_is_inside_the_shared_bytes_lock(no_leftover_processes):
    """SharedBytes' section shares memory; a fork in the middle of it would leave torch's own state half-changed in the
    child, so the fork waits for the section to end (quiet_at_fork, FORK_WAIT at most)."""
    death_safe_locks()
    lock, holding, released = SharedBytes._lock, threading.Event(), []

    def allocating() -> None:
        with lock:
            holding.set()
            time.sleep(0.5)
            released.append(time.monotonic())
    thread = threading.Thread(target=allocating, daemon=True)
    thread.start()
    assert holding.wait(10)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    forked = time.monotonic()
    os.waitpid(pid, 0)
    thread.join(10)
    assert released and forked >= released[0], "the fork came while a thread was inside SharedBytes' section"
    assert lock.acquire(block=False), "the lock stayed held after the fork"
    lock.release()


class _Averager(StartsWithin, AveragerHooks):
    """As collab's averagers are made: the bounded start first, hivemind's door (its leave closes its p2pd client)."""


def test_an_averager_whose_process_never_says_it_is_ready_is_given_up_with_a_clear_error(monkeypatch,
                                                                                          no_leftover_processes):
    """hivemind waits for an averager's process to say it is ready for good: a peer whose averager's process was
    stuck sat at start-up until stopped. Here the process cannot report (another process holds the update lock, as a
    stuck one would) and the start gives up after its bound, naming the averager and where its process waits."""
    death_safe_locks()
    monkeypatch.setattr(child_stacks, "_file", None)  # (this test worker's later forks get no handler)
    monkeypatch.setattr(child_stacks, "_owner", None)
    child_stacks.arm()  # as a peer's StopOnSignal does
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True, shutdown_timeout=1.0)
    holder = averager = None
    try:
        averager = _Averager([torch.zeros(4)], dht, prefix="never-ready", start=False)
        holder = _held_by_a_child(seconds=60)  # (the constructor asks the DHT's process, which then cannot answer)
        began = time.monotonic()
        monkeypatch.setattr(bounded_start, "START_WITHIN", 3.0)
        with pytest.raises(AveragerDidNotStart, match=r"\(never-ready\) did not say it was ready within 3 s") as error:
            averager.run_in_background(await_ready=True)  # as hivemind's constructor starts it: no timeout
        assert time.monotonic() - began < 10
        path = re.search(r"its stacks in (\S+)\)", str(error.value)).group(1)
        with open(path) as f:
            stacks = f.read()
        os.remove(path)
        assert f"process {averager.pid} " in stacks and "hivemind/averaging/averager.py" in stacks, stacks
    finally:
        if holder is not None:
            holder.kill()
            holder.join(10)
        if averager is not None and averager.is_alive():
            averager.shutdown()
        shut_down_dht(dht)
