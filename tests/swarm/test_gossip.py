"""averaging.mode gossip on real peers (real DHT, p2pd, exchanges over hivemind's P2P): every peer merges, both
sides of each exchange use the factor their rule defines, the replicas stay together, a kill -9 is survived, and a
hostile peer's parameters are refused and attributed to it."""

from __future__ import annotations

import math
import signal
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from collab.config import load_config
from collab.peers.launcher import LocalSwarm
from collab.tasks import build_task
from tests.conftest import fork_server, peer_env, read_summary, scaled, status_json, swarm_config, wait_for


MAX_EPOCHS = 6
ATTACKER = [sys.executable, str(Path(__file__).with_name("attacker_peer.py"))]


def _final_weights(path):
    return load_file(sorted(path.glob("epoch-*"))[-1] / "model.safetensors")


def _relative_distance(a: dict, b: dict) -> float:
    norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in a.values()))
    return math.sqrt(sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)) / norm


def test_three_gossip_peers_merge_pairwise_stay_together_and_survive_a_kill(tmp_path, run_id, no_leftover_processes):
    config = swarm_config(tmp_path, 3, {"averaging.mode": "gossip", "averaging.compression": "none",
                                        "averaging.gossip": {"mean_local_steps": 2, "lr": 0.001,
                                                             "interpolation": "evolutionary"},
                                        "training.target_batch_size": 960})
    # peers 0 and 1 train to the end, 2 is killed, 3 sends its parameters x 1000 (and merges honestly)
    finishing, honest, hostile = (0, 1), (0, 1, 2), 3
    args = {i: ["--max-epochs", str(MAX_EPOCHS), "--checkpoint-dir", str(tmp_path / f"ckpt{i}"), "--wait-peers", "4"]
            for i in finishing}
    args[2] = ["--wait-peers", "4"]
    args[hostile] = ["--max-epochs", str(MAX_EPOCHS), "--wait-peers", "4"]
    with LocalSwarm(4, run_id, tmp_path, ["--config", str(config)],
                    env=peer_env(), forks=fork_server(), per_peer_args=args,
                    per_peer_program={hostile: [*ATTACKER, "--gossip-scale", "1000"]}) as swarm:
        swarm.start()
        victim, attacker = swarm.peers[2], swarm.peers[hostile].peer_id
        # killed once it has merged both ways: in the middle of its local steps, with exchanges in flight. (Two
        # epochs are not enough: in a CI run a CPU-starved victim had asked once by then, and answered 17 times;
        # and asking is not merging: in another, it had asked 3 times, each ask busy or in flight, merged none)
        def merged_both_ways() -> bool:
            if not victim.summary_path.exists():
                return False
            s = read_summary(victim)
            g = s.get("gossip") or {}
            return s["final_epoch"] >= 2 and g.get("asked", 0) >= 3 and g.get("answered", 0) >= 1 \
                and {m["asked"] for m in g.get("recent", [])} == {True, False}
        wait_for(merged_both_ways, timeout=240, what="two epochs of gossip, in which the victim merged both ways")
        victim.signal(signal.SIGKILL)
        killed_at = time.monotonic()
        state = status_json(run_id, swarm.initial_peer)  # the killed peer's last record is still fresh
        codes = {i: swarm.peers[i].wait(timeout=scaled(300)) for i in finishing}
        logs = "\n".join(f"--- peer {p.index}\n{p.log_text()[-2500:]}" for p in swarm.peers)
        assert all(code == 0 for code in codes.values()), f"exit codes {codes}\n{logs}"
        summaries = {i: read_summary(swarm.peers[i]) for i in range(4)}
    print(f"the swarm went on for {time.monotonic() - killed_at:.0f} s after the kill")

    # what a user watching sees: merges per minute, the last merge's update norm, each replica's distance to the
    # replicas' mean (estimated from the published sketches)
    assert state["mode"] == "gossip", state
    shown = [{k: p[k] for k in ("merges_per_minute", "merge_update_norm", "distance_to_mean", "epoch")}
             for p in state["peers"] if p["merges_per_minute"] is not None]
    # all four peers' records show the gossip fields; the ones that merged, their rate and last update (a
    # CPU-starved peer - 25 samples/s beside the others' 300 in a CI run - may still show its first record, from
    # before it trained, when this is read)
    merged = [p for p in shown if p["merges_per_minute"] > 0 and p["merge_update_norm"] > 0]
    assert len(shown) == 4 and len(merged) >= 3, shown
    # (replicas that never merged end ~0.8 of the norm apart in this run; merging ones a few percent). Those within
    # an epoch of the swarm's: gossip peers are not in lockstep (a CI run read 3, 2, 3 for the three training), and
    # a record epochs old is the sketch of a replica left behind
    print(shown)
    current = [p for p in shown if p["epoch"] >= max(q["epoch"] for q in shown) - 1]
    assert len(current) >= 3 and all(p["distance_to_mean"] is not None and p["distance_to_mean"] < 0.2
                                     for p in current), shown

    gossip = {i: s["gossip"] for i, s in summaries.items()}
    for i in honest:  # every honest peer asked and was asked, and merged both ways
        g = gossip[i]
        assert g["asked"] >= 3 and g["answered"] >= 1, (i, g)
        assert {m["asked"] for m in g["recent"]} == {True, False}, (i, g["recent"])
        # it refused only the hostile peer, for being too far, and never merged it
        assert set(summaries[i]["rejected"]) <= {attacker}, (i, summaries[i]["rejected"])
        assert all(m["peer"] != attacker for m in g["recent"]), (i, g["recent"])
    for i in finishing:
        reasons = summaries[i]["rejected"].get(attacker, {})
        assert gossip[i]["refused"] >= 1 and all(r.startswith("parameters too far") for r in reasons), (i, reasons)
    assert gossip[hostile]["merges"] >= 3  # what it received was honest: it merged

    # both sides of an exchange weigh the same pair of claims with the same draw: under the evolutionary rule the
    # better model moves by min(u, 1 - u), the worse by max(u, 1 - u) - together, one
    sides: dict[str, list] = {}
    for i in honest:
        for merge in gossip[i]["recent"]:
            sides.setdefault(merge["exchange"], []).append(merge)
    pairs = [both for both in sides.values() if len(both) == 2]
    assert len(pairs) >= 5, sides
    for asker, answerer in pairs:
        assert asker["u"] == answerer["u"], (asker, answerer)
        assert min(asker["a"], answerer["a"]) == pytest.approx(min(asker["u"], 1 - asker["u"]), abs=1e-12)
        assert asker["a"] + answerer["a"] == pytest.approx(1.0, abs=1e-12), (asker, answerer)

    # the kill: the two left kept merging with each other to the end
    after = [m for i in finishing for m in gossip[i]["recent"] if m["epoch"] > summaries[2]["final_epoch"]]
    assert len(after) >= 4 and all(summaries[i]["final_epoch"] == MAX_EPOCHS for i in finishing), summaries

    # the replicas drift together: their distance at the end is a small part of how far each one travelled from
    # the run's initial model (without merges, two replicas of this run ended about as far apart as they travelled;
    # with them, under the evolutionary rule's random, one-sided moves, a CI run ended at 0.26 of it)
    start = {k: v.detach() for k, v in build_task(load_config(config)).model.state_dict().items()}
    first, second = (_final_weights(tmp_path / f"ckpt{i}") for i in finishing)
    apart = _relative_distance(first, second)
    travelled = min(_relative_distance({k: start[k] for k in final}, final) for final in (first, second))
    print(f"replicas {apart:.4f} apart, each travelled at least {travelled:.4f} (relative to the norm)")
    assert apart < 0.4 * travelled, (apart, travelled)
    # and at --max-epochs each survivor stopped training and merged until the replicas were close (the issue's
    # goal: within 1% of the norm at the end; before settling, such runs ended 0.3-2% apart)
    settled = [gossip[i]["settled"] for i in finishing]
    print("settling:", settled)
    assert all(s is not None and s["merges"] >= 1 for s in settled), settled
    assert apart < 0.01, (apart, settled)
    for i in finishing:
        losses = [v for _, v in sorted((int(k), v) for k, v in summaries[i]["loss_by_epoch"].items())]
        assert losses[-1] < losses[0], (i, losses)
