"""Averaging that survives a hostile peer: real collab peers, one of them started through tests/attacker_peer.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from transformers import AlbertForPreTraining

from collab.checkpoint import list_checkpoints
from peers.launcher import LocalSwarm
from tests.conftest import peer_env, read_summary
from tests.test_swarm_training import PARAM_TOLERANCE

pytestmark = pytest.mark.swarm
ATTACKER = [sys.executable, str(Path(__file__).with_name("attacker_peer.py"))]


def run_with_attacker(tmp_path, micro_config, run_id, attack: list[str], honest: int, max_epochs: int):
    """`honest` peers and one attacker (the last peer); the honest peers' summaries and final models."""
    n = honest + 1
    per_peer = {i: ["--checkpoint-dir", str(tmp_path / f"peer{i}")] for i in range(honest)}
    with LocalSwarm(n, run_id, tmp_path, ["--config", str(micro_config), "--max-epochs", str(max_epochs),
                                          "--wait-peers", str(n)],
                    per_peer_args=per_peer, env=peer_env(), per_peer_program={honest: [*ATTACKER, *attack]}) as swarm:
        swarm.start()
        codes = [swarm.peers[i].wait(timeout=420) for i in range(honest)]
        logs = "\n".join(f"--- peer {p.index}\n{p.log_text()[-2500:]}" for p in swarm.peers)
        assert codes == [0] * honest, f"the honest peers did not reach epoch {max_epochs}: exit codes {codes}\n{logs}"
        summaries = [read_summary(p) for p in swarm.peers[:honest]]
        attacker_id = swarm.peers[honest].peer_id
    models = [AlbertForPreTraining.from_pretrained(list_checkpoints(tmp_path / f"peer{i}")[-1]) for i in range(honest)]
    return summaries, models, attacker_id, logs


def test_sign_flip_x1000_every_round_is_clipped(tmp_path, micro_config, run_id, no_leftover_processes):
    """One peer in five sends its gradient times -1000 in every round. With hivemind's mean, one such round set
    the honest peers back by 25 epochs; with centered_clip (an open run's default) they learn as usual, agree
    with each other, and each of them names the attacker."""
    summaries, models, attacker, logs = run_with_attacker(tmp_path, micro_config, run_id, ["--sign-flip", "1000"],
                                                          honest=4, max_epochs=4)
    for s in summaries:
        losses = [v for _, v in sorted((int(k), v) for k, v in s["loss_by_epoch"].items())]
        assert s["nonfinite_parameters"] == [], s
        assert losses[-1] < losses[0] - 0.5, f"honest peer {s['peer_id']} did not learn: {losses}\n{logs}"
        assert s["rounds_joined"] >= 2, s
        assert any(reason.startswith("part clipped") for reason in s["rejected"].get(attacker, {})), s["rejected"]
    reference = dict(models[0].named_parameters())
    for other in models[1:]:
        worst = max((reference[n] - p).abs().max().item() for n, p in other.named_parameters())
        assert worst < PARAM_TOLERANCE, f"honest replicas differ by {worst:.2e}"


def test_nan_every_round_is_excluded_and_rounds_succeed(tmp_path, micro_config, run_id, no_leftover_processes):
    """One peer in five sends NaN in every round. hivemind's guard threw every round away (19 of 19 failed);
    here its part is excluded, the others' mean is exact, and the honest peers' rounds succeed."""
    summaries, _, attacker, logs = run_with_attacker(tmp_path, micro_config, run_id, ["--nan"], honest=4,
                                                     max_epochs=4)
    for s in summaries:
        assert s["nonfinite_parameters"] == [], s
        ok, failed = s["rounds_joined"], s["rounds_failed"]
        assert ok >= 3 and ok / (ok + failed) >= 0.9, f"{ok} rounds ok, {failed} failed\n{logs}"
        assert "part not finite (gradients)" in s["rejected"].get(attacker, {}), s["rejected"]
