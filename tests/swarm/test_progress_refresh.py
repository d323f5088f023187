"""How a peer reads the swarm's progress (collab.modes.tracker.HonestProgressTracker): a peer about to step alone
reads it
again (refresh), and hivemind's forecast of the epoch's end does not count a pause as training. On a real DHT, two
trackers with their own signing identities."""

from __future__ import annotations

import contextlib
import time

from hivemind.utils.timed_storage import get_dht_time

import collab.modes.tracker as tracker_module
import collab.records.shared_reads as shared_reads
from collab.modes.tracker import REPORT_EVERY, HonestProgressTracker
from collab.records.identity import hivemind_reads_ed25519, load_or_create_identity
from collab.swarm.node import OwnGroupDHT, shut_down_dht


@contextlib.contextmanager
def two_trackers(tmp_path, target_batch_size: int):
    hivemind_reads_ed25519()  # as a peer's Swarm does: the identities are Ed25519
    identities = [load_or_create_identity(tmp_path / f"peer{i}.identity") for i in (0, 1)]
    dhts, trackers = [], []
    try:
        for identity in identities:
            initial = dhts[0].get_visible_maddrs() if dhts else None
            dhts.append(OwnGroupDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial,
                                    identity_path=str(identity.path)))
        for dht, identity in zip(dhts, identities):
            trackers.append(HonestProgressTracker(dht=dht, prefix="refresh-test", target_batch_size=target_batch_size,
                                                  start=True, private_key=identity.key, min_refresh_period=0.5,
                                                  max_refresh_period=600))
        yield trackers
    finally:
        for tracker in trackers:
            tracker.shutdown(timeout=5)
        for dht in dhts:
            shut_down_dht(dht)


def records_visible(tracker: HonestProgressTracker, count: int, timeout: float = 10.0) -> None:
    """Wait until `count` peers' progress records can be read from this tracker's DHT node."""
    deadline = time.monotonic() + timeout
    while True:
        found = tracker.dht.get(tracker.training_progress_key, latest=True)
        if found is not None and len(found.value) >= count:
            return
        assert time.monotonic() < deadline, f"fewer than {count} progress records in the DHT"
        time.sleep(0.05)


def wait_for_read(tracker: HonestProgressTracker, reads: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while tracker.reads == reads:
        assert time.monotonic() < deadline, "no read of the swarm's progress"
        time.sleep(0.02)


def test_refresh_reads_the_swarm_now_and_sees_a_peer_that_hiveminds_schedule_would_see_later(tmp_path, monkeypatch,
                                                                                             no_leftover_processes):
    monkeypatch.setattr(shared_reads, "PEERS_PER_READ", 1)  # two peers read as a swarm of 16 would
    with two_trackers(tmp_path, target_batch_size=100) as (ours, theirs):
        ours.report_local_progress(0, 40)
        wait_for_read(ours, 0)  # the read that the first micro-batch asks for
        # what hivemind does when this peer's own ETA is far: the next read is scheduled that far ahead
        ours.global_progress.next_fetch_time = get_dht_time() + 600
        ours.global_state_updated.set()
        theirs.report_local_progress(0, 70)  # the other peer's record: stored at once
        records_visible(ours, 2)  # a read now would see it
        assert ours.global_progress.num_peers <= 1, "hivemind read the swarm before its schedule: nothing to show"
        reads = ours.reads
        assert ours.refresh(timeout=5.0)
        assert ours.reads > reads
        assert ours.global_progress.num_peers == 2, ours.global_progress
        assert ours.global_progress.samples_accumulated == 110, ours.global_progress
        assert ours.ready_to_update_epoch  # the target is the swarm's now, with the other peer in it
        # the target reached, hivemind would read again after min_refresh_period (0.5 s): 1 s for this swarm
        assert ours.global_progress.next_fetch_time >= ours.forecast_at + 1.0, ours.global_progress


def test_a_paused_peers_record_does_not_end_the_epoch_on_a_forecast(tmp_path, no_leftover_processes):
    with two_trackers(tmp_path, target_batch_size=2000) as (ours, theirs):
        ours.micro_batch_size = 16
        ours.report_local_progress(1, 16)  # this peer's first micro-batch of epoch 1: it asks for a read of its own
        wait_for_read(ours, 0)
        # the other peer stepped to epoch 1 and sits in a state round or a checkpoint: a record of no samples at
        # 1000/s. hivemind extrapolates it through the pause: 3 s later it counts 3000 and calls the epoch done
        theirs.report_local_progress(0, 32)
        records_visible(ours, 2)  # hivemind stores a peer's records only once it has reported samples
        theirs.performance_ema.samples_per_second = 1000.0
        theirs.report_local_progress(1, 0)
        time.sleep(3.0)  # time itself is what hivemind extrapolates the record through: no condition to wait on
        assert ours.refresh(timeout=5.0)
        assert ours.global_progress.num_peers == 2, ours.global_progress
        assert ours.global_progress.samples_accumulated == 16, ours.global_progress
        # not counted, the pause leaves about 2000 - 32 samples at both peers' rates (this peer's is what its first
        # micro-batch measured: 16 samples over the time since its tracker started); counted, none: an ETA of now
        rates = 1000.0 + ours.local_progress.samples_per_second
        left = ours.global_progress.eta_next_epoch - get_dht_time()
        assert left > 0.5 * (2000 - 64) / rates, f"the pause was extrapolated as training: {left:.2f} s at {rates:.0f}/s"
        assert not ours.ready_to_update_epoch

        # a forecast that passes while this peer is not computing (its step, then a pause) does not end its epoch
        ours.report_local_progress(1, 0)
        ours.global_progress.eta_next_epoch = get_dht_time() - 1.0
        assert not ours.ready_to_update_epoch
        ours.global_progress.samples_accumulated = 2000  # what was counted still does
        assert ours.ready_to_update_epoch


def test_a_read_that_found_no_record_does_not_leave_the_peer_alone(tmp_path, monkeypatch, no_leftover_processes):
    """A read of the progress key that found nothing, not even this peer's own record, failed (the key's nodes did
    not answer in time). hivemind took it for an empty swarm: 0 peers, and at the step no gradient round ("could not
    start": one peer of the 12-peer test in three CI runs). The last read stands for FOUND_NOTHING_KEPT seconds."""
    with two_trackers(tmp_path, target_batch_size=1000) as (ours, theirs):
        ours.report_local_progress(0, 40)
        theirs.report_local_progress(0, 70)
        records_visible(ours, 2)
        assert ours.refresh(timeout=5.0) and ours.global_progress.num_peers == 2, ours.global_progress
        reads = ours.reads
        progress = ours.parse_swarm_progress(None)  # what hivemind's reader passes for a read that found nothing
        assert progress.num_peers == 2 and progress.samples_accumulated == 110, progress
        assert ours.found_nothing == 1 and ours.reads == reads  # counted, and not a read: refresh() waits on
        assert progress.next_fetch_time <= get_dht_time() + ours.min_refresh_period, progress  # read again soon
        # long after the last read that found others, nothing is what there is: hivemind's empty swarm
        monkeypatch.setattr(tracker_module, "FOUND_NOTHING_KEPT", 0.0)
        assert ours.parse_swarm_progress({}).num_peers == 0
    with two_trackers(tmp_path, target_batch_size=1000) as (ours, _):
        assert ours.parse_swarm_progress(None).num_peers == 0  # nothing stored yet, nobody read: nothing to keep
        assert ours.found_nothing == 0


def test_a_computing_peer_stores_its_progress_every_half_second_mid_epoch_and_a_few_times_a_read_at_the_end(
        tmp_path, no_leftover_processes):
    """hivemind stored a record after every micro-batch (each store signed, and validated whole by every node it
    reached: a quarter of 2 cores for 3 micro peers). Mid-epoch at most one per REPORT_EVERY now; what the others
    read is still at most that old; an epoch's first micro-batch and the one that reaches the target are stored at
    once, and past the target one every near_the_end_every() (a few per read of the key)."""
    with two_trackers(tmp_path, target_batch_size=10**6) as (ours, theirs):
        stores = []
        store = ours.dht.store

        def counted(*args, **kwargs):  # the real store, counted
            value = kwargs.get("value")
            if isinstance(value, dict):  # (at shutdown hivemind stores None: no record)
                stores.append(value.get("samples_accumulated"))
            return store(*args, **kwargs)
        ours.dht.store = counted
        for i in range(1, 41):  # 20 micro-batches a second for 2 s, the ETA far away
            ours.report_local_progress(0, 8 * i)
            time.sleep(0.05)
        time.sleep(0.2)
        mid_epoch = len(stores)
        assert 2 <= mid_epoch <= 2 / REPORT_EVERY + 2, stores  # hivemind's: 40
        reads = theirs.reads
        theirs.refresh(timeout=5)
        wait_for_read(theirs, reads)
        seen = theirs.global_progress.samples_accumulated
        assert seen >= 8 * 40 - 8 * 20 * REPORT_EVERY - 8, (seen, stores)  # at most REPORT_EVERY behind

        ours.report_local_progress(1, 8)  # a new epoch: stored at once
        time.sleep(0.2)
        assert stores[-1] == 8, stores
        ours.target_batch_size = 16  # the next micro-batch reaches the target: stored at once
        before, began = len(stores), time.monotonic()
        for i in range(2, 12):
            ours.report_local_progress(1, 8 * i)
            time.sleep(0.05)
        took = time.monotonic() - began
        time.sleep(0.2)
        every, past = ours.near_the_end_every(), stores[before:]
        assert every == 0.125 and past and past[0] == 16, stores  # (2 peers: share_for(2) / 4)
        assert 3 <= len(past) <= took / every + 2, (stores, took)  # hivemind's and collab's before: 10
        assert past[-1] >= 88 - 8 * (every / 0.05 + 1), stores  # what the others read is at most `every` behind


def test_a_trainers_record_follows_its_epoch_through_epochs_whose_stores_carried_no_samples(tmp_path,
                                                                                            no_leftover_processes):
    """hivemind's reporter stops storing once its stores carried no samples for two epochs (its rule for auxiliary
    peers); with sub-second epochs a trainer's stores often came after the epoch had moved on (samples 0), its record
    froze epochs back, and at --max-epochs every peer waited a record's lifetime (60 s) as the others' state donor.
    collab's reporter stores every due report, and none before the peer's first micro-batch."""
    with two_trackers(tmp_path, target_batch_size=10**6) as (ours, theirs):
        stores = []
        store = ours.dht.store

        def counted(*args, **kwargs):  # the real store, counted
            value = kwargs.get("value")
            if isinstance(value, dict):
                stores.append(value["epoch"])
            return store(*args, **kwargs)
        ours.dht.store = counted
        with ours.pause_updates():
            ours.update_epoch(0)  # a report of 0 samples: not a trainer yet
        time.sleep(0.3)
        assert stores == [], stores
        ours.report_local_progress(0, 8)  # its first micro-batch
        for epoch in range(1, 5):  # four epochs whose reports the reporter reads with 0 samples
            time.sleep(0.3)
            with ours.pause_updates():
                ours.update_epoch(epoch)
        deadline = time.monotonic() + 10
        while True:  # what another peer reads: our record at our epoch
            found = theirs.dht.get(ours.training_progress_key, latest=True)
            epochs = [entry.value["epoch"] for entry in (found.value.values() if found else [])
                      if isinstance(entry.value, dict) and entry.value["peer_id"] == ours.local_progress.peer_id]
            if epochs == [4]:
                break
            assert time.monotonic() < deadline, f"our record says epochs {epochs}, stores {stores}; we are at 4"
            time.sleep(0.1)



def test_a_first_gradient_round_plans_from_the_trainers_view_and_the_averager_reads_the_records_at_once(
        no_leftover_processes):
    """read_progress_soon (called when --wait-peers counts every peer, or as a peer joins without it) hands the
    gradient averager the trainer's view of who trains, and starts the averager's own read of the records at once.
    24 peers on 2 cores: 21 had no records FIRST_PLAN_WAIT into their first round (a read took 4-6 s under that
    load), so no group target and no planned leader, and the round split into groups of 2-8. Here two real
    averagers (DHT, p2pd, averager processes) with no progress records in the DHT at all: given the view naming both,
    the leader begins as soon as the other has joined; without it, the round waits out the whole matchmaking time
    (no target). And the averager's DHT node asks for the progress key at once, before any round."""
    import torch

    from benchmarks.lab.averager_pair import start_averager_pair
    from collab.averaging.robust_rounds import CheckedRounds
    from collab.config import join_request_timeout
    from collab.swarm.dht_traffic import dht_requests, start_counting
    from tests.conftest import wait_for

    class GradientRounds(CheckedRounds):
        kind = "gradients"

    matchmaking = 15.0
    run_id, sent, dhts = f"warm-{time.time_ns()}", [torch.ones(8), torch.full((8,), 3.0)], []

    def make(dht, i):
        dhts.append(dht)
        # the timeouts a peer's would be (a 2-s join request, tighter than a peer's, lost a round under CI's load)
        return GradientRounds([sent[i].clone()], dht=dht, prefix=f"{run_id}_grad_averager", start=True,
                              target_group_size=None, min_matchmaking_time=matchmaking,
                              request_timeout=join_request_timeout(matchmaking), allreduce_timeout=2 * matchmaking)

    def progress_requests() -> int:
        counts = dht_requests(dhts[0], run_id) or {}
        return counts.get("by_key", {}).get(f"{run_id}_progress", {}).get("requests", 0)

    with contextlib.ExitStack() as stack:
        averagers = start_averager_pair(stack, make)
        start_counting(dhts[0])
        time.sleep(1.0)
        assert progress_requests() == 0, dht_requests(dhts[0], run_id)  # no round, no read
        seen = {averager.peer_id.to_base58(): (0, False) for averager in averagers}
        for averager in averagers:
            averager.read_progress_soon(seen)
        wait_for(lambda: progress_requests() > 0, timeout=30, interval=0.2, what="the averager's read of the records")
        started = time.monotonic()
        controls = [averager.step(wait=False, timeout=3 * matchmaking) for averager in averagers]
        for control in controls:
            control.result(timeout=6 * matchmaking)
        took = time.monotonic() - started
        for averager in averagers:
            with averager.get_tensors() as tensors:
                assert torch.allclose(tensors[0], torch.full((8,), 2.0)), tensors[0]  # the exact mean
        assert took < matchmaking, f"the round took {took:.1f} s: it waited out matchmaking_time, with no target"
