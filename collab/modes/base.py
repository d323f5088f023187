"""What every averaging mode's optimizer shares: hivemind.Optimizer built with collab's progress tracker and state
averager; the swarm's epoch label, the batch plan it follows and a healed lineage split; whether the replica is the
swarm's (collab.modes.replica_sync) and the download that makes it so; a private run's revocations; and leaving, at
--max-epochs or on a signal (collab.modes.leaving). Each mode composes this base with what is its own: sync
(collab.modes.sync) the gradient rounds and what follows a failed one, diloco (on sync) its outer steps, gossip its
pairwise exchanges.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Optional

from hivemind.utils.logging import get_logger

from collab.adaptive.noise_scale import NOISE_INPUTS_KEPT, NoiseScale, noise_fields
from collab.averaging.aggregation import Aggregation
from collab.averaging.donor_patience import EpochPace
from collab.averaging.replica import RecordingStateAverager, others_present, wait_for_a_donor_at
from collab.averaging.round_control import still_matching
from collab.averaging.state_download import download_with_retries
from collab.averaging.traffic import TrafficLog
from collab.hivemind_hooks.optimizer import OptimizerHooks
from collab.hivemind_hooks.patches import update_scheduler
from collab.modes import ModeReport
from collab.modes.leaving import LeavesTheSwarm, LeavingMidStep, QuietLeave
from collab.modes.replica_sync import OwnStep, ReplicaSync
from collab.modes.tracker import HonestProgressTracker
from collab.records.metrics import AveragingLog
from collab.records.rejections import RejectionLog
from collab.run.gate import MemberGate

ALONE_READ_AGE = 1.0  # a peer about to step alone reads the swarm's progress again if its view is older than this
ALONE_READ_TIMEOUT = 2.0
MID_STEP_RETRIES = 2  # a state downloaded one epoch behind the swarm's is asked for again, this many times at most,
MID_STEP_PAUSE = 0.5  # this long apart (a donor's optimizer step takes milliseconds to a second)
logger = get_logger(__name__)


class SwarmOptimizer(LeavesTheSwarm, OptimizerHooks):
    """hivemind.Optimizer with what every collab mode shares (see the module)."""

    sums_micro_batches = False  # (collab.modes.AveragingMode) the sync mode's does

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
        # groupmates' epoch) starts no round for the next one: a peer bumped to its last epoch would go into a round
        # the others have left, and wait for a group and a donor that never come
        self.leave_at_epoch: Optional[int] = None
        # the gradient noise scale, from this peer's rounds (collab.adaptive.noise_scale)
        self.noise_scale = NoiseScale()
        self.noise_inputs: deque = deque(maxlen=NOISE_INPUTS_KEPT)  # each measured round's inputs to it
        self.plan_keeper = plan_keeper  # the run's target and lr gain per epoch (collab.train.plan_keeper), or None
        self._plan_followed = None
        self.replica = ReplicaSync()  # whether the replica is the swarm's (its tracker reads the epoch held)
        self.downloads = 0  # states downloaded from other peers (at the start, to re-sync, to catch up)
        self.downloaded_at_epoch: Optional[int] = None  # the local epoch after the last download
        self.rounds_replayed = 0  # missed gradient rounds applied from a peer that made them (averaging.round_replay)
        self._most_peers = 1  # peers seen this epoch: those that left at --max-epochs meanwhile still made its step
        self.pace = EpochPace()  # how long this peer's epochs take: a leaving donor's patience follows it
        self._start_with: Optional[tuple[int, float]] = None  # start_together: (peers, until when)
        QuietLeave.install(self.stop)
        super().__init__(**kwargs)

    def leave_at(self, epoch: Optional[int]) -> None:
        self.leave_at_epoch = epoch

    def start_together(self, peers: int, timeout: float) -> None:
        """--wait-peers: the first step waits (at most `timeout` s) until this peer's tracker counts `peers`. A peer
        has no progress record before its first micro-batch, so the first to start read a swarm of one: on a cheap
        task it made the whole first target alone and stepped alone, again and again (12 linreg peers: 8 went one
        to seven epochs ahead on their own before the first round)."""
        self._start_with = (peers, time.monotonic() + timeout)

    def holding_for_the_others(self) -> bool:
        """start_together, seen from the training loop: once this peer has reported samples (so the others' trackers
        count it), it computes nothing more until its tracker counts the others. Computing on meant a first step
        on everything computed meanwhile: 12 linreg peers, whose first reads took up to 20 s, stepped on 40-80
        epochs' worth of samples."""
        return self.tracker.local_progress.samples_accumulated > 0 and self._waiting_for_the_others()

    def _waiting_for_the_others(self) -> bool:
        if self._start_with is None:
            return False
        peers, until = self._start_with
        if self.tracker.global_progress.num_peers < peers and time.monotonic() < until:
            if time.monotonic() - self.tracker.read_at > ALONE_READ_AGE:
                self.tracker.refresh(ALONE_READ_TIMEOUT)
            if self.tracker.global_progress.num_peers < peers:
                return True
        self._start_with = None
        self.read_progress_soon()  # every peer has a record now: the first round's plan needs them all
        return False

    def read_progress_soon(self) -> None:
        """Hand both averagers this peer's view of who trains, for their first rounds' group targets and planned
        leaders (collab.averaging.round_plans), and have them read the run's records now, not when a round begins."""
        seen = getattr(self.tracker, "records_seen", {})  # (collab.modes.tracker: signed records only)
        for averager in (self.grad_averager if self.use_gradient_averaging else None, self.state_averager):
            if averager is not None and hasattr(averager, "read_progress_soon"):
                averager.read_progress_soon({peer: (r.epoch, r.client_mode) for peer, r in seen.items()})

    def count_only_members(self, allows) -> None:
        self.tracker.members = allows

    @property
    def own_step(self) -> Optional[OwnStep]:
        return self.replica.own_step

    def mode_report(self) -> ModeReport:
        return ModeReport(noise=noise_fields(self.noise_scale), noise_inputs=list(self.noise_inputs))

    def make_progress_tracker(self, target_batch_size: int, **kwargs) -> "HonestProgressTracker":
        tracker = HonestProgressTracker(dht=self.dht, prefix=self.run_id, target_batch_size=target_batch_size,
                                        client_mode=self.client_mode, status_loglevel=self.status_loglevel,
                                        hold=lambda: self.replica.held_epoch, start=True, **kwargs)
        tracker.micro_batch_size = self.batch_size_per_step
        return tracker

    def make_state_averager(self, **kwargs) -> RecordingStateAverager:
        # hivemind's own construction, with an averager that reports what its rounds and downloads achieved
        averager = RecordingStateAverager(
            dht=self.dht, prefix=f"{self.run_id}_state_averager", min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout, shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer, custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel, next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode, auxiliary=self.auxiliary, gate=self.gate, rule=self.rule,
            findings=self.rejections.queue, start=True, **kwargs)
        # a replica held one update away from the swarm's (an own step, re-sync pending) averages its state with nobody
        averager.out_of_step = lambda: self.replica.held_epoch is not None
        return averager

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
            update_scheduler(self.state_averager)
            self.replica.renumbered(behind_by)  # an own step counts in the swarm's numbering, which moved
            self.tracker.report_local_progress(ahead, self.tracker.local_progress.samples_accumulated)
        if self.replica.in_sync:
            self._set_sharing_priority(ahead)
        logger.warning(f"Epoch {ahead - behind_by}: the last state-averaging round showed this peer one epoch "
                       f"behind its groupmates, though it made the same steps; now at epoch {ahead}")
        return True

    def _at_the_end(self) -> bool:
        return self.leave_at_epoch is not None and self.local_epoch >= self.leave_at_epoch

    def update_global_epoch(self, grad_scaler) -> None:
        if self.stop.is_set() or self._at_the_end():
            # leaving: this epoch's step is left to the peers who stay. Starting it would wait for the gradient
            # buffers, which a background round (overlap=full) holds until it gives up: past the leave's grace
            return
        if self._waiting_for_the_others():
            return
        if (self.tracker.global_progress.num_peers <= 1
                and time.monotonic() - self.tracker.read_at > ALONE_READ_AGE
                and self.tracker.refresh(ALONE_READ_TIMEOUT) and not self.tracker.ready_to_update_epoch):
            # about to step alone on a view of the swarm that may be stale: a peer of several that start together
            # can read the swarm before the others have a record, make the whole first target by itself and step
            # alone while the others average: two lineages from step one
            return
        # hivemind first waits for the last epoch's background step and state round: not for one that finds no group.
        # (A state round runs in the background whatever averaging.overlap says - hivemind's delay_state_averaging -
        # and with overlap none the next optimizer step would queue behind it in the same executor)
        background = self.delay_optimizer_step or (self.delay_state_averaging and self.use_gradient_averaging)
        if background and self.state_averager.give_up_matchmaking(
                self.local_epoch, self.matchmaking_time, self.stop, limit=self.averaging_timeout,
                hold=self._gradient_round_matching):
            logger.warning(f"Epoch {self.local_epoch}: the state-averaging round found no group in time; given up")
        if background:
            # (hivemind's own first step here) the last epoch's state round may show this peer one epoch behind.
            # A peer that is behind is "ready" at once, at every step: without this check here it would go
            # straight into the next gradient round and stay behind for good (each time joining the others' next
            # round, contributing only the few samples it gathered meanwhile)
            self.state_averager.step(wait_for_delayed_updates=True)
            if self.stop.is_set():
                return  # asked to leave during that wait (up to averaging_timeout): leaving, as above
            if self._adopt_the_swarms_epoch() and (self._at_the_end() or not self.tracker.ready_to_update_epoch):
                return  # at the swarm's epoch now: accumulate toward its target like everyone else (or leave)
        try:
            super().update_global_epoch(grad_scaler)
        except LeavingMidStep:
            return  # this epoch's step is abandoned: the peers who stay make it, and we keep our last state
        if self.replica.own_step_to(self.local_epoch):
            # honest progress: this replica did not make the swarm's step to this epoch. A peer that downloads
            # state must not pick it as a donor over one that did, and a leaving peer waits to be its donor.
            self.tracker.report_local_progress(self.local_epoch - 1, samples_accumulated=0)
            self._set_sharing_priority(self.local_epoch - 1)
        self._most_peers = self.tracker.global_progress.num_peers

    def _gradient_round_matching(self) -> bool:
        """Whether this epoch's gradient round, pre-scheduled, is still looking for its group: the step waits for it
        to find one anyway, so a state round still looking too costs no time (replica.give_up_matchmaking)."""
        return self.use_gradient_averaging and still_matching(self.scheduled_grads)

    def in_sync(self) -> bool:
        """Whether this replica holds the swarm's state (as far as this peer can tell): its last step used the
        swarm's averaged gradients, or a download undid it (or, no donor found, a state round of the whole swarm)."""
        own = self.replica.own_step
        if self.replica.repaired_by(self.state_averager.gathered_since):
            self._now_in_sync("no peer could give its state; a state-averaging round of the whole swarm followed")
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
        whose remaining peers each stepped alone once (none ahead of the others, so none a donor) would count no
        samples at all and never end an epoch again, however many each computes. The replica is still not the
        swarm's (in_sync() says so until a state round of the whole swarm or a download repairs it); a peer behind
        it now finds it a donor."""
        if not self.replica.stop_holding():
            return
        self.tracker.report_local_progress(self.local_epoch, self.grad_averager.local_samples_accumulated)
        self._set_sharing_priority(self.local_epoch)

    def _set_sharing_priority(self, epoch: int) -> None:
        if not self.client_mode:
            self.state_averager.state_sharing_priority = epoch

    def load_state_from_peers(self, deadline: Optional[float] = None, **kwargs) -> bool:
        """hivemind's catch-up, with three changes: it says whether a state was really loaded (hivemind returns
        quietly when no peer gave one); a peer asked to leave stops retrying (hivemind retries a failed download
        forever), and with a `deadline` it keeps asking until then when no peer had a state to give (without
        one, that answer ends it, as in hivemind's per-step catch-up); and the gradient averager's "state" is
        not downloaded - another peer's accumulated gradients, which hivemind fetches and throws away."""
        self.replica.start_resync()
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            self.tag_along(self.scheduled_grads)
            self.scheduled_grads = None
        self.state_averager.step(wait_for_delayed_updates=True)
        if not self.replica.in_sync and self.in_sync():
            return True  # (after a re-sync that found no donor) a state round of the whole swarm: no download
        epoch_before = self.local_epoch
        self._adopt_the_swarms_epoch()
        if (self.replica.in_sync and epoch_before < self.local_epoch >= self.tracker.global_epoch
                and self.state_averager.gathered_since(epoch_before) >= self.tracker.global_progress.num_peers):
            return True  # that round also healed a lineage split, with the whole swarm's parameters: no download

        if not self.replica.in_sync and deadline is None:
            # a re-sync right after an own step: the swarm may not have made this epoch's step yet (its round still
            # running). Asked now, every donor is an epoch behind and refused; the hold was then released, and the two
            # peers of a 2-of-12 split round downloaded each other's state and stayed 1e-2 off the swarm to the end
            wait_for_a_donor_at(self.dht, self.run_id, self.dht.peer_id.to_base58(), self.local_epoch, self.stop,
                                limit=self.averaging_timeout)
        for peer in self.rejections.take_caught():  # a peer caught cheating in a round is no donor either
            if self.state_averager.is_alive():
                self.state_averager._outer_pipe.send(("_skip_donor", [peer], {}))
        with self.tracker.pause_updates():
            loaded = download_with_retries(
                lambda: self._download_a_stepped_state(**kwargs),
                alone=self._alone_now, stop=self.stop, deadline=deadline)
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
                self.grad_averager.reset_accumulated_grads_()  # (it shares no state: grad_averager.SharesNoState)
        self.downloads += 1
        self.downloaded_at_epoch = self.local_epoch  # (a round of this epoch is not replayed on it: sync.py)
        if self.replica.in_sync and deadline is None:
            # hivemind's own catch-up (this replica fell behind the swarm's epoch: e.g. its groupmates made a step
            # whose average it did not get): said, as every other re-sync is
            logger.warning(f"Epoch {self.local_epoch}: behind the swarm; downloaded its state")
        self._now_in_sync(f"downloaded the swarm's state at epoch {self.local_epoch}")
        return True

    def _download_a_stepped_state(self, **kwargs) -> bool:
        """One download. A state one epoch behind the swarm's may come from a donor that had yet to make the step
        (collab.averaging.served_state): asked again a moment later, that donor or another has it. Taking the swarm's
        epoch number for it instead (hivemind's catch-up, still the fallback) would leave this replica one update
        behind every other while it counts as in step."""
        loaded = self.state_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)
        for _ in range(MID_STEP_RETRIES):
            behind = self.local_epoch
            if not loaded or behind != self.tracker.global_epoch - 1 or self.stop.wait(MID_STEP_PAUSE):
                break
            try:
                if not self.state_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs):
                    break  # (the state loaded first stays)
            except Exception:
                break
            logger.warning(f"Epoch {behind}: the state downloaded was one epoch behind the swarm's; asked again, got "
                           f"epoch {self.local_epoch}")
        return loaded

    def _alone_now(self) -> bool:
        """Whether no other peer is left to give a state: read afresh, not from the tracker's view (paused during a
        download, and seconds old). The donor list still names a peer that said goodbye: a peer whose only groupmate
        had left at --max-epochs tried it for load_state_timeout (30 s) before going on alone."""
        return not others_present(self.dht, self.run_id, self.dht.peer_id.to_base58())

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

    def schedule_state_round(self) -> None:
        if self.tracker.global_progress.num_peers > 1:
            super().schedule_state_round()
