"""The run's batch plan: the target batch and AdaScale's learning-rate gain for every epoch, the same on every peer.

`training.target_batch_size: auto` lets the target follow the gradient noise scale B_noise the swarm measures
(collab.adaptive.noise_scale): training far below B_noise wastes steps, far above it wastes samples.
`training.lr_scaling: adascale` multiplies the learning rate by AdaScale's gain (Johnson et al. 2020)

    r = (B_noise / B0 + 1) / (B_noise / T + 1)      (= (var + sqr) / (var / S + sqr), S = T / B0)

for target T and base batch B0 (the batch the schedule was tuned at), and runs the schedule on scale-invariant
progress: an epoch advances it by r, not by 1, so a bigger target or a smaller swarm does not change what a
step of the schedule means. Under LAMB or LARS the gain multiplies the global learning rate, which their
layer-wise trust ratios then scale per layer: every layer's step grows by r, as plain SGD's would.

Peers must agree: two peers on different targets end their epochs at different times, and different gains
give different replicas. Each peer's own estimate differs (it measures the rounds it reduced), so nobody
decides alone. The organizer's peer (it holds the run's key) reads the pooled estimate from the peers' signed
records, and issues a plan signed with the run's key, for an epoch far enough ahead (>= 2 epochs and >= 4 s: four
of the peers' 1-s reads) that every peer has read it before it starts (a peer that reads one late counts it). Every peer re-publishes the newest plan it holds, so the plan
outlives the organizer's peer; without the organizer the run keeps its last plan. A plan also carries the
target and gain in force before it, so a peer that joins while one is pending knows both.

The target changes at most once per `auto_target.every_epochs` epochs, by at most 2x, and not for less than
25% (a noisy estimate must not make the target flap); the gain changes when it moves by 5% or more.
"""

from __future__ import annotations

import math
import time
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from collab.adaptive.noise_scale import adascale_gain
from collab.run.access import _payload, newest_signed, signature_holds, signed_record

PLAN_SUFFIX = "_plan"
# the least time between issuing a plan and its first epoch: every peer reads it first (collab.train.plan_keeper reads
# every second). Not much more: under 1-s epochs a lead of 10 s brings AdaScale's gain 10 epochs after the estimate
LEAD_SECONDS = 4.0
MIN_LEAD_EPOCHS = 2
MAX_CHANGE = 2.0
HYSTERESIS = 1.25
GAIN_CHANGE = 0.05
MIN_NOISE_ROUNDS = 3  # rounds behind the pooled estimate before the plan follows it


class BatchPlan(BaseModel):
    """From `from_epoch` on: target `target` and gain `gain`, the schedule at `progress` scale-invariant steps
    when `from_epoch` starts; before it, `before_target` and `before_gain`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str = Field(max_length=64)
    from_epoch: int = Field(ge=0, le=10**9)
    target: int = Field(gt=0, le=10**9)
    gain: float = Field(ge=1, le=1e6)
    progress: float = Field(ge=0, le=1e12)
    before_target: int = Field(gt=0, le=10**9)
    before_gain: float = Field(ge=1, le=1e6)
    changed_at: int = Field(ge=0, le=10**9, description="the epoch the target last changed")
    b_noise: Optional[float] = Field(None, ge=0, le=1e12, description="the pooled estimate it was planned on")
    issued_at: float = Field(ge=0)
    signature: str = ""

    def target_at(self, epoch: int) -> int:
        return self.target if epoch >= self.from_epoch else self.before_target

    def gain_at(self, epoch: float) -> float:
        return self.gain if epoch >= self.from_epoch else self.before_gain

    def progress_at(self, epoch: float) -> float:
        """Scale-invariant steps done when `epoch` starts (the schedule's position)."""
        return max(0.0, self.progress + self.gain_at(epoch) * (epoch - self.from_epoch))

    def payload(self) -> bytes:
        return _payload("collab-batch-plan", **self.model_dump(exclude={"signature"}))

    def signed(self, organizer_key) -> "BatchPlan":
        return signed_record(self, organizer_key)

    def valid_for(self, run_id: str, organizer_key: str) -> bool:
        return self.run_id == run_id and signature_holds(organizer_key, self.payload(), self.signature)


def first_plan(run_id: str, training) -> BatchPlan:
    """What every peer follows before the organizer issued anything: the config's target, no gain."""
    target = training.target_batch_size
    return BatchPlan(run_id=run_id, from_epoch=0, target=target, gain=1.0, progress=0.0, before_target=target,
                     before_gain=1.0, changed_at=0, issued_at=0.0)


def adascale_gain_for(b_noise: float, base: int, target: int) -> float:
    """AdaScale's gain at target `target` over base batch `base`, from B_noise = tr(Sigma) / |G|^2."""
    return adascale_gain(noise=b_noise / base, signal=1.0, scale=max(1.0, target / base))


def efficiency(b_noise: float, base: int, target: int) -> float:
    """Pollux's statistical efficiency of target `target` against `base`: gain / scale, in (0, 1]; what a sample
    at this target is worth in progress, against one at the base batch."""
    return (b_noise + base) / (b_noise + max(target, base))


def next_plan(plan: BatchPlan, epoch: int, b_noise: Optional[float], training, seconds_per_epoch: Optional[float],
              now: Optional[float] = None) -> Optional[BatchPlan]:
    """The organizer's next plan at `epoch` (unsigned), or None when nothing should change. `training`:
    collab.config.TrainingConfig."""
    if plan.from_epoch > epoch or b_noise is None or not math.isfinite(b_noise) or b_noise <= 0:
        return None  # one plan pending at a time; nothing measured, nothing to follow
    auto = training.auto_target
    target = plan.target_at(epoch)
    new_target = target
    if auto.enabled and epoch - plan.changed_at >= auto.every_epochs:
        wanted = min(max(b_noise, auto.min, target / MAX_CHANGE), auto.max, target * MAX_CHANGE)
        if max(wanted / target, target / wanted) >= HYSTERESIS:
            micro = training.micro_batch_size  # whole micro-batches, within the bounds
            new_target = min(auto.max, max(auto.min, int(round(wanted / micro)) * micro))
    gain = plan.gain_at(epoch)
    if training.lr_scaling == "adascale":
        gain = adascale_gain_for(b_noise, training.base_batch, new_target)
    if new_target == target and abs(gain - plan.gain_at(epoch)) < GAIN_CHANGE * plan.gain_at(epoch):
        return None
    lead = MIN_LEAD_EPOCHS
    if seconds_per_epoch is not None and seconds_per_epoch > 0:
        lead = max(lead, math.ceil(LEAD_SECONDS / seconds_per_epoch))
    start = epoch + lead
    return BatchPlan(run_id=plan.run_id, from_epoch=start, target=new_target, gain=gain,
                     progress=plan.progress_at(start), before_target=plan.target_at(start - 1),
                     before_gain=plan.gain_at(start - 1), changed_at=start if new_target != target else plan.changed_at,
                     b_noise=float(b_noise), issued_at=time.time() if now is None else now)


def newest_plan(entries, run_id: str, organizer_key: str, rejected=None) -> Optional[BatchPlan]:
    """The newest plan signed with the run's key among (signer, blob) DHT entries; others (forged, malformed,
    another run's) are counted in `rejected` (collab.records.untrusted.Rejections) when given."""
    return newest_signed(BatchPlan, entries, run_id, organizer_key, 4096, rejected)
