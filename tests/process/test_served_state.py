"""A donor serves the epoch its tensors hold (collab.averaging.served_state), against hivemind's own step: a real DHT
(p2pd) and hivemind's TrainingStateAverager, whose step raises the epoch before it makes the optimizer step. The
state is copied at that moment, from the step's trigger, as a downloading peer's request would be served."""

from __future__ import annotations

import torch
from hivemind.optim.state_averager import TrainingStateAverager

from benchmarks.lab.averager_pair import shut_down_averager
from collab.averaging.served_state import ServesItsSteps


class _Served(ServesItsSteps, TrainingStateAverager):
    pass


def _served_during_a_step(kind, dht) -> tuple:
    """The state served while a step is under way, as (epoch, its parameter then, the same tensor once the step is
    made: hivemind's averager process streams it from there), and the state served after the step."""
    model = torch.nn.Linear(3, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    averager = kind(dht=dht, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), prefix=f"served_{kind.__name__}",
                    reuse_tensors=True, start=True)  # (reuse: hivemind's condition for a step's trigger)
    try:
        model.weight.grad = torch.ones_like(model.weight)
        served = []

        def serve():
            metadata, tensors, _ = averager.get_current_state()
            served.append((metadata["epoch"], tensors[0], float(tensors[0].flatten()[0])))

        averager.step(increment_epoch=True, optimizer_step=True, wait_for_trigger=serve)
        (mid_epoch, mid_tensor, mid_value), = served
        after, tensors, _ = averager.get_current_state()
        return (mid_epoch, mid_value, float(mid_tensor.flatten()[0])), (after["epoch"], float(tensors[0].flatten()[0]))
    finally:
        shut_down_averager(averager)  # (hivemind's own averager would leave its socket file in /tmp)


def test_a_state_served_while_a_step_is_under_way_is_the_epoch_before_and_stays_so(dht):
    # hivemind alone: epoch 1 with epoch 0's parameters (1.0; the step makes them 0.5), and the very tensors the
    # optimizer then moves, while the averager process still streams them. A peer that downloaded that counted itself
    # at epoch 1 one update behind everyone, or got a mix of both: this is what the mixin is for
    assert _served_during_a_step(TrainingStateAverager, dht) == ((1, 1.0, 0.5), (1, 0.5))
    assert _served_during_a_step(_Served, dht) == ((0, 1.0, 1.0), (1, 0.5))
