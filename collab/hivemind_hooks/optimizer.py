"""hivemind.Optimizer and its progress tracker with the private steps collab extends opened under public names.

Each hivemind method here hands over to a public method whose default is hivemind's own behaviour; collab's modes
(collab.modes: the base every mode composes, sync, diloco, gossip) and its tracker override the public names and call
`super()`, so no class outside this package defines a private hivemind name.
"""

from __future__ import annotations

from hivemind.optim.optimizer import Optimizer
from hivemind.optim.progress_tracker import ProgressTracker


class OptimizerHooks(Optimizer):
    """hivemind.Optimizer, its private steps handed to collab's public ones (see the module)."""

    # built in hivemind's constructor: collab's signed, honest tracker and its checked, recording state averager
    def _make_progress_tracker(self, target_batch_size: int, **kwargs):
        return self.make_progress_tracker(target_batch_size, **kwargs)

    def make_progress_tracker(self, target_batch_size: int, **kwargs):
        return super()._make_progress_tracker(target_batch_size, **kwargs)

    def _make_state_averager(self, **kwargs):
        return self.make_state_averager(**kwargs)

    def make_state_averager(self, **kwargs):
        return super()._make_state_averager(**kwargs)

    # the end of an epoch: a split healed, a round with no group given up, an own step published
    def _update_global_epoch(self, grad_scaler) -> None:
        self.update_global_epoch(grad_scaler)

    def update_global_epoch(self, grad_scaler) -> None:
        super()._update_global_epoch(grad_scaler)

    # a gradient round: a stale pre-scheduled round replaced, waited for in slices, non-finite averages refused
    def _begin_averaging_gradients(self, grad_scaler) -> bool:
        return self.begin_gradient_round(grad_scaler)

    def begin_gradient_round(self, grad_scaler) -> bool:
        return super()._begin_averaging_gradients(grad_scaler)

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control) -> None:
        self.finish_gradient_round(maybe_step_control)

    def finish_gradient_round(self, maybe_step_control) -> None:
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)

    # what the optimizer steps on: this peer's own gradients after a failed round, the average (or DiLoCo's
    # projection) after a good one
    def _load_local_gradients_into_optimizer(self) -> None:
        self.load_own_gradients()

    def load_own_gradients(self) -> None:
        super()._load_local_gradients_into_optimizer()

    def _load_averaged_gradients_into_optimizer_(self) -> None:
        self.load_averaged_gradients()

    def load_averaged_gradients(self) -> None:
        super()._load_averaged_gradients_into_optimizer_()

    # whether to download the swarm's state now: after an own step (sync), never (gossip)
    def _should_load_state_from_peers(self) -> bool:
        return self.should_download_state()

    def should_download_state(self) -> bool:
        return super()._should_load_state_from_peers()

    # a peer that has nothing to send joins a running round with zero weight; a leaving one cancels it instead
    def _tag_along_with_zero_weight(self, control) -> None:
        self.tag_along(control)

    def tag_along(self, control) -> None:
        super()._tag_along_with_zero_weight(control)

    # matchmaking ahead of the epoch's end: none while this peer is alone
    def _maybe_schedule_gradient_averaging(self) -> None:
        self.schedule_gradient_round()

    def schedule_gradient_round(self) -> None:
        super()._maybe_schedule_gradient_averaging()

    def _maybe_schedule_state_averaging(self) -> None:
        self.schedule_state_round()

    def schedule_state_round(self) -> None:
        super()._maybe_schedule_state_averaging()


class TrackerHooks(ProgressTracker):
    """hivemind's ProgressTracker, its reading of the swarm's progress handed to collab's public method."""

    # other peers' progress records: bounded, and this peer's own epoch counted honestly
    def _parse_swarm_progress_data(self, metadata):
        return self.parse_swarm_progress(metadata)

    def parse_swarm_progress(self, metadata):
        return super()._parse_swarm_progress_data(metadata)

    # the task that stores this peer's progress record
    async def _progress_reporter(self):
        return await self.report_progress_forever()

    async def report_progress_forever(self):
        return await super()._progress_reporter()
