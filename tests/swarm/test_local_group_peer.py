"""One peer for several devices (--gpus; collab.train.local_group) in a real swarm: two CPU processes over gloo
make one hivemind peer, which averages with a plain peer every round and ends with the same replica; and its
NaN micro-batches (tests/swarm/faulty_peer.py --nan-every) are dropped on the device, counted, and never sent."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from transformers import AlbertForPreTraining

from collab.peers.launcher import LocalSwarm
from collab.train.checkpoint import list_checkpoints
from tests.conftest import fork_server, peer_env, read_summary, scaled, swarm_config, swarm_logs
from tests.swarm.test_swarm_training import SAME_AVERAGES, max_difference



def test_a_two_process_peer_averages_with_a_plain_one_and_counts_both_processes_samples(tmp_path, run_id,
                                                                                        no_leftover_processes):
    # state averaging off: it would make the replicas equal whether the two-process peer's gradients were right or
    # not; only identical averaged gradients (each peer's own data) keep them equal
    config = swarm_config(tmp_path, 2, {"averaging.average_state_every": 1000, "averaging.averaging_timeout": 45.0,
                                        "averaging.next_chunk_timeout": 15.0})
    per_peer = {i: ["--checkpoint-dir", str(tmp_path / f"peer{i}")] for i in range(2)}
    per_peer[1] += ["--gpus", "cpu,cpu"]
    faulty = [sys.executable, str(Path(__file__).with_name("faulty_peer.py")), "--nan-every", "5"]
    with LocalSwarm(2, run_id, tmp_path, ["--config", str(config), "--max-epochs", "3"],
                    per_peer_args=per_peer, per_peer_program={1: faulty}, env=peer_env(),
                    forks=fork_server()) as swarm:
        swarm.start()
        assert swarm.wait(timeout=scaled(240)), "\n".join(p.log_text()[-3000:] for p in swarm.peers)
        plain, pair = read_summary(swarm.peers[0]), read_summary(swarm.peers[1])
    for s in (plain, pair):
        assert s["final_epoch"] == 3 and s["rounds_joined"] >= 2 and set(s["group_sizes"]) == {2}, s
        assert s["rounds_failed"] == 0 and s["final_replica"] == "swarm", f"{s}\n{swarm_logs(tmp_path, 40000)}"
    ranks = pair["local_group"]["micro_batches_by_rank"]
    assert pair["local_group"]["devices"] == ["cpu", "cpu"] and len(ranks) == 2
    assert min(ranks) >= 0.4 * max(ranks), ranks  # each process computed its share
    # rank 0's every fifth loss was NaN (the warm-up's and the probes' calls count too): each dropped, none sent
    dropped = pair["batches_dropped"]
    assert set(dropped) == {"loss not finite"} and abs(dropped["loss not finite"] - ranks[0] / 5) <= 2, (dropped, ranks)
    assert pair["reloads"] == 0 and all(math.isfinite(v) for v in pair["loss_by_epoch"].values())
    micro = 8  # (the swarm config's micro-batch)
    # every sample the peer counted toward the swarm's target was a good one of its two processes
    good = sum(ranks) - dropped["loss not finite"]
    assert micro * max(ranks) < pair["samples_contributed"] <= micro * good, (pair["samples_contributed"], ranks)
    models = [AlbertForPreTraining.from_pretrained(list_checkpoints(tmp_path / f"peer{i}")[-1]) for i in range(2)]
    worst = max_difference(models[0], models[1])
    assert worst < SAME_AVERAGES, f"without state averaging the replicas differ by {worst:.2e}: not the same averages"
