"""averaging.mode diloco: DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of
Language Models"), elastic, on the same hivemind machinery as the sync mode.

Each peer trains its replica with its own inner optimizer (AdamW), one step per micro-batch, in its own data
order. The swarm counts samples as in the sync mode; when it has trained `training.target_batch_size` samples
since the last outer step, every peer sends its pseudo-gradient - the outer parameters (where the replicas all
started this outer step) minus its replica now - into one all-reduce, weighted by the samples it trained. The
average is the outer gradient: a Nesterov SGD step (OpenDiLoCo's lr 0.7, momentum 0.9) on the outer parameters,
the same on every replica, and each replica starts the next inner loop from the result.

What this borrows from the sync mode, and why it makes DiLoCo elastic where OpenDiLoCo is not:
- the outer parameters and the outer optimizer are hivemind's offloaded optimizer (fp32, on the CPU): a peer
  that joins downloads them (and the outer momentum) like any state, and trains toward the current outer step;
- the outer step closes on the swarm's samples, not on a count of workers: a peer that leaves or is killed mid-
  inner-loop only takes its own samples away, and one that joins adds its own;
- the all-reduce is the sync mode's: the configured codec, client-mode (NAT'd) peers, the robust aggregation
  and members-only rules, and the fallback when a round fails (an outer step on this peer's own pseudo-gradient,
  recorded as an own step and repaired by the next state round or download).
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial
from typing import Callable, Optional

import torch

from hivemind.optim.grad_averager import GradientAverager

from collab.averaging.aggregation import Aggregation
from collab.averaging.bounded_start import StartsWithin
from collab.averaging.grad_averager import OwnGradients, SharesNoState
from collab.averaging.members_only import MembersOnly
from collab.averaging.robust_rounds import CheckedRounds
from collab.modes import ModeContext, ModeReport
from collab.modes.sync import CollabOptimizer
from collab.run.gate import MemberGate


class PseudoGradients:
    """A GradientAverager mixin: a round averages outer parameters minus the replica, not accumulated gradients.
    The micro-batches only count toward this peer's weight (its samples); their gradients are the inner
    optimizer's. Placed after OwnGradients, so the copy a failed round steps on is this pseudo-gradient."""

    outer_parameters: Optional[list[torch.Tensor]] = None  # set by DiLoCoOptimizer once hivemind made them
    probe_seed = 0
    last_norm: Optional[float] = None
    last_weight = 0
    last_probe: Optional[float] = None

    epoch = 0  # this peer's outer step, sent along with every round (DiLoCoOptimizer keeps it current)

    def schedule_step(self, *args, **kwargs):
        # each member says its outer step and where its outer parameters are (a projection): members at one
        # outer step hold the same ones, to fp32 rounding
        kwargs.setdefault("gather", [self.epoch, _probe(self.outer_parameters, self.probe_seed + 1)])
        return super().schedule_step(*args, **kwargs)

    @torch.no_grad()
    def accumulate_grads_(self, batch_size: int) -> None:
        self.local_samples_accumulated += batch_size
        self.local_times_accumulated += 1

    @torch.no_grad()
    def load_accumulators_into_averager_(self) -> None:
        squares = 0.0
        with self.get_tensors() as averaged:
            for outer, replica, slot in zip(self.outer_parameters, self.parameters, averaged):
                delta = outer.detach() - replica.detach().to(outer.device, torch.float32)
                squares += float(delta.pow(2).sum())
                slot.copy_(delta)
            self.last_probe = _probe(averaged, self.probe_seed)
        self.last_norm, self.last_weight = squares ** 0.5, self.local_samples_accumulated

    @torch.no_grad()
    def reset_accumulated_grads_(self) -> None:
        self._accumulators_used_in_step = False
        self.local_samples_accumulated = self.local_times_accumulated = 0
        self._anchor_batch_size = None


class PseudoGradientAverager(StartsWithin, MembersOnly, CheckedRounds, OwnGradients, PseudoGradients, SharesNoState,
                             GradientAverager):
    measures_noise = False  # (collab.adaptive.noise_scale) a pseudo-gradient is no per-sample mean gradient
    def __init__(self, *args, gate: Optional[MemberGate] = None, rule: Aggregation = Aggregation(), findings=None,
                 traffic=None, target_batch_size: int = 1, **kwargs):
        # as CollabGradientAverager: before hivemind's constructor starts the averager process
        self.gate, self.rule, self.kind, self.findings, self.traffic = gate, rule, "gradients", findings, traffic
        self.target_batch_size = target_batch_size
        super().__init__(*args, **kwargs)

    def _own_norm_scale(self, weight) -> float:
        # a pseudo-gradient grows with the inner steps taken (at most linearly): a peer that joined with one micro-
        # batch to go holds a part many times shorter than the average, and would refuse an honest round as
        # "implausible" unless it scaled its own by the steps the swarm took
        return max(1.0, self.target_batch_size / weight) if weight and weight > 0 else 1.0


class DiLoCoOptimizer(CollabOptimizer):
    """The trainer's loop calls step() after each micro-batch, as in the sync mode: here that is an inner step,
    and, when the swarm's samples reach the target, the outer step."""

    sums_micro_batches = False  # each micro-batch is an inner step

    def __init__(self, *, inner: Callable[[], torch.optim.Optimizer], max_grad_norm: float, seed: int, **kwargs):
        self.seed = seed
        super().__init__(**kwargs)
        self.inner, self.max_grad_norm = inner(), max_grad_norm
        self.inner_steps = 0  # this outer step's, on this peer
        self._applied: Optional[float] = None  # the probe of the outer gradient loaded for the coming outer step
        # outer step -> {"norm": of this peer's pseudo-gradient, "weight": its samples, "probe": its projection on
        # a direction drawn from the run's seed, "applied": the projection of the outer gradient it applied}.
        # Projections are linear: a swarm whose average was exact has applied == sum(weight * probe) / sum(weight)
        self.outer_steps: dict[int, dict] = {}
        self.grad_averager.outer_parameters = [p for group in self.state_averager.optimizer.param_groups
                                               for p in group["params"]]
        self.grad_averager.probe_seed = seed
        # an outer step moves the parameters ~H inner steps' worth (a 2-step-old replica was 1.4x its norm away
        # from an honest donor's): only a donor at this peer's own outer step must be near it. The norm and
        # finiteness checks still hold for every donor
        self.state_averager.near_epochs = 0

    def step(self, *args, **kwargs):
        self.grad_averager.epoch = self.local_epoch
        torch.nn.utils.clip_grad_norm_(self.grad_averager.parameters, self.max_grad_norm)
        self.inner.step()
        self.inner.zero_grad(set_to_none=True)
        self.inner_steps += 1
        epoch, downloads = self.local_epoch, self.downloads
        result = super().step(*args, **kwargs)
        if self.local_epoch != epoch and self.downloads != downloads:
            # no outer step of this peer's: hivemind's catch-up replaced the replica with a donor's
            self.outer_steps[self.local_epoch - 1] = dict(downloaded=True)
            self.inner_steps, self._applied = 0, None
        elif self.local_epoch != epoch:
            averager = self.grad_averager
            # alone, hivemind loads the pseudo-gradient without a round: the outer gradient is this peer's own
            applied = self._applied if self._applied is not None else averager.last_probe
            # under the group's number, if this peer took it (_wait_for_round)
            self.outer_steps[self.local_epoch - 1] = dict(norm=averager.last_norm, weight=averager.last_weight,
                                                          probe=averager.last_probe, applied=applied)
            self.inner_steps, self._applied = 0, None
        return result

    def _wait_for_round(self, control):
        """A peer that joined late can count one outer step fewer than its groupmates (it downloaded the state just
        before their step) while averaging with them: the same outer steps under another number. The sync mode
        learns this from state rounds, which diloco runs rarely; here every round says each member's outer step,
        and this peer takes the group's (bounded by the swarm's epoch as the progress records show it, so a
        groupmate cannot make it skip ahead)."""
        group = super()._wait_for_round(control)
        claims = [_claim(gathered) for gathered in group.values()]
        ahead = min(max((epoch for epoch, _ in claims if epoch is not None), default=self.local_epoch),
                    self.tracker.global_epoch)
        if ahead > self.local_epoch:
            ours = _probe(self.grad_averager.outer_parameters, self.seed + 1)
            same = [epoch for epoch, where in claims
                    if where is not None and math.isclose(where, ours, rel_tol=1e-4, abs_tol=1e-6)]
            if ahead in same:
                with self.state_averager.lock_optimizer:
                    self.state_averager.local_epoch = ahead
                self.tracker.report_local_progress(ahead, self.tracker.local_progress.samples_accumulated)
            elif len(same) < 2:  # (itself included) no groupmate holds its outer parameters, and some are ahead
                # it downloaded a donor's state from before the outer step the others made meanwhile (its replica
                # would end one outer step short of theirs). This round's outer step is applied, then the
                # swarm's state downloaded. (With a groupmate beside it, the one ahead is the odd one: a peer
                # that stepped alone)
                self._record_own_step(f"its outer parameters are not its group's (outer step {ahead}): it missed "
                                      "an outer step while it downloaded the state")
        return group

    def load_averaged_gradients(self) -> None:
        super().load_averaged_gradients()  # after a round, or on the fallback to its own
        with self.grad_averager.get_tensors() as outer_gradient:
            self._applied = _probe(outer_gradient, self.seed)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    @property
    def last_pseudo_gradient_norm(self) -> Optional[float]:
        return self.grad_averager.last_norm

    def mode_report(self) -> ModeReport:
        return replace(super().mode_report(), outer_steps=dict(self.outer_steps), inner_steps=self.inner_steps,
                       pseudo_gradient_norm=self.last_pseudo_gradient_norm)


def _claim(gathered) -> tuple[Optional[int], Optional[float]]:
    """(outer step, outer-parameter projection) from what a member gathered; (None, None) for anything else."""
    if isinstance(gathered, (list, tuple)) and len(gathered) == 2 and type(gathered[0]) is int \
            and isinstance(gathered[1], float) and math.isfinite(gathered[1]):
        return gathered[0], gathered[1]
    return None, None


def _probe(tensors, seed: int) -> float:
    """<tensors, r> for a Gaussian r drawn from `seed`, the same on every peer."""
    generator = torch.Generator().manual_seed(seed)
    return float(sum(torch.dot(t.detach().float().flatten().cpu(),
                               torch.randn(t.numel(), generator=generator)) for t in tensors))


def inner_optimizer(config, task) -> Callable[[], torch.optim.Optimizer]:
    """AdamW over the task's parameter groups (its weight-decay split), with an optional linear warm-up."""
    settings, training = config.averaging.diloco, config.training
    lr = settings.inner_lr if settings.inner_lr is not None else training.learning_rate
    warmup = settings.inner_warmup_steps

    return lambda: adamw_with_warmup(task.parameter_groups(), lr, warmup)


def adamw_with_warmup(groups, lr: float, warmup_steps: int) -> torch.optim.Optimizer:
    """AdamW whose learning rate rises linearly over its first `warmup_steps` steps (0: none)."""
    optimizer = torch.optim.AdamW(groups, lr=lr)
    if warmup_steps:
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup_steps))
        optimizer.register_step_post_hook(lambda *_: schedule.step())
    return optimizer


def outer_optimizer(config) -> Callable[[list], torch.optim.Optimizer]:
    settings = config.averaging.diloco
    return lambda groups: torch.optim.SGD(groups, lr=settings.outer_lr, momentum=settings.outer_momentum,
                                          nesterov=True)


def optimizer_options(context: ModeContext) -> dict:
    """What averaging.mode diloco changes (collab.train.make_optimizer): the optimizer hivemind wraps is the outer one
    (no schedule, no weight decay: those are the inner optimizer's), rounds carry pseudo-gradients, and nothing
    overlaps (the outer step replaces the parameters the inner steps work on)."""
    config, task = context.config, context.task
    return dict(
        optimizer_class=DiLoCoOptimizer,
        inner=inner_optimizer(config, task),
        max_grad_norm=config.training.max_grad_norm,
        seed=config.training.seed,
        params=[{"params": [p for p in task.model.parameters() if p.requires_grad]}],
        optimizer=outer_optimizer(config),
        scheduler=None,
        reuse_grad_buffers=True,  # no accumulators: a round's tensors are made from the parameters
        delay_optimizer_step=False,
        delay_grad_averaging=False,
        # hivemind applies a background state round's result at a later step, copying the averaged outer
        # parameters over the replica: the inner steps taken since would be lost (the peer's next pseudo-gradient
        # would be zero, yet carry its samples' weight). The state round runs inside the outer step instead
        delay_state_averaging=False,
        grad_averager_factory=partial(PseudoGradientAverager, gate=context.gate, rule=context.rule,
                                      findings=context.rejections.queue,
                                      target_batch_size=config.training.target_batch_size,
                                      traffic=context.traffic.queue, **context.averager_opts),
    )
