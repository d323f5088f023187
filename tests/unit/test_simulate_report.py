"""The simulation's report: per-peer incarnations added up, churn hits counted."""

from __future__ import annotations

import json
from dataclasses import asdict

from collab.peers.launcher import PeerProcess
from collab.peers.report import PeerReport, SwarmReport, peer_report


def test_report_table_counts_churn_hits_and_the_peers_they_hit():
    def peer(index: int, last_loss: float = 9.6, loss_epochs: int = 3) -> PeerReport:
        return PeerReport(index=index, peer_id=f"peer{index}", link="-", incarnations=1, start_epoch=0, final_epoch=3,
                          samples_contributed=100, rounds_joined=3, rounds_failed=0, mean_group_size=3.0,
                          first_loss=9.7, last_loss=last_loss, loaded_state_from_peers=False, bytes_sent=None,
                          bytes_received=None, nonfinite_parameters=[], exit="exit 0 (stopped by signal)",
                          loss_epochs=loss_epochs)
    # peer 1 frozen twice, peer 0 once: three hits on two of the three peers, all brought back
    events = [dict(at=at, peer=index, action=action) for at, index, action in
              [(25, 1, "stop"), (35, 1, "continue"), (50, 1, "stop"), (60, 1, "continue"), (75, 0, "stop"),
               (85, 0, "continue")]]
    # peer 2 restarted at the end: two losses from a few micro-batches, not a sign of training going wrong
    report = SwarmReport("run", "127.0.0.1, no shaping", 100.0, 3, 1.95,
                         [peer(0), peer(1), peer(2, last_loss=9.8, loss_epochs=2)], churn_events=events)
    table = report.to_table()
    assert "churn: 3 hits on 2 of 3 peers, 3 brought back" in table, table
    assert "loss fell on every peer that trained 3+ epochs: yes" in table and "NaN/inf parameters: none" in table
    rising = SwarmReport("run", "-", 100.0, 3, 1.95, [peer(0), peer(1, last_loss=9.8)])
    assert not rising.loss_fell
    assert json.loads(report.to_json())["churn_events"] == events


def test_peer_report_adds_up_incarnations_and_keeps_the_furthest_epoch(tmp_path):
    peer = PeerProcess(index=0, args=[], workdir=tmp_path, starts=2, peer_id="peer0")
    # trained to epoch 10, was hit by the churn, and its restart was stopped while it was still starting up
    first, restart = peer.summary_paths()
    first.write_text(json.dumps(dict(start_epoch=0, final_epoch=10, samples_contributed=648, rounds_joined=10,
                                     group_sizes=[2, 3], loss_by_epoch={"1": 9.7, "10": 9.4},
                                     train_seconds=40.0, compute_seconds=30.0,
                                     progress_reads=dict(read=50, found_nothing=2),
                                     dht=dict(seconds=60, requests=10, bytes_sent=1, bytes_received=1,
                                              records=dict(checked=100, remembered=500)))))
    restart.write_text(json.dumps(dict(start_epoch=0, final_epoch=0, samples_contributed=0,
                                       exit_reason="stopped by signal", train_seconds=0.0,
                                       progress_reads=dict(read=3, found_nothing=1),
                                       dht=dict(seconds=5, requests=1, bytes_sent=1, bytes_received=1,
                                                records=dict(checked=100, remembered=100)))))
    report = peer_report(peer, "-", None, hits=1)
    assert (report.start_epoch, report.final_epoch, report.samples_contributed) == (0, 10, 648), report
    assert (report.rounds_joined, report.mean_group_size, report.first_loss, report.last_loss) == (10, 2.5, 9.7, 9.4)
    assert report.loss_epochs == 2
    # scale.py's rates: samples over the time in the training loop, both incarnations', not the wall time
    assert (report.train_seconds, report.compute_utilization) == (40.0, 0.75)
    assert report.progress_reads_found_nothing == 3  # failed progress reads, both incarnations' (scale.py's column)
    assert report.records_remembered == 600 / 800  # both incarnations' records, answered from memory or checked
    assert report.exit == "not started; hit by churn 1x, started 2x"  # no process handle in this test


def test_the_replicas_spread_is_read_per_epoch_from_the_peers_sketches(tmp_path):
    import torch

    from collab.train.summary import REPLICA_SKETCHES_KEPT, Summary, sketch_replica

    torch.manual_seed(0)
    base = torch.nn.Linear(1000, 10)
    summaries = [Summary() for _ in range(3)]
    for epoch in range(1, REPLICA_SKETCHES_KEPT + 3):
        for index, summary in enumerate(summaries):
            model = torch.nn.Linear(1000, 10)
            model.load_state_dict(base.state_dict())
            if epoch == 5 and index == 2:  # one replica 1% off the others at the start of epoch 5
                with torch.no_grad():
                    model.weight.add_(0.01 * model.weight.norm() * torch.nn.functional.normalize(
                        torch.randn_like(model.weight), dim=None))
            sketch_replica(summary, epoch, model)
    assert sorted(summaries[0].replica_sketches) == list(range(3, REPLICA_SKETCHES_KEPT + 3))  # the last ones kept
    peers = []
    for index, summary in enumerate(summaries):
        peer = PeerProcess(index=index, args=[], workdir=tmp_path / str(index), starts=1, peer_id=f"peer{index}")
        peer.workdir.mkdir()
        peer.summary_paths()[0].write_text(json.dumps(asdict(summary)))
        peers.append(peer_report(peer, "-", None, hits=0))
    spreads = SwarmReport("run", "-", 60.0, 18, 1.0, peers).spread_by_epoch
    assert sorted(spreads) == list(range(3, REPLICA_SKETCHES_KEPT + 3))
    # equal replicas give equal sketches: exactly 0; the one off by 1% is ~2/3 of that from the three's mean
    assert all(spread == 0.0 for epoch, spread in spreads.items() if epoch != 5), spreads
    assert 0.3e-2 < spreads[5] < 1.2e-2, spreads


def test_a_failed_round_says_why_in_words_that_add_up_across_peers():
    from concurrent.futures import TimeoutError as FutureTimeout

    from hivemind.averaging.allreduce import AllreduceException

    from collab.modes.round_failures import NobodyLeftToJoin, round_failure
    from collab.peers.report import _add_up

    reasons = [round_failure(e) for e in (AllreduceException("Averaging step failed: could not find a group"),
                                          FutureTimeout(), TimeoutError("x"), NobodyLeftToJoin("everyone left"))]
    assert reasons == ["no group found", "timed out", "timed out", "nobody left to join"]
    assert _add_up([{"timed out": 2}, {"timed out": 1, "no group found": 4}]) == {"timed out": 3, "no group found": 4}


def test_a_round_that_found_no_group_says_why():
    from collab.modes.round_failures import why_no_group

    # (epoch, client mode) of each peer in the last read of the records, this one's included
    assert why_no_group(4, False, [(4, False)], 3.0).startswith("no group found: this peer is alone in the run")
    both_clients = why_no_group(4, True, [(4, True), (4, True), (5, True)], 3.0)
    assert both_clients.startswith("no group found: the 2 other peer(s) are clients too") and "open port" in both_clients
    # a client beside a reachable peer is no reason: that peer can lead
    assert "clients too" not in why_no_group(4, True, [(4, True), (4, False)], 3.0)
    elsewhere = why_no_group(4, False, [(4, False), (6, False), (7, True)], 3.0)
    assert elsewhere.startswith("no group found: the other peers are on epoch 6, 7, this one on 4"), elsewhere
    slow = why_no_group(4, False, [(4, False), (4, False), (4, True), (3, False)], 3.0)
    assert slow == ("no group found: 2 other peer(s) on this epoch, but none matched within 3 s: on slow or distant "
                    "links raise averaging.matchmaking_time")
