"""`collab simulate`, the README's first command, end to end on a micro config."""

from __future__ import annotations

import json
import re


from tests.conftest import run_cli, swarm_config


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

