"""`collab simulate`, the README's first command, end to end on a micro config."""

from __future__ import annotations

import json
import re

import pytest

from collab.peers.launcher import PeerProcess
from collab.peers.report import PeerReport, SwarmReport, peer_report
from tests.conftest import run_cli, swarm_config


@pytest.mark.swarm
def test_simulate_runs_peers_that_average_and_reports(tmp_path, no_leftover_processes):
    # the command end to end, in the gossip mode: the sync mode's simulation runs in test_churn.py (the same
    # Simulation, churned), and the diloco mode's swarm in test_diloco.py, which checks its outer steps exactly (a
    # diloco case here checked a subset of that in 28 s of a suite that must stay under 20 minutes on 2 cores)
    # (an epoch of 480 samples: with fewer, one peer's few-sample epochs made its loss curve noise)
    config = swarm_config(tmp_path, 2, {"averaging.mode": "gossip", "training.target_batch_size": 480,
                                        "averaging.gossip": {"lr": 0.001, "mean_local_steps": 4}})
    result = run_cli("simulate", "--peers", "2", "--config", str(config), "--max-epochs", "4",
                     "--workdir", str(tmp_path), "--json", timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    assert "collab status --run-id sim-" in result.stdout  # tells where to watch
    assert re.search(r"^  epoch \d+: peer 0: ", result.stdout, re.M)  # live progress lines while it runs
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert report["epochs_reached"] == 4 and report["network"] == "127.0.0.1, no shaping"
    assert report["epochs_per_minute"] > 0 and report["any_nonfinite"] is False
    assert len(report["peers"]) == 2
    for peer in report["peers"]:
        assert peer["exit"] == "exit 0 (reached epoch 4)", peer
        assert peer["samples_contributed"] > 0
    assert report["loss_fell"] is True
    # no rounds: merges, and the replicas' spread at the end (two replicas trained apart end ~0.5-0.8)
    assert all(peer["merges"] >= 5 and peer["rounds_joined"] == 0 for peer in report["peers"]), report["peers"]
    assert report["replica_spread"] is not None and report["replica_spread"] < 0.1, report["replica_spread"]


@pytest.mark.parametrize("args, message", [
    (["--churn", "kill-30-20"], "--churn 'kill-30-20' is not ACTION:EVERY:DOWNTIME"),
    (["--churn", "stop:0:5"], "EVERY must be more than 0"),
    (["--churn", "kill:30:20", "--peers", "1"], "--churn needs --peers 2 or more"),
    (["--profile", "moon-base"], "--profile 'moon-base' is neither a file nor a shipped profile; use one of: datacenter"),
    (["--duration", "-5"], "--duration -5.0 must be positive"),
])
def test_simulate_flag_errors_are_one_line(args, message):
    result = run_cli("simulate", *args, timeout=60, fork=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


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
                                     group_sizes=[2, 3], loss_by_epoch={"1": 9.7, "10": 9.4})))
    restart.write_text(json.dumps(dict(start_epoch=0, final_epoch=0, samples_contributed=0,
                                       exit_reason="stopped by signal")))
    report = peer_report(peer, "-", None, hits=1)
    assert (report.start_epoch, report.final_epoch, report.samples_contributed) == (0, 10, 648), report
    assert (report.rounds_joined, report.mean_group_size, report.first_loss, report.last_loss) == (10, 2.5, 9.7, 9.4)
    assert report.loss_epochs == 2
    assert report.exit == "not started; hit by churn 1x, started 2x"  # no process handle in this test
