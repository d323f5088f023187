"""Two SwAV peers on real hivemind: they average and learn."""

from __future__ import annotations

import yaml
from transformers import ResNetModel

from collab.config import shipped_config
from tests.conftest import train_swarm_to_epoch


def test_two_swav_peers_average_and_learn(tmp_path, run_id, no_leftover_processes):
    """Real peers (real DHT, p2pd, all-reduce) run the same trainer loop on the SwAV task."""

    data = yaml.safe_load(shipped_config("swav-tiny").read_text())
    # 16 micro-batches per peer per epoch: with fewer, a peer reached the target before the progress
    # tracker showed it the other one, stepped alone and ran ahead. No warm-up to speak of, so the loss
    # moves within a few epochs. Averaging as in the ALBERT tests: 2 peers x 5 processes on 2 cores
    data["training"].update(target_batch_size=2048, warmup_steps=1, compile="off")
    data["averaging"].update(matchmaking_time=5.0, averaging_timeout=60.0, next_chunk_timeout=30.0,
                             load_state_timeout=30.0, average_state_every=1, group_size=2)
    config = tmp_path / "swav.yaml"
    config.write_text(yaml.safe_dump(data))
    # 3 epochs: the loss fell by 0.27 from the first to the third (6.00, 5.98, 5.72, then 5.60 and 5.51 at 5)
    max_epochs = 3
    per_peer = {i: ["--checkpoint-dir", str(tmp_path / f"peer{i}")] for i in range(2)}
    summaries = train_swarm_to_epoch(2, run_id, tmp_path, ["--config", str(config)], max_epochs, per_peer)
    for s in summaries:
        assert s["rounds_joined"] >= 1 and 2 in s["group_sizes"], s
        # state rounds too (every epoch here), each of both peers (collab.averaging.replica.RoundOutcomes)
        assert s["state_rounds"]["ok"] >= 1 and s["state_rounds"]["peers"] == 2 * s["state_rounds"]["ok"], s
        losses = [v for _, v in sorted((int(k), v) for k, v in s["loss_by_epoch"].items())]
        assert losses[-1] < losses[0], f"loss did not fall on peer {s['peer_id']}: {losses}"
        print(f"\npeer {s['peer_id'][:8]}: epochs {s['start_epoch']}->{s['final_epoch']}, rounds "
              f"{s['rounds_joined']}, groups {s['group_sizes']}, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    # both final backbones load as plain transformers ResNets and hold the same weights (state averaging
    # is exact and runs every epoch here; measured difference 0.0). BatchNorm running statistics are
    # buffers, which hivemind does not average: each peer keeps its own.
    first, second = (ResNetModel.from_pretrained(sorted((tmp_path / f"peer{i}").glob("epoch-*"))[-1]) for i in range(2))
    assert first.config.hidden_sizes == [16, 32, 64, 128]
    theirs = dict(second.named_parameters())
    assert max((p - theirs[n]).abs().max().item() for n, p in first.named_parameters()) < 1e-3
