"""Twelve peers in one swarm (issue 36): the size at which, before its fixes, rounds split into groups of 2-7 and
the replicas parted. The long runs (8-64 peers, latency) are benchmarks/scale.py's."""

from __future__ import annotations

import json

import yaml

from tests.conftest import run_cli

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
    result = run_cli("simulate", "--peers", str(PEERS), "--config", str(config), "--max-epochs", str(EPOCHS),
                     "--workdir", str(tmp_path / "run"), "--json", timeout=420)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    report = json.loads(result.stdout[result.stdout.index("\n{"):])
    peers = report["peers"]
    assert len(peers) == PEERS
    # one epoch at the end: every peer reached it and left on its own
    assert all(p["exit"] == f"exit 0 (reached epoch {EPOCHS})" for p in peers), [p["exit"] for p in peers]
    # all rounds but the swarm's start ok: a peer late for the first round steps on its own; until its download
    # lands it is an epoch behind, and its next round finds nobody of its epoch either (seen once in CI: 2 failed
    # rounds, both 'nobody left to join'). No other failure. One peer may miss a third: in one CI run a peer starved of
    # CPU (10-15 samples/s where the others made 800+) was late for the first round, skipped the next by its download
    # and came late to a third ('nobody left to join'); the others joined every round
    for p in peers:
        assert set(p["rounds_failed_by_reason"]) <= {"nobody left to join", "no group found"}, p
    joined = sorted(p["rounds_joined"] for p in peers)
    assert joined[0] >= 1 and joined[1] >= EPOCHS - 2, joined
    assert sum(p["rounds_failed"] for p in peers) <= 3, [p["rounds_failed_by_reason"] for p in peers]
    assert sum(p["rounds_joined"] for p in peers) >= PEERS * EPOCHS - 3, [p["rounds_joined"] for p in peers]
    # whole groups, not fragments (before the fixes: groups of 2-7). On 2 busy cores two leaders still match at once
    # now and then (9 + 3 in a round; the 3 then re-sync from the 9): one such round of four averages 10.9
    groups = [p["mean_group_size"] for p in peers]
    assert sum(groups) / PEERS >= 10.0, groups
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
