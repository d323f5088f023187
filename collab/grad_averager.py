"""collab's gradient averager: hivemind's GradientAverager, members-only in a private run (collab.run.gate),
with checked rounds (collab.robust_rounds), and this peer's own gradients kept until the round's outcome is known.

hivemind zeroes the accumulators when a round starts (GradientAverager.step(reset_accumulators=True)), and its
all-reduce overwrites the averaged buffers in place, so after a failed round its "proceed with local gradients"
loaded zeros: a step of momentum and weight decay alone. Here the gradients this peer sent are copied when they
are loaded for the round, and a failed round steps on that copy (collab.optim).
"""

from __future__ import annotations

from typing import Optional

import torch
from hivemind.optim.grad_averager import GradientAverager

from collab.aggregation import Aggregation
from collab.robust_rounds import CheckedRounds
from collab.run.gate import MemberGate, MembersOnly


class CollabGradientAverager(MembersOnly, CheckedRounds, GradientAverager):
    def __init__(self, *args, gate: Optional[MemberGate] = None, rule: Aggregation = Aggregation(), findings=None,
                 **kwargs):
        # before hivemind's constructor starts the averager process, which takes a copy
        self.gate, self.rule, self.kind, self.findings = gate, rule, "gradients", findings
        self._own_gradients: Optional[list[torch.Tensor]] = None
        super().__init__(*args, **kwargs)

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
