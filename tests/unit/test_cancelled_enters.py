"""A round cancelled while it waits for a blocking context (hivemind's enter_asynchronously: the averaged tensors'
lock, shared with the trainer's optimizer step) does not leave that context entered by the thread that went on
waiting (collab.hivemind_hooks.patches.cancelled_enters_exit). Before, the thread took the lock after the round had
given up and nothing released it: the trainer's next optimizer step waited for good."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from contextlib import contextmanager

from hivemind.utils.asyncio import enter_asynchronously

from collab.hivemind_hooks.patches import cancelled_enters_exit


def test_a_cancelled_enter_releases_the_lock_its_thread_took_later():
    cancelled_enters_exit()
    lock, entered = mp.Lock(), mp.Event()

    @contextmanager
    def tensors():  # hivemind's DecentralizedAverager.get_tensors
        with lock:
            entered.set()
            yield

    async def round_that_times_out():
        async def aggregate():
            async with enter_asynchronously(tensors()):
                raise AssertionError("entered while the trainer held the lock")
        try:
            await asyncio.wait_for(aggregate(), timeout=0.2)
        except asyncio.TimeoutError as error:
            return error  # kept, as hivemind's step keeps a failed round's error (its traceback holds the context)
        raise AssertionError("the round did not time out")

    assert lock.acquire(timeout=1)  # the trainer's optimizer step holds the lock
    kept = asyncio.run(round_that_times_out())
    lock.release()  # the step ends: the thread that still waits takes the lock now
    assert entered.wait(5), "the waiting thread never took the lock"
    assert lock.acquire(timeout=5), "the cancelled round's thread kept the lock"
    lock.release()
    assert kept is not None
