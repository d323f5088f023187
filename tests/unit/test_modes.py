"""averaging.mode: one module per mode behind the interface the trainer's loop uses (collab.modes)."""

from __future__ import annotations

import inspect
import typing

import pytest
from hivemind import Optimizer

from collab.averaging.aggregation import Aggregation
from collab.averaging.traffic import TrafficLog
from collab.config import AveragingConfig, load_config
from collab.modes import MODES, AveragingMode, ModeContext, optimizer_options
from collab.records.rejections import RejectionLog
from collab.tasks import build_task
from tests.conftest import write_config


def test_the_config_offers_exactly_the_modes_that_have_a_module():
    assert set(typing.get_args(AveragingConfig.model_fields["mode"].annotation)) == set(MODES)


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_builds_an_optimizer_with_everything_the_trainer_calls(tmp_path, mode):
    config = load_config(write_config(tmp_path, {"averaging.mode": mode}))
    options = optimizer_options(mode, ModeContext(config=config, task=build_task(config), rule=Aggregation(),
                                                  rejections=RejectionLog(), traffic=TrafficLog()))
    optimizer_class = options.pop("optimizer_class")
    assert issubclass(optimizer_class, Optimizer) and optimizer_class.__module__ == f"collab.modes.{mode}"
    wanted = [name for name, member in vars(AveragingMode).items()
              if inspect.isfunction(member) and not name.startswith("_")]
    assert len(wanted) >= 10
    missing = [name for name in wanted if not callable(getattr(optimizer_class, name, None))]
    assert not missing, f"{optimizer_class.__name__} lacks {missing}"
    # what the mode sets are hivemind.Optimizer's keywords, or its own constructor's
    accepted = set(inspect.signature(Optimizer.__init__).parameters)
    for cls in optimizer_class.__mro__:
        if cls is Optimizer:
            break
        accepted |= set(inspect.signature(cls.__init__).parameters)
    assert set(options) <= accepted, set(options) - accepted


def test_an_unknown_mode_is_named():
    with pytest.raises(ValueError, match="'ring' is not one of sync, diloco, gossip"):
        optimizer_options("ring", ModeContext(config=None, task=None, rule=None))


def test_a_pre_scheduled_round_that_waited_out_half_its_timeout_is_renewed_at_the_step():
    from collab.modes.sync import round_is_stale

    # pre-scheduled when the forecast said the epoch ends within matchmaking_time (5 s): triggered on time, kept
    assert not round_is_stale(30.0 - 5.0, averaging_timeout=30.0)
    # the epoch ended 20 s after its forecast (a slow groupmate): 5 s left would end the round before the
    # groupmate's own matchmaking and all-reduce began
    assert round_is_stale(30.0 - 25.0, averaging_timeout=30.0)
    assert round_is_stale(-1.0, averaging_timeout=30.0)
