"""`collab simulate`, the README's first command, end to end on a micro config."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.swarm


def test_simulate_runs_peers_that_average_and_reports(tmp_path, micro_config, no_leftover_processes):
    result = run_cli("simulate", "--peers", "2", "--config", str(micro_config), "--max-epochs", "4",
                     "--workdir", str(tmp_path), "--json", timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    assert "collab status --run-id sim-" in result.stdout  # tells where to watch
    assert "peer 0: epoch" in result.stdout  # live progress lines while it runs
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert report["epochs_reached"] == 4
    assert len(report["peers"]) == 2
    for peer in report["peers"]:
        assert peer["exit"] == "exit 0, reached epoch 4", peer
        assert peer["rounds_joined"] >= 2 and peer["mean_group_size"] == 2.0, peer
        assert peer["samples_contributed"] > 0
    assert report["loss_fell"] is True
