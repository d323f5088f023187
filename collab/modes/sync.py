"""averaging.mode sync, DeDLOC's recipe: gradients accumulate locally toward the swarm's target batch, are averaged in
one all-reduce per epoch, and every peer applies the same LAMB step. With `overlap` (off by default), the
optimizer step, and with `full` the all-reduce too, run in a background thread while the next micro-batches are
computed (hivemind's delayed optimizer step / delayed gradient averaging, one step of staleness). State rounds
run in the background either way. What every mode shares is collab.modes.base; a leaving peer's stay as the donor
of peers behind it is collab.modes.staying_donor, and why a round failed collab.modes.round_failures.
"""

from __future__ import annotations

import itertools
import random
import time
from concurrent.futures import TimeoutError as FutureTimeout

import torch
from hivemind.averaging.control import AveragingStage
from hivemind.utils.logging import get_logger

from collab.averaging.left_out import LeftOutOfRound
from collab.averaging.planned_leader import loses_an_even_split, planned_leader
from collab.averaging.replica import others_epochs, swarm_finished_without
from collab.averaging.round_control import cancel_round
from collab.averaging.round_replay import what_is_wrong
from collab.averaging.split_rounds import KnownGroups, round_group
from collab.modes import ModeContext
from collab.modes.base import SwarmOptimizer
from collab.modes.fresh_rounds import FreshRounds
from collab.modes.leaving import LeavingMidStep
from collab.modes.round_failures import NobodyLeftToJoin, round_failure, why_no_group, why_not_begun
from collab.modes.staying_donor import StaysAsDonor
from collab.records.untrusted import progress_records

NOBODY_LEFT_CHECK = 2.0  # seconds between two looks, from a last round still matching, at whether anyone is left
# the few of a split round ask the many for their round this long before they re-sync by download instead: the many
# made their step up to 10 s after the few's group formed at 32 peers on 2 cores (5 s missed a third of them), and the
# download it spares took 8-14 s there
DONORS_WAIT = 15.0
DONORS_POLL = 0.5
DONORS_READ_EVERY = 4  # looks between two reads of the progress key for donors (the last read names most of the many)
EMPTY_LOOKS = 2  # looks in a row that find no other peer's record before a round begun with others is given up
logger = get_logger(__name__)


class CollabOptimizer(FreshRounds, StaysAsDonor, SwarmOptimizer):
    """The sync mode's optimizer, on collab.modes.base.SwarmOptimizer: it records each gradient-averaging round,
    refuses averages it cannot trust, steps on its own gradients when a round fails, and re-syncs after.

    hivemind applies whatever the group returned. Here the averagers check every round (collab.averaging.robust_rounds)
    and a refused round fails. A failed round (refused, a timeout, no group) makes this epoch's step one on this
    peer's own gradients: the ones it sent into the round, kept by collab.averaging.grad_averager (hivemind's fallback
    loaded its zeroed accumulators instead, a step of momentum and weight decay alone). Why a step and not
    none: when a whole group fails (a network blip), each of its peers still learns from its own batch, and the
    next state round averages those steps, as local SGD does. Either way the replica is one update away from
    the swarm: it is recorded as an own step (collab.modes.replica_sync), published as the epoch before (so a leaving
    peer waits to be its state donor), and undone by downloading the swarm's state at the next step, or before
    leaving (when no peer can give it, by a state-averaging round that gathered the whole swarm).
    """

    _with_others, _empty_looks = False, 0  # the round being waited for: begun with others there; empty looks since
    sums_micro_batches = True  # its averagers count a window's micro-batches (grad_averager.SummedMicroBatches)

    def begin_gradient_round(self, grad_scaler) -> bool:
        self.grad_averager.epoch = self.local_epoch  # (grad_averager.EpochGroups) the round ends this epoch
        if hasattr(self.grad_averager, "set_round_context"):  # dgc: its warm-up and its clipping need these
            self.grad_averager.set_round_context(self.local_epoch, max(1, self.tracker.global_progress.num_peers))
        self.refresh_the_pre_scheduled_round()
        control, peers = self.scheduled_grads, self.tracker.global_progress.num_peers
        began = super().begin_gradient_round(grad_scaler)
        if not began and self._most_peers > 1:
            # hivemind steps alone while others average. Not a round that failed when this peer is leaving: its
            # leave cancelled the pre-scheduled round (every peer of a `simulate --duration` run, at its end)
            if not self.stop.is_set():
                self.averaging_log.failure("round could not start")
            self._record_own_step(f"the gradient round could not start: {why_not_begun(control, peers)}")
        return began

    def _record_own_step(self, why: str, whose: str = "this peer's own gradients") -> None:
        peers = max(self._most_peers, self.tracker.global_progress.num_peers)
        if peers > 1:
            # with overlap=full this runs in the background step, after the epoch was incremented
            epoch = self.local_epoch + (0 if self.delay_grad_averaging else 1)
            self.replica.stepped_alone(epoch, peers, time.monotonic())  # held before hivemind publishes the epoch
            logger.warning(f"Epoch {self.local_epoch}: {why}; this step is on {whose}, so its "
                           "replica is one update away from the swarm's until it is re-synced")

    def _in_a_minority(self, group: list[str]) -> bool:
        """Whether this peer's round gathered fewer than half the peers training: the swarm split into groups (two
        leaders matched at once: 12 linreg peers on 2 cores went 9 + 3), and the replicas of the few part from the
        many's. Such a step is treated as an own step: the few re-sync from the many (whose records claim the epoch
        while the few hold theirs at the one before, collab.modes.replica_sync), not the other way round. In an even
        split (6 + 6) the half without the round's planned leader (the one this peer's search planned:
        collab.averaging.round_plans.round_leader) re-syncs from the half with it, if the other half was on this epoch
        too."""
        peers = self.tracker.global_progress.num_peers
        if len(group) * 2 != peers:
            return len(group) * 2 < peers
        epoch = self.grad_averager.epoch
        ask = getattr(self.grad_averager, "round_leader", None)
        return loses_an_even_split(getattr(self.tracker, "records_seen", {}), epoch, group,
                                   ask(epoch) if ask is not None else None)

    def should_download_state(self) -> bool:
        # after a step on our own gradients, download the swarm's state at the next step: exact, and the
        # gradients we would compute meanwhile would be for parameters nobody else has
        if not self.in_sync() and self.replica.wants_resync:
            return True
        return super().should_download_state()

    def _wait_for_round(self, control):
        """The round's result, waiting in short slices: a peer asked to leave must not sit out a whole
        averaging_timeout (up to minutes) inside an all-reduce before it can say goodbye; nor a peer whose last
        round has nobody left to find (_nobody_left_to_join)."""
        started = time.monotonic()
        # the first look at once: a peer whose round starts after the others made this epoch's step (it was
        # downloading the swarm's state as they stepped) looked for nobody for 7 s, stepped alone, and missed their
        # next round too. With overlap=full the others publish the next epoch as their round for this one begins
        # in the background: only after matchmaking_time is their matching surely over
        first_look = self.matchmaking_time + NOBODY_LEFT_CHECK if self.delay_grad_averaging else 0.0
        deadline, next_check = started + self.averaging_timeout, started + first_look
        self._with_others, self._empty_looks = self.tracker.global_progress.num_peers > 1, 0
        while True:
            try:
                return control.result(timeout=0.25)
            except FutureTimeout:
                if self.stop.is_set() or time.monotonic() > deadline:
                    raise
                if time.monotonic() > next_check:
                    next_check = time.monotonic() + NOBODY_LEFT_CHECK
                    self._nobody_left_to_join(control)

    def _nobody_left_to_join(self, control) -> None:
        """Ends a round still looking for a group once every other peer has made that epoch's step: they would never
        join it (at the last round before --max-epochs, they are done and leaving). It failed at once, so
        the peer downloads their state before it leaves (settle_before_leaving), rather than wait out
        averaging_timeout alone first while they linger as its donors."""
        epoch = self.local_epoch - (1 if self.delay_grad_averaging else 0)  # overlap=full: the epoch moved on
        # mid-run as at the last round: a round is matched among its epoch's peers only (grad_averager.EpochGroups),
        # so once every other peer has made this epoch's step nobody is left to join it (a late peer then steps on
        # its own and re-syncs at its next step, rather than search for averaging_timeout first)
        if control.stage != AveragingStage.LOOKING_FOR_GROUP:
            return
        me = self.dht.peer_id.to_base58()
        # nor a peer this one caught cheating: its averager refuses it as leader and as follower (robust_rounds), so
        # it never joins. A NaN attacker held on its epoch kept an honest peer, whose retry of a round the others
        # had applied, searching its whole averaging_timeout (45 s) while they made 4 epochs (a CI run, Dec 7)
        try:
            others = others_epochs(self.dht, self.run_id, me, refused=frozenset(self.rejections.caught_ever()))
        except Exception:  # a DHT that does not answer: wait on, as without this check
            return
        swarm = swarm_finished_without(others, epoch)
        # a round begun with others, whose records are all gone since: they said goodbye (or went silent for
        # PRESENT_FRESH_SECONDS), and nobody is left to join it. Twice in a row: one read that came back empty is
        # no proof. (The peer that stayed when its only groupmate left at --max-epochs waited out its whole
        # averaging_timeout here: 2 of 12 trials)
        gone = self._with_others and not others
        self._empty_looks = self._empty_looks + 1 if gone else 0
        if control.stage != AveragingStage.LOOKING_FOR_GROUP:
            return
        if swarm is not None:
            cancel_round(control)
            raise NobodyLeftToJoin(f"every other peer made epoch {epoch}'s step without this one (the swarm is at "
                                   f"epoch {swarm}); nobody is left to average with")
        if self._empty_looks >= EMPTY_LOOKS:
            cancel_round(control)
            raise NobodyLeftToJoin("every other peer left the run (their progress records are gone) or was caught "
                                   "cheating; nobody is left to average with")

    def finish_gradient_round(self, maybe_step_control) -> None:
        averaged, missed, left_out, ungrouped = False, False, None, False
        if maybe_step_control is not None:
            try:
                group = self._wait_for_round(maybe_step_control)
                if self._averaged_gradients_are_finite():
                    members = [peer.to_base58() for peer in group]
                    self.averaging_log.success(members, self.local_epoch)
                    averaged, group_size = True, len(group)
                else:
                    self.averaging_log.failure("averaged gradients not finite")
            except BaseException as e:  # timeouts, a peer that vanished mid-round: fall back to local gradients
                if not self.stop.is_set():  # (a round this peer cancelled to leave did not fail)
                    self.averaging_log.failure(round_failure(e))
                missed = isinstance(e, NobodyLeftToJoin)
                left_out = e if isinstance(e, LeftOutOfRound) else None
                failure = f"gradient averaging failed ({type(e).__name__}: {e})"
                if round_failure(e) == "no group found":
                    failure = why_no_group(self.local_epoch, self.client_mode, self.tracker.peers_seen,
                                           self.grad_averager.matchmaking_kwargs["min_matchmaking_time"])
                    ungrouped = self._others_on_this_epoch()  # others on its epoch may have made the round
            else:
                failure = "the averaged gradients were not finite" if not averaged else None
        else:
            failure = "no gradient round was running"
        # the averager's process counted the round's bytes just before it returned; the queue may lag a moment
        measuring = averaged and self.grad_averager.measures_noise
        round_traffic = self.traffic.end_round(wait=0.5 if averaged else 0.0, norms_wait=0.3 if measuring else 0.0)
        if measuring and round_traffic is not None and round_traffic.norms is not None:
            own_sq, own_samples, average_sq, group_samples = round_traffic.norms
            # the group's samples are known exactly to a peer that reduced a part (the weights it combined): one
            # that reduced none (a client; or a small model, whose one part another peer reduced) does not guess
            if group_samples and self.noise_scale.update(own_sq, own_samples, average_sq, group_samples):
                self.noise_inputs.append((self.local_epoch, own_sq, own_samples, average_sq, group_samples))
        if not averaged:
            if self.stop.is_set():
                # leaving: no step at all rather than one on local gradients. Loading them would also wait
                # for the averager process, which holds the gradient buffers until its all-reduce gives up
                # (with overlap=full, past the leave's grace: forced exits). In that mode this runs in hivemind's
                # background step, which logs what it raises: collab.modes.leaving.QuietLeave keeps that out of the
                # peer's log.
                raise LeavingMidStep()
            if missed and self._replayed_the_missed_round(failure):
                return
            # its groupmates stepped on their round: the same step, from one of them (collab.averaging.left_out)
            if left_out is not None and self._replayed_the_missed_round(
                    failure, donors_wait=min(DONORS_WAIT, self.averaging_timeout), groupmates=left_out.members):
                return
            # a peer that found no group while others on its epoch did is a few of one (64 peers on 2 cores: 37 of 58
            # failed rounds; each stepped alone and then downloaded the whole state)
            if ungrouped and self._replayed_as_one_of_the_few(failure, [self.dht.peer_id.to_base58()]):
                return
            self.load_own_gradients()
            self._record_own_step(failure)
        elif self._in_a_minority(members):
            peers = self.tracker.global_progress.num_peers
            few = f"its gradient round gathered {group_size} of the {peers} peers training"
            if not self._replayed_as_one_of_the_few(few, members):
                self.load_averaged_gradients()  # (not kept to serve: a few's round is no peer's to replay)
                self._record_own_step(few, whose="a few peers' gradients")
        else:
            if getattr(self.grad_averager, "serves_rounds", False) and not self.delay_grad_averaging:
                self.grad_averager.keep_round(self.local_epoch, members)  # for a peer that missed it (round_replay)
            self.load_averaged_gradients()

    def _others_on_this_epoch(self) -> bool:
        """Whether the last read of the progress records showed another peer on this epoch or the next: peers that
        may make (or have made) this epoch's round without this one."""
        me = self.dht.peer_id.to_base58()
        return any(record.epoch in (self.local_epoch, self.local_epoch + 1) for peer, record in
                   getattr(self.tracker, "records_seen", {}).items() if peer != me)

    def _replayed_as_one_of_the_few(self, why: str, members: list[str]) -> bool:
        """This peer's round gathered only `members` (itself alone: no group found): the many's round is the swarm's
        step, and applied here this replica stays the swarm's with no download (at 32 peers on 2 cores the few
        re-synced for 1.5-39 s and then began their next round late, splitting it). Whether it was applied."""
        if getattr(self.grad_averager, "serves_rounds", False):
            self.grad_averager.note_few(self.local_epoch, members)  # the other few learn of a round nobody won
        return self._replayed_the_missed_round(why, donors_wait=min(DONORS_WAIT, self.averaging_timeout),
                                               group=members)

    def _replayed_the_missed_round(self, failure: str, donors_wait: float = 0.0, group=(), groupmates=()) -> bool:
        """The round this peer missed (every other peer made this epoch's step without it; or the many of a split
        round, this peer among the few of `group`; or its own group's round, which a reducer left it out of:
        `groupmates` are asked first), applied from a peer that made it: the same step as theirs, with no download
        (collab.averaging.round_replay). Only for a replica in sync at this epoch; whether it was
        applied. Asked again for up to `donors_wait` seconds (the many may end their round after the few), unless
        the groups the other few name leave too few peers for any group to have won (collab.averaging.split_rounds)."""
        averager = self.grad_averager
        if not getattr(averager, "serves_rounds", False) or self.delay_grad_averaging or not self.in_sync():
            return False
        if self.downloaded_at_epoch == self.local_epoch:
            # a state downloaded during this epoch may lack a step: one a donor had yet to make when it served the
            # state, renumbered to the swarm's epoch by hivemind's catch-up (the fallback of base.py's
            # _download_a_stepped_state; before collab.averaging.served_state, any download mid-step). A replay on it
            # would look in step and stay one update behind: the split test's healed peer ended 0.034 from the others
            # so once. An own step instead marks it out of step, and the re-sync that follows brings it back
            return False
        epoch, started, me = self.local_epoch, time.monotonic(), self.dht.peer_id.to_base58()
        known = KnownGroups(frozenset(group) | {me}) if group else None
        for look in itertools.count():
            # the few know the many without waiting for their records of the next epoch (on 2 cores those came
            # seconds late): every other peer the last read showed on this epoch, the round's planned leader first;
            # the progress key, read every few looks, adds any peer it shows on the next epoch
            grouped = known.members() if known else set()  # the peers of a known group have no round to give
            donors = the_many(getattr(self.tracker, "records_seen", {}), epoch, grouped, me) if known else []
            if groupmates:
                caught = self.rejections.caught_ever()
                donors = random.sample(groupmates, len(groupmates))  # (a look asks a few of them; any has the round)
                donors = [peer for peer in donors if peer not in caught]
            if not donors or look % DONORS_READ_EVERY == 0:
                records = read_progress(self.dht, self.run_id)
                if swarm_moved_on(records, epoch, grouped | {me}):
                    # a donor keeps only the last round it applied: nobody has this one any more (12 peers on 2 cores:
                    # three starved ones asked for 15 s while the others made three epochs, then downloaded)
                    logger.warning(f"Epoch {epoch}: the other peers are past epoch {epoch + 1}: nobody keeps its round "
                                   "to replay")
                    return False
                donors += [peer for peer in round_donors(records, me, epoch)
                           if peer not in donors and peer not in grouped]
            try:
                answers = averager.fetch_round(epoch, donors, self.load_state_timeout, self.stop) if donors else None
            except Exception as e:
                logger.warning(f"Epoch {epoch}: could not fetch the round it missed ({type(e).__name__}: {e})")
                return False
            for donor, why in answers.refused if answers is not None else ():
                self.rejections.add(donor, why, "a replayed round")  # counted and attributed; the next is asked
            got = answers.round if answers is not None else None
            if got is None and known is not None and self._no_group_won(known, answers, epoch):
                return False
            if got is not None or time.monotonic() >= started + donors_wait or self.stop.wait(DONORS_POLL):
                break
        if got is None:
            return False
        donor, tensors = got
        with torch.no_grad(), averager.get_tensors() as like:
            why = what_is_wrong(tensors, list(like), averager._own_gradients)
        if why is not None:
            self.rejections.add(donor, why, "a missed round")  # counted and attributed, as every refusal
            logger.warning(f"Epoch {epoch}: refused the missed round's average from {donor}: {why}")
            return False
        averager.load_replayed_(tensors)
        many, why = round_group(donor, answers.group)  # the next round's leader is planned from the many's group
        if why is not None:
            self.rejections.add(donor, why, "a replayed round's group")
        averager.keep_round(epoch, many or ())  # the swarm's round, served in turn
        if many:
            averager.adopt_step_group(epoch, many)
        self.load_averaged_gradients()
        self.rounds_replayed += 1
        megabytes = sum(t.numel() * t.element_size() for t in tensors) / 1e6
        logger.warning(f"Epoch {epoch}: {failure}; applied that round's average from {donor} instead ({megabytes:.1f} "
                       f"MB in {time.monotonic() - started:.1f} s): the swarm's step, with no state download")
        return True

    def _no_group_won(self, known: KnownGroups, answers, epoch: int) -> bool:
        """Adds the groups the other few named in `answers` to `known` (refusing, counted, what cannot be); whether
        they show that no group of `epoch`'s round won: then nobody will keep it to replay."""
        for donor, claim in answers.fews if answers is not None else ():
            why = known.add(donor, claim)
            if why is not None:
                self.rejections.add(donor, why, "a split round's group")
        peers = self.tracker.global_progress.num_peers
        if not known.no_group_won(peers):
            return False
        logger.warning(f"Epoch {epoch}: its round split into groups of {known.sizes()} of the {peers} peers training, "
                       "none of them a majority: nobody has the round to replay")
        return True

    def load_own_gradients(self) -> None:
        # the gradients this peer sent into the failed round (hivemind would load its zeroed accumulators); when
        # no round took them, the accumulators still hold them and hivemind's own fallback is right
        own = self.grad_averager.take_own_gradients()
        if own is None:
            return super().load_own_gradients()
        self.grad_averager.restore_own_gradients_(own)
        self.load_averaged_gradients()

    def load_averaged_gradients(self) -> None:
        super().load_averaged_gradients()
        self.grad_averager.take_own_gradients()  # used: a later failure must not step on them again

    def tag_along(self, control) -> None:
        # on the way out, hivemind would sit through a running round (up to averaging_timeout) with zero
        # weight; a leaving peer cancels instead, and the group finishes without it
        if self.stop.is_set():
            cancel_round(control)
            return
        super().tag_along(control)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # with reuse_grad_buffers hivemind accumulates in .grad itself and clears it after each epoch
        if not self.grad_averager.reuse_grad_buffers:
            super().zero_grad(set_to_none)

    def schedule_gradient_round(self) -> None:
        # hivemind pre-schedules matchmaking even for a peer that is alone, and the fruitless search keeps
        # the DHT and averager processes busy (a third of a core here). With one peer there is nobody to
        # match; when another appears, begin_gradient_round still starts a round at the epoch's end.
        if self.tracker.global_progress.num_peers > 1:
            self.grad_averager.epoch = self.local_epoch
            if self._asked_to_lead_now():
                self.scheduled_grads = self.grad_averager.schedule_step(timeout=self.averaging_timeout)
                return
            super().schedule_gradient_round()

    def _asked_to_lead_now(self) -> bool:
        """Whether a peer already searching asked this one to lead this epoch's round before this peer's own reads
        said the epoch ends (collab.averaging.woken_leader), and no round of this peer's is under way."""
        asked = getattr(self.grad_averager, "asked_to_lead", lambda: None)()
        control = self.scheduled_grads
        if asked != self.local_epoch or not (control is None or control.triggered or control.done()):
            return False
        logger.debug(f"Epoch {self.local_epoch}: asked to lead its round by a peer already searching; beginning now")
        return True

    def _averaged_gradients_are_finite(self) -> bool:
        with torch.no_grad(), self.grad_averager.get_tensors() as tensors:
            return all(bool(torch.isfinite(t).all()) for t in tensors)


def read_progress(dht, run_id: str) -> dict:
    """The run's progress records as a fresh read finds them; none if the read failed."""
    try:
        return progress_records(dht, run_id)
    except Exception:
        return {}


def round_donors(records: dict, me: str, epoch: int) -> list[str]:
    """Peers whose records show the epoch after `epoch`: they keep its round (a peer further on kept a later one); a
    client-mode peer cannot be dialed."""
    return [peer for peer, record in records.items()
            if peer != me and record.epoch == epoch + 1 and not getattr(record, "client_mode", False)]


def swarm_moved_on(records: dict, epoch: int, known: set) -> bool:
    """Whether every peer of `records` outside `known` (this peer, and the groups of `epoch`'s round it knows) is
    past epoch + 1, at least one of them: each kept only its last round, a later one, and none can give `epoch`'s."""
    others = [record.epoch for peer, record in records.items() if peer not in known]
    return bool(others) and min(others) > epoch + 1


def the_many(records: dict, epoch: int, group, me: str) -> list[str]:
    """Peers (base58) that can have made `epoch`'s round in a group other than this peer's `group`: on that epoch or
    the next by `records` (the trainer's last read), no client (it cannot be dialed); the round's planned leader
    first, the rest shuffled (each look asks a few: round_replay.ASK_AT_MOST)."""
    members = set(group) | {me}
    others = [peer for peer, record in records.items() if peer not in members
              and record.epoch in (epoch, epoch + 1) and not getattr(record, "client_mode", False)]
    random.shuffle(others)
    leader = planned_leader(records, epoch)
    return sorted(others, key=lambda peer: peer != leader)


def optimizer_options(context: ModeContext) -> dict:
    """What averaging.mode sync sets beyond collab.train.make_optimizer's defaults: only the batch plan, when the run's
    target or learning rate follows the noise scale (collab.train.plan_keeper)."""
    return dict(optimizer_class=CollabOptimizer, plan_keeper=context.plan)
