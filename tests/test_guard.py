"""A peer never sends what it should not (collab.train.guard), and a failed round steps on what it did send."""

from __future__ import annotations

import time

import torch

from collab.records.metrics import PeerMetricsRecord
from collab.records.rejections import RejectionLog
from collab.swarm.state import PeerState, _flag_suspects
from collab.train.guard import RELOAD_AFTER, BatchGuard


def test_nonfinite_loss_and_gradients_are_dropped_counted_and_many_in_a_row_mean_reload():
    model = torch.nn.Linear(4, 1)
    guard = BatchGuard(model.parameters())
    assert guard.loss_ok(torch.tensor(1.0))
    model(torch.ones(1, 4)).sum().backward()
    assert guard.gradients_ok() and guard.in_a_row == 0
    assert not guard.loss_ok(torch.tensor(float("nan")))
    model.weight.grad[0, 0] = float("inf")
    assert guard.loss_ok(torch.tensor(1.0)) and not guard.gradients_ok()
    assert guard.dropped == {"loss not finite": 1, "gradients not finite": 1} and guard.in_a_row == 2
    for _ in range(RELOAD_AFTER - 2):
        guard.loss_ok(torch.tensor(float("inf")))
    assert guard.replica_is_broken()
    model.zero_grad()
    assert guard.loss_ok(torch.tensor(0.5)) and guard.gradients_ok() and guard.in_a_row == 0


def test_a_failed_round_keeps_the_gradients_this_peer_sent(no_leftover_processes):
    """hivemind zeroes the accumulators when the round starts; the copy taken then is what a failed round
    steps on (before, its fallback loaded zeros: a step of momentum and weight decay alone)."""
    import hivemind

    from collab.averaging.grad_averager import CollabGradientAverager

    model = torch.nn.Linear(8, 2)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = CollabGradientAverager(model.parameters(), dht=dht, prefix=f"guard-{time.time_ns()}", start=True,
                                      min_matchmaking_time=0.5, request_timeout=0.25)
    try:
        model(torch.randn(3, 8)).pow(2).sum().backward()
        sent = [p.grad.clone() for p in model.parameters()]
        averager.accumulate_grads_(batch_size=3)
        control = averager.step(wait=False, timeout=2.0)  # nobody to average with: the round fails
        try:
            control.result(timeout=10)
        except Exception:
            pass
        assert all(float(acc.abs().sum()) == 0 for acc in averager._grad_accumulators())  # hivemind zeroed them
        own = averager.take_own_gradients()
        assert own is not None and all(torch.allclose(o, s) for o, s in zip(own, sent))
        assert averager.take_own_gradients() is None  # used once
    finally:
        averager.shutdown()
        dht.shutdown()


def record(peer: str, rejected: dict) -> PeerMetricsRecord:
    return PeerMetricsRecord(peer_id=peer, role="trainer", epoch=3, loss=1.0, samples_per_second=1.0,
                             samples_contributed=10, target_batch_size=64, client_mode=False, bandwidth_mbps=None,
                             rounds_joined=1, rounds_failed=0, last_group_size=2, time=time.time(), rejected=rejected)


def peer_state(peer: str) -> PeerState:
    return PeerState(peer_id=peer, role="trainer", client_mode=False, samples_per_second=1.0, epoch=3, loss=1.0,
                     samples_contributed=10, contribution=0.25, samples_accumulated=0, bandwidth_mbps=None,
                     rounds_joined=1, rounds_failed=0, last_seen=0.0, online=True, straggler=False)


def test_a_peer_is_suspect_only_when_half_of_the_others_report_it():
    clipped = {"part clipped (far from the others') (gradients)": 4}
    records = {"a": record("a", {"x": clipped}), "b": record("b", {"x": clipped}), "c": record("c", {}),
               "x": record("x", {"a": {"part not finite (gradients)": 99}})}  # the attacker accuses an honest peer
    peers = [peer_state(p) for p in "abcx"]
    _flag_suspects(peers, records)
    by_id = {p.peer_id: p for p in peers}
    assert by_id["x"].suspect and by_id["x"].reported_by == 2 and by_id["x"].contributions_rejected == 8
    assert not by_id["a"].suspect and by_id["a"].reported_by == 1  # one accuser of three others is not enough
    assert not by_id["b"].suspect and not by_id["c"].suspect


def test_a_peer_caught_with_hard_evidence_is_handed_over_once_and_a_clipped_one_never():
    """The gradient averager catches a cheat in its own process; the trainer hands it to the state averager,
    which then never downloads a state from it (a test run loaded the NaN attacker's replica before this)."""
    log = RejectionLog()
    for finding in [("QmNaN", "part not finite", "gradients"), ("QmFlip", "part clipped (far from the others')",
                                                                 "gradients"),
                    ("(the group)", "returned a non-finite average", "gradients"),
                    ("QmNaN", "part not finite", "gradients"), ("QmGarbage", "returned a non-finite average", "state")]:
        log.queue.put(finding)
    time.sleep(0.5)  # a multiprocessing queue's feeder thread
    assert log.take_caught() == ["QmNaN", "QmGarbage"]
    log.queue.put(("QmNaN", "part not finite", "gradients"))
    time.sleep(0.5)
    assert log.take_caught() == []
    assert log.drain()["QmNaN"] == {"part not finite (gradients)": 3}
    # and a leaving peer does not stay on as the state donor of one it caught (collab.modes.sync._serve_peers_behind)
    assert {"QmNaN", "QmGarbage"} <= log.caught_ever() and "QmFlip" not in log.caught_ever()


def test_donors_of_one_epoch_are_ordered_by_their_uplink_and_never_above_a_newer_epoch(no_leftover_processes):
    """hivemind downloads state from the highest priority its averagers declare in the DHT: a 2 Mbit/s uplink
    (160 s for a 40 MB state) must come after a faster one at the same epoch (one that announced nothing counts
    as 100 Mbit/s), and before nobody an epoch ahead. Checked on what real averagers declare, where hivemind's
    download reads it."""
    import hivemind
    from hivemind.p2p import PeerID

    from collab.averaging.replica import RecordingStateAverager

    prefix = f"donors-{time.time_ns()}"
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dhts, averagers = [first], []
    try:
        for upload in (2.0, 1000.0, None, 2.0):
            if averagers:  # the first averager shares the first DHT node; each other one gets its own
                dhts.append(hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                         initial_peers=first.get_visible_maddrs()))
            dht = dhts[-1]
            model = torch.nn.Linear(4, 2)
            averagers.append(RecordingStateAverager(
                dht=dht, prefix=prefix, optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                params=model.parameters(), bandwidth=upload, start=True))
        for averager, epoch in zip(averagers, (5, 5, 5, 6)):
            averager.state_sharing_priority = epoch

        def declared():
            entries, _ = first.get(f"{prefix}.all_averagers", latest=True) or ({}, None)
            # keyed as hivemind's download reads them: PeerID(subkey)
            values = {PeerID(key): float(entry.value) for key, entry in entries.items()}
            return values if len(values) == 4 and min(values.values()) >= 5 else None
        deadline = time.monotonic() + 30
        while (found := declared()) is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert found is not None, "the averagers did not declare their state in the DHT within 30 s"
        by_peer = [found[a.peer_id] for a in averagers]
        slow, fast, unknown, slow_ahead = by_peer
        assert 5 <= slow < unknown < fast < 6 <= slow_ahead < 7, by_peer
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()


def test_a_straggler_is_flagged_with_its_reason_compute_or_link():
    from collab.records.untrusted import LATE_PART
    from collab.swarm.state import _flag_stragglers

    peers = {name: peer_state(name) for name in ("fast", "fast2", "slow", "late", "once")}
    for p in peers.values():
        p.samples_per_second, p.rounds_joined = 40.0, 8
    peers["slow"].samples_per_second = 5.0
    peers["late"].rejected_by_reason = {f"{LATE_PART} (gradients)": 4}  # 4 of its 8 rounds: its uplink
    peers["once"].rejected_by_reason = {f"{LATE_PART} (gradients)": 1}  # once: a hiccup, not a straggler
    _flag_stragglers(list(peers.values()), global_epoch=3)
    assert peers["slow"].straggler and peers["slow"].straggler_reason.startswith("compute: 5.0 samples/s")
    assert peers["late"].straggler and peers["late"].straggler_reason == "link: its parts came too late for 4 of " \
        "the others' rounds"
    assert not any(peers[name].straggler for name in ("fast", "fast2", "once"))
