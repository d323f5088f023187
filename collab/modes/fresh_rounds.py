"""The sync mode's pre-scheduled gradient round, made fit for its step as the step begins.

hivemind schedules an epoch's gradient round when its forecast says the epoch ends within matchmaking_time, and at
the step uses that round as it finds it. Two states of it cost this peer its place in the swarm's round: one that
has spent most of its time looking (the epoch ran long), and one that has already ended. Each is replaced here by a
fresh round with its whole averaging_timeout.
"""

from __future__ import annotations

from hivemind.averaging.control import AveragingStage
from hivemind.utils.logging import get_logger
from hivemind.utils.timed_storage import get_dht_time

from collab.averaging.round_control import cancel_round

logger = get_logger(__name__)


class FreshRounds:
    """A mixin for collab.modes.sync.CollabOptimizer (a hivemind Optimizer: scheduled_grads, grad_averager,
    averaging_timeout, local_epoch; and collab's stop event)."""

    def refresh_the_pre_scheduled_round(self) -> None:
        """Called as the step begins its gradient round, before hivemind reads scheduled_grads."""
        self._renew_a_stale_round()
        self._replace_an_ended_round()

    def _renew_a_stale_round(self) -> None:
        """hivemind pre-schedules an epoch's gradient round when its forecast says the epoch ends within
        matchmaking_time, and that round gives up averaging_timeout after it was scheduled, not after it is
        triggered. When the epoch ends much later than forecast (a slow groupmate, a busy machine), the round has
        seconds left when its peer reaches the step: a client-mode peer's round can run out just before its server
        joins it, and both step alone. Such a round is cancelled and a fresh one, with the whole averaging_timeout,
        takes its place."""
        control = self.scheduled_grads
        # (a round whose group is assembled waits only for this trigger: its deadline no longer matters)
        if control is None or control.triggered or control.done() or control.stage != AveragingStage.LOOKING_FOR_GROUP:
            return
        left = control.deadline - get_dht_time()
        if not round_is_stale(left, self.averaging_timeout):
            return
        cancel_round(control)
        self.scheduled_grads = self.grad_averager.schedule_step(timeout=self.averaging_timeout)
        logger.warning(f"Epoch {self.local_epoch}: the pre-scheduled gradient round had {left:.1f} s left of its "
                       f"{self.averaging_timeout:g} s; renewed")

    def _replace_an_ended_round(self) -> None:
        """A pre-scheduled round that ended before its peer reached the step is one hivemind discards at the step, and
        the peer then steps on its own gradients: "round could not start", which a CI run's 12-peer test failed on once
        (its cause not in that log: the warning below names it). A search that finds no group waits for the step's
        trigger before it fails, so such a round ended on an error in its search that hivemind did not retry: one
        past the round's deadline, or of a kind it does not retry. A fresh round takes its place: it joins its
        epoch's round if one still forms, or, when every other peer made this epoch's step, ends as nobody left to
        join and the peer replays their round (collab.averaging.round_replay) rather than step alone and download the
        swarm's state. Not for a peer that is leaving: its leave ended the round."""
        control = self.scheduled_grads
        # (a cancelled StepControl reads as triggered too: hivemind cancels its trigger with it)
        if control is None or control.triggered or not control.done() or self.stop.is_set():
            return
        error = control.exception()
        logger.warning(f"Epoch {self.local_epoch}: its pre-scheduled gradient round ended before the step "
                       f"({type(error).__name__}: {error}); beginning a fresh one")
        self.scheduled_grads = None


def round_is_stale(seconds_left: float, averaging_timeout: float) -> bool:
    """Whether a pre-scheduled round, still looking for a group when its peer reaches the step, has spent too much
    of its timeout waiting for it: over half. (Pre-scheduled on a forecast that the epoch ends within
    matchmaking_time, it normally has all but a few seconds left)"""
    return seconds_left < averaging_timeout / 2
