"""Checkpoints: written atomically as HF folders; a restarted peer resumes from its checkpoint."""

from __future__ import annotations

import torch
from transformers import AlbertForPreTraining

from collab.peers.launcher import LocalSwarm
from collab.train.checkpoint import TRAINING_STATE, list_checkpoints
from tests.conftest import fork_server, peer_env, read_summary, scaled



def run_alone(tmp_path, config, run_id, checkpoints, max_epochs: int) -> tuple[dict, str]:
    with LocalSwarm(1, run_id, tmp_path, ["--config", str(config), "--max-epochs", str(max_epochs),
                                          "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2"],
                    env=peer_env(), forks=fork_server()) as swarm:
        swarm.start()
        assert swarm.wait(timeout=scaled(180)), swarm.peers[0].log_text()[-3000:]
        peer = swarm.peers[0]
        assert peer.popen.returncode == 0, peer.log_text()[-3000:]
        return read_summary(peer), peer.log_text()


def test_restarted_peer_resumes_from_its_checkpoint(tmp_path, micro_config, run_id, no_leftover_processes):
    checkpoints = tmp_path / "checkpoints"
    first, _ = run_alone(tmp_path, micro_config, run_id, checkpoints, max_epochs=3)
    assert first["final_epoch"] == 3
    saved = list_checkpoints(checkpoints)
    assert [p.name for p in saved] == ["epoch-000003"]  # keep: 1 in the micro config, epoch 2 was pruned
    assert not [p for p in checkpoints.iterdir() if p.name.startswith(".tmp")]
    assert AlbertForPreTraining.from_pretrained(saved[-1]).config.hidden_size == 64
    place = torch.load(saved[-1] / TRAINING_STATE, weights_only=False)["data"]  # where it was in the data

    # a half-written checkpoint (a crash mid-save) is never picked up
    (checkpoints / "epoch-000009").mkdir()
    (checkpoints / "epoch-000009" / "config.json").write_text("{")

    second, log = run_alone(tmp_path, micro_config, run_id + "-again", checkpoints, max_epochs=5)
    assert "Resumed from checkpoint at epoch 3" in log
    assert second["start_epoch"] == 3 and second["final_epoch"] == 5
    losses_before = [v for _, v in sorted((int(k), v) for k, v in first["loss_by_epoch"].items())]
    losses_after = [v for _, v in sorted((int(k), v) for k, v in second["loss_by_epoch"].items())]
    # it continued from the trained weights, not from a fresh initialisation
    assert losses_after[0] < losses_before[0] - 0.05, (losses_before, losses_after)
    assert [p.name for p in list_checkpoints(checkpoints)] == ["epoch-000005"]

    # its data too: the quick start's run reads the embedded corpus's shards, and the restart went on where the
    # checkpoint was in them, not from the start (nor at another peer's place: the ring is the same, its place too)
    assert first["data"]["came_from"] == "own hash" and place["position"] > 0
    assert second["data"]["came_from"] == "checkpoint" and second["data"]["start"] == place["start"] == \
        first["data"]["start"]
    assert f"from window {place['position']} at" in log
    assert second["data"]["position"] > first["data"]["position"]

    # without a checkpoint, a restart with the same identity resumes where it last was (its saved place)
    third, log = run_alone(tmp_path, micro_config, run_id + "-third", tmp_path / "no-checkpoints", max_epochs=1)
    assert third["data"]["came_from"] == "saved" and f"from window {second['data']['position']} at" in log
