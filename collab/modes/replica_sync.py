"""Whether this peer's replica is the swarm's, and which epoch its progress record may claim meanwhile.

A sync-mode peer whose gradient round failed steps on its own gradients (collab.modes.sync): its replica is then one
update away from the swarm's. Until that is repaired, by a download (or, when no peer could give its state, by a
state-averaging round that gathered the whole swarm of the time), it publishes the epoch before (`held_epoch`), with no
samples: a peer that downloads state must not pick it as a donor over one that made the swarm's step, and a leaving
peer waits to be its donor. A re-sync (download) is tried once per own step, not at every step after it.

Why a state round is only the last resort: hivemind's state rounds average the parameters, not the optimizer's
statistics (LAMB's moments). After one, this replica's parameters are the swarm's, but its moments still hold the
own step (and miss the swarm's), so its next step on the same averaged gradients differs. In a 3-peer CI run a slow
peer "repaired" so stepped apart from its groupmate, the next state round pulled that one along, and both ended
3.8e-2 from the third peer, which had made every step on the swarm's averages. A download brings both.

The states and their transitions, each a method here (the optimizer applies their effects on hivemind: its records
and its state-sharing priority):

    in sync --stepped_alone--> own step, held --start_resync--> (re-sync tried)
    own step, held --stop_holding--> own step, not held     (a re-sync found no donor: the record says the truth again)
    own step --renumbered--> own step                       (a lineage split healed: epochs counted one higher)
    own step --back_in_sync--> in sync                      (a download; alone now; or, after a re-sync found no
                                                             donor, a whole-swarm state round: repaired_by)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass
class OwnStep:
    """A step this peer made on its own gradients while others were in the swarm."""

    epoch: int  # the epoch the step led to
    peers: int  # peers in the swarm then: a state-averaging round must gather as many to undo it
    at: float  # time.monotonic() when it was made


class ReplicaSync:
    """The replica's sync state (see the module). Pure bookkeeping: no hivemind, no I/O."""

    def __init__(self):
        self.own_step: Optional[OwnStep] = None  # the replica's last step was its own, not the swarm's
        self.held_epoch: Optional[int] = None  # the most its progress record may claim; None: its own epoch
        self._resync_tried: Optional[OwnStep] = None  # the own step a re-sync was last tried for

    @property
    def in_sync(self) -> bool:
        return self.own_step is None

    def repaired_by(self, gathered_since: Callable[[int], int]) -> bool:
        """Whether, a re-sync having found no donor, a state-averaging round since the own step gathered the whole
        swarm of that time (every replica in it, this one included, then holds the same parameters: the best there
        is without a donor, though the optimizer's statistics stay each peer's own; see the module).
        `gathered_since(epoch)`: the most peers a round after `epoch` gathered
        (collab.averaging.replica.RecordingStateAverager)."""
        # (an own step whose hold was released: only a re-sync that found no donor releases it, stop_holding)
        return (self.own_step is not None and self.held_epoch is None
                and gathered_since(self.own_step.epoch) >= self.own_step.peers)

    def stepped_alone(self, epoch: int, peers: int, at: float) -> None:
        """This peer's step to `epoch` was on its own gradients, with `peers` in the swarm."""
        self.own_step = OwnStep(epoch=epoch, peers=peers, at=at)
        self.held_epoch = epoch - 1

    def own_step_to(self, epoch: int) -> bool:
        """Whether this replica's step to `epoch` was its own."""
        return self.own_step is not None and self.own_step.epoch == epoch

    def renumbered(self, by: int) -> None:
        """A lineage split healed: this peer takes its groupmates' epoch numbering, `by` epochs higher. An own
        step counts in the new numbering; a hold moves with it (not one a failed re-sync already released)."""
        if self.own_step is None:
            return
        self.own_step.epoch += by
        if self.held_epoch is not None:
            self.held_epoch = self.own_step.epoch - 1

    @property
    def wants_resync(self) -> bool:
        """Out of sync, and no re-sync tried yet for this own step."""
        return self.own_step is not None and self._resync_tried is not self.own_step

    def start_resync(self) -> None:
        self._resync_tried = self.own_step

    def stop_holding(self) -> bool:
        """A re-sync found no donor: the record goes back to this replica's own epoch and samples (held, they
        count for nothing, and a swarm whose peers have each stepped alone once would never end an epoch again). The
        replica is still not the swarm's. Whether a hold was released."""
        released, self.held_epoch = self.held_epoch is not None, None
        return released

    def back_in_sync(self) -> bool:
        """The replica is the swarm's again. Whether it was out of sync."""
        if self.own_step is None:
            return False
        self.own_step, self.held_epoch = None, None
        return True
