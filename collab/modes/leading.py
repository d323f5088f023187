"""When the sync mode's trainer begins its gradient round's search: hivemind's pre-scheduling (its forecast says the
epoch ends within matchmaking_time), and two ways of its round's planned leader (collab.averaging.planned_leader) to
begin sooner: asked by a follower already searching (collab.averaging.woken_leader), or knowing from the round before
that it leads this one (`begins_early`).
"""

from __future__ import annotations

from hivemind.utils.logging import get_logger
from hivemind.utils.timed_storage import get_dht_time

from collab.averaging.planned_leader import begins_early

logger = get_logger(__name__)


class LeadsPlannedRounds:
    """A mixin of collab.modes.sync.CollabOptimizer (before SwarmOptimizer, whose schedule_gradient_round it wraps)."""

    def schedule_gradient_round(self) -> None:
        # hivemind pre-schedules matchmaking even for a peer that is alone, and the fruitless search keeps
        # the DHT and averager processes busy (a third of a core here). With one peer there is nobody to
        # match; when another appears, begin_gradient_round still starts a round at the epoch's end.
        if self.tracker.global_progress.num_peers > 1:
            self.grad_averager.epoch = self.local_epoch
            if self._asked_to_lead_now():
                self.scheduled_grads = self.grad_averager.schedule_step(timeout=self.averaging_timeout)
                return
            if self._leads_early_now():
                # its group begins at the forecast end, where its followers' searches end (hivemind's would end
                # matchmaking_time from now, before theirs: a leader refuses followers whose searches end first)
                ends = max(self.tracker.estimated_next_update_time, get_dht_time() + self.matchmaking_time)
                self.scheduled_grads = self.grad_averager.schedule_step(scheduled_time=ends,
                                                                        timeout=self.averaging_timeout)
                return
            super().schedule_gradient_round()

    def _leads_early_now(self) -> bool:
        """Whether this peer is the planned leader of this epoch's round (its averager's reckoning after the last
        round: collab.averaging.woken_leader) and begins its search now, before its followers (begins_early), with
        no round of its own under way."""
        leads = getattr(self.grad_averager, "planned_to_lead", lambda: None)()
        control = self.scheduled_grads
        if leads != self.local_epoch or not (control is None or control.triggered or control.done()):
            return False
        seconds_left = self.tracker.estimated_next_update_time - get_dht_time()
        if not begins_early(seconds_left, self.matchmaking_time, self.averaging_timeout):
            return False
        logger.debug(f"Epoch {self.local_epoch}: the planned leader of its round; searching from {seconds_left:.1f} s "
                     "before the forecast end of the epoch")
        return True

    def _asked_to_lead_now(self) -> bool:
        """Whether a peer already searching asked this one to lead this epoch's round before this peer's own reads
        said the epoch ends (collab.averaging.woken_leader), and no round of this peer's is under way."""
        asked = getattr(self.grad_averager, "asked_to_lead", lambda: None)()
        control = self.scheduled_grads
        if asked != self.local_epoch or not (control is None or control.triggered or control.done()):
            return False
        logger.debug(f"Epoch {self.local_epoch}: asked to lead its round by a peer already searching; beginning now")
        return True
