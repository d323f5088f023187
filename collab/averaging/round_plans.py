"""How an averaging round's group is planned from the run's progress records (a CheckedRounds mixin).

hivemind's leader waits out matchmaking_time for peers that may not exist, and its peers find leaders only through
DHT reads of the group key. Here a round's group target is every peer the records show training (`_fit_group_to_swarm`,
its search's length following what the last rounds found: collab.averaging.matching_budget), a round that carries
its epoch is matched under that epoch's key (`_match_within_epoch`), and every peer asks the epoch's planned leader
first (`_plan_round`, `_plan`; collab.averaging.planned_leader). A state round is planned alike, under the run's key
(`_plan_state_round`). The records come from collab.averaging.signed_progress.
"""

from __future__ import annotations

import logging
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Optional

from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.mpfuture import MPFuture

from collab.averaging.matching_budget import MatchingBudget
from collab.averaging.planned_leader import LATE_LEADER_SHARE, PLAN_SHARE, peers_training, planned_leader

BUDGET_CEILING = 3.0  # a search waits at most this many times the configured matchmaking_time (matching_budget)
# a state round's search, at most, in configured matchmaking_times: it begins one before its scheduled time, and the
# next step gives up one still looking one after it (collab.averaging.replica.give_up_matchmaking), so its leader
# must begin before then. Searches of up to 3x (the gradient rounds' budget) were all cancelled at 32 peers on 2
# cores, none averaged; waiting 3x for them held the peers still looking out of the next gradient round, which split.
# With a planned leader (1.5x), the leader began its search up to 2 s after the first peer and its group formed 1-2 s
# after its search ended: 27 of 64 given up at 32 peers, 9 of 64 at 1x (every group that formed was the whole swarm)
STATE_SEARCH = 1.0
FIRST_PLAN_WAIT = 5.0  # seconds a first gradient round waits for the records its plan is made from (reads: <= 3.2 s)
KEPT_LEADERS = 4  # epochs whose rounds' planned leaders the averager keeps (the trainer asks for its last round's)
ROUND_LEADER_WAIT = 2.0  # seconds the trainer waits for the averager's process to name its round's planned leader


class PlansRounds:
    """A mixin of a DecentralizedAverager that reads the signed progress (collab.averaging.signed_progress) and
    knows whom it bans (`banned`)."""

    async def _plan_gradient_round(self, matchmaking, step, records: dict) -> None:
        """The group size and plan of a gradient round, from the run's progress records. A peer's first round
        comes as its first read of the records has only just begun, and without them there is no planned leader
        and no group target (12 peers' first rounds, hivemind's search alone, split 5 + 5 + 2 at start-up on 2
        cores, and no group was the many to re-sync from). The trainer hands over its own view first
        (read_progress_soon); without that, the round waits for the read, at most FIRST_PLAN_WAIT."""
        if not records:
            await self._first_progress_read(FIRST_PLAN_WAIT)
        records = self._progress_state()["records"]  # the read waited for may have replaced them
        self._fit_group_to_swarm(matchmaking, records, step.deadline)
        self._plan_round(matchmaking, step, self._match_within_epoch(matchmaking, step))

    _budget: Optional[MatchingBudget] = None  # set when a gradient round's group size follows the swarm
    _last_group: frozenset = frozenset()  # the base58 ids of this peer's last gradient group
    _averaged_epoch: Optional[int] = None  # the epoch of the last gradient round this peer averaged (in _last_group)

    def _fit_group_to_swarm(self, matchmaking, records: dict, deadline: Optional[float] = None,
                            most: Optional[float] = None) -> None:
        """averaging.group_size unset: a leader begins its round as soon as every peer the run's progress records
        show training (within an epoch of the furthest) has joined, instead of waiting out matchmaking_time for
        peers that do not exist (a 2-peer swarm spent 3 of every 3.5 s matching). Records are at most
        PROGRESS_REFRESH s old: a peer that just joined may miss one round; one that just left makes that round wait
        the whole search. How long a search waits follows what the last rounds found (MatchingBudget), and leaves
        at least two thirds of the round's time (to `deadline`, dht time) to its all-reduce, and at most `most` x the
        configured time (a state round: STATE_SEARCH)."""
        configured = self.__dict__.setdefault("_configured_group_size", matchmaking.target_group_size)
        if configured is not None:
            return
        if self._budget is None:
            self._budget = MatchingBudget(matchmaking.min_matchmaking_time,
                                          ceiling=BUDGET_CEILING * matchmaking.min_matchmaking_time)
        # a client never leads, and a leader refuses a follower whose search ends before its own: a client searches
        # as long as any leader may (at 3x a NAT'd peer found no group in 3 of 4 rounds while the leaders' searches
        # had grown past its own)
        seconds = self._budget.ceiling if getattr(matchmaking, "client_mode", False) else self._budget.seconds
        if deadline is not None:
            seconds = max(self._budget.configured, min(seconds, (deadline - get_dht_time()) / 3))
        if most is not None:
            seconds = min(seconds, most * self._budget.configured)
        # both copies: the search's requests read the Matchmaking's, its declared deadline the PotentialLeaders'
        matchmaking.min_matchmaking_time = matchmaking.potential_leaders.min_matchmaking_time = seconds
        matchmaking.target_group_size = _peers_training(records, self._last_group)
        # the records read while the group is matched (the first round's first read among them) may show more
        # peers than the last read did: the target follows them up, never down, within the round
        task = self.__dict__.get("_progress_cache", {}).get("task")
        if task is not None and not task.done():
            task.add_done_callback(lambda _: self._raise_group_target(matchmaking))
        logging.getLogger(__name__).debug(
            f"round: group target {matchmaking.target_group_size}, searching for at least "
            f"{matchmaking.min_matchmaking_time:.1f} s")

    def _plan_state_round(self, matchmaking, step, records: dict) -> None:
        """A state round's group: begun once every peer training has joined, as a gradient round's (hivemind's leader
        would wait out matchmaking_time for more, every average_state_every epochs, and the next step waits for that
        round: with epochs of 2 s, a quarter of a 2-peer swarm's training thread), searching at most STATE_SEARCH.
        And every peer asks the same leader first: the planned leader of the epoch the round carries (hivemind's
        state averager gathers it). Without one, at 32 peers on 2 cores, 49 of 64 state rounds were given up and
        the 15 that averaged had groups of about 5. Matched under the run's key, not the epoch's, so that a peer an
        epoch behind still averages with the swarm and learns its epoch (collab.averaging.replica)."""
        self._fit_group_to_swarm(matchmaking, records, step.deadline, most=STATE_SEARCH)
        self._plan_round(matchmaking, step, self._gathered_epoch(step))

    def _gathered_epoch(self, step) -> Optional[int]:
        """The epoch a round carries in its gathered data (None: none): a gradient round's is the epoch it ends
        (collab.averaging.grad_averager.EpochGroups), a state round's the epoch after the step it follows."""
        try:
            _bandwidth, _mode, user_data = self.serializer.loads(step.data_for_gather)
            epoch = self.serializer.loads(user_data)
        except Exception:  # (our own process's data)
            return None
        return epoch if type(epoch) is int else None

    def _match_within_epoch(self, matchmaking, step) -> Optional[int]:
        """A round that carries its epoch (collab.averaging.grad_averager.EpochGroups) is matched under a key of that
        epoch: hivemind's leaders refuse a request made under another key, and no search sees another epoch's."""
        base, epoch = self._run_prefix(matchmaking), self._gathered_epoch(step)
        matchmaking.group_key_manager.prefix = base if epoch is None else epoch_prefix(base, epoch)
        self._round_epoch = epoch
        if self._round_epoch is not None:  # (a later ask for it is no longer to come: collab.averaging.woken_leader)
            self._searched_epoch = max(self._searched_epoch, self._round_epoch)
        return self._round_epoch

    def _run_prefix(self, matchmaking) -> str:
        """The run's own group key prefix, as hivemind's constructor set it (before any round's epoch replaced it)."""
        return self.__dict__.setdefault("_base_group_prefix", matchmaking.group_key_manager.prefix)

    _round_plan: Optional[tuple] = None  # (epoch, until, latest): whom this search asks first, and how long
    _round_epoch: Optional[int] = None  # the epoch this gradient round averages toward (None: it carries none)
    _searched_epoch = -1  # the newest such epoch (also collab.averaging.woken_leader's)

    def _plan_round(self, matchmaking, step, epoch: Optional[int]) -> None:
        """A round that carries its epoch, with a group that follows the swarm, asks the epoch's planned leader
        (collab.averaging.planned_leader) for the first PLAN_SHARE of its search."""
        if epoch is None or self.__dict__.get("_configured_group_size") is not None:
            self._round_plan = None
            return
        now = get_dht_time()
        ends = max(step.scheduled_time, now + matchmaking.min_matchmaking_time)
        if step.deadline is not None:
            ends = min(ends, step.deadline)
        until = now + PLAN_SHARE * max(0.0, ends - now)
        # a leader that says its search is yet to begin is asked on (matchmaking.follow_a_plan), within the share of the
        # round's time a search may take (_fit_group_to_swarm leaves the rest to the all-reduce)
        latest = max(until, now + LATE_LEADER_SHARE * (step.deadline - now)) if step.deadline is not None else until
        self._round_plan = (epoch, until, latest)
        log = logging.getLogger(__name__)
        if log.isEnabledFor(logging.DEBUG):  # (which leader each peer planned: a split's cause in its peers' logs)
            plan = self._plan()
            log.debug(f"{self._round_kind()}round of epoch {epoch}: asks {plan[0].to_base58()[-6:] if plan else None} "
                      f"first, for {self._round_plan[1] - now:.1f} s")

    def _plan(self) -> Optional[tuple]:
        """(planned leader's PeerID, until, latest) for the search under way, from the records as last read (None:
        none): the leader is asked first until `until`, and on until `latest` while it says it is coming."""
        if self._round_plan is None:
            return None
        epoch, until, latest = self._round_plan
        leader = self._planned_leader(epoch)
        if leader is None:
            return None
        leader_id = PeerID.from_base58(leader)
        return None if self.banned(leader_id) else (leader_id, until, latest)

    def _planned_leader(self, epoch: int) -> Optional[str]:
        """The planned leader (base58) of this averager's round of `epoch`, from the records as last read."""
        records = self.__dict__.get("_progress_cache", {}).get("records", {})
        step_leader = self._round_leaders().get(epoch - 1) if self._round_kind() == "" else None
        return planned_leader(records, epoch, self._last_group, self._step_group(epoch), step_leader)

    def _round_leaders(self) -> dict:
        """(the averager's process) epoch -> the planned leader (base58) of this peer's gradient round of that epoch,
        as its search last planned it: both halves of an even split, and the next round's plan, judge by it
        (collab.averaging.planned_leader.loses_an_even_split)."""
        return self.__dict__.setdefault("_leaders_planned", {})

    def _note_round_leader(self) -> None:
        """(the averager's process) As a gradient round's search ends: the leader it planned, kept for a few epochs."""
        if self._round_plan is None or self._round_kind() != "":
            return
        leaders = self._round_leaders()
        leaders[self._round_plan[0]] = self._planned_leader(self._round_plan[0])
        for old in sorted(leaders)[:-KEPT_LEADERS]:
            del leaders[old]

    def round_leader(self, epoch: int, timeout: float = ROUND_LEADER_WAIT) -> Optional[str]:
        """(the trainer's process) The planned leader of this peer's gradient round of `epoch` (base58), as its search
        planned it; None when it planned none, or the averager's process does not answer within `timeout` s."""
        future = MPFuture()
        self._outer_pipe.send(("_tell_round_leader", [], dict(epoch=epoch, future=future)))
        try:
            return future.result(timeout=timeout)
        except FutureTimeout:
            return None

    async def _tell_round_leader(self, epoch: int, future: MPFuture) -> None:
        future.set_result(self._round_leaders().get(epoch))

    def _step_group(self, epoch: int) -> Optional[frozenset]:
        """The group this peer averaged with in the gradient round before `epoch`'s; empty if it did not average then.
        None for a state round: any peer training may lead it. The state averager knows no gradient group, and the
        rule without one (the peers whose records show the furthest epoch) splits a state round's plan: its records
        are read every few epochs, each peer's at another moment, some before and some after a peer stepped."""
        if getattr(self, "kind", "gradients") != "gradients":
            return None
        return self._last_group if self._averaged_epoch == epoch - 1 else frozenset()

    def _log_group(self, seconds: float, group, target: Optional[int]) -> None:
        """A debug line for each gradient round planned: the group against its target and plan, and which peers the
        records showed but the target left out (why a round split: each peer's log holds its own view)."""
        log = logging.getLogger(__name__)
        if self._round_plan is None or not log.isEnabledFor(logging.DEBUG):
            return
        records = self.__dict__.get("_progress_cache", {}).get("records", {})
        counted = peers_training(records, self._last_group)
        leader = self._planned_leader(self._round_plan[0])
        members = {peer.to_base58() for peer in group.peer_ids} if group is not None else set()
        left_out = sorted(f"{peer[-6:]}@{getattr(records[peer], 'epoch', '?')}" for peer in set(records) - counted)
        log.debug(f"{self._round_kind()}round of epoch {self._round_plan[0]}: group of {len(members) or None} for a "
                  f"target of {target} after {seconds:.1f} s; planned leader {leader[-6:] if leader else None} "
                  f"{'in' if leader in members else 'not in'} it; {len(records)} records, not counted: "
                  f"{', '.join(left_out) or 'none'}")

    def _round_kind(self) -> str:
        """How a debug line names this averager's rounds: "" for gradient rounds, "state " for state rounds (one
        peer's log holds both; benchmarks/lab/split_log.py reads the gradient rounds')."""
        kind = getattr(self, "kind", "gradients")
        return "" if kind == "gradients" else f"{kind} "

    def _raise_group_target(self, matchmaking) -> None:
        training = _peers_training(self._progress_cache["records"], self._last_group)
        if training is not None and training > (matchmaking.target_group_size or 0):
            matchmaking.target_group_size = training
            logging.getLogger(__name__).debug(f"group target raised to {training} by a fresh read")


def epoch_prefix(run_prefix: str, epoch) -> str:
    """The group key prefix of an epoch's gradient round (collab.averaging.woken_leader parses it back). hivemind's
    group keys are PREFIX.0bBITS with no dot in PREFIX."""
    return f"{run_prefix}_epoch{epoch}"


def _peers_training(records: dict, last_group: frozenset = frozenset()) -> Optional[int]:
    """How many peers the progress records show training (collab.averaging.planned_leader.peers_training; None:
    fewer than two). Counting the last group's peers matters: two of 12 peers that had just averaged with this one
    showed two epochs behind, the target fell to 10, and the leader began without them (groups of 9 + 3 from then
    on)."""
    training = len(peers_training(records, last_group))
    return training if training >= 2 else None
