"""How a peer's optimizer leaves the swarm: at --max-epochs, after its last step and with a replica that is the
swarm's (settle_before_leaving, then shutdown); on a signal, at once, its rounds in flight cancelled (abort_rounds)
and nothing waited for that the peers who stay finish without it. A mixin of collab.modes.base.SwarmOptimizer."""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref

from hivemind.averaging.control import AveragingStage
from hivemind.utils.logging import get_logger

from collab.averaging.replica import others_present
from collab.averaging.round_control import cancel_round
from collab.hivemind_hooks.patches import step_controls_in_flight

logger = get_logger(__name__)


class LeavingMidStep(Exception):
    """Raised inside opt.step() when the peer was asked to leave while its epoch's round ran."""


class QuietLeave(logging.Filter):
    """hivemind's background step logs an error and the traceback of what its trigger raised: not for a leave.
    One per process, on hivemind's logger; each optimizer adds its stop event."""

    def __init__(self):
        super().__init__()
        self.stops: "weakref.WeakSet[threading.Event]" = weakref.WeakSet()

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(record.msg, LeavingMidStep) or isinstance(error, LeavingMidStep):
            return False
        leaving = any(stop.is_set() for stop in list(self.stops))
        return not (leaving and "wait_for_trigger raised exception" in str(record.msg))

    @classmethod
    def install(cls, stop: threading.Event) -> None:
        logger = logging.getLogger("hivemind.optim.state_averager")
        quiet = next((f for f in logger.filters if isinstance(f, cls)), None)
        if quiet is None:
            quiet = cls()
            logger.addFilter(quiet)
        quiet.stops.add(stop)


class LeavesTheSwarm:
    """SwarmOptimizer's leaving (see the module); it reads the optimizer's averagers, tracker, stop event and
    timeouts."""

    def settle_before_leaving(self, timeout: float) -> str:
        """At --max-epochs: finish the last step, then make sure the replica is the swarm's before it is saved.
        Returns "swarm" (it was), "downloaded" (it is now) or "own step" (no peer could give the state)."""
        # our last state round, if it is still looking for a group, is left: it could only average replicas that
        # are the swarm's already, or make one that is not the swarm's parameters without its optimizer's statistics
        # (no re-sync: collab.modes.replica_sync; the check below downloads instead). At once when no other peer is
        # there (the last peer of a run waited 10 s here for nobody); while others train on, after matchmaking_time
        # as before: cancelled at once, it met their state round as it formed (2 peers, 1 leaving at --max-epochs:
        # 1 of 4 times), and the one that stayed waited out averaging_timeout for its part
        alone = not others_present(self.dht, self.run_id, self.dht.peer_id.to_base58())
        patience = -math.inf if alone else self.matchmaking_time
        if self.state_averager.give_up_matchmaking(self.local_epoch, patience, self.stop, limit=self.averaging_timeout):
            logger.debug(f"Epoch {self.local_epoch}: left the last state-averaging round, still looking for a group")
        self.state_averager.step(wait_for_delayed_updates=True)  # the last step (and a state round already matched)
        self.state_averager.finish_running_rounds(self.stop, limit=self.averaging_timeout)
        if self.in_sync():
            return "swarm"
        return "downloaded" if self.load_state_from_peers(deadline=time.monotonic() + timeout) else "own step"

    def abort_rounds(self) -> None:
        """On a signal: cancel averaging rounds in flight, so the training thread is not held inside
        opt.step() for up to averaging_timeout by a round that the peers who stay will finish anyway."""
        for control in (self.scheduled_grads, self.scheduled_state, *self.state_averager.round_controls()):
            cancel_round(control)
        # hivemind's background optimizer step also makes rounds of its own (when none was pre-scheduled)
        # and keeps them nowhere we can reach; the main thread then waits on that step. Every round is a
        # StepControl future registered by the process that made it, so cancel those too.
        for control in step_controls_in_flight():
            cancel_round(control)
        # and a round already past matching runs on regardless (hivemind's cancel does not reach it): ended here
        self.state_averager.abort_running_rounds()  # (every collab averager is a CheckedRounds)
        if self.use_gradient_averaging:
            self.grad_averager.abort_running_rounds()

    def shutdown(self) -> None:
        if not self.stop.is_set():
            # leaving at --max-epochs: finish the delayed step (with overlap=full it holds our last gradient
            # round, still running). Our round may be over while we still stream a client-mode (NAT'd or slow)
            # groupmate its share: each averager's shutdown waits for the replies it still holds to be read
            # (collab.averaging.members_only, REPLY_DRAIN) - a fixed linger here would cost every leave, needed or not
            self._finish_before_leaving()
            for name in ("scheduled_grads", "scheduled_state"):
                control = getattr(self, name)
                if control is not None and control.stage == AveragingStage.LOOKING_FOR_GROUP:
                    # hivemind's shutdown cancels such a round again, and its cancel raises for one that collab
                    # already cancelled (_nobody_left_to_join), failing the peer's exit: "Can't set_result to a
                    # future that is FINISHED"
                    cancel_round(control)
                    setattr(self, name, None)
            return super().shutdown()
        # leaving on a signal: say goodbye and go, without waiting up to averaging_timeout for a
        # background state-averaging round (the peers that stay finish it without us)
        self.tracker.shutdown(self.shutdown_timeout)
        for control in (self.scheduled_grads, self.scheduled_state):
            cancel_round(control)
        self.state_averager.shutdown()
        if self.use_gradient_averaging:
            self.grad_averager.shutdown()

    def _finish_before_leaving(self) -> None:
        """Leaving at --max-epochs: the last step and its state round (a mode adds what it owes the peers who stay)."""
        if self.tracker.global_progress.num_peers > 1:
            self.state_averager.step(wait_for_delayed_updates=True)
