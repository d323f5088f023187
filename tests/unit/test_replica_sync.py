"""collab.modes.replica_sync: the replica's sync state and the epoch its record may claim, through every transition a
sync-mode peer makes (without hivemind: the optimizer applies the effects)."""

from __future__ import annotations

from collab.modes.replica_sync import ReplicaSync


def test_an_own_step_holds_the_record_one_epoch_back_until_a_download_repairs_it():
    replica = ReplicaSync()
    assert replica.in_sync and replica.held_epoch is None and not replica.wants_resync
    replica.stepped_alone(epoch=5, peers=3, at=0.0)
    assert not replica.in_sync and replica.held_epoch == 4 and replica.own_step_to(5) and not replica.own_step_to(4)
    assert replica.wants_resync
    replica.start_resync()
    assert not replica.wants_resync, "a re-sync is tried once per own step, not at every step"
    assert replica.back_in_sync() and replica.in_sync and replica.held_epoch is None
    assert not replica.back_in_sync(), "already in sync: nothing to say"


def test_a_resync_with_no_donor_releases_the_hold_but_not_the_own_step():
    replica = ReplicaSync()
    replica.stepped_alone(epoch=7, peers=2, at=0.0)
    replica.start_resync()
    assert replica.stop_holding() and replica.held_epoch is None
    assert not replica.in_sync and not replica.stop_holding()
    # a second own step is a new one: the hold returns, and a re-sync may be tried again
    replica.stepped_alone(epoch=8, peers=2, at=1.0)
    assert replica.held_epoch == 7 and replica.wants_resync


def test_a_healed_lineage_split_renumbers_the_own_step_and_its_hold():
    replica = ReplicaSync()
    replica.renumbered(by=1)  # in sync: nothing to move
    assert replica.in_sync and replica.held_epoch is None
    replica.stepped_alone(epoch=3, peers=2, at=0.0)
    replica.renumbered(by=1)
    assert replica.own_step_to(4) and replica.held_epoch == 3
    replica.stop_holding()
    replica.renumbered(by=1)
    assert replica.own_step_to(5) and replica.held_epoch is None, "a released hold stays released"


def test_a_state_round_of_the_whole_swarm_repairs_an_own_step_only_when_no_peer_could_give_its_state():
    """A state round averages parameters, not the optimizer's moments: while a download may still bring both, it is
    no repair (a CI run's slow peer, "repaired" so, ended 3.8e-2 from the swarm)."""
    replica = ReplicaSync()
    assert not replica.repaired_by(lambda epoch: 99), "in sync: nothing to repair"
    replica.stepped_alone(epoch=6, peers=3, at=0.0)
    assert not replica.repaired_by(lambda epoch: 3), "a download is still to be tried"
    replica.start_resync()
    assert not replica.repaired_by(lambda epoch: 3), "a download is under way"
    replica.stop_holding()  # it found no donor
    asked = []

    def gathered_since(epoch: int) -> int:
        asked.append(epoch)
        return 2

    assert not replica.repaired_by(gathered_since) and asked == [6], "2 of the 3 peers of the own step's time"
    assert replica.repaired_by(lambda epoch: 3)
    # a later own step is a new one: a download is tried for it first
    replica.stepped_alone(epoch=9, peers=3, at=1.0)
    assert not replica.repaired_by(lambda epoch: 3)


def test_a_leaving_peer_lets_a_state_round_under_way_finish_and_asks_whether_anyone_is_left():
    import threading
    import time
    from types import SimpleNamespace

    from hivemind.averaging.control import AveragingStage

    from collab.averaging.replica import RecordingStateAverager, others_present

    running = SimpleNamespace(stage=AveragingStage.RUNNING_ALLREDUCE)
    averager = SimpleNamespace(round_controls=lambda: [SimpleNamespace(stage=AveragingStage.FINISHED), running])
    finish = lambda limit: RecordingStateAverager.finish_running_rounds(averager, threading.Event(), limit)  # noqa: E731
    threading.Timer(0.3, lambda: setattr(running, "stage", AveragingStage.FINISHED)).start()
    began = time.monotonic()
    finish(5.0)
    assert 0.25 < time.monotonic() - began < 2.0, "it must wait for the all-reduce under way, and no longer"
    running.stage = AveragingStage.RUNNING_ALLREDUCE  # one that never ends: waited for `limit` at most
    began = time.monotonic()
    finish(0.3)
    assert 0.25 < time.monotonic() - began < 2.0

    class DHT:
        def __init__(self, fails):
            self.fails = fails

        def get(self, key, latest=False):
            if self.fails:
                raise TimeoutError("no answer")
            return None  # every other peer said goodbye: no record left

    assert not others_present(DHT(fails=False), "run", "me")
    assert others_present(DHT(fails=True), "run", "me"), "a DHT that does not answer must not make a peer cancel"


def test_a_round_begun_with_others_is_given_up_once_all_of_them_left(monkeypatch):
    # the peer that stays when its only groupmate leaves at --max-epochs: its round, begun while the other was there,
    # waited out the whole averaging_timeout for nobody (2 of 12 trials). Two looks in a row that find no other
    # record end it; a peer alone from the start, or a DHT that does not answer, waits as before
    import threading
    import time
    from concurrent.futures import TimeoutError as FutureTimeout
    from types import SimpleNamespace

    from hivemind.averaging.control import AveragingStage

    from collab.modes import sync
    from collab.modes.round_failures import NobodyLeftToJoin
    from collab.modes.sync import CollabOptimizer

    monkeypatch.setattr(sync, "NOBODY_LEFT_CHECK", 0.05)

    class Round:
        stage, cancelled = AveragingStage.LOOKING_FOR_GROUP, False

        def result(self, timeout):
            time.sleep(min(timeout, 0.02))
            raise FutureTimeout()

        def done(self):
            return self.cancelled

        def cancel(self):
            self.cancelled = True

    class DHT:
        peer_id = SimpleNamespace(to_base58=lambda: "me")

        def __init__(self, fails=False):
            self.fails = fails

        def get(self, key, latest=False):
            if self.fails:
                raise TimeoutError("no answer")
            return None  # no progress record but our own: everyone else said goodbye

    def waiting(peers_at_start, dht, matchmaking_time=0.05, delayed=False, caught=()):
        opt = object.__new__(CollabOptimizer)
        opt.rejections = SimpleNamespace(caught_ever=lambda: set(caught))
        opt.dht, opt.run_id, opt.stop = dht, "run", threading.Event()
        opt._parent_pid = None  # (hivemind's __del__ would shut down the averagers this one never started)
        # (overlap=full: the round is for the epoch before local_epoch)
        opt.state_averager = SimpleNamespace(local_epoch=8 if delayed else 7)
        opt.delay_grad_averaging = delayed
        opt.matchmaking_time, opt.averaging_timeout = matchmaking_time, 1.5
        opt.tracker = SimpleNamespace(global_progress=SimpleNamespace(num_peers=peers_at_start))
        control = Round()
        began = time.monotonic()
        try:
            opt._wait_for_round(control)
        except BaseException as e:  # noqa: BLE001 - which one is the point
            return e, time.monotonic() - began, control
        raise AssertionError("a round that never ends returned")

    error, took, control = waiting(2, DHT())
    assert isinstance(error, NobodyLeftToJoin) and "left the run" in str(error), error
    assert took < 1.0 and control.cancelled
    # alone from the start (a first peer waiting for others) or a DHT that does not answer: the timeout, as before
    for peers, dht in ((1, DHT()), (2, DHT(fails=True))):
        error, took, control = waiting(peers, dht)
        assert isinstance(error, FutureTimeout) and took >= 1.5 and not control.cancelled, (peers, error)
    # every other peer made this epoch's step already (this one was downloading their state as they stepped): given
    # up at the first look, not after matchmaking_time; with overlap=full their records say the next epoch while
    # their round for this one is still matching, so not before it
    monkeypatch.setattr(sync, "others_epochs", lambda dht, run_id, me, refused=frozenset(): [8, 9])
    for delayed, within in ((False, (0.0, 0.5)), (True, (1.0, 1.5))):
        error, took, control = waiting(2, DHT(), matchmaking_time=1.0, delayed=delayed)
        assert isinstance(error, NobodyLeftToJoin) and "the swarm is at epoch 9" in str(error), error
        assert within[0] <= took < within[1] and control.cancelled, (delayed, took)
    # still on this epoch: a peer this one caught cheating, whom its averager never lets in (robust_rounds), is nobody
    # to wait for; one not caught may yet join, and the round waits on
    import collab.averaging.replica as replica

    now = time.time()
    monkeypatch.setattr(sync, "others_epochs", replica.others_epochs)
    monkeypatch.setattr(replica, "progress_records", lambda dht, run_id: {
        "honest": SimpleNamespace(epoch=9, time=now), "nan": SimpleNamespace(epoch=7, time=now)})
    error, took, control = waiting(2, DHT(), caught={"nan"})
    assert isinstance(error, NobodyLeftToJoin) and "the swarm is at epoch 9" in str(error), error
    assert took < 0.5 and control.cancelled
    error, took, control = waiting(2, DHT())
    assert isinstance(error, FutureTimeout) and not control.cancelled, error


def test_a_leaving_peer_waits_for_its_goodbye_to_be_stored():
    # hivemind sends the goodbye (its progress record cleared) and goes on: the DHT was shut down under it 3 times
    # in 10, and the peer that stayed took the one that left for a state donor for 30 s
    import multiprocessing
    import os
    import threading
    import time
    from concurrent.futures import Future

    from collab.modes.tracker import HonestProgressTracker

    stores = []

    class DHT:
        def __init__(self):
            # a pipe to a DHT process that reads it, as far as select can tell (nothing reads it here)
            self._reader, self._outer_pipe = multiprocessing.Pipe(duplex=False)

        def store(self, key, subkey, value, expiration_time, return_future=False):
            stored = Future()
            stores.append((key, value, stored))
            threading.Timer(0.3, stored.set_result, args=(True,)).start()  # a store walk takes a moment
            return stored

    tracker = object.__new__(HonestProgressTracker)
    threading.Thread.__init__(tracker)  # (a thread never started: hivemind runs its reporter in it)
    tracker.dht, tracker.training_progress_key, tracker._local_public_key = DHT(), "run_progress", b"me"
    tracker.metadata_expiration = 60.0
    for name in ("shutdown_triggered", "should_report_progress", "global_state_updated", "shutdown_complete"):
        setattr(tracker, name, threading.Event())
    tracker.shutdown_complete.set()  # the reporter task has ended
    began = time.monotonic()
    tracker.shutdown(1.0)
    assert stores and all(key == "run_progress" and value is None for key, value, _ in stores), stores
    assert stores[-1][2].done(), "it left before its goodbye was stored"
    assert 0.25 < time.monotonic() - began < 2.5

    # a DHT process that stopped reading its pipe: hivemind's store would block the leave for good; none is sent
    stores.clear()
    tracker.dht = DHT()
    fd = tracker.dht._outer_pipe.fileno()
    os.set_blocking(fd, False)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except BlockingIOError:
        pass
    began = time.monotonic()
    tracker.shutdown(1.0)
    assert not stores and time.monotonic() - began < 0.5


def test_a_resync_after_an_own_step_waits_for_a_peer_that_made_the_swarms_step(monkeypatch):
    # the two peers of a 2-of-12 split round re-synced at once: every donor was still an epoch behind (the ten were
    # in their round), so each released its hold, and they downloaded each other's state: 1e-2 off the swarm to the
    # end (CI). The re-sync now waits until a peer's progress says the epoch (the swarm's step), within a limit
    import threading
    import time

    import collab.averaging.replica as replica

    seen = iter([[4, 4, 4], [4, 4, 4], [4, 5, 4]])
    monkeypatch.setattr(replica, "others_epochs", lambda dht, run_id, me, refused=frozenset(): next(seen))
    stop = threading.Event()
    assert replica.wait_for_a_donor_at(None, "run", "me", 5, stop, limit=5.0, pause=0.01)
    # nobody makes the step: given up after the limit; alone or a DHT that does not answer: at once
    monkeypatch.setattr(replica, "others_epochs", lambda dht, run_id, me, refused=frozenset(): [4, 4])
    began = time.monotonic()
    assert not replica.wait_for_a_donor_at(None, "run", "me", 5, stop, limit=0.3, pause=0.05)
    assert 0.2 <= time.monotonic() - began < 1.0
    monkeypatch.setattr(replica, "others_epochs", lambda dht, run_id, me, refused=frozenset(): [])
    assert not replica.wait_for_a_donor_at(None, "run", "me", 5, stop, limit=30.0)

    def no_answer(dht, run_id, me, refused=frozenset()):
        raise TimeoutError("the DHT")

    monkeypatch.setattr(replica, "others_epochs", no_answer)
    began = time.monotonic()
    assert not replica.wait_for_a_donor_at(None, "run", "me", 5, stop, limit=30.0)
    assert time.monotonic() - began < 1.0


def test_state_round_outcomes_are_counted_by_how_each_round_ended():
    from concurrent.futures import Future

    from collab.averaging.replica import RoundOutcomes

    outcomes, rounds = RoundOutcomes(), [Future() for _ in range(5)]
    for control in rounds:
        control.add_done_callback(outcomes.add)
    rounds[0].set_result({"a": b"", "b": b"", "c": b""})  # a group of 3
    rounds[1].set_result({"a": b"", "b": b""})
    rounds[2].cancel()  # given up: no group in time
    rounds[3].set_exception(TimeoutError("averaging timed out"))
    rounds[4].set_result(None)  # nothing gathered: not an average
    assert outcomes.counts() == {"ok": 2, "given_up": 1, "failed": 2, "peers": 5}


def test_a_state_round_looks_on_while_the_next_gradient_round_is_matching_too_and_no_longer():
    """At 32 peers on 2 cores a state round's group of the whole swarm formed 5-8 s after its first peers began, and
    the next step gave it up 6 s after (matchmaking_time past its scheduled time) as it formed, though that step
    then waited seconds more for its gradient round's group. While the gradient round is matching, the state round
    looks on, up to HOLD_MOST x the patience past its scheduled time."""
    import threading
    import time
    from types import SimpleNamespace

    from hivemind.averaging.control import AveragingStage
    from hivemind.utils.timed_storage import get_dht_time

    from collab.averaging.replica import HOLD_MOST, RecordingStateAverager

    class Round:
        def __init__(self, late: float):
            self.scheduled_time, self.given_up = get_dht_time() - late, False
            self.stage = AveragingStage.LOOKING_FOR_GROUP

        def done(self):
            return self.given_up

        def cancel(self):
            self.given_up = True

    def seconds_to_give_up(hold, patience: float = 1.0) -> float:
        state_round = Round(late=patience + 0.05)
        averager = SimpleNamespace(rounds=[(5, state_round)], pending_updates=[])
        began = time.monotonic()
        assert RecordingStateAverager.give_up_matchmaking(averager, 5, patience, threading.Event(), limit=10.0,
                                                          hold=hold) == 1
        assert state_round.given_up
        return time.monotonic() - began

    # (each wait polls every 0.1 s; bounds with room for a busy CI worker)
    assert seconds_to_give_up(lambda: False) < 0.6  # past its patience, the gradient round matched: given up
    # the gradient round still matching: the state round looks on, HOLD_MOST x the patience past its time at most
    assert HOLD_MOST - 1 - 0.1 < seconds_to_give_up(lambda: True) < HOLD_MOST - 1 + 0.6
    matched_at = time.monotonic() + 0.2  # ... or until the gradient round found its group
    assert 0.15 < seconds_to_give_up(lambda: time.monotonic() < matched_at) < 0.7
