"""collab's gradient averagers: hivemind's GradientAverager (and its PowerSGD variant), members-only in a private
run (collab.run.gate), with checked rounds (collab.averaging.robust_rounds), and this peer's own gradients kept until
the round's outcome is known.

hivemind zeroes the accumulators when a round starts (GradientAverager.step(reset_accumulators=True)), and its
all-reduce overwrites the averaged buffers in place, so after a failed round its "proceed with local gradients"
loaded zeros: a step of momentum and weight decay alone. Here the gradients this peer sent are copied when they
are loaded for the round, and a failed round steps on that copy (collab.modes.sync).
"""

from __future__ import annotations

from typing import Optional

import torch
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager

from collab.averaging.aggregation import Aggregation
from collab.averaging.bounded_start import StartsWithin
from collab.averaging.dgc import DGCMemory, DGCSettings
from collab.averaging.members_only import MembersOnly
from collab.averaging.robust_rounds import CheckedRounds
from collab.averaging.round_replay import ServedRounds
from collab.run.gate import MemberGate


class SummedMicroBatches:
    """A GradientAverager mixin: the trainer hands over a window of micro-batches at once (collab.train.window), their
    gradients summed in .grad and their samples as the batch size: they count as that many micro-batches, each of
    the micro-batch's size (hivemind counts one per call, and weighs a call by its size against the first's; so does
    an averager built without a micro-batch size)."""

    def __init__(self, *args, micro_batch_size: Optional[int] = None, **kwargs):
        self.micro_batch_size = micro_batch_size
        super().__init__(*args, **kwargs)

    @torch.no_grad()
    def accumulate_grads_(self, batch_size: int) -> None:
        if self.micro_batch_size is None:
            return super().accumulate_grads_(batch_size)
        self.local_samples_accumulated += batch_size
        self.local_times_accumulated += max(1, round(batch_size / self.micro_batch_size))
        if not self.reuse_grad_buffers:  # else .grad is the accumulator itself, summed by the trainer
            for grad_buf, grad_acc in zip(self._grads_from_parameters(), self._grad_accumulators()):
                grad_acc.add_(grad_buf.to(grad_acc.device))


class EpochGroups:
    """A GradientAverager mixin: a round groups only peers at one epoch. hivemind keys every round of a run alike,
    so a peer that reached an epoch's end late joined the next epoch's round of the others: 12 linreg peers, one
    of them 0.3 s late for the first round (it went on with 11), averaged its epoch-0 gradients into the others'
    epoch-1 round, and its replica stayed 2% from theirs to the end. Each round carries the epoch it ends
    (hivemind's gathered data), and the averager process matches it under that epoch's key
    (collab.averaging.robust_rounds); a late peer finds no group and re-syncs, as after any failed round."""

    epoch = 0  # the epoch this peer's next round ends; kept current by collab.modes.sync.CollabOptimizer

    def schedule_step(self, *args, **kwargs):
        kwargs.setdefault("gather", self.epoch)
        return super().schedule_step(*args, **kwargs)


class SharesNoState:
    """A GradientAverager mixin, placed just before hivemind's class: the averager is no donor of state. Nobody
    downloads a gradient averager's "state" (collab.modes.base downloads the training state only; hivemind's own
    catch-up fetched another peer's accumulators and threw them away), yet hivemind declares every averager a donor
    under `{prefix}.all_averagers` at its start and again after each round: a DHT store, to several nodes, per peer
    and round for nothing. In a 12-peer linreg swarm on 2 cores that was 13% of each peer's DHT
    requests (docs/benchmarks.md). Not declared, and a download asked of it gets nothing."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "allow_state_sharing": False})


class OwnGradients:
    """A GradientAverager mixin: a copy of what this peer sent into its round, for a step if the round fails."""

    _own_gradients: Optional[list[torch.Tensor]] = None

    @torch.no_grad()
    def load_accumulators_into_averager_(self):
        super().load_accumulators_into_averager_()
        with self.get_tensors() as averaged:
            self._own_gradients = [t.clone() for t in averaged]

    def take_own_gradients(self) -> Optional[list[torch.Tensor]]:
        """The gradients this peer sent into its last round (None if they were used already)."""
        own, self._own_gradients = self._own_gradients, None
        return own

    @torch.no_grad()
    def restore_own_gradients_(self, own: list[torch.Tensor]) -> None:
        with self.get_tensors() as averaged:
            for buffer, tensor in zip(averaged, own):
                buffer.copy_(tensor)


class DGCSelection:
    """A GradientAverager mixin: what is loaded for a round is DGC's selection (collab.averaging.dgc), not the gradient.
    Placed after OwnGradients, so the copy a failed round steps on is what this peer sent."""

    dgc: Optional[DGCMemory] = None
    round_epoch, round_peers = 0, 1  # set by the optimizer before each round (set_round_context)

    def set_round_context(self, epoch: int, peers: int) -> None:
        self.round_epoch, self.round_peers = epoch, peers

    @torch.no_grad()
    def load_accumulators_into_averager_(self):
        super().load_accumulators_into_averager_()
        with self.get_tensors() as averaged:
            self.dgc.compress_(averaged, self.round_epoch, self.round_peers)


class CollabGradientAverager(StartsWithin, MembersOnly, CheckedRounds, EpochGroups, OwnGradients, ServedRounds,
                             SummedMicroBatches, SharesNoState, GradientAverager):
    def __init__(self, parameters, *args, gate: Optional[MemberGate] = None, rule: Aggregation = Aggregation(),
                 findings=None, traffic=None, replays: bool = True, **kwargs):
        # before hivemind's constructor starts the averager process, which takes a copy
        self.gate, self.rule, self.kind, self.findings, self.traffic = gate, rule, "gradients", findings, traffic
        self.listen_for_asks()  # (collab.averaging.woken_leader)
        parameters = list(parameters)
        self.prepare_served_round(parameters, replays)
        super().__init__(parameters, *args, **kwargs)


class CollabPowerSGDAverager(StartsWithin, MembersOnly, CheckedRounds, EpochGroups, OwnGradients, SummedMicroBatches,
                             SharesNoState, PowerSGDGradientAverager):
    """PowerSGD (Vogels et al. 2019) as hivemind implements it, with two changes.

    Its starting projections Q are drawn from `seed` (the run's): hivemind draws them unseeded, so each peer
    started from its own. A round's result is P P^T (mean of the groupmates' M) for the group's common,
    orthogonalised P whatever Qs went in, and Q is all-reduced, so a group shares one Q after its round; equal
    starts make the first rounds the same on every peer and a run reproducible from its seed.

    Its error feedback (the part of each gradient the factorisation has not sent yet, kept in shared memory) is
    restored when a round fails: the trainer then steps on this peer's own gradients, and the same gradient left
    in the feedback would be sent again in the next round and applied twice.
    """
    measures_noise = False  # (collab.adaptive.noise_scale) its rounds carry no whole gradients

    def __init__(self, parameters, averager_rank: int, *, seed: int, gate: Optional[MemberGate] = None,
                 rule: Aggregation = Aggregation(), findings=None, traffic=None, **kwargs):
        self.gate, self.rule, self.kind, self.findings, self.traffic = gate, rule, "gradients", findings, traffic
        self.listen_for_asks()  # (collab.averaging.woken_leader)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            super().__init__(parameters, averager_rank, **kwargs)
        self._feedback_before: Optional[list[torch.Tensor]] = None

    def _values_per_round(self) -> int:
        # P (rows x rank) for each factorised matrix, then Q (columns x rank) and the vectors sent whole
        factors = sum(m.numel() // q.shape[0] * q.shape[1] + q.numel() for m, q in zip(self._ms, self._qs))
        whole = sum(t.numel() for i, t in enumerate(self._averaged_tensors) if i in self._uncompressed_gradients_indexes)
        return factors + whole

    @torch.no_grad()
    def load_accumulators_into_averager_(self):
        super().load_accumulators_into_averager_()
        self._feedback_before = [m.clone() for m in self._ms]

    @torch.no_grad()
    def restore_own_gradients_(self, own: list[torch.Tensor]) -> None:
        super().restore_own_gradients_(own)
        if self._feedback_before is not None:
            for m, before in zip(self._ms, self._feedback_before):
                m.copy_(before)
        self._feedback_before = None


class CollabDGCAverager(StartsWithin, MembersOnly, CheckedRounds, EpochGroups, OwnGradients, DGCSelection,
                        SummedMicroBatches, SharesNoState, GradientAverager):
    """Deep Gradient Compression (collab.averaging.dgc); its sparse parts travel losslessly
    (collab.averaging.compression.SparseParts)."""
    measures_noise = False  # (collab.adaptive.noise_scale) its rounds carry no whole gradients

    def __init__(self, *args, settings: DGCSettings, seed: int, gate: Optional[MemberGate] = None,
                 rule: Aggregation = Aggregation(), findings=None, traffic=None, **kwargs):
        self.gate, self.rule, self.kind, self.findings, self.traffic = gate, rule, "gradients", findings, traffic
        self.listen_for_asks()  # (collab.averaging.woken_leader)
        super().__init__(*args, **kwargs)
        with self.get_tensors() as averaged:
            self.dgc = DGCMemory(averaged, settings, seed)
