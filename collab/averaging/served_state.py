"""A donor serves the epoch its tensors hold.

hivemind's TrainingStateAverager.step raises `local_epoch` in the training thread, then hands the optimizer step to
a background thread; `get_current_state` (what a downloading peer receives) copies the tensors under one lock and
reads `local_epoch` after it. A download that lands between the two gets epoch E+1 with the parameters from before
epoch E's step: its receiver believes it is in step with the swarm and stays one update behind every other replica
for the rest of the run (hivemind's periodic state averaging would blur that; collab's exact replicas do not).

And the tensors it serves are the live ones, which hivemind's averager process then streams part by part while the
optimizer moves them: a download that spans a step gets parts of two states.

Here the epoch a state is served under is the epoch before a step that was asked for and not yet made, and the state
is a copy, taken while no step is under way (hivemind's `lock_optimizer`, which its step holds). A downloading peer
that then finds itself one epoch behind the swarm asks again a moment later (collab.modes.base), instead of taking
the swarm's epoch number for a state that lacks the step.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from hivemind.optim.state_averager import TrainingStateAverager


class ServesItsSteps(TrainingStateAverager):
    """A mixin for TrainingStateAverager (in the trainer's process, where steps run and states are copied)."""

    # (epoch before the step, epoch after it) for a step asked for and not yet made; None when the tensors are current
    _unstepped: Optional[Tuple[int, int]] = None

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # torch's own hook, called inside hivemind's step (under lock_optimizer) once the parameters have moved;
        # a step a grad scaler skipped (inf gradients) never calls it, and the tensors did not move either
        self.optimizer.register_step_post_hook(self._made_the_step)

    def _made_the_step(self, optimizer, args, kwargs) -> None:
        self._unstepped = None

    def step(self, *args, increment_epoch: bool = False, optimizer_step: bool = False, **kwargs):
        if increment_epoch and optimizer_step:
            self._unstepped = (self.local_epoch, self.local_epoch + 1)  # before hivemind raises local_epoch
        return super().step(*args, increment_epoch=increment_epoch, optimizer_step=optimizer_step, **kwargs)

    def get_current_state(self):
        with self.lock_optimizer:  # not half-way through a step
            metadata, tensors, infos = super().get_current_state()
            unstepped = self._unstepped
            # hivemind serves the live tensors themselves (`.cpu()` of a CPU tensor is the tensor), and its averager
            # process streams them part by part for seconds while the optimizer keeps moving them: a copy, taken here,
            # is one state (one state's size in memory, for as long as the download lasts; a GPU peer's `.cpu()`
            # already copied, and is not copied twice)
            live = self._live_storages()
            tensors = [t.detach().clone() if t.untyped_storage().data_ptr() in live else t for t in tensors]
        # a download or an adopted epoch since (another epoch number) made the tensors current again
        if unstepped is not None and isinstance(metadata, dict) and metadata.get("epoch") == unstepped[1]:
            metadata["epoch"] = unstepped[0]
        return metadata, tensors, infos

    def _live_storages(self) -> set:
        """Where the tensors the optimizer moves keep their data, on the CPU."""
        tensors = [p for group in self.optimizer.param_groups for p in group["params"]] + list(self.extra_tensors)
        tensors += [v for state in self.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        return {t.untyped_storage().data_ptr() for t in tensors if t.device.type == "cpu"}
