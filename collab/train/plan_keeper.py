"""Keeping the run's batch plan (collab.adaptive.batch_plan) while a peer trains: a thread with a stop event.

Every peer reads the newest plan signed with the run's key every few seconds and re-publishes it under its own
key (so it outlives the organizer's peer). The organizer's peer also plans: from the run's state as any reader
sees it (the pooled noise scale of the online peers' signed records, the swarm's throughput), at its own epoch.
What the optimizer and the schedule read is `keeper.plan`, swapped whole (no lock needed to read it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Optional

from collab.adaptive.batch_plan import MIN_NOISE_ROUNDS, PLAN_SUFFIX, BatchPlan, first_plan, newest_plan, next_plan
from collab.records.untrusted import Rejections, signed_values
from collab.run.manifest import verify
from collab.run.sharing import store_own_copy
from collab.swarm.state import read_run_state

READ_SECONDS = 1.0  # one small DHT get a second, as hivemind's progress tracker does at its fastest
PLAN_SECONDS = 2.0
REPUBLISH_SECONDS = 30.0
PACE_WINDOW = 60.0  # the run's pace (seconds per epoch) is measured over the last minute
PLAN_RECORD_LIFETIME = 600.0  # seconds the run's batch plan lives in the DHT unless republished
logger = logging.getLogger(__name__)


class PlanKeeper:
    def __init__(self, swarm, run_id: str, training, organizer_public_key: str, organizer_key=None,
                 epoch: Callable[[], int] = lambda: 0):
        """`organizer_key`: the run's private key, on the organizer's peer only (it then plans); `epoch`: this
        peer's epoch, read when planning."""
        self.swarm, self.run_id, self.training = swarm, run_id, training
        self.organizer_public_key, self.organizer_key, self.epoch = organizer_public_key, organizer_key, epoch
        self.plan: BatchPlan = first_plan(run_id, training)
        self.issued = 0  # plans this peer issued (the organizer's)
        self.late = 0  # plans this peer read after their first epoch had begun here: its lr differed for a while
        self.rejected = Rejections()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="plan-keeper", daemon=True)
        self._published = self._planned = float("-inf")
        self._epochs_seen: deque[tuple[float, int]] = deque()  # (time, epoch) at each planning: the run's pace

    def start(self) -> "PlanKeeper":
        try:  # a peer joining a run that already moved starts on the run's plan, not on the config's
            self._read()
        except Exception as e:  # the thread reads again in a second
            logger.warning(f"Batch plan: could not read the run's plan yet ({type(e).__name__}: {e})")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)  # daemon: a DHT read it may be inside must not delay the leave

    def _run(self) -> None:
        while not self._stop.wait(READ_SECONDS):
            try:
                self._read()
                if self.organizer_key is not None and time.monotonic() - self._planned > PLAN_SECONDS:
                    self._planned = time.monotonic()
                    self._plan()
                if self.plan.issued_at > 0 and time.monotonic() - self._published > REPUBLISH_SECONDS:
                    self._publish()
            except Exception as e:  # a DHT that does not answer now may answer next time
                logger.warning(f"Batch plan: {type(e).__name__}: {e} (trying again)")

    def _read(self) -> None:
        found = self.swarm.dht.get(self.run_id + PLAN_SUFFIX, latest=True)
        newest = newest_plan(signed_values(found), self.run_id, self.organizer_public_key, self.rejected)
        if newest is not None and newest.issued_at > self.plan.issued_at:
            self._adopt(newest)

    def _plan(self) -> None:
        state = read_run_state(self.swarm.dht, self.run_id)
        b_noise = state.noise_scale if state.noise_scale_rounds >= MIN_NOISE_ROUNDS else None
        epoch, now = self.epoch(), time.monotonic()
        self._epochs_seen.append((now, epoch))
        while len(self._epochs_seen) > 2 and now - self._epochs_seen[1][0] > PACE_WINDOW:
            self._epochs_seen.popleft()
        pace = fastest_pace(self._epochs_seen)
        if pace is None:
            return
        planned = next_plan(self.plan, epoch, b_noise, self.training, pace)
        if planned is None:
            return
        self._adopt(planned.signed(self.organizer_key))
        self.issued += 1
        self._publish()

    def _adopt(self, plan: BatchPlan) -> None:
        before = self.plan
        self.plan = plan
        if self.organizer_key is None and self.epoch() >= plan.from_epoch > before.from_epoch:
            self.late += 1
            logger.warning(f"Batch plan for epoch {plan.from_epoch} read late, at epoch {self.epoch()}: this peer's "
                           "learning rate differed from the others' until now (a slow DHT; it is counted)")
        logger.warning(f"Batch plan from epoch {plan.from_epoch}: target {before.target_at(plan.from_epoch)} -> "
                       f"{plan.target}, learning-rate gain {plan.gain:.3g} (B_noise {plan.b_noise or 0:.0f})")

    def _publish(self) -> None:
        store_own_copy(self.swarm.dht, self.run_id + PLAN_SUFFIX, self.swarm.public_key,
                       self.plan.model_dump_json(), PLAN_RECORD_LIFETIME)
        self._published = time.monotonic()


def fastest_pace(seen) -> Optional[float]:
    """Seconds per epoch as this peer lived them, rounds included (the records' rates count compute only: where
    rounds take most of an epoch, a lead counted from them is far too many epochs), from its (time, epoch) samples:
    the fastest interval's. A lead counted in epochs must hold at the fastest pace the run has shown: a run speeds
    up after its start (peers waiting, first rounds), and at the minute's average a 4-s lead came out as 2 epochs
    that then took 1.7 s (a peer read the plan late, in CI). None before any epoch has passed."""
    paces = [(t1 - t0) / (e1 - e0) for (t0, e0), (t1, e1) in zip(seen, list(seen)[1:]) if e1 > e0]
    return min(paces) if paces else None


def scheduled_by_plan(factory, keeper: PlanKeeper):
    """The task's schedule (a LambdaLR) run on the plan's scale-invariant progress, times its gain: AdaScale
    (collab.adaptive.batch_plan). Without lr_scaling adascale the gain is 1 and the progress the epoch."""
    def make(optimizer):
        scheduler = factory(optimizer)
        if not hasattr(scheduler, "lr_lambdas"):
            raise TypeError(f"lr_scaling adascale needs a LambdaLR schedule, not {type(scheduler).__name__}")
        scheduler.lr_lambdas = [
            (lambda epoch, f=f: f(keeper.plan.progress_at(epoch)) * keeper.plan.gain_at(epoch))
            for f in scheduler.lr_lambdas]
        return scheduler
    return make


def start_plan_keeper(config, swarm, shared, epoch: Callable[[], int]) -> Optional[PlanKeeper]:
    """A started keeper when the run's target or learning rate follows the noise scale (config: RunConfig;
    shared: collab.run.sharer.SharedRun, whose manifest names the run's key)."""
    if not follows_a_plan(config.training) or shared is None:
        return None

    public = verify(shared.signed, swarm.peer.run_id, shared.fingerprint).organizer_key
    return PlanKeeper(swarm, swarm.peer.run_id, config.training, public, shared.organizer_key, epoch).start()


def plan_in_force(keeper: PlanKeeper, opt) -> list:
    """[target, gain, scale-invariant progress, learning rate] of the epoch `opt` is at: the rate its schedule
    gives the step that closes this epoch (read from the schedule: with overlap, the scheduler itself moves
    to the epoch in the background step, maybe after this is read)."""
    plan, epoch = keeper.plan, opt.local_epoch
    scheduler = opt.state_averager.scheduler
    lr = scheduler.base_lrs[0] * scheduler.lr_lambdas[0](epoch)
    return [plan.target_at(epoch), plan.gain_at(epoch), plan.progress_at(epoch), lr]


def plan_fields(keeper: Optional[PlanKeeper], epoch: int, training) -> dict:
    """A metrics record's view of the plan (readers show goodput and the ETA from it)."""
    if keeper is None:
        return {}
    plan = keeper.plan
    return dict(lr_gain=plan.gain_at(epoch), progress_steps=plan.progress_at(epoch),
                base_batch_size=training.base_batch, total_steps=training.total_steps)


def follows_a_plan(training) -> bool:
    """Whether a run needs a plan keeper: its target or its learning rate follows the swarm's noise scale."""
    return training.auto_target.enabled or training.lr_scaling == "adascale"

