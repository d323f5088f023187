"""Twelve peers in one swarm (issue 36): the size at which, before its fixes, rounds split into groups of 2-7 and
the replicas parted. The long runs (8-64 peers, latency) are benchmarks/scale.py's."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from collab.peers.simulation import Simulation, SimulationSpec
from tests.conftest import fork_server, peer_env, scaled, swarm_logs

PEERS, EPOCHS = 12, 4
DISTANCE = 10.0  # |w - w*| at the start (noise_sd: the default 1)
SPREAD_BOUND = 1e-3  # the issue's: the replicas' spread at an epoch's end, relative to the parameters' norm


def test_twelve_peers_average_in_whole_groups_and_end_on_one_epoch_with_equal_replicas(tmp_path,
                                                                                       no_leftover_processes):
    # linreg: compute is not the bound, the protocol is. No state-averaging round in the run (every 1000 epochs): a
    # state round would make the replicas equal whether the gradient rounds grouped everyone or not
    config = tmp_path / "many.yaml"
    config.write_text(yaml.safe_dump({
        "task": {"name": "linreg", "dim": 1000, "distance": DISTANCE},
        "training": {"micro_batch_size": 16, "target_batch_size": 64 * PEERS, "learning_rate": 0.05,
                     "warmup_steps": 0, "device": "cpu", "compile": "off"},
        "averaging": {"matchmaking_time": 3.0, "averaging_timeout": 30.0, "average_state_every": 1000},
    }))
    # `collab simulate`'s own Simulation, in this process, its peers forked from the session's fork server: the
    # command itself would start a fork server of its own first (~12 s of the 2 cores; test_simulate.py runs it)
    spec = SimulationSpec(peers=PEERS, run_id=f"many-{tmp_path.name[-6:]}", workdir=tmp_path / "run",
                          config_path=config, duration=scaled(420), max_epochs=EPOCHS, env=peer_env(),
                          forks=fork_server())
    report = json.loads(Simulation(spec, say=print).run().to_json())
    peers = report["peers"]
    assert len(peers) == PEERS
    # one epoch at the end: every peer reached it and left on its own
    assert all(p["exit"] == f"exit 0 (reached epoch {EPOCHS})" for p in peers), [p["exit"] for p in peers]
    # all rounds but the swarm's start ok. On 2 cores a peer or two can be starved at the start (6-30 samples/s where
    # the others made 1000+): late for the first round, each then re-synced and came late again, the swarm's round of
    # the epoch it had downloaded having begun without it ('nobody left to join', 2-3 times each), while the other ten
    # grouped whole every round (one such peer joined no round at all: it kept pace by downloads). So the swarm's
    # rounds are checked, each round's largest group; each peer's own, for ten of the twelve (no failed round, every
    # round after the first joined); and no failure but finding nobody
    for p in peers:
        assert set(p["rounds_failed_by_reason"]) <= {"nobody left to join", "no group found"}, \
            f"{p}\n{swarm_logs(tmp_path / 'run', tail=2500)}"
    punctual = [p for p in peers if p["rounds_failed"] == 0 and p["rounds_joined"] >= EPOCHS - 1]
    assert len(punctual) >= PEERS - 2, [(p["rounds_joined"], p["rounds_failed_by_reason"]) for p in peers]
    # whole groups, not fragments (before the fixes: groups of 2-7; before the planned leader, 6 + 6, 8 + 4 or 7 + 5
    # in 3 of 3 runs here): after the first round, the largest group of each holds 3/4 of the swarm or more and 10 of
    # 12 on average (a CPU-starved peer late for its rounds is one short of 12 each time)
    largest = largest_group_by_epoch(tmp_path / "run")
    later = [largest.get(epoch, 0) for epoch in range(1, EPOCHS)]
    assert min(later) >= 0.75 * PEERS and sum(later) / len(later) >= 10.0, largest
    # the replicas equal at the end: each peer's as it left (a peer whose last round split downloaded the swarm's
    # state first). One replica that stepped on its own gradients once and was not re-synced is ~2% off
    spread = report["spread_by_epoch"]
    assert str(EPOCHS) in spread and spread[str(EPOCHS)] < SPREAD_BOUND, spread
    # and from the gradient rounds alone at most epochs (a split's few are off until their next step's download)
    assert sum(value < SPREAD_BOUND for value in spread.values()) >= len(spread) / 2, spread
    # the swarm learned. The starting loss is known exactly: 0.5 (distance^2 + noise_sd^2) = 50.5. Three whole-swarm
    # steps at lr 0.05 bring it to ~37 (each epoch's loss is a mean over ~770 samples a peer: +-2%), no step leaves it
    # at 50.5. Not against the peers' own first epoch: in it they saw 32 samples each, and one CI run's 12 means came
    # to 38.9 (3 sigma low) and failed a 10% drop while every round had grouped all twelve
    start = 0.5 * (DISTANCE ** 2 + 1.0)
    last = sum(p["last_loss"] for p in peers) / PEERS
    assert last < 0.85 * start and report["any_nonfinite"] is False, (start, last)
    # each DHT node checked the records it read once, not once per node and per read (collab.records.verdicts):
    # with 12 peers reading each other's progress, most records came again unchanged (75-87% in a 60 s run when a
    # read merged all ~5 replicas; 53-54% since it asks the key's 2 nearest). Each node remembered some (the key's
    # nearest nodes check every peer's new record as it is stored, and may remember fewer than they check: summed
    # over the swarm 2394 against 2755 checked in one CI run, once records were stored a few times per read)
    verdicts = [summary.get("dht", {}).get("records") for summary in
                (json.loads(path.read_text()) for path in (tmp_path / "run").glob("peer*.summary.json"))]
    verdicts = [counts for counts in verdicts if counts]  # the exit's read of the DHT's figures is bounded (5 s)
    assert len(verdicts) >= PEERS // 2 and all(c["remembered"] > 0 and c["checked"] > 0 for c in verdicts), verdicts


def largest_group_by_epoch(workdir: Path) -> dict[int, int]:
    """epoch -> how many peers its largest gradient round's group held, from every peer's summary."""
    groups: dict[int, set] = {}
    for path in workdir.glob("peer*.summary.json"):
        for group in json.loads(path.read_text()).get("groups", []):
            groups.setdefault(group["epoch"], set()).add(tuple(sorted(group["peers"])))
    return {epoch: max(len(group) for group in found) for epoch, found in groups.items()}
