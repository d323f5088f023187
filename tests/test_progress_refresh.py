"""A peer about to step alone reads the swarm's progress again (collab.tracker.HonestProgressTracker.refresh): on a
real DHT, two trackers with their own signing identities."""

from __future__ import annotations

import time

from hivemind import DHT
from hivemind.utils.timed_storage import get_dht_time

from collab.identity import load_or_create_identity
from collab.tracker import HonestProgressTracker


def test_refresh_reads_the_swarm_now_and_sees_a_peer_that_hiveminds_schedule_would_see_later(tmp_path,
                                                                                             no_leftover_processes):
    identities = [load_or_create_identity(tmp_path / f"peer{i}.identity") for i in (0, 1)]
    dhts, trackers = [], []
    try:
        for identity in identities:
            initial = dhts[0].get_visible_maddrs() if dhts else None
            dhts.append(DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial,
                            identity_path=str(identity.path)))
        ours, theirs = [HonestProgressTracker(dht=dht, prefix="refresh-test", target_batch_size=100, start=True,
                                              private_key=identity.key, min_refresh_period=0.5,
                                              max_refresh_period=600)
                        for dht, identity in zip(dhts, identities)]
        trackers = [ours, theirs]
        ours.report_local_progress(0, 40)
        # what hivemind does when this peer's own ETA is far: the next read is scheduled that far ahead
        ours.global_progress.next_fetch_time = get_dht_time() + 600
        ours.global_state_updated.set()
        theirs.report_local_progress(0, 70)  # the other peer's record: stored at once
        time.sleep(1.5)
        assert ours.global_progress.num_peers <= 1, "hivemind read the swarm before its schedule: nothing to show"
        reads = ours.reads
        assert ours.refresh(timeout=5.0)
        assert ours.reads > reads
        assert ours.global_progress.num_peers == 2, ours.global_progress
        assert ours.global_progress.samples_accumulated == 110, ours.global_progress
        assert ours.ready_to_update_epoch  # the target is the swarm's now, with the other peer in it
    finally:
        for tracker in trackers:
            tracker.shutdown(timeout=5)
        for dht in dhts:
            dht.shutdown()
