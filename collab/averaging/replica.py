"""Is this peer's replica the swarm's? What a peer must know before it checkpoints or leaves.

Peers stay identical because every step applies the same averaged gradients. A step on this peer's
own gradients (its gradient round failed while others were in the swarm) moves it one update away
from everyone else, and a download of another peer's state brings it back (a state-averaging round that
gathered the whole swarm does too, when no peer could give its state: it makes the parameters the same, not the
optimizer's statistics, collab.modes.replica_sync). Mid-run, hivemind downloads at the next step.
At `--max-epochs` there is no next step: a peer starved of CPU can miss the last gradient round, then
the last state-averaging round (its groupmates have finished theirs), and would write a final checkpoint
one update away from the others'.

So the optimizer records an own step when it makes one (collab.modes.replica_sync), this module records the
outcome of every state-averaging round and download, and a peer leaving or checkpointing asks whether a round
since gathered the whole swarm (`gathered_since`).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.utils.timed_storage import get_dht_time

from collab.averaging.aggregation import Aggregation
from collab.averaging.bounded_start import StartsWithin
from collab.averaging.donor_patience import Behind
from collab.averaging.members_only import MembersOnly
from collab.averaging.robust_rounds import CheckedRounds
from collab.averaging.round_control import cancel_round, still_matching
from collab.averaging.served_state import ServesItsSteps
from collab.averaging.sit_out import SitsOutWhileOutOfStep
from collab.averaging.state_download import CheckedDownloads
from collab.records.untrusted import progress_records
from collab.run.gate import MemberGate

KEEP_ROUNDS = 8
# a state round still looking for its group while the next gradient round is, too, looks on up to this many times
# give_up_matchmaking's patience. At 32 peers on 2 cores a state round's group of the whole swarm formed 5-8 s after
# its first peers began (everything there is slow: the gradient rounds' took as long), and a give-up 6 s after the
# search began cancelled it as it formed (9 to 27 of 64 rounds); the gradient round was still matching meanwhile
HOLD_MOST = 2.0


class RoundOutcomes:
    """Counts of finished rounds by outcome, from their StepControls' done callbacks (another thread)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts = dict(ok=0, given_up=0, failed=0, peers=0)

    def add(self, control) -> None:
        if control.cancelled():  # no group in time (give_up_matchmaking), sat out (sit_out), or left
            outcome, peers = "given_up", 0
        elif control.exception() is not None:
            outcome, peers = "failed", 0
        else:
            gathered = control.result()
            outcome, peers = ("ok", len(gathered)) if gathered else ("failed", 0)
        with self._lock:
            self._counts[outcome] += 1
            self._counts["peers"] += peers

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class _RecordOutcomes(DecentralizedAverager):
    """Sits between TrainingStateAverager and DecentralizedAverager in the MRO, where every state-averaging
    round (pre-scheduled or not) and every download passes, and keeps their outcomes."""

    rounds: list  # (gathered epoch, StepControl), newest last
    downloaded_epoch: Optional[int]

    def step(self, *args, gather=None, **kwargs):
        control = super().step(*args, gather=gather, **kwargs)
        if isinstance(control, StepControl) and isinstance(gather, int):
            self.rounds = [*getattr(self, "rounds", [])[-KEEP_ROUNDS + 1:], (gather, control)]
            if "_outcomes" not in self.__dict__:
                self._outcomes = RoundOutcomes()
            control.add_done_callback(self._outcomes.add)  # (run in this process: the control is made here)
        return control

    def state_round_outcomes(self) -> dict[str, int]:
        """How this peer's state rounds ended: {"ok", "given_up", "failed", "peers"} ("peers": summed group sizes)."""
        outcomes = self.__dict__.get("_outcomes")
        return outcomes.counts() if outcomes is not None else RoundOutcomes().counts()

    def load_state_from_peers(self, *args, **kwargs):
        loaded = super().load_state_from_peers(*args, **kwargs)
        if loaded is not None and not self.check_download(loaded, self.local_epoch):  # collab.averaging.state_download
            return None
        if loaded is not None and isinstance(loaded[0], dict) and isinstance(loaded[0].get("epoch"), int):
            self.downloaded_epoch = loaded[0]["epoch"]
        return loaded


class RecordingStateAverager(StartsWithin, MembersOnly, CheckedRounds, CheckedDownloads, SitsOutWhileOutOfStep,
                             ServesItsSteps, TrainingStateAverager, _RecordOutcomes):
    """hivemind's TrainingStateAverager, which also says whether a round or a download really happened, checks its
    rounds (collab.averaging.robust_rounds) and downloads (collab.averaging.state_download), serves a state under the
    epoch its tensors hold (collab.averaging.served_state), sits out state rounds while its replica awaits a re-sync
    (collab.averaging.sit_out) and, in a private run, averages with and serves its state to members only."""

    def __init__(self, *, gate: Optional[MemberGate] = None, rule: Aggregation = Aggregation(), findings=None,
                 **kwargs):
        # before hivemind's constructor starts the averager process, which takes a copy
        self.gate, self.rule, self.kind, self.findings = gate, rule, "state", findings
        self.upload_mbit = kwargs.get("bandwidth")  # orders donors of one epoch (collab.averaging.state_download)
        super().__init__(**kwargs)

    def round_controls(self) -> list:
        """Recent state-averaging rounds (hivemind hands them to a background step and forgets them)."""
        return [control for _, control in getattr(self, "rounds", [])]

    def gathered_since(self, epoch: int) -> int:
        """The largest group of a finished state-averaging round at `epoch` or later (0: none succeeded)."""
        best = 0
        for gathered_epoch, control in getattr(self, "rounds", []):
            if gathered_epoch >= epoch and control.done() and not control.cancelled() and control.exception() is None:
                best = max(best, len(control.result() or ()))
        return best

    def epoch_ahead(self, epoch: int) -> Optional[int]:
        """`epoch + 1` if the newest finished state round this peer joined at `epoch` had groupmates one epoch
        ahead (each says its epoch in the round's gathered data), else None.

        A lineage split: hivemind matches every gradient round of a run under one key, and a peer one epoch
        behind is "ready" at once, so a peer whose round starts after the others' has assembled (a slow start,
        a stall) joins their *next* round, steps to the epoch they just left, and stays one behind for the
        rest of the run - at --max-epochs such a peer needs one more round, after the others have gone. The
        state round after the shared gradient round shows it. Anything else a groupmate
        says (further ahead, behind, not a number) is ignored: one epoch is all a lineage split puts between
        honest peers, and one peer's word must not move the rest further."""
        for gathered_epoch, control in reversed(getattr(self, "rounds", [])):
            if not control.done() or control.cancelled() or control.exception() is not None:
                continue
            if gathered_epoch != epoch:
                return None
            epochs = [e for e in (control.result() or {}).values() if isinstance(e, int) and not isinstance(e, bool)]
            return epoch + 1 if epoch + 1 in epochs else None
        return None

    def give_up_matchmaking(self, up_to_epoch: int, patience: float, stop, limit: float,
                            hold: Callable[[], bool] = lambda: False) -> int:
        """Wait while a state round of `up_to_epoch` or before looks for a group, and cancel one that still looks
        `patience` seconds after it was due. hivemind would let it look for up to averaging_timeout (a minute),
        blocking the next step or the exit, though its groupmates have averaged without it (this peer was
        starved or late) and will not come back for it. A round that found its group runs to its end; a
        background step that has not started its round yet is waited for (its round may yet need giving up),
        for `limit` seconds at most: then hivemind's own wait, with its own timeouts, takes over. While `hold()`
        (this peer's next gradient round is still looking for its group: the step waits for that anyway), the
        round looks on, up to HOLD_MOST x `patience` after it was due."""
        cancelled, give_up_at = 0, time.monotonic() + limit
        while not stop.is_set() and time.monotonic() < give_up_at:
            matching = [control for epoch, control in getattr(self, "rounds", [])
                        if epoch <= up_to_epoch and still_matching(control)]
            if not matching and not any(not update.done() for update in self.pending_updates):
                break
            held = bool(matching) and hold()
            for control in matching:
                late = get_dht_time() - control.scheduled_time
                if late > patience and not (held and late <= HOLD_MOST * patience):
                    cancel_round(control)
                    cancelled += 1
            stop.wait(0.1)
        return cancelled

    def finish_running_rounds(self, stop, limit: float) -> None:
        """Wait (at most `limit` s) for a state round whose all-reduce is under way to end. A cancel that came as the
        round's group formed does not stop it in the averager process: shut down then, it leaves its groupmates
        waiting for its part until their averaging_timeout."""
        give_up_at = time.monotonic() + limit
        while not stop.is_set() and time.monotonic() < give_up_at and any(
                control.stage == AveragingStage.RUNNING_ALLREDUCE for control in self.round_controls()):
            stop.wait(0.05)

    def load_state_from_peers(self, **kwargs) -> bool:
        """True only if a state was downloaded and loaded: hivemind returns quietly when no peer could give one,
        or when it refused what it got (an epoch behind ours)."""
        self.downloaded_epoch = None
        super().load_state_from_peers(**kwargs)
        return self.downloaded_epoch is not None and self.downloaded_epoch == self.local_epoch


PRESENT_FRESH_SECONDS = 75.0  # a progress record this recent is a peer still there (see peers_behind)


def _fresh_records(dht, run_id: str, ignore: frozenset) -> dict:
    now = time.time()
    return {peer: p for peer, p in progress_records(dht, run_id).items()
            if now - p.time < PRESENT_FRESH_SECONDS and peer not in ignore}


def _fresh_epochs(dht, run_id: str, ignore: frozenset) -> list[int]:
    return [p.epoch for p in _fresh_records(dht, run_id, ignore).values()]


def others_present(dht, run_id: str, me: str) -> bool:
    """Whether a fresh progress record of another peer is in the run (a peer that left said goodbye: its record is
    gone). True when the DHT does not answer: the caller then acts as if someone were there."""
    try:
        return bool(_fresh_records(dht, run_id, frozenset({me})))
    except Exception:
        return True


def peers_behind(dht, run_id: str, epoch: int, ignore: frozenset = frozenset()) -> list[Behind]:
    """Peers whose signed progress (hivemind's tracker) is behind `epoch`, furthest first: each will want a state
    donor at `epoch` to leave in sync. After an own step a peer reports the epoch before it; a peer whose lineage
    split (it made its groupmates' steps under a lower number) reports two or more behind until a state round
    shows it, and both need a donor. A peer waiting inside a gradient round reports nothing new (hivemind
    re-stores the same record every 30 s), so a record is fresh for a whole averaging round."""
    now = time.time()
    return sorted((Behind(epochs=epoch - p.epoch, samples=p.samples_accumulated, samples_per_second=p.samples_per_second,
                          peer=peer, record_age=now - p.time, client_mode=p.client_mode)
                   for peer, p in _fresh_records(dht, run_id, ignore).items() if p.epoch < epoch),
                  key=lambda b: -b.epochs)


def others_epochs(dht, run_id: str, me: str, refused: frozenset = frozenset()) -> list[int]:
    """The epoch of every other peer with a fresh progress record, but those in `refused`; raises when the DHT does
    not answer."""
    return _fresh_epochs(dht, run_id, frozenset({me}) | refused)


def wait_for_a_donor_at(dht, run_id: str, me: str, epoch: int, stop, limit: float, pause: float = 0.5) -> bool:
    """Wait (`limit` s at most) until another peer's fresh progress says `epoch` or later: a peer that made the
    swarm's step to `epoch`, whose state a re-sync at `epoch` can take. False when none did in time, when no other
    peer is there, or when the DHT does not answer (the caller then asks the donors as it would have)."""
    give_up_at = time.monotonic() + limit
    while True:
        try:
            others = others_epochs(dht, run_id, me)
        except Exception:
            return False
        if not others:
            return False
        if max(others) >= epoch:
            return True
        if time.monotonic() + pause > give_up_at or stop.wait(pause):
            return False


def swarm_finished_without(others: list[int], epoch: int) -> Optional[int]:
    """The swarm's epoch when every other peer (their `others_epochs`) has already made `epoch`'s step (each reports
    a later epoch), so a round for `epoch` has nobody left to find; None when some peer is still at `epoch` or behind
    it (it may yet join), or when this peer is alone."""
    return max(others) if others and min(others) > epoch else None
