"""A sender its reducer left out of a round: the group's average, replayed from a groupmate, instead of a retry.

A reducer leaves a sender out when the sender's parts come too late (hivemind's next_chunk_timeout: a peer starved
of CPU, a slow uplink): it bans the sender for the round, averages its span without it, and either ends the
sender's reply stream short ("sent 3 parts, but we expected 4") or answers INTERNAL_ERROR. Every other member of
the group has the whole average and steps on it. The sender, left with its own values for that span, saw a "lost
reducer"; hivemind's retry then matched it again in an epoch its group had already left, and it found nobody (or
only the others left out), stepped on its own gradients and re-synced by a download: at 32 peers on 2 cores, 14
peers at once, and the swarm broke into seven groups for the next epoch.

The reducer is alive and its group has the round: this peer now asks its groupmates for that round
(collab.averaging.round_replay) and applies it, the same step as theirs. A lost reducer that did not answer at all
(it died, timed out) is still hivemind's retry: then every member lost it, and the survivors average again.

A groupmate's served round is untrusted. Besides round_replay's checks (shape, finite, norm), it must agree with
every part this peer did get from the group's other reducers (`disagreement`): only the span of the reducer that
left this peer out is taken on the donor's word, and the reducers that left it out are never asked.
"""

from __future__ import annotations

from typing import Optional

import torch
from hivemind.averaging.matchmaking import MatchmakingException

AGREEMENT = 1e-4  # a served value may differ from this peer's by this much of the tensor's largest value (rounding)


class LeftOutOfRound(MatchmakingException):
    """This peer's parts reached a live reducer too late and it was left out of that span; the rest of its group
    averaged without it. `members`: the groupmates who may have the round (base58); `by`: the reducers that left this
    peer out (never asked for it)."""

    def __init__(self, message: str, members=(), by=()):
        super().__init__(message)
        self.members, self.by = list(members), list(by)

    def __reduce__(self):  # (it crosses from the averager's process to the trainer's in an MPFuture)
        return type(self), (str(self), self.members, self.by)


def left_this_peer_out(error: BaseException) -> bool:
    """Whether a reducer's answer to this peer's parts says the reducer is alive and dropped them: its reply stream
    ended short, or it answered INTERNAL_ERROR (hivemind's reducer does both to a sender it banned for lateness)."""
    text = str(error)
    return text.endswith(" sent INTERNAL_ERROR") or ("parts, but we expected" in text and " sent " in text)


def left_out_error(peer_ids: list, me, left_us_out: set[int]) -> LeftOutOfRound:
    """The failure of a round the reducers at `left_us_out` (indices into the group's `peer_ids`) left `me` out of."""
    by = sorted(peer_ids[i].to_base58() for i in left_us_out)
    members = [peer.to_base58() for peer in peer_ids if peer != me and peer.to_base58() not in by]
    return LeftOutOfRound(f"reducer(s) {', '.join('...' + peer[-6:] for peer in by)} left this peer out of the round "
                          "(its parts came after next_chunk_timeout: a busy CPU or a slow uplink); its group averaged "
                          "without it", members, by)


def disagreement(served: list[torch.Tensor], partial: list[torch.Tensor], got: list[torch.Tensor]) -> Optional[str]:
    """Why a served round cannot be the one this peer's group made (None: it can be). `partial`: this peer's
    tensors plus the updates it received; `got`: where it received an average (a reducer that answered)."""
    if len(served) != len(partial):
        return "an average of the wrong shape"
    for index, (value, mine, mask) in enumerate(zip(served, partial, got)):
        if value.shape != mine.shape:
            return "an average of the wrong shape"
        scale = float(mine.abs().max()) if mine.numel() else 0.0  # (not the served value's: a forger's to inflate)
        off = (value.float() - mine.float()).abs()[mask]
        if off.numel() and float(off.max()) > AGREEMENT * scale:
            return f"an average that differs from the parts this peer's group sent it (tensor {index})"
    return None
