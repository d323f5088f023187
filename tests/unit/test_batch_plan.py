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
from collab.records.untrusted import Rejections


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


def test_a_plan_s_lead_is_counted_at_the_fastest_pace_the_run_has_shown():
    from collab.train.plan_keeper import fastest_pace

    assert fastest_pace([(0.0, 0), (2.0, 0)]) is None  # no epoch yet: no plan
    # slow first rounds, then 2 epochs in 2 s, then a slow one: the lead holds at 1 s an epoch, not at the minute's
    # 1.5 s or the last interval's 2 s (a 4-s lead of 4 epochs, not 3 that then pass in 3 s)
    seen = [(0.0, 0), (2.0, 1), (4.0, 3), (6.0, 4)]
    assert fastest_pace(seen) == 1.0
    config = training(**AUTO, lr_scaling="adascale", base_batch_size=256)
    planned = next_plan(first_plan("run", config), 4, 20000.0, config, fastest_pace(seen))
    assert planned is not None and planned.from_epoch == 4 + 4
