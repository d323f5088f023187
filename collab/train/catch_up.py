"""A peer's way into the swarm's state and out of it: waiting for the peers a simulation starts together, catching up
with the swarm's epoch on joining, and making sure the replica it leaves with is the swarm's."""

from __future__ import annotations

import threading
import time
from typing import Callable

from collab.config import RunConfig
from collab.modes import AveragingMode
from collab.swarm.node import Swarm
from collab.swarm.state import read_run_state
from collab.train.progress import ProgressDisplay

STALE_AFTER = 120.0  # seconds: a waiting peer's record older than this is not counted (it may have left)
ANNOUNCE_EVERY = 30.0  # a waiting peer's record is published again this often: online while it waits
LOOK_EVERY = 1.0  # seconds between two reads of the run's records while waiting: 32 peers read 32 records each
WAIT_AT_MOST = 4  # x the wait's timeout (counted from the last new peer): the longest a peer waits for the others


def settle(opt: AveragingMode, config: RunConfig) -> str:
    """Leaving at --max-epochs: the final replica is the swarm's, or it is said loudly that it is not."""
    try:
        outcome = opt.settle_before_leaving(timeout=config.averaging.load_state_timeout)
    except Exception as e:  # a DHT or averager failing now must not cost the exit summary, nor claim a sync
        print(f"while re-syncing before leaving: {type(e).__name__}: {e}", flush=True)
        return "swarm" if opt.own_step is None else "own step"
    if outcome == "downloaded":
        print(f"The last step (to epoch {opt.local_epoch}) was not the swarm's: its gradient round failed or gathered "
              "fewer than half the peers. Downloaded the swarm's state before leaving.", flush=True)
    elif outcome == "own step":
        print(f"The last step (to epoch {opt.local_epoch}) was not the swarm's: its gradient round failed or gathered "
              "fewer than half the peers, and no peer could give the swarm's state. This replica is not the swarm's: "
              "no checkpoint written for it.", flush=True)
    return outcome


def wait_for_peers(swarm: Swarm, wanted: int, timeout: float, display: ProgressDisplay, stop: threading.Event,
                   announce: Callable[[], None]) -> int:
    """Hold step 0 until the expected peers have published, so a simulated swarm starts together. Gives up after
    `timeout` s in which no more peers came, and after WAIT_AT_MOST x `timeout` in all: 64 peers started together on 2
    cores took 3.5 minutes to all publish, and the first, waiting a fixed 180 s, trained without the last 6. Returns
how many peers it saw (the first step waits for as many: not for those that never came).

    This peer's record counts as online for STALE_AFTER s from when it was published: `announce` publishes it again
    every ANNOUNCE_EVERY s (published once, the first of 32 peers on 2 cores went stale before the last, restarted
    after a failed join, came: none of them ever saw all 32, and the whole run went by waiting)."""
    display.message(f"Waiting for {wanted} peers to join...")
    began = announced = came = time.monotonic()
    deadline, most = began + timeout, 0
    while not stop.is_set() and time.monotonic() < deadline:
        present = sum(p.online for p in read_run_state(swarm.dht, swarm.peer.run_id, stale_after=STALE_AFTER).peers)
        if present >= wanted:  # (a peer that just left still counts here for STALE_AFTER s: not more than wanted)
            return wanted
        if present > most:  # peers still coming: wait on
            most, came = present, time.monotonic()
            deadline = min(came + timeout, began + WAIT_AT_MOST * timeout)
        if time.monotonic() - announced >= ANNOUNCE_EVERY:
            announce()
            announced = time.monotonic()
        stop.wait(LOOK_EVERY)
    if not stop.is_set():
        now = time.monotonic()
        why = (f"none new for {now - came:.0f} s" if now - came >= timeout
               else f"the longest wait, {WAIT_AT_MOST} x {timeout:.0f} s")
        display.message(f"Only {most} of {wanted} peers after {now - began:.0f} s ({why}); training anyway")
    return max(most, 1)


def catch_up(opt: AveragingMode, display: ProgressDisplay, stop: threading.Event,
              wait: float = 30.0) -> tuple[bool, str]:
    """A late peer first downloads the swarm's parameters and optimizer state, then trains at its epoch. Says
    whether it loaded a state, and what happened (kept in the summary: a late peer that trained from its own
    replica says why)."""
    started = time.monotonic()
    while not opt.tracker.fetched_global_progress_this_epoch.is_set() and time.monotonic() < started + wait:
        if stop.wait(0.1):
            return False, "stopped"
    seen = "" if opt.tracker.fetched_global_progress_this_epoch.is_set() else f" (no progress read in {wait:.0f} s)"
    if opt.tracker.global_epoch <= opt.local_epoch:
        return False, f"the swarm was at epoch {opt.tracker.global_epoch}, this peer at {opt.local_epoch}{seen}"
    display.message(f"Swarm is at epoch {opt.tracker.global_epoch}, this peer at {opt.local_epoch}: "
                    "loading state from peers...")
    asking = time.monotonic()
    # under churn the first donors tried may be dead peers whose records linger: keep asking a while
    if not opt.load_state_from_peers(deadline=asking + 5 * opt.load_state_timeout) or stop.is_set():
        display.message("No peer gave its state yet: training from this replica, and trying again at the next step")
        return False, (f"no peer gave its state in {time.monotonic() - asking:.0f} s (the swarm at epoch "
                       f"{opt.tracker.global_epoch}, {opt.tracker.global_progress.num_peers} peers)")
    display.message(f"Caught up: now at epoch {opt.local_epoch}")
    return True, f"loaded the swarm's state at epoch {opt.local_epoch} in {time.monotonic() - started:.0f} s"
