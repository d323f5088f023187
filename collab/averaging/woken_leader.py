"""A planned leader woken by its followers: asked to lead its epoch's round before it searches, it begins at once.

A peer begins its gradient round when its own reads of the swarm's progress say the epoch ends soon (hivemind's
pre-scheduling). At 32 peers on 2 cores those reads landed a median 1.2 s after they were due, a tenth over 4 s: in a
late round the planned leader (collab.averaging.planned_leader) learned of its epoch's end 3-5 s after the first of
its followers, past their plan windows, and the round split. But the followers' asks reach it the moment the first of
them begins: a join request under the key of this peer's own epoch, while it is not searching, says just that.

The averager's process notes the newest epoch it was asked to lead (`_asked`, a value shared with the trainer's
process, made before the averager forks); the trainer's process begins its round at its next micro-batch when that
epoch is its own (collab.modes.sync). An untrusted peer can only make this peer begin its search early, once an
epoch (the epoch must be the trainer's own; a search that grows stale before the step is renewed, as any).

The asker is told so (NOT_DECLARED: "my search is yet to begin", where hivemind says NOT_LOOKING_FOR_GROUP, which
also means "my round is over") and asks on past its plan's window
(collab.hivemind_hooks.matchmaking.follow_a_plan). At 64 peers on 2 cores the planned leader began its search 8 s after
the first of its followers; their 3-s plans had ended, and the round split into 10 groups, none of them a majority.
"""

from __future__ import annotations

import multiprocessing
import re
from typing import Optional

from collab.averaging.round_plans import epoch_prefix

MOST_DIGITS = 12  # an epoch in a group key: beyond this, not a round of this run
COMING_EPOCHS = 2  # a peer that searched for epoch E's round is coming to lead epochs E + 1 to E + this (one missed)


class WokenByAsks:
    """A CheckedRounds mixin (beside round_plans.PlansRounds, whose `_run_prefix` and `_searched_epoch` it reads): call
    `listen_for_asks()` before hivemind's constructor forks the averager process."""

    _asked = None  # multiprocessing.RawValue("q"): the newest epoch whose round a peer asked this one to lead, or -1

    def listen_for_asks(self) -> None:
        self._asked = multiprocessing.RawValue("q", -1)

    def asked_to_lead(self) -> Optional[int]:
        """(the trainer's process) The newest epoch whose round another peer asked this one to lead before it
        searched; None: none yet."""
        return None if self._asked is None or self._asked.value < 0 else int(self._asked.value)

    def _note_ask(self, group_key: str) -> bool:
        """(the averager's process) A join request came under `group_key`: noted if this peer was not searching and
        the key's epoch is one it has yet to search for. Whether it was: the asker is told that this peer's search
        is yet to begin (NOT_DECLARED, collab.averaging.robust_rounds), and asks on (matchmaking.follow_a_plan)."""
        matchmaking = getattr(self, "_matchmaking", None)
        if self._asked is None or matchmaking is None or matchmaking.is_looking_for_group:
            return False
        epoch, searched = epoch_of_key(group_key, self._run_prefix(matchmaking)), self._searched_epoch
        # (a far epoch is no round of this peer's: noted, a forged one would stop every later wake)
        if epoch is None or epoch <= searched or (searched >= 0 and epoch > searched + COMING_EPOCHS):
            return False
        if epoch > self._asked.value:
            self._asked.value = epoch
        return True


def epoch_of_key(group_key, run_prefix: str) -> Optional[int]:
    """The epoch of a gradient round's group key (collab.averaging.round_plans.epoch_prefix, then hivemind's .0bBITS),
    or None for any other string."""
    if not isinstance(group_key, str):
        return None
    pattern = re.escape(epoch_prefix(run_prefix, "")) + r"(\d{1,%d})\.0b[01]*" % MOST_DIGITS
    match = re.fullmatch(pattern, group_key)
    return int(match.group(1)) if match else None
