"""Averaging rounds that another peer cannot poison: a DecentralizedAverager mixin for both of collab's averagers.

Three things hivemind leaves unchecked (see docs/design.md, "hivemind hooks"), checked here:
- what this peer reduces for others: collab.averaging.aggregation's reducer (non-finite parts dropped, weights bounded
  by the group's median and by each sender's signed progress, read in the background by
  collab.averaging.signed_progress; mean or CenteredClip), in place of hivemind's running sum;
- what other peers' reducers send back: every returned part must be finite and of a plausible size, or the
  reducer is caught; the round's updates are held until all have arrived and been checked, then applied all
  at once or not at all (hivemind applies each as it comes, so a bad part would already be in the model).
  For gradients "plausible" is at most GRADIENT_BOUND times the larger of this peer's own gradient and the
  recent averages (an average of honest gradients is never longer than the longest of them); for the
  training state (parameters, optimizer statistics) a change of at most STATE_BOUND of its own norm;
- a round that is rejected fails at once for this peer, without hivemind's retry (its group has finished),
  and the trainer treats it as any failed round (collab.modes.sync).
A peer caught sending a non-finite part or returning a bad one is banned for BAN_SECONDS: hard evidence, unlike
a clipped part, which an honest peer with odd data may send. This peer then neither accepts a banned peer's join
request as a leader nor asks it to lead; in a group another leader put it in (a leader that has not caught it),
its parts are left out of what this peer reduces and this peer's parts are not sent to it: what it would have
reduced stays this peer's own for that round, as with any reducer that fails in hivemind (refusing whole groups
that hold it would fail the honest peers' rounds too). Every finding
goes to `findings` (a multiprocessing queue: the averager runs in its own process) for the trainer to count,
attribute and publish (collab.records.rejections).
"""

from __future__ import annotations

import contextvars
import logging
import statistics
import time
from typing import Optional

import torch
from hivemind.averaging.allreduce import AllreduceException, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import as_aiter, azip

from collab.averaging.aggregation import Aggregation, RobustPartReducer
from collab.averaging.one_average import OneAverage
from collab.averaging.planned_leader import ASK_AGAIN
from collab.averaging.reply_streams import WholeReplies
from collab.averaging.round_plans import PlansRounds
from collab.averaging.signed_progress import ReadsSignedProgress
from collab.averaging.known_groups import BAD_GROUP, KnownGroupsOnly
from collab.averaging.left_out import LeftOutOfRound, TellsLeftOut, leaves_few_out, left_out_error
from collab.averaging.tidy_leave import LeavesNoSocketFile, ReadsWholeRequests
from collab.averaging.traffic import CountingRunner, TrafficLog
from collab.averaging.woken_leader import WokenByAsks
from collab.hivemind_hooks.averager import end_step_unstarted
from collab.hivemind_hooks.matchmaking import (follow_a_plan, never_ask_leaders, pace_group_reads, patient_followers,
                                               time_matchmaking)
from collab.hivemind_hooks.patches import before_failed_reducer, check_returned_parts
from collab.records.rejections import HARD_EVIDENCE

GRADIENT_BOUND = 10.0
STATE_BOUND = 1.0
GROUP_READ_FLOOR = 0.1  # seconds: the DHT reads of a group key are at least this far apart (pace_group_reads)
BAN_SECONDS = 600.0
# how many times request_timeout an accepted follower waits for its group's start past its own search's deadline
# (hivemind: once; collab.hivemind_hooks.matchmaking.patient_followers)
FOLLOWER_PATIENCE = 3.0
_step_in_progress: contextvars.ContextVar = contextvars.ContextVar("collab_step_in_progress", default=None)


class RejectedRound(MatchmakingException):
    """This peer refused the average its group computed: nothing was applied."""


class LeavingPeer(MatchmakingException):
    """A round asked for after this peer began to leave (CheckedRounds.abort_running_rounds): never started."""


def _end_step(error: BaseException) -> None:
    """Fails the step in progress with `error`, and raises it: hivemind would retry a group that has finished (a
    refused round, one this peer was left out of) or one that a leaving peer cannot finish."""
    step = _step_in_progress.get()
    if step is not None and not step.done():
        step.set_exception(error)
    raise error


def nobody_else_sent(runner, peer_id) -> bool:
    """This peer reduced a part of the round and not one other sender of its group began sending it (hivemind bans
    such a sender after next_chunk_timeout and returns the rest of the average as a success). A peer with a share
    of the group but no part to reduce (a tensor smaller than the group's parts: all of it goes to one reducer)
    hears from no sender, and that is no sign of anything."""
    parts = runner.tensor_part_container.num_parts_by_peer[runner.ordered_peer_ids.index(peer_id)]
    others = set(runner.sender_peer_ids) - {peer_id}
    return parts > 0 and bool(others) and not others & runner.active_senders


class _CheckedRunner(CountingRunner, OneAverage, TellsLeftOut, WholeReplies):
    """hivemind's all-reduce runner with collab's reducer, every part other reducers return checked, its
    bytes counted (collab.averaging.traffic), one rounded average for the whole group
    (collab.averaging.one_average) and its reply streams closed by the side that is done
    (collab.averaging.reply_streams)."""

    def __init__(self, *, rule: Aggregation, bound: float, on_finding, is_banned, report_clipping: bool,
                 weight_caps: dict, **kwargs):
        super().__init__(**kwargs)
        self.bound, self.on_finding, self.is_banned = bound, on_finding, is_banned
        self.caught: dict[int, str] = {}  # peer index -> why its returned part was refused
        # reducers that failed mid-round (died, timed out): hivemind then keeps each sender's own values for their
        # parts, so the "average" differs from peer to peer (a peer killed mid-round leaves the replicas far
        # apart). Not those this peer left out for a ban: that choice is deliberate
        self.lost_reducers: set[int] = set()
        self._keep_own_parts = before_failed_reducer(self.tensor_part_container, self.lost_reducers.add)
        banned = {i for i, peer_id in enumerate(self.sender_peer_ids) if is_banned(peer_id)}
        # hivemind's own reducer, replaced below, warns "Reducer: received 0.0% of input tensors" when collected
        # unless marked finished: every peer would log that false alarm once per round
        self.tensor_part_reducer.finished.set()
        self.tensor_part_reducer = RobustPartReducer(
            self.tensor_part_reducer.part_shapes, len(self.sender_peer_ids), rule,
            report=lambda sender, reason: on_finding(self.sender_peer_ids[sender], reason), excluded=banned,
            report_clipping=report_clipping,
            own=self.sender_peer_ids.index(self.peer_id) if self.peer_id in self.sender_peer_ids else None,
            caps={i: weight_caps[p.to_base58()] for i, p in enumerate(self.sender_peer_ids)
                  if p.to_base58() in weight_caps})
        clipped_group = rule.method == "centered_clip" and len(self.sender_peer_ids) >= 3

        def checked(peer_index: int, part_index: int, returned: torch.Tensor):
            delta = self.as_difference(peer_index, part_index, returned)
            if peer_index not in self.caught:
                if not bool(torch.isfinite(delta).all()):
                    self.caught[peer_index] = "returned a non-finite average"
                elif float(delta.float().norm()) > self.bound:
                    self.caught[peer_index] = "returned an implausible average" + (
                        " of a clipped group" if clipped_group else "")
            return delta

        check_returned_parts(self.tensor_part_container, checked)

    async def exchange_with_peer(self, peer_id: PeerID):
        if peer_id != self.peer_id and self.is_banned(peer_id):
            self.on_finding(peer_id, "banned: left out of a group")
            self._keep_own_parts(self.ordered_peer_ids.index(peer_id))
            return
        try:
            await super().exchange_with_peer(peer_id)
        except BaseException as e:
            if peer_id == self.peer_id:
                # this peer's own reduction failed (no part it got could be used; cancelled): hivemind registers a
                # failed reducer for the others only, and the round waited for this span until averaging_timeout.
                # Lost now, with this peer's own values kept: the round ends, and runs again as for any lost reducer
                self.tensor_part_container.register_failed_reducer(self.ordered_peer_ids.index(peer_id))
            elif isinstance(e, AllreduceException) and str(e).endswith(f"sent {BAD_GROUP}") \
                    and peer_id in self.sender_peer_ids:
                # it is not in this group (collab.averaging.known_groups): its parts will not come either, so
                # this peer's reducer need not wait next_chunk_timeout for them
                await self.ban_sender(peer_id)
            raise


# the two mixins of collab's own names first: a name hivemind's classes gain in an upgrade cannot hide theirs
class CheckedRounds(PlansRounds, WokenByAsks, ReadsSignedProgress, LeavesNoSocketFile, ReadsWholeRequests,
                    KnownGroupsOnly):
    """A DecentralizedAverager mixin. Set `rule`, `kind` ("gradients" or "state") and `findings` (a queue, or
    None) before hivemind's constructor starts the averager process."""

    rule: Aggregation = Aggregation()
    kind: str = "gradients"
    findings = None
    exchange_averages = True  # collab.averaging.one_average (False: hivemind's differences, as an older collab sends)
    traffic = None  # a TrafficLog's queue: each run's bytes (gradient rounds)
    # whether a round's tensors are this peer's mean gradient and the group's (collab.adaptive.noise_scale): not DGC's
    # selections, PowerSGD's factors or diloco's pseudo-gradients
    measures_noise = True

    def abort_running_rounds(self) -> None:
        """(the trainer's process) End this averager's all-reduce in flight now, on the way out. hivemind's cancel
        stops a round only while it is still matching; one already running holds the averaged tensors' lock until
        it ends or times out, and the leaving peer's last optimizer step waits on that lock: when a whole swarm
        leaves at once (the end of a simulation), every state round would stall for next_chunk_timeout and the
        peers be killed at the end of their grace period instead of leaving. The groupmates lose this peer's part, as
        they would if it were killed. No round starts after this: a step the leave itself makes (the signal came
        inside an optimizer step, whose gradient round it cancelled: the step goes on alone, and asks for a
        state round) would otherwise run an all-reduce with peers that are leaving too, holding the lock the
        step's optimizer update waits for until it timed out, past the leave's grace (test_churn, 2 in 16)."""
        if self.is_alive():
            self._outer_pipe.send(("_abort_running_rounds", [], {}))

    _leaving = False  # (the averager's process) set by _abort_running_rounds: no round starts after it

    async def _abort_running_rounds(self) -> None:
        self._leaving = True
        for future in list(self._running_groups.values()):  # hivemind: group id -> future of its AllReduceRunner
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().finalize(cancel=True)

    def _values_per_round(self) -> int:
        """How many values one round all-reduces (PowerSGD: its factors, fewer than the gradient's)."""
        return self.total_size

    def _report(self, peer_id, reason: str, what: Optional[str] = None) -> None:
        peer = peer_id.to_base58() if isinstance(peer_id, PeerID) else str(peer_id)
        if reason in HARD_EVIDENCE and peer != self.peer_id.to_base58():
            self._bans()[peer] = time.monotonic() + BAN_SECONDS
        if self.findings is not None:
            self.findings.put((peer, reason, what or self.kind))

    def _bans(self) -> dict:
        if not hasattr(self, "_banned_until"):
            self._banned_until = {}
        return self._banned_until

    def banned(self, peer_id: PeerID) -> bool:
        return self._bans().get(peer_id.to_base58(), 0.0) > time.monotonic()

    async def serve_join_request(self, request: averaging_pb2.JoinRequest, context: P2PContext):
        if self.banned(context.remote_id):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        if self._note_ask(request.group_key):
            # asked to lead a round this peer has yet to search for (its reads of the swarm's progress came later than
            # the asker's): hivemind's NOT_LOOKING_FOR_GROUP would send the asker to another leader; this, to ask on
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_DECLARED)
            return
        async for message in super().serve_join_request(request, context):
            yield message

    _matching_seconds = 0.0  # the search that found the last round's group (time_matchmaking)

    def _accepted_request_ended(self, leader, seconds: float, began: bool) -> None:
        if not began and seconds >= FOLLOWER_PATIENCE * self._matchmaking.request_timeout:
            # said, because the leader may have begun the group a moment later, counting this peer in: its members
            # then wait for this peer's parts (next_chunk_timeout) while it looks for another group
            logging.getLogger(__name__).warning(
                f"{self.kind} round: leader ...{str(leader)[-6:]} accepted this peer, but its group had not begun "
                f"after {seconds:.1f} s; looking for another group")

    async def averaging_step(self, *, step, **kwargs):
        if self._leaving:
            end_step_unstarted(step, kwargs["future_for_init"], LeavingPeer("this peer is leaving the swarm"))
            return
        _step_in_progress.set(step)  # the round's tasks inherit it: a rejected round must end this step
        self._round_epoch = None  # set by _match_within_epoch for a round that carries its epoch
        matchmaking = getattr(self, "_matchmaking", None)  # made in the averager process
        if matchmaking is not None:
            never_ask_leaders(matchmaking, self.banned)
            patient_followers(matchmaking, FOLLOWER_PATIENCE, self._accepted_request_ended)
            time_matchmaking(matchmaking, self._matched_in)
            pace_group_reads(matchmaking, every=max(GROUP_READ_FLOOR, matchmaking.min_matchmaking_time / 10))
            # an accepted follower waits for the group's start until FOLLOWER_PATIENCE x request_timeout past its own
            # search's end, so a leader whose search ends up to one request_timeout less after it can still take it
            # in (collab.averaging.planned_leader: at 32 peers the planned leader began up to 8 s after the first)
            follow_a_plan(matchmaking, self._plan, slack=(FOLLOWER_PATIENCE - 1) * matchmaking.request_timeout,
                          ask_again=ASK_AGAIN, what=f"{self.kind} round")  # (its debug line says which)
        if self.kind == "gradients":
            records = self._signed_progress()  # a fresh read starts while the group is being matched
            if matchmaking is not None:
                await self._plan_gradient_round(matchmaking, step, records)
        elif matchmaking is not None:
            # the records are the last read's (one every few epochs here, and the trainer's view at first): a
            # fresh read starts, and a plan or target it changes is followed within the search
            self._plan_state_round(matchmaking, step, self._signed_progress())
        return await super().averaging_step(step=step, **kwargs)

    async def aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        if self._leaving:  # matched as this peer began to leave: its all-reduce would hold the tensors' lock
            self._refuse_as_leaving()
        return await super().aggregate_with_group(group_info, min_vector_size, **kwargs)

    @staticmethod
    def _refuse_as_leaving() -> None:
        _end_step(LeavingPeer("this peer is leaving the swarm"))

    async def run_allreduce(self, tensors, group_info: GroupInfo, group_id=None, **kwargs):
        group_id = group_info.group_id if group_id is None else group_id
        # PowerSGD runs two all-reduces per round (its P, then its Q): each has its own history of norms
        phase = group_id[len(group_info.group_id):]
        own_norm = _norm(tensors)
        bound = self._bound(own_norm * self._own_norm_scale(kwargs.get("weight")), phase)
        if self.kind == "gradients":
            await self._first_progress_read()
            self._last_group = frozenset(peer.to_base58() for peer in group_info.peer_ids)
        if self._leaving:
            # the leave began while this round waited for the tensors' lock (held in the trainer's process: a state
            # served to a downloading peer, an optimizer step), after aggregate_with_group's check and before
            # _abort_running_rounds had a runner to end: run, it would hold the lock for the leaving peer's last
            # step until a groupmate that is leaving too timed out (test_churn: a forced exit, once in CI)
            self._refuse_as_leaving()
        # (run by hivemind, which passes no epoch: the round's, as matched, is self._round_epoch)
        caps = self._weight_caps(self._round_epoch) if self.kind == "gradients" else {}
        runner = _CheckedRunner(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors,
                                group_id=group_id, ordered_peer_ids=group_info.peer_ids, rule=self.rule, bound=bound,
                                on_finding=self._report, is_banned=self.banned,
                                report_clipping=self.kind == "gradients", exchange_averages=self.exchange_averages,
                                weight_caps=caps, **kwargs)
        assert group_id in self._running_groups, f"Group id {group_id} was not registered in _register_allreduce_group"
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")
            return
        started = time.monotonic()
        try:
            updates = [update async for _, update in azip(as_aiter(*tensors), runner)]
            # a sender whose parts come after this now hears that it was left out, if most of the group was not
            self.group_ended(group_id, tell_late=leaves_few_out(runner))
        finally:
            TrafficLog.put(self.traffic, runner, self._values_per_round(), self.total_size,
                           seconds=(self._matching_seconds, time.monotonic() - started))
        if self.kind == "gradients" and not phase and nobody_else_sent(runner, self.peer_id):
            # the group held a peer that never took part: one that gave up its join request a moment before the
            # leader's answer came (a CPU-starved peer), while the leader counted it in. The "average" is this
            # peer's own gradient; nothing is applied, and hivemind's retry loop matches the group again while
            # the round has time left: the missing peer is still looking for a group
            raise AllreduceException("no groupmate sent its part of this round (one missed the group's start); "
                                     "looking for the group again instead of averaging alone")
        if self.kind == "gradients" and not phase and runner.banned_senders and not leaves_few_out(runner):
            # most of the group lost this reducer and runs the round again without it (collab.averaging.left_out:
            # it does not tell them they were left out): this peer's step would be on an average nobody else applies
            # (31 of 32 peers retried so with next_chunk_timeout 1.5 s on 2 cores, while the one stepped on it)
            raise AllreduceException(f"this peer's reducer left out {len(runner.banned_senders)} of its "
                                     f"{len(runner.sender_peer_ids)} senders (their parts came after "
                                     "next_chunk_timeout); they run the round again without it, and so does this peer")
        if runner.lost_reducers and runner.lost_reducers <= runner.left_us_out and not phase \
                and getattr(self, "replays_rounds", False):
            # (collab.averaging.left_out) what this peer got is kept, to check the replayed round against
            self.keep_partial_round(self._round_epoch, [t + u for t, u in zip(tensors, updates)],
                                    [u != 0 for u in updates])
            _end_step(left_out_error(runner.ordered_peer_ids, self.peer_id, runner.left_us_out))
        if runner.lost_reducers and self.kind == "gradients" and not phase:
            # nothing applied yet, and the tensors are as they were: hivemind's retry loop matches the group's
            # survivors again (they all lost the same reducer) and averages the same values, exactly. Not within
            # PowerSGD's two-phase rounds (`phase`): its retry would add the gradients to its error buffers twice
            lost = ", ".join("this peer" if runner.ordered_peer_ids[i] == self.peer_id else
                             "..." + runner.ordered_peer_ids[i].to_base58()[-6:] for i in sorted(runner.lost_reducers))
            raise AllreduceException(f"reducer(s) {lost} left mid-round: their parts would differ from peer to "
                                     f"peer; running the round again without them")
        averaged_norm = _norm([t + u for t, u in zip(tensors, updates)]) if self.kind == "gradients" else None
        why = self._refusal(runner, updates, bound, averaged_norm)
        if why is not None:
            _end_step(RejectedRound(why))
        for tensor, update in zip(tensors, updates):
            tensor.add_(update, alpha=self._averaging_alpha)
        # collab.adaptive.noise_scale's inputs, exact here; not under adasum, whose result is no weighted mean
        if averaged_norm is not None and not phase and self.measures_noise and self.rule.method != "adasum":
            TrafficLog.put_norms(self.traffic, own_sq=own_norm ** 2, own_samples=kwargs.get("weight"),
                                 average_sq=averaged_norm ** 2,
                                 group_samples=runner.tensor_part_reducer.group_weight)
        if averaged_norm is not None:
            recent = self._recent_norms(phase)
            recent.append(averaged_norm)
            del recent[:-16]
        if self.kind == "gradients" and not phase:
            self._averaged_epoch = self._round_epoch  # (collab.averaging.round_plans._step_group)
            if getattr(self, "_partial", None) is not None:
                self.keep_partial_round(None, None, None)  # an earlier left-out round's: one model's worth, let go
        self.last_updated = get_dht_time()
        self._state_updated.set()

    def _matched_in(self, seconds: float, group: Optional[GroupInfo]) -> None:
        self._matching_seconds = seconds
        self.group_found(group)
        self._note_round_leader()
        matchmaking = getattr(self, "_matchmaking", None)
        self._log_group(seconds, group, getattr(matchmaking, "target_group_size", None))
        if self._budget is not None and matchmaking is not None:
            self._budget.after_round(len(group.peer_ids) if group is not None else None,
                                     matchmaking.target_group_size)

    def _refusal(self, runner: _CheckedRunner, updates, bound: float, averaged_norm: Optional[float]
                 ) -> Optional[str]:
        """Why this peer refuses the round (None: it accepts). `averaged_norm`: the averaged gradient's norm."""
        for peer_index, reason in runner.caught.items():
            peer_id = runner.ordered_peer_ids[peer_index]
            self._report(peer_id if peer_id != self.peer_id else "(this peer's own reduction)", reason)
        if runner.caught:
            return f"{len(runner.caught)} reducer(s) of the group returned bad parts"
        if averaged_norm is not None:
            if not averaged_norm <= bound:
                self._report("(the group)", "average out of bounds")
                return f"the averaged gradient's norm {averaged_norm:.3g} is above this peer's bound {bound:.3g}"
        elif not _norm(updates) <= bound:
            self._report("(the group)", "average out of bounds")
            return f"the averaged state moves this replica by {_norm(updates):.3g}, above the bound {bound:.3g}"
        return None

    def _own_norm_scale(self, weight: Optional[float]) -> float:
        """How much longer than this peer's own part an honest average may be, given this peer's weight (1: as
        long; gradients are per-sample means. collab.modes.diloco's pseudo-gradients grow with the steps taken)."""
        return 1.0

    def _bound(self, own_norm: float, phase: bytes = b"") -> float:
        if self.kind == "gradients":
            recent = self._recent_norms(phase)
            return GRADIENT_BOUND * max(own_norm, statistics.median(recent) if recent else 0.0) + 1e-12
        # state: honest replicas are near-identical, so a state round moves each by a small fraction of its norm.
        # (A tighter bound, such as 0.25, can refuse an honest reducer's part; a reducer returning noise x 1000,
        # which a finite-only check lets through, wrecks the honest loss: benchmarks/robustness.py)
        return STATE_BOUND * own_norm + 1e-12

    def _recent_norms(self, phase: bytes = b"") -> list:
        if not hasattr(self, "_norms"):
            self._norms = {}
        return self._norms.setdefault(phase, [])


def _norm(tensors) -> float:
    return float(torch.stack([t.detach().float().norm() for t in tensors]).norm()) if len(tensors) else 0.0


class _QuietRejections(logging.Filter):
    """hivemind logs a failed round with its traceback; a round this peer refused is reported by collab, once, and
    so is a round that found no group (with why: collab.modes.round_failures.why_no_group)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        while error is not None:
            if isinstance(error, (RejectedRound, LeftOutOfRound)) or "could not find a group" in str(error):
                return False
            error = error.__cause__ or error.__context__
        return True


def quiet_rejections() -> None:
    for name in ("hivemind.averaging.averager", "hivemind.optim.optimizer", "hivemind.optim.state_averager"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _QuietRejections) for f in logger.filters):
            logger.addFilter(_QuietRejections())
