"""A peer never sends what it should not: a micro-batch whose loss or gradients are not finite is dropped
before the optimizer counts it (not accumulated, not counted toward the swarm's target, not averaged).

The checks run on the device (collab.train.window); the guard counts their outcomes when the trainer reads them.
One NaN in a peer's accumulated gradient used to reach the all-reduce, where it made every groupmate's
average NaN and the whole round fail for everyone. Dropping it here costs one micro-batch. Many drops in a
row mean the replica itself is broken (NaN weights after a bad step, a corrupted checkpoint): then the
trainer reloads the swarm's state.
"""

from __future__ import annotations

import time

RELOAD_AFTER = 8  # non-finite micro-batches in a row before the replica is reloaded from the swarm


class BatchGuard:
    """Counts the micro-batches dropped, and why, from their device checks (collab.train.window.Outcome)."""

    def __init__(self):
        self.dropped: dict[str, int] = {}  # reason -> micro-batches dropped
        self.in_a_row = 0

    @property
    def total_dropped(self) -> int:
        return sum(self.dropped.values())

    def count(self, loss_finite: bool, gradients_finite: bool) -> bool:
        """Whether the micro-batch is good; a bad one is counted under its first failed check (a non-finite loss
        spoils its gradients too: it is one reason, not two)."""
        if loss_finite and gradients_finite:
            self.in_a_row = 0
            return True
        reason = "loss not finite" if not loss_finite else "gradients not finite"
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        self.in_a_row += 1
        return False

    def replica_is_broken(self) -> bool:
        return self.in_a_row >= RELOAD_AFTER

    def reload_replica(self, opt, summary, display) -> None:
        """Micro-batch after micro-batch gave NaN or inf: the replica itself is broken (its weights, or a corrupted
        checkpoint it resumed from). The swarm's state replaces it; alone, there is nothing to reload from.
        `opt`: the peer's averaging mode (collab.modes); `summary` and `display`: the trainer's."""
        why = ", ".join(f"{n} {reason}" for reason, n in self.dropped.items())
        display.message(f"{RELOAD_AFTER} micro-batches in a row were dropped ({why} so far): this replica is "
                        "broken; reloading the swarm's state")
        summary.reloads += 1
        self.in_a_row = 0
        if not opt.load_state_from_peers(deadline=time.monotonic() + opt.load_state_timeout):
            display.message("No peer gave its state: training on with this replica")
