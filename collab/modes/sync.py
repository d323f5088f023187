"""Building the collaborative optimizer: hivemind.Optimizer with collab's defaults and guards.

DeDLOC's recipe: gradients accumulate locally toward the swarm's target batch, are averaged in
one all-reduce per epoch, and every peer applies the same LAMB step. With `overlap` (off by default), the
optimizer step, and with `full` the all-reduce too, run in a background thread while the next micro-batches are
computed (hivemind's delayed optimizer step / delayed gradient averaging, one step of staleness). State rounds
run in the background either way.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Optional
import torch
from hivemind import Optimizer
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.utils.logging import get_logger
from hivemind.utils.timed_storage import get_dht_time
from hivemind.utils.mpfuture import MPFuture

from collab.adaptive.noise_scale import NOISE_INPUTS_KEPT, NoiseScale, noise_fields
from collab.averaging.aggregation import Aggregation
from collab.averaging.donor_patience import EpochPace, donor_patience
from collab.averaging.replica import RecordingStateAverager, cancel_round, peers_behind, swarm_finished_without
from collab.averaging.state_download import download_with_retries
from collab.averaging.traffic import TrafficLog
from collab.modes import ModeContext, ModeReport
from collab.modes.replica_sync import OwnStep, ReplicaSync
from collab.modes.tracker import HonestProgressTracker
from collab.records.metrics import AveragingLog
from collab.records.rejections import RejectionLog
from collab.run.gate import MemberGate

NOBODY_LEFT_CHECK = 2.0  # seconds between two looks, from a last round still matching, at whether anyone is left
ALONE_READ_AGE = 1.0  # a peer about to step alone reads the swarm's progress again if its view is older than this
ALONE_READ_TIMEOUT = 2.0
logger = get_logger(__name__)


class LeavingMidStep(Exception):
    """Raised inside opt.step() when the peer was asked to leave while its epoch's round ran."""


class NobodyLeftToJoin(Exception):
    """A peer's last gradient round, ended because every other peer had finished that epoch without it."""


class _QuietLeave(logging.Filter):
    """hivemind's background step logs an error and the traceback of what its trigger raised: not for a leave.
    One per process, on hivemind's logger; each optimizer adds its stop event."""

    def __init__(self):
        super().__init__()
        self.stops: "weakref.WeakSet[threading.Event]" = weakref.WeakSet()

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, LeavingMidStep) or (record.exc_info and isinstance(record.exc_info[1], LeavingMidStep)):
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


class CollabOptimizer(Optimizer):
    """hivemind.Optimizer that records each gradient-averaging round, refuses averages it cannot trust, and knows
    whether its replica is the swarm's.

    hivemind applies whatever the group returned. Here the averagers check every round (collab.averaging.robust_rounds)
    and a refused round fails. A failed round (refused, a timeout, no group) makes this epoch's step one on this
    peer's own gradients: the ones it sent into the round, kept by collab.averaging.grad_averager (hivemind's fallback
    loaded its zeroed accumulators instead, a step of momentum and weight decay alone). Why a step and not
    none: when a whole group fails (a network blip), each of its peers still learns from its own batch, and the
    next state round averages those steps, as local SGD does. Either way the replica is one update away from
    the swarm: it is recorded as an own step (collab.modes.replica_sync), published as the epoch before (so a leaving
    peer waits to be its state donor), and undone by a state-averaging round that gathered the whole swarm or
    by downloading the swarm's state at the next step, or before leaving.
    """

    def __init__(self, *, averaging_log: AveragingLog, stop: Optional[threading.Event] = None,
                 gate: Optional[MemberGate] = None, rule: Aggregation = Aggregation(),
                 rejections: Optional[RejectionLog] = None, traffic: Optional[TrafficLog] = None,
                 plan_keeper=None, **kwargs):
        self.averaging_log = averaging_log
        self.traffic = traffic if traffic is not None else TrafficLog()  # its queue goes to the gradient averager
        self.gate, self.rule = gate, rule
        self.rejections = rejections if rejections is not None else RejectionLog()
        self.stop = stop if stop is not None else threading.Event()
        # --max-epochs: the trainer leaves at this epoch. A step that moves this peer's label to it (taking its
        # groupmates' epoch) starts no round for the next one: a CI peer bumped to its last epoch went into a round
        # the others had left, and waited 90 s for a group and a donor that never came
        self.leave_at_epoch: Optional[int] = None
        # the gradient noise scale, from this peer's rounds (collab.adaptive.noise_scale)
        self.noise_scale = NoiseScale()
        self.noise_inputs: deque = deque(maxlen=NOISE_INPUTS_KEPT)  # each measured round's inputs to it
        self.plan_keeper = plan_keeper  # the run's target and lr gain per epoch (collab.train.plan_keeper), or None
        self._plan_followed = None
        self.replica = ReplicaSync()  # whether the replica is the swarm's (its tracker reads the epoch held)
        self.downloads = 0  # states downloaded from other peers (at the start, to re-sync, to catch up)
        self._most_peers = 1  # peers seen this epoch: those that left at --max-epochs meanwhile still made its step
        self.pace = EpochPace()  # how long this peer's epochs take: a leaving donor's patience follows it
        _QuietLeave.install(self.stop)
        super().__init__(**kwargs)

    def leave_at(self, epoch: Optional[int]) -> None:
        self.leave_at_epoch = epoch

    def count_only_members(self, allows) -> None:
        self.tracker.members = allows

    @property
    def own_step(self) -> Optional[OwnStep]:
        return self.replica.own_step

    def mode_report(self) -> ModeReport:
        return ModeReport(noise=noise_fields(self.noise_scale), noise_inputs=list(self.noise_inputs))

    def _make_progress_tracker(self, target_batch_size: int, **kwargs) -> "HonestProgressTracker":
        tracker = HonestProgressTracker(dht=self.dht, prefix=self.run_id, target_batch_size=target_batch_size,
                                        client_mode=self.client_mode, status_loglevel=self.status_loglevel,
                                        hold=lambda: self.replica.held_epoch, start=True, **kwargs)
        tracker.micro_batch_size = self.batch_size_per_step
        return tracker

    def _make_state_averager(self, **kwargs) -> RecordingStateAverager:
        # hivemind's own construction, with an averager that reports what its rounds and downloads achieved
        return RecordingStateAverager(
            dht=self.dht, prefix=f"{self.run_id}_state_averager", min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout, shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer, custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel, next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode, auxiliary=self.auxiliary, gate=self.gate, rule=self.rule,
            findings=self.rejections.queue, start=True, **kwargs)

    def step(self, *args, **kwargs):
        self._most_peers = max(self._most_peers, self.tracker.global_progress.num_peers)
        self._adopt_the_swarms_epoch()
        self._follow_the_plan()
        try:
            return super().step(*args, **kwargs)
        finally:
            self.pace.observe(self.local_epoch)

    def _follow_the_plan(self) -> None:
        """The run's target for this epoch (collab.adaptive.batch_plan); and, for a plan read after the schedule stepped
        into this epoch, this epoch's learning rate again (the schedule reads the plan: collab.train.plan_keeper)."""
        if self.plan_keeper is None:
            return
        plan = self.plan_keeper.plan
        self.tracker.target_batch_size = plan.target_at(self.local_epoch)
        if plan is not self._plan_followed:
            self._plan_followed = plan
            scheduler = self.state_averager.scheduler
            with self.state_averager.lock_optimizer:
                for group, base, lr_lambda in zip(scheduler.optimizer.param_groups, scheduler.base_lrs,
                                                  scheduler.lr_lambdas):
                    group["lr"] = base * lr_lambda(scheduler.last_epoch)

    def _adopt_the_swarms_epoch(self) -> bool:
        """Heal a lineage split (collab.averaging.replica.RecordingStateAverager.epoch_ahead): this peer made its
        groupmates' step under an epoch number one lower, so it takes their epoch and learning-rate schedule."""
        ahead = self.state_averager.epoch_ahead(self.local_epoch)
        if ahead is None:
            return False
        with self.tracker.pause_updates(), self.state_averager.lock_optimizer:
            behind_by = ahead - self.local_epoch
            self.state_averager.local_epoch = ahead
            self.state_averager._update_scheduler()
            self.replica.renumbered(behind_by)  # an own step counts in the swarm's numbering, which moved
            self.tracker.report_local_progress(ahead, self.tracker.local_progress.samples_accumulated)
        if self.replica.in_sync:
            self._set_sharing_priority(ahead)
        logger.warning(f"Epoch {ahead - behind_by}: the last state-averaging round showed this peer one epoch "
                       f"behind its groupmates, though it made the same steps; now at epoch {ahead}")
        return True

    def _at_the_end(self) -> bool:
        return self.leave_at_epoch is not None and self.local_epoch >= self.leave_at_epoch

    def _update_global_epoch(self, grad_scaler) -> None:
        if self.stop.is_set() or self._at_the_end():
            # leaving: this epoch's step is left to the peers who stay. Starting it would wait for the gradient
            # buffers, which a background round (overlap=full) holds until it gives up: past the leave's grace
            return
        if (self.tracker.global_progress.num_peers <= 1
                and time.monotonic() - self.tracker.read_at > ALONE_READ_AGE
                and self.tracker.refresh(ALONE_READ_TIMEOUT) and not self.tracker.ready_to_update_epoch):
            # about to step alone on a view of the swarm that may be stale: a peer of three that started together
            # (the diloco test, 2 of 9 runs here) read the swarm before the others had a record, made the whole
            # first target by itself and stepped alone while the two others averaged: two lineages from step one
            return
        # hivemind first waits for the last epoch's background step and state round: not for one that finds no group.
        # (A state round runs in the background whatever averaging.overlap says - hivemind's delay_state_averaging -
        # and with overlap none the next optimizer step would queue behind it in the same executor)
        background = self.delay_optimizer_step or (self.delay_state_averaging and self.use_gradient_averaging)
        if background and self.state_averager.give_up_matchmaking(
                self.local_epoch, self.matchmaking_time, self.stop, limit=self.averaging_timeout):
            logger.warning(f"Epoch {self.local_epoch}: the state-averaging round found no group in time; given up")
        if background:
            # (hivemind's own first step here) the last epoch's state round may show this peer one epoch behind.
            # A peer that is behind is "ready" at once, at every step: without this check here it would go
            # straight into the next gradient round and stay behind for good (CI, the NAT test: two of four
            # peers contributed 8 samples an epoch, each time joining the others' next round)
            self.state_averager.step(wait_for_delayed_updates=True)
            if self._adopt_the_swarms_epoch() and (self._at_the_end() or not self.tracker.ready_to_update_epoch):
                return  # at the swarm's epoch now: accumulate toward its target like everyone else (or leave)
        try:
            super()._update_global_epoch(grad_scaler)
        except LeavingMidStep:
            return  # this epoch's step is abandoned: the peers who stay make it, and we keep our last state
        if self.replica.own_step_to(self.local_epoch):
            # honest progress: this replica did not make the swarm's step to this epoch. A peer that downloads
            # state must not pick it as a donor over one that did, and a leaving peer waits to be its donor.
            self.tracker.report_local_progress(self.local_epoch - 1, samples_accumulated=0)
            self._set_sharing_priority(self.local_epoch - 1)
        self._most_peers = self.tracker.global_progress.num_peers

    def _begin_averaging_gradients(self, grad_scaler) -> bool:
        if hasattr(self.grad_averager, "set_round_context"):  # dgc: its warm-up and its clipping need these
            self.grad_averager.set_round_context(self.local_epoch, max(1, self.tracker.global_progress.num_peers))
        self._renew_a_stale_round()
        began = super()._begin_averaging_gradients(grad_scaler)
        if not began and self._most_peers > 1:
            self.averaging_log.failure()  # hivemind steps on local gradients while others average without us
            self._record_own_step("the gradient round could not start")
        return began

    def _renew_a_stale_round(self) -> None:
        """hivemind pre-schedules an epoch's gradient round when its forecast says the epoch ends within
        matchmaking_time, and that round gives up averaging_timeout after it was scheduled, not after it is
        triggered. When the epoch ends much later than forecast (a slow groupmate, a busy machine), the round has
        seconds left when its peer reaches the step: a client-mode peer's round ran out 3 s before its server
        joined it, and both stepped alone (a test beside a CPU hog, 2 of 3 runs). Such a round is cancelled and
        a fresh one, with the whole averaging_timeout, takes its place."""
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

    def _record_own_step(self, why: str) -> None:
        peers = max(self._most_peers, self.tracker.global_progress.num_peers)
        if peers > 1:
            # with overlap=full this runs in the background step, after the epoch was incremented
            epoch = self.local_epoch + (0 if self.delay_grad_averaging else 1)
            self.replica.stepped_alone(epoch, peers, time.monotonic())  # held before hivemind publishes the epoch
            logger.warning(f"Epoch {self.local_epoch}: {why}; this step is on this peer's own gradients, so its "
                           "replica is one update away from the swarm's until it is re-synced")

    def in_sync(self) -> bool:
        """Whether this replica holds the swarm's state (as far as this peer can tell): its last step used the
        swarm's averaged gradients, or a later state-averaging round of the whole swarm or a download undid it."""
        own = self.replica.own_step
        if self.replica.repaired_by(self.state_averager.gathered_since):
            self._now_in_sync("a state-averaging round of the whole swarm followed it")
        elif own is not None and self.local_epoch > own.epoch and self.tracker.global_progress.num_peers <= 1:
            # everyone else left and this peer trained on: its replica is the run's now, and a newcomer downloads it
            self._now_in_sync("the others left; this replica is the run's now")
        return self.replica.in_sync

    def _now_in_sync(self, how: str) -> None:
        if not self.replica.back_in_sync():
            return
        logger.warning(f"Epoch {self.local_epoch}: in sync with the swarm again ({how})")
        self.tracker.report_local_progress(self.local_epoch, self.grad_averager.local_samples_accumulated)
        self._set_sharing_priority(self.local_epoch)

    def _stop_holding_the_epoch(self) -> None:
        """After an own step the record says the epoch before, with no samples, until a re-sync. When that finds no
        donor, the record goes back to this replica's epoch and samples: held, they count for nothing, and a swarm
        whose remaining peers each stepped alone once (none ahead of the others, so none a donor) counted no
        samples at all and never ended an epoch again (CI, the lifecycle test: two peers at epochs 6 and 7, each
        computing 60000 samples for 4 minutes). The replica is still not the swarm's (in_sync() says so until a
        state round of the whole swarm or a download repairs it); a peer behind it now finds it a donor."""
        if not self.replica.stop_holding():
            return
        self.tracker.report_local_progress(self.local_epoch, self.grad_averager.local_samples_accumulated)
        self._set_sharing_priority(self.local_epoch)

    def _set_sharing_priority(self, epoch: int) -> None:
        if not self.client_mode:
            self.state_averager.state_sharing_priority = epoch

    def settle_before_leaving(self, timeout: float) -> str:
        """At --max-epochs: finish the last step, then make sure the replica is the swarm's before it is saved.
        Returns "swarm" (it was), "downloaded" (it is now) or "own step" (no peer could give the state)."""
        # our last state round may look for groupmates who finished theirs long ago (after an own step, it will):
        # give it the matchmaking time, then go on without it and download instead
        if self.state_averager.give_up_matchmaking(self.local_epoch, self.matchmaking_time, self.stop,
                                                   limit=self.averaging_timeout):
            logger.warning(f"Epoch {self.local_epoch}: the last state-averaging round found no group in time")
        self.state_averager.step(wait_for_delayed_updates=True)  # the last step, and its state-averaging round
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
        for future_ref in list((MPFuture._active_futures or {}).values()):
            control = future_ref()
            if isinstance(control, StepControl):
                cancel_round(control)
        # and a round already past matching runs on regardless (hivemind's cancel does not reach it): ended here
        self.state_averager.abort_running_rounds()  # (every collab averager is a CheckedRounds)
        if self.use_gradient_averaging:
            self.grad_averager.abort_running_rounds()

    def _should_load_state_from_peers(self) -> bool:
        # after a step on our own gradients, download the swarm's state at the next step: exact, and the
        # gradients we would compute meanwhile would be for parameters nobody else has
        if not self.in_sync() and self.replica.wants_resync:
            return True
        return super()._should_load_state_from_peers()

    def load_state_from_peers(self, deadline: Optional[float] = None, **kwargs) -> bool:
        """hivemind's catch-up, with three changes: it says whether a state was really loaded (hivemind returns
        quietly when no peer gave one); a peer asked to leave stops retrying (hivemind retries a failed download
        forever), and with a `deadline` it keeps asking until then when no peer had a state to give (without
        one, that answer ends it, as in hivemind's per-step catch-up); and the gradient averager's "state" is
        not downloaded - another peer's accumulated gradients, which hivemind fetches and throws away."""
        self.replica.start_resync()
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            self._tag_along_with_zero_weight(self.scheduled_grads)
            self.scheduled_grads = None
        self.state_averager.step(wait_for_delayed_updates=True)
        if not self.replica.in_sync and self.in_sync():
            return True  # the state-averaging round that just finished gathered the whole swarm: no download
        epoch_before = self.local_epoch
        self._adopt_the_swarms_epoch()
        if (self.replica.in_sync and epoch_before < self.local_epoch >= self.tracker.global_epoch
                and self.state_averager.gathered_since(epoch_before) >= self.tracker.global_progress.num_peers):
            return True  # that round also healed a lineage split, with the whole swarm's parameters: no download

        for peer in self.rejections.take_caught():  # a peer caught cheating in a round is no donor either
            if self.state_averager.is_alive():
                self.state_averager._outer_pipe.send(("_skip_donor", [peer], {}))
        with self.tracker.pause_updates():
            loaded = download_with_retries(
                lambda: self.state_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs),
                alone=lambda: self.tracker.global_progress.num_peers <= 1, stop=self.stop, deadline=deadline)
            if self.stop.is_set() or not loaded:
                logger.warning(f"Epoch {self.local_epoch}: no peer gave its state; going on with this replica")
                if not self.stop.is_set():
                    self._stop_holding_the_epoch()
                return False
            if self.tracker.global_epoch - 1 <= self.local_epoch < self.tracker.global_epoch:
                self.state_averager.local_epoch = self.tracker.global_epoch  # one epoch behind: that step is ours
            self.tracker.report_local_progress(local_epoch=self.local_epoch, samples_accumulated=0)
            if not self.client_mode:
                self.state_averager.state_sharing_priority = self.local_epoch
            if self.use_gradient_averaging:
                self.grad_averager.reset_accumulated_grads_()
                if not self.client_mode:
                    self.grad_averager.state_sharing_priority = self.local_epoch
        self.downloads += 1
        if self.replica.in_sync and deadline is None:
            # hivemind's own catch-up (this replica fell behind the swarm's epoch: e.g. its groupmates made a step
            # whose average it did not get): said, as every other re-sync is
            logger.warning(f"Epoch {self.local_epoch}: behind the swarm; downloaded its state")
        self._now_in_sync(f"downloaded the swarm's state at epoch {self.local_epoch}")
        return True

    def _wait_for_round(self, control):
        """The round's result, waiting in short slices: a peer asked to leave must not sit out a whole
        averaging_timeout (up to minutes) inside an all-reduce before it can say goodbye; nor a peer whose last
        round has nobody left to find (_nobody_left_to_join)."""
        started = time.monotonic()
        deadline, next_check = started + self.averaging_timeout, started + self.matchmaking_time + NOBODY_LEFT_CHECK
        while True:
            try:
                return control.result(timeout=0.25)
            except FutureTimeout:
                if self.stop.is_set() or time.monotonic() > deadline:
                    raise
                if time.monotonic() > next_check:
                    next_check = time.monotonic() + NOBODY_LEFT_CHECK
                    self._nobody_left_to_join(control)

    def _nobody_left_to_join(self, control) -> None:
        """Ends this peer's last round (before --max-epochs) when it is still looking for a group and every other
        peer has made that epoch's step and left it: they are done, and would never join. It failed at once, so
        the peer downloads their state before it leaves (settle_before_leaving), rather than wait out
        averaging_timeout alone first while they linger as its donors (CI: 30-60 s at the end of many tests)."""
        epoch = self.local_epoch - (1 if self.delay_grad_averaging else 0)  # overlap=full: the epoch moved on
        if (self.leave_at_epoch is None or epoch + 1 < self.leave_at_epoch
                or control.stage != AveragingStage.LOOKING_FOR_GROUP):
            return  # mid-run a peer ahead may still join this round (a lineage split, healed by state rounds)
        try:
            swarm = swarm_finished_without(self.dht, self.run_id, epoch, self.dht.peer_id.to_base58())
        except Exception:  # a DHT that does not answer: wait on, as without this check
            return
        if swarm is not None and control.stage == AveragingStage.LOOKING_FOR_GROUP:
            cancel_round(control)
            raise NobodyLeftToJoin(f"every other peer made epoch {epoch}'s step without this one (the swarm is at "
                                   f"epoch {swarm}); nobody is left to average with")

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control) -> None:
        averaged = False
        if maybe_step_control is not None:
            try:
                group = self._wait_for_round(maybe_step_control)
                if self._averaged_gradients_are_finite():
                    self._load_averaged_gradients_into_optimizer_()
                    self.averaging_log.success([peer.to_base58() for peer in group], self.local_epoch)
                    averaged = True
                else:
                    self.averaging_log.failure()
            except BaseException as e:  # timeouts, a peer that vanished mid-round: fall back to local gradients
                self.averaging_log.failure()
                failure = f"gradient averaging failed ({type(e).__name__}: {e})"
            else:
                failure = "the averaged gradients were not finite" if not averaged else None
        else:
            failure = "no gradient round was running"
        # the averager's process counted the round's bytes just before it returned; the queue may lag a moment
        measuring = averaged and self.grad_averager.measures_noise
        round_traffic = self.traffic.end_round(wait=0.5 if averaged else 0.0, norms_wait=0.3 if measuring else 0.0)
        if measuring and round_traffic is not None and round_traffic.norms is not None:
            own_sq, own_samples, average_sq, group_samples = round_traffic.norms
            # the group's samples are known exactly to a peer that reduced a part (the weights it combined): one
            # that reduced none (a client; or a small model, whose one part another peer reduced) does not guess
            if group_samples and self.noise_scale.update(own_sq, own_samples, average_sq, group_samples):
                self.noise_inputs.append((self.local_epoch, own_sq, own_samples, average_sq, group_samples))
        if not averaged:
            if self.stop.is_set():
                # leaving: no step at all rather than one on local gradients. Loading them would also wait
                # for the averager process, which holds the gradient buffers until its all-reduce gives up
                # (with overlap=full, past the leave's grace: forced exits). In that mode this runs in hivemind's
                # background step, which logs what it raises: _QuietLeave keeps that out of the peer's log.
                raise LeavingMidStep()
            self._load_local_gradients_into_optimizer()
            self._record_own_step(failure)

    def _load_local_gradients_into_optimizer(self) -> None:
        # the gradients this peer sent into the failed round (hivemind would load its zeroed accumulators); when
        # no round took them, the accumulators still hold them and hivemind's own fallback is right
        own = self.grad_averager.take_own_gradients()
        if own is None:
            return super()._load_local_gradients_into_optimizer()
        self.grad_averager.restore_own_gradients_(own)
        self._load_averaged_gradients_into_optimizer_()

    def _load_averaged_gradients_into_optimizer_(self) -> None:
        super()._load_averaged_gradients_into_optimizer_()
        self.grad_averager.take_own_gradients()  # used: a later failure must not step on them again

    def drop_micro_batch(self) -> None:
        """The last backward pass gave non-finite gradients (collab.train.guard): make sure they are never sent. With
        reuse_grad_buffers they were added into the epoch's accumulator in .grad, which is then unusable too:
        it is reset, and the samples it held are un-counted from this peer's progress."""
        if self.grad_averager.reuse_grad_buffers:
            self.grad_averager.reset_accumulated_grads_()
            self.tracker.report_local_progress(self.local_epoch, samples_accumulated=0)
        else:
            for param in self.grad_averager.parameters:  # the model's: hivemind adds .grad in at opt.step()
                param.grad = None

    def _tag_along_with_zero_weight(self, control) -> None:
        # on the way out, hivemind would sit through a running round (up to averaging_timeout) with zero
        # weight; a leaving peer cancels instead, and the group finishes without it
        if self.stop.is_set():
            cancel_round(control)
            return
        super()._tag_along_with_zero_weight(control)

    def shutdown(self) -> None:
        if not self.stop.is_set():
            # leaving at --max-epochs: finish the delayed step (with overlap=full it holds our last gradient
            # round, still running). Our round may be over while we still stream a client-mode (NAT'd or slow)
            # groupmate its share: each averager's shutdown waits for the replies it still holds to be read
            # (collab.averaging.members_only, REPLY_DRAIN) - a fixed 3-s linger here cost every leave, needed or not
            if self.tracker.global_progress.num_peers > 1:
                self.state_averager.step(wait_for_delayed_updates=True)
            # whatever this peer's view of the swarm says (it may be a minute old): the records say who is behind
            self._serve_peers_behind()
            for name in ("scheduled_grads", "scheduled_state"):
                control = getattr(self, name)
                if control is not None and control.stage == AveragingStage.LOOKING_FOR_GROUP:
                    # hivemind's shutdown cancels such a round again, and its cancel raises for one that collab
                    # already cancelled (_nobody_left_to_join; a CI peer exited 1: "Can't set_result to a future
                    # that is FINISHED")
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

    def _serve_peers_behind(self) -> None:
        """A peer behind ours (it missed the last step, its lineage split, or it has not noticed our step yet) will
        want our state to leave in sync with the swarm: stay its donor while it is behind, for as long as it needs at
        the swarm's measured pace (collab.averaging.donor_patience), rather than leave it with nobody to ask."""
        if self.client_mode:
            # it serves no state (nobody can dial it), so it would wait for nothing: the NAT'd peer of a CI test,
            # left alone with its only server's last record cached, waited out that record's 60-s life
            return
        # not for a peer caught sending or returning bad parts (hard evidence): in CI the honest peers stayed on
        # a whole minute as donors for a NaN sender one epoch behind them
        caught = frozenset(self.rejections.caught_ever())
        # nor for itself: after an own step this peer's record says the epoch before (a CI run's peer that could not
        # re-sync waited 75 s for its own record, and its groupmate for it)
        ignore = caught | {self.dht.peer_id.to_base58()}
        started, patience, said = time.monotonic(), 0.0, False
        while not self.stop.is_set():
            try:
                behind = peers_behind(self.dht, self.run_id, self.local_epoch, ignore=ignore)
            except Exception:  # a DHT that fails to answer here must not turn a clean leave into a traceback
                return
            waited = time.monotonic() - started
            epochs = [self.local_epoch - b.epochs for b in behind]
            if not behind:
                if said:
                    logger.warning(f"Epoch {self.local_epoch}: no peer is behind any more; leaving after {waited:.0f} s")
                return
            patience = max(patience, donor_patience(
                behind, self.tracker.target_batch_size, self.pace.seconds(), self.averaging_timeout,
                self.matchmaking_time, self.load_state_timeout))
            if waited > patience:
                logger.warning(f"Epoch {self.local_epoch}: {len(behind)} peer(s) still behind (epochs {epochs}) after "
                               f"{waited:.0f} s as their state donor; leaving")
                return
            if not said:
                said = True
                pace = self.pace.seconds()
                logger.warning(f"Epoch {self.local_epoch}: {len(behind)} peer(s) behind (epochs {epochs}): staying on as "
                               f"their state donor for up to {patience:.0f} s (epochs take "
                               f"{'?' if pace is None else f'{pace:.1f}'} s here)")
            self.stop.wait(0.5)

    def apply_revocations(self, revocations) -> None:
        """A private run's newer revocation list, into both averager processes
        (collab.averaging.members_only.MembersOnly)."""
        averagers = [self.state_averager, *([self.grad_averager] if self.use_gradient_averaging else [])]
        for averager in averagers:
            if averager.is_alive():
                averager._outer_pipe.send(("_apply_revocations", [revocations], {}))

    def has_pending_updates(self) -> bool:
        return any(not update.done() for update in self.state_averager.pending_updates)

    def observe_loss(self, loss: float) -> None:
        """The loss of each micro-batch this peer trained on (gossip's merges weigh replicas by it)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        # with reuse_grad_buffers hivemind accumulates in .grad itself and clears it after each epoch
        if not self.grad_averager.reuse_grad_buffers:
            super().zero_grad(set_to_none)

    def _maybe_schedule_gradient_averaging(self) -> None:
        # hivemind pre-schedules matchmaking even for a peer that is alone, and the fruitless search keeps
        # the DHT and averager processes busy (a third of a core here). With one peer there is nobody to
        # match; when another appears, _begin_averaging_gradients still starts a round at the epoch's end.
        if self.tracker.global_progress.num_peers > 1:
            super()._maybe_schedule_gradient_averaging()

    def _maybe_schedule_state_averaging(self) -> None:
        if self.tracker.global_progress.num_peers > 1:
            super()._maybe_schedule_state_averaging()

    def _averaged_gradients_are_finite(self) -> bool:
        with torch.no_grad(), self.grad_averager.get_tensors() as tensors:
            return all(bool(torch.isfinite(t).all()) for t in tensors)


def round_is_stale(seconds_left: float, averaging_timeout: float) -> bool:
    """Whether a pre-scheduled round, still looking for a group when its peer reaches the step, has spent too much
    of its timeout waiting for it: over half. (Pre-scheduled on a forecast that the epoch ends within
    matchmaking_time, it normally has all but a few seconds left)"""
    return seconds_left < averaging_timeout / 2


def optimizer_options(context: ModeContext) -> dict:
    """What averaging.mode sync sets beyond collab.train.make_optimizer's defaults: only the batch plan, when the run's
    target or learning rate follows the noise scale (collab.train.plan_keeper)."""
    return dict(optimizer_class=CollabOptimizer, plan_keeper=context.plan)
