"""What a peer does with other peers' reports and findings: suspects, hard evidence, stragglers (the guard's own
counting is tested with the window that feeds it: test_window)."""

from __future__ import annotations

import time

from collab.records.metrics import PeerMetricsRecord
from collab.records.rejections import RejectionLog
from collab.run.shard_fetch import REFUSED
from collab.swarm.state import PeerState, _flag_suspects


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
    # and a leaving peer does not stay on as the state donor of one it caught (collab.modes.staying_donor)
    assert {"QmNaN", "QmGarbage"} <= log.caught_ever() and "QmFlip" not in log.caught_ever()
    # a peer that served a shard whose sha256 is not the manifest's (the trainer's own finding: collab.run.shard_fetch)
    log.add("QmBadShards", REFUSED, "data")
    assert log.take_caught() == ["QmBadShards"]
    assert log.for_record()["QmBadShards"] == {f"{REFUSED} (data)": 1}


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
