"""Twelve peers in one swarm (issue 36): the size at which, before its fixes, rounds split into groups of 2-7 and
the replicas parted. The long runs (8-64 peers, latency) are benchmarks/scale.py's."""

from __future__ import annotations

import json

import yaml

from tests.conftest import run_cli

PEERS, EPOCHS = 12, 4
SPREAD_BOUND = 1e-3  # the issue's: the replicas' spread at an epoch's end, relative to the parameters' norm


def test_twelve_peers_average_in_whole_groups_and_end_on_one_epoch_with_equal_replicas(tmp_path,
                                                                                       no_leftover_processes):
    # linreg: compute is not the bound, the protocol is. No state-averaging round in the run (every 1000 epochs): a
    # state round would make the replicas equal whether the gradient rounds grouped everyone or not
    config = tmp_path / "many.yaml"
    config.write_text(yaml.safe_dump({
        "task": {"name": "linreg", "dim": 1000, "distance": 10.0},
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
    # rounds, both 'nobody left to join'). No other failure, and no peer misses more
    for p in peers:
        assert p["rounds_joined"] >= EPOCHS - 2, p
        assert set(p["rounds_failed_by_reason"]) <= {"nobody left to join", "no group found"}, p
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
    # the swarm learned (one peer's last micro-batch loss is noise at lr 0.05: the mean over the 12 is not)
    first, last = (sum(p[key] for p in peers) / PEERS for key in ("first_loss", "last_loss"))
    assert last < 0.9 * first and report["any_nonfinite"] is False, (first, last)
