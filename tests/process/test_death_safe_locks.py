"""hivemind's process-shared locks, as a peer holds them (collab.hivemind_hooks.locks): a process killed while it held
one does not block the others for good, and they still exclude processes and threads.

In CI a test killed a hivemind process while it held MPFuture's update lock; every DHT that test worker started
after it hung in `DHT.__init__`, its process waiting for that lock (600 s each, then the next)."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import hivemind
from hivemind.utils import get_dht_time
from hivemind.utils.mpfuture import MPFuture

from collab.hivemind_hooks.patches import death_safe_locks
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
