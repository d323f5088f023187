"""A peer's first progress record is stored at its first micro-batch, even after a catch-up reported epoch and zero
samples before it (collab.modes.tracker.HonestProgressTracker; real DHT, real hivemind reporter).

A late volunteer with --wait-peers downloads the swarm's state (a report: the new epoch, 0 samples), computes one
micro-batch, then holds until its tracker counts the others. That hold computes nothing more, so no later report
comes: when the first micro-batch's report was not stored, the peer stayed unseen until the reporter's own wake-up
(half the record's 60-s life), and the peer it waited for trained on alone (the shards-from-the-swarm test, 30 s)."""

from __future__ import annotations

import time


from collab.modes.tracker import REPORT_EVERY, HonestProgressTracker
from collab.swarm.node import OwnGroupDHT, shut_down_dht

SEEN_WITHIN = 5.0  # seconds: the reporter stores at once when told; its own wake-up is 30 s away


def _stored(dht, tracker) -> list:
    """(epoch, samples) of each record under the run's progress key, as stored (this test's DHT signs with a key of
    its own, not its peer id's: collab's checks would drop it, hivemind's reader would not)."""
    found = dht.get(tracker.training_progress_key, latest=True)
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    return [(e.value["epoch"], e.value["samples_accumulated"]) for e in entries.values() if isinstance(e.value, dict)]


def test_the_first_micro_batch_after_a_catch_up_is_stored_at_once(no_leftover_processes):
    run_id = f"first-record-{time.time_ns()}"
    dht = OwnGroupDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    tracker = HonestProgressTracker(dht=dht, prefix=run_id, target_batch_size=512, start=True)
    try:
        tracker.report_local_progress(4, 0)  # the catch-up: at the swarm's epoch now, nothing computed
        time.sleep(REPORT_EVERY / 2)  # the reporter wakes, finds nothing trained, and sleeps again
        # the first micro-batch, within REPORT_EVERY of the catch-up (then the peer holds and reports nothing more)
        tracker.report_local_progress(4, 8)
        deadline, records = time.monotonic() + SEEN_WITHIN, []
        while time.monotonic() < deadline and not records:
            time.sleep(0.2)
            records = _stored(dht, tracker)
        assert records == [(4, 8)], f"no record within {SEEN_WITHIN:g} s of the first micro-batch: {records}"
    finally:
        tracker.shutdown(5.0)
        shut_down_dht(dht)
