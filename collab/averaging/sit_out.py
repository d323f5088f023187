"""A replica one update away from the swarm's sits out state-averaging rounds until it is re-synced.

After a step on its own gradients (collab.modes.replica_sync) a sync-mode peer downloads the swarm's state at its next
step. hivemind would still average its state with whoever it meets at that step, which does two kinds of harm:
- the average mixes its off-by-one-update parameters into the replicas of peers that made the swarm's step (they are
  then off it too, and, the moments not averaged, no state round makes them whole again);
- its step waits for that round to end before it downloads (the download must not be overwritten by it). A groupmate
  still inside its own gradient round (waiting for a group that this peer, re-syncing, will not join) triggers its
  part only after that round times out: both peers sat out averaging_timeout. A second volunteer joining a peer that
  trained alone lost a minute so (the shards-from-the-swarm test, 50-99 s against 40).

So the round of such a step is not started, and one pre-scheduled for it that is not yet looking or still looking
for a group is cancelled. A pre-scheduled round already matched runs as hivemind runs it: its groupmates wait for
this peer's part.
With averaging.overlap full the gradient round, and so the own step, ends in hivemind's background step, after that
step's state round began: that one round runs too (the next step's re-sync downloads over it).
The rounds resume once the replica is the swarm's again, or once a re-sync found no donor (its record stops holding
the epoch: a state round of the whole swarm is then its repair).
"""

from __future__ import annotations

from typing import Callable

from hivemind.averaging.control import AveragingStage
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.utils.logging import get_logger

from collab.averaging.round_control import cancel_round

logger = get_logger(__name__)


class SitsOutWhileOutOfStep(TrainingStateAverager):
    """A mixin for TrainingStateAverager: `out_of_step()` (set by the optimizer) says whether the replica awaits a
    re-sync."""

    out_of_step: Callable[[], bool] = staticmethod(lambda: False)
    rounds_sat_out = 0

    def step(self, *args, averaging_round: bool = False, averaging_control=None, **kwargs):
        if averaging_round and self.out_of_step():
            control = averaging_control
            # IDLE: scheduled, its averager process not yet looking (a step right after the schedule sees that)
            if control is None or control.done() or control.stage in (AveragingStage.IDLE,
                                                                        AveragingStage.LOOKING_FOR_GROUP):
                cancel_round(control)
                averaging_round, averaging_control = False, None
                kwargs.pop("averaging_opts", None)
                self.rounds_sat_out += 1
                logger.debug(f"Epoch {self.local_epoch}: sat out the state round (replica awaits a re-sync)")
        return super().step(*args, averaging_round=averaging_round, averaging_control=averaging_control, **kwargs)
