"""training.target_batch_size auto and lr_scaling adascale (collab.adaptive.batch_plan): the organizer's signed plan,
its
rules, and three real peers that follow one plan epoch by epoch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hivemind.utils.crypto import RSAPrivateKey
from pydantic import ValidationError

from collab.adaptive.batch_plan import adascale_gain_for, efficiency, first_plan, newest_plan, next_plan
from collab.config import RunConfig
from collab.peers.launcher import LocalSwarm
from collab.records.untrusted import Rejections
from collab.swarm.state import pooled_noise_scale
from collab.tasks.linreg_config import LinregTaskConfig
from tests.conftest import fork_server, peer_env, read_summary, scaled, swarm_config


def training(**changes):
    return RunConfig.model_validate({"training": {"micro_batch_size": 16, **changes}}).training


AUTO = dict(target_batch_size="auto", auto_target={"min": 256, "max": 4096, "every_epochs": 3})


def test_auto_moves_the_target_toward_b_noise_by_at_most_2x_per_n_epochs_within_bounds():
    config = training(**AUTO)
    plan = first_plan("run", config)
    assert plan.target_at(0) == 256 and config.auto_target.enabled
    assert next_plan(plan, 1, None, config, 1.0) is None  # nothing measured: nothing changes
    assert next_plan(plan, 1, 20000.0, config, 1.0) is None  # fewer than every_epochs since the last change
    step = next_plan(plan, 3, 20000.0, config, seconds_per_epoch=1.0)
    # 2x at most, starting far enough ahead for every peer to read it (4 s at 1 s per epoch)
    assert (step.target, step.from_epoch, step.before_target) == (512, 7, 256)
    assert step.target_at(6) == 256 and step.target_at(7) == 512
    assert next_plan(step, 5, 20000.0, config, 1.0) is None  # one pending plan at a time
    assert next_plan(step, 9, 20000.0, config, 1.0) is None  # the last change was at 7: not before 10
    later = next_plan(step, 10, 20000.0, config, 1.0)
    assert later.target == 1024 and later.from_epoch == 14
    assert next_plan(later, 30, 1100.0, config, 1.0) is None  # within 25% of B_noise: it stays
    top = later
    for epoch in (30, 45, 60):  # bounded above by auto_target.max
        top = next_plan(top, epoch, 1e9, config, 1.0) or top
    assert top.target == 4096
    down = next_plan(top, 80, 10.0, config, 1.0)
    assert down.target == 2048  # halved, not to the bound at once
    assert next_plan(first_plan("run", config), 3, 10.0, config, 1.0) is None  # at the lower bound already


def test_adascale_gain_is_the_formula_one_at_the_base_batch_and_advances_the_schedule_by_it():
    config = training(target_batch_size=1024, base_batch_size=256, lr_scaling="adascale")
    plan = first_plan("run", config)
    b_noise = 3000.0
    step = next_plan(plan, 4, b_noise, config, seconds_per_epoch=100.0)  # 4 s is under 2 epochs: 2 ahead
    var, sqr, scale = b_noise / 256, 1.0, 1024 / 256  # per-base-batch variance over |G|^2 = 1
    assert step.gain == pytest.approx((var + sqr) / (var / scale + sqr)) and step.from_epoch == 6
    assert adascale_gain_for(b_noise, 256, 256) == 1.0
    assert efficiency(b_noise, 256, 1024) == pytest.approx(step.gain / scale)  # Pollux: gain / S
    # scale-invariant progress: 6 epochs at gain 1, then `gain` steps per epoch
    assert step.progress_at(6) == 6 and step.progress_at(8) == pytest.approx(6 + 2 * step.gain)
    assert step.progress_at(5) == 5 and step.gain_at(5) == 1.0
    with pytest.raises(ValidationError, match="base_batch_size .* is above the smallest target"):
        training(target_batch_size=128, base_batch_size=256, lr_scaling="adascale")


def test_only_plans_signed_with_the_runs_key_count_and_forged_ones_are_counted():
    key, stranger = RSAPrivateKey(), RSAPrivateKey()
    public = key.get_public_key().to_bytes().decode()
    config = training(**AUTO)
    honest = next_plan(first_plan("run", config), 3, 5000.0, config, 1.0, now=100.0).signed(key)
    forged = honest.model_copy(update=dict(target=4096, issued_at=200.0)).signed(stranger)
    altered = honest.model_copy(update=dict(target=4096, issued_at=300.0))  # the organizer's signature kept
    other_run = next_plan(first_plan("other", config), 3, 5000.0, config, 1.0, now=400.0).signed(key)
    rejected = Rejections()
    blobs = [(f"peer{i}", p.model_dump_json()) for i, p in enumerate((honest, forged, altered, other_run))]
    assert newest_plan([*blobs, ("peer9", b"{not json")], "run", public, rejected) == honest
    assert rejected.total == 4 and set(rejected.by_signer) == {"peer1", "peer2", "peer3", "peer9"}


@pytest.mark.parametrize("changes, message", [
    ({"training.target_batch_size": "auto", "averaging.mode": "diloco"}, "measured in sync mode only"),
    ({"training.lr_scaling": "adascale", "averaging.compression": "powersgd"}, "do not measure"),
    ({"training.target_batch_size": "auto", "averaging.aggregation": "adasum"}, "do not measure"),
    ({"training.target_batch_size": "auto", "training.auto_target": {"min": 512, "start": 256}}, "min .* <= start"),
])
def test_a_plan_the_swarm_cannot_follow_is_refused_with_the_reason(tmp_path, changes, message):
    from collab.config import load_config
    from collab.errors import UserError
    from tests.conftest import write_config

    with pytest.raises(UserError, match=message):
        load_config(write_config(tmp_path, changes))


@pytest.mark.swarm
def test_three_peers_measure_b_noise_follow_one_plan_toward_it_and_adascale_scales_the_lr(
        tmp_path, run_id, no_leftover_processes):
    """linreg with B_noise 40001 (a learning rate too small to change it): the 3 peers measure it within 20%;
    target auto from 15360 within [7680, 122880], changes every 2 epochs, AdaScale over a base batch of 7680:
    the organizer's plans take the target up toward B_noise, first by 2x; every peer used the same target, gain,
    schedule progress and learning rate for every epoch they all logged; the gain is AdaScale's for the
    measured B_noise. (Epochs of seconds: at linreg's speed a target of 1000 samples is over before the others'
    progress reaches a peer, and peers step alone. Per-round estimates of |G|^2 carry noise ~ tr(Sigma) / B:
    at targets near 10000 three runs' pooled B_noise were 3-12% off, at 30000 0.2-2%.)"""
    task = {"name": "linreg", "dim": 20000, "noise_sd": 1.0, "distance": 1.0}
    truth = LinregTaskConfig(**task).true_noise_scale()
    lr, base = 1e-9, 7680
    config = swarm_config(tmp_path, 3, {
        "task": task, "training.micro_batch_size": 256, "training.learning_rate": lr,
        "training.target_batch_size": "auto", "training.base_batch_size": base, "training.lr_scaling": "adascale",
        "training.auto_target": {"min": 7680, "max": 122880, "start": 15360, "every_epochs": 2},
        "averaging.aggregation": "mean", "averaging.compression": "none", "averaging.average_state_every": 1000})
    with LocalSwarm(3, run_id, tmp_path, ["--config", str(config), "--max-epochs", "10"],
                    env=peer_env(), forks=fork_server(),
                    per_peer_args={i: ["--wait-peers", "3"] for i in range(3)}) as swarm:
        swarm.start()
        codes = [peer.wait(timeout=scaled(240)) for peer in swarm.peers]
        logs = "\n".join(f"--- peer {p.index}\n{p.log_text()[-2000:]}" for p in swarm.peers)
        assert codes == [0, 0, 0], f"exit codes {codes}\n{logs}"
        summaries = [read_summary(peer) for peer in swarm.peers]
    # the noise scale the peers measured from their rounds' norms and published, pooled as status and the
    # organizer pool it: the truth within 20%. (A peer measures the rounds in which it reduced a part: it then
    # knows the group's samples exactly. Measured in other runs at B_noise 40001: 39526-40856.)
    measured = [s["noise_scale"] for s in summaries if s["noise_scale"].get("noise_rounds")]
    pooled, peers = pooled_noise_scale([SimpleNamespace(**m) for m in measured])
    print(f"B_noise measured {pooled:.1f} by {peers} peer(s), truth {truth:.1f}")
    assert peers >= 1 and abs(pooled - truth) < 0.2 * truth, (pooled, truth, measured)

    plans = [{int(e): v for e, v in s["plan_by_epoch"].items()} for s in summaries]
    print("targets and gains by epoch:", {e: (v[0], round(v[1], 3)) for e, v in sorted(plans[0].items())})
    assert summaries[0]["plans_issued"] >= 1 and not any(s["plans_issued"] for s in summaries[1:]), \
        [(s["plans_issued"], s["plan_by_epoch"]) for s in summaries]
    assert not any(s["plans_read_late"] for s in summaries), [s["plans_read_late"] for s in summaries]
    shared = sorted(set(plans[0]) & set(plans[1]) & set(plans[2]))
    assert len(shared) >= 6, [sorted(p) for p in plans]
    for epoch in shared:  # one plan: the same target, gain, progress and learning rate on every peer
        first = plans[0][epoch]
        assert all(p[epoch][:3] == pytest.approx(first[:3], rel=1e-9) for p in plans), (epoch, [p[epoch] for p in plans])
        assert all(p[epoch][3] == pytest.approx(lr * first[1], rel=1e-6) for p in plans), (epoch, first)
    targets = [plans[0][e][0] for e in sorted(plans[0])]
    # up toward B_noise: first by 2x (it is 2.6x away), then (2 epochs and a lead of >= 4 s later, if the run
    # lasts) to within 25% of it, never by more than 2x at once
    changes = [(a, b) for a, b in zip(targets, targets[1:]) if a != b]
    assert targets[0] == 15360 and changes and changes[0] == (15360, 30720), targets
    assert all(a < b <= 2 * a and abs(b - truth) < abs(a - truth) for a, b in changes[1:]), targets
    epochs = sorted(plans[0])
    changed = [b for a, b in zip(epochs, epochs[1:]) if plans[0][a][0] != plans[0][b][0]]
    assert all(b - a >= 2 for a, b in zip(changed, changed[1:])), changed  # every_epochs apart
    # AdaScale's gain at the last target over 5120 for the B_noise the swarm measured: near the truth's
    last = plans[0][epochs[-1]]
    assert 1 < last[1] < last[0] / base and \
        last[1] == pytest.approx(adascale_gain_for(truth, base, last[0]), rel=0.2), last  # B_noise 2x off: 17%
    # the schedule advanced by each epoch's gain (scale-invariant progress)
    for a, b in zip(epochs, epochs[1:]):
        if plans[0][a][1] == plans[0][b][1]:
            assert plans[0][b][2] == pytest.approx(plans[0][a][2] + (b - a) * plans[0][a][1], rel=1e-6), (a, b)


def test_goodput_and_the_eta_come_from_the_records_most_peers_agree_on():
    from collab.commands.status import goodput_line
    from collab.swarm.state import RunState, adaptive_progress

    def record(**changes):
        return SimpleNamespace(**{**dict(lr_gain=2.0, progress_steps=100.0, total_steps=1100, base_batch_size=256),
                                  **changes})

    liar = record(lr_gain=1000.0, total_steps=10**9, base_batch_size=1, progress_steps=1e9)
    fields = adaptive_progress([record(), record(progress_steps=98.0), liar], noise_scale=768.0, target=1024,
                               throughput=512.0)
    assert (fields["lr_gain"], fields["total_steps"], fields["base_batch_size"]) == (2.0, 1100, 256)
    assert fields["efficiency"] == pytest.approx((768 + 256) / (768 + 1024))  # Pollux's, = gain / S
    assert fields["goodput"] == pytest.approx(512 * fields["efficiency"])
    # 1000 steps left, 2 per epoch of 1024 samples at 512 samples/s: 500 epochs of 2 s
    assert fields["eta_to_end_seconds"] == pytest.approx(1000.0)
    state = RunState(run_id="r", global_epoch=5, samples_accumulated=0, target_batch_size=1024,
                     samples_per_second=512.0, eta_seconds=None, num_peers=3, num_clients=0, rejected_records=0,
                     peers=[], time=0.0, noise_scale=768.0, **fields)
    line = goodput_line(state)
    assert "goodput 292.6 samples/s" in line and "efficiency 0.57" in line and "100.0/1100" in line, line
    assert adaptive_progress([], None, 1024, 512.0) == dict(lr_gain=None, progress_steps=None, total_steps=None,
                                                           base_batch_size=None)
