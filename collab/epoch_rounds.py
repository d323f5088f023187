"""Gradient rounds matched by epoch: a peer averages only with peers making the same epoch's step.

hivemind matches gradient rounds under one DHT key for the whole run, and its optimizer treats a
peer one epoch behind the swarm as "ready" at once. Such a peer starts a round immediately, sits in
matchmaking until the others start their next round, joins it, and steps to the epoch they just
left - and again every epoch, so it never looks out of sync (its exact-epoch check runs only after
a progress fetch, and the next round has begun by then). A CI run ended so: two peers one update
behind the other two, their last round ("epoch 5") a group of 2 after the others stopped at 6.

Here the matchmaking key names the epoch. A peer behind finds nobody at its epoch, its step is
recorded as its own (collab.replica), and it is re-synced by a download or the next state round.
The epoch goes in the key's prefix, not in its bits: hivemind rewrites the bits whenever a group
assembles, which can happen after the next epoch's key was set.
"""

from __future__ import annotations

from hivemind.optim.grad_averager import GradientAverager


class EpochKeyedGradientAverager(GradientAverager):
    """hivemind's GradientAverager whose matchmaking key carries the epoch of the round it is for."""

    def set_round_epoch(self, epoch: int) -> None:
        """Key the next search to `epoch`. Commands reach the averager process in order, so a step sent
        after this call searches under the new key."""
        self._outer_pipe.send(("_set_round_epoch", [], dict(epoch=epoch)))

    async def _set_round_epoch(self, epoch: int) -> None:
        manager = self._matchmaking.group_key_manager
        if not hasattr(self, "_unkeyed_prefix"):
            self._unkeyed_prefix = manager.prefix
        manager.prefix = f"{self._unkeyed_prefix}_epoch{epoch}"  # no dots: hivemind's group-key pattern
