"""A peer never sends what it should not: a micro-batch whose loss or gradients are not finite is dropped
before the optimizer counts it (not accumulated, not counted toward the swarm's target, not averaged).

One NaN in a peer's accumulated gradient used to reach the all-reduce, where it made every groupmate's
average NaN and the whole round fail for everyone. Dropping it here costs one micro-batch. Many drops in a
row mean the replica itself is broken (NaN weights after a bad step, a corrupted checkpoint): then the
trainer reloads the swarm's state.
"""

from __future__ import annotations

from typing import Iterable

import torch

RELOAD_AFTER = 8  # non-finite micro-batches in a row before the replica is reloaded from the swarm


class BatchGuard:
    def __init__(self, parameters: Iterable[torch.nn.Parameter]):
        self.parameters = [p for p in parameters if p.requires_grad]
        self.dropped: dict[str, int] = {}  # reason -> micro-batches dropped
        self.in_a_row = 0

    @property
    def total_dropped(self) -> int:
        return sum(self.dropped.values())

    def loss_ok(self, loss: torch.Tensor) -> bool:
        """Checked before backward: a non-finite loss never reaches the gradients."""
        return self._outcome(bool(torch.isfinite(loss.detach()).all()), "loss not finite", last_check=False)

    def gradients_ok(self) -> bool:
        """Checked after backward: a finite loss can still overflow in the backward pass."""
        grads = [p.grad for p in self.parameters if p.grad is not None]
        finite = not grads or bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all())
        return self._outcome(finite, "gradients not finite")

    def _outcome(self, ok: bool, reason: str, last_check: bool = True) -> bool:
        if ok:
            if last_check:  # the micro-batch passed every check
                self.in_a_row = 0
        else:
            self.dropped[reason] = self.dropped.get(reason, 0) + 1
            self.in_a_row += 1
        return ok

    def replica_is_broken(self) -> bool:
        return self.in_a_row >= RELOAD_AFTER
