"""A missed round's average comes from another peer: untrusted input, checked before it is applied
(collab.averaging.round_replay)."""

from __future__ import annotations

import torch

from collab.averaging.round_replay import NORM_RATIO, what_is_wrong


def _like():
    return [torch.zeros(4, 3), torch.zeros(5)]


def test_an_honest_average_is_applied_and_a_bad_one_is_refused_with_the_reason():
    own = [torch.ones(4, 3), torch.ones(5)]
    honest = [0.5 * t for t in own]  # averaging with others shrinks the noise: a smaller norm than one's own
    assert what_is_wrong(honest, _like(), own) is None
    assert what_is_wrong(honest, _like(), None) is None  # own gradients already used: the other checks still hold
    assert what_is_wrong(honest[:1], _like(), own) == "an average of the wrong shape"
    assert what_is_wrong([torch.ones(3, 4), torch.ones(5)], _like(), own) == "an average of the wrong shape"
    assert what_is_wrong(["not a tensor", torch.ones(5)], _like(), own) == "an average of the wrong shape"
    assert what_is_wrong([torch.full((4, 3), float("nan")), torch.ones(5)], _like(), own) == \
        "an average that is not finite"
    assert what_is_wrong([torch.zeros(4, 3), torch.zeros(5)], _like(), own) == "an average of zeros"
    huge = [2 * NORM_RATIO * t for t in own]
    assert what_is_wrong(huge, _like(), own) == f"an average {2 * NORM_RATIO:.3g}x the norm of this peer's own gradients"


class _Asked(BaseException):
    """The guard under test let the replay go on to ask the swarm (not an Exception: the replay swallows those)."""


def _peer_at(epoch: int, downloaded_at):
    """Just what CollabOptimizer._replayed_the_missed_round reads before it asks anyone for the round."""
    from types import SimpleNamespace

    averager = SimpleNamespace(serves_rounds=True)
    return SimpleNamespace(grad_averager=averager, delay_grad_averaging=False, in_sync=lambda: True,
                           local_epoch=epoch, downloaded_at_epoch=downloaded_at, run_id="run",
                           dht=SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "me")))


def test_a_round_is_not_replayed_onto_a_state_downloaded_in_the_same_epoch(monkeypatch):
    """A download during epoch E may lack a step (a donor's state renumbered to the swarm's epoch): a replay of E's
    round on it would look in step and stay one update behind. The guard must refuse before it reads a record or dials
    a donor; a download one epoch earlier must not stop the replay (it goes on to read the records: the second half
    fails if the guard is too wide)."""
    import collab.modes.sync as sync

    def asked(*args, **kwargs):
        raise _Asked()

    monkeypatch.setattr(sync, "progress_records", asked)
    replay = sync.CollabOptimizer._replayed_the_missed_round
    assert replay(_peer_at(8, downloaded_at=8), "no group found") is False
    for downloaded_at in (7, None):
        try:
            replay(_peer_at(8, downloaded_at=downloaded_at), "no group found")
        except _Asked:
            continue
        raise AssertionError(f"a download at epoch {downloaded_at} stopped epoch 8's replay before it asked the swarm")


class _Averager:
    """The gradient averager as CollabOptimizer.finish_gradient_round and the replay use it: the buffers hold the
    round's average; `kept`: what it serves to peers that missed the round. `answers`: what each fetch returns."""
    serves_rounds, measures_noise = True, False

    def __init__(self, averaged, own, answers):
        self.buffers, self._own_gradients, self.answers = [averaged.clone()], [own.clone()], list(answers)
        self.kept, self.asked = [], []

    def get_tensors(self):
        from contextlib import nullcontext
        return nullcontext(self.buffers)

    def keep_round(self, epoch):
        self.kept.append((epoch, self.buffers[0].clone()))

    def fetch_round(self, epoch, donors, timeout, stop=None):
        self.asked.append((epoch, list(donors)))
        return self.answers.pop(0) if self.answers else None

    def load_replayed_(self, tensors):
        self.buffers[0].copy_(tensors[0])


def _few_of_a_split(averaged, own, answers, records_seen=None):
    """A CollabOptimizer (its constructor skipped) at epoch 8 whose round averaged with 3 of the 12 peers training."""
    import threading
    from types import SimpleNamespace

    from collab.modes.sync import CollabOptimizer

    peer = object.__new__(CollabOptimizer)
    applied, own_steps = [], []
    group = [SimpleNamespace(to_base58=lambda i=i: f"few{i}") for i in range(3)]
    tracker = SimpleNamespace(global_progress=SimpleNamespace(num_peers=12), records_seen=records_seen or {})
    peer.__dict__.update(
        grad_averager=_Averager(averaged, own, answers), state_averager=SimpleNamespace(local_epoch=8),
        tracker=tracker, delay_grad_averaging=False, rejections=SimpleNamespace(add=lambda *a: None),
        stop=threading.Event(), in_sync=lambda: True, downloaded_at_epoch=None, rounds_replayed=0, run_id="run",
        load_state_timeout=5.0, dht=SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "few0")),
        averaging_log=SimpleNamespace(success=lambda *a: None), traffic=SimpleNamespace(end_round=lambda **k: None),
        _wait_for_round=lambda control: group, _averaged_gradients_are_finite=lambda: True,
        load_averaged_gradients=lambda: applied.append(peer.grad_averager.buffers[0].clone()),
        _record_own_step=lambda why, whose="": own_steps.append(whose), _parent_pid=-1)
    return peer, applied, own_steps


def test_the_few_of_a_split_round_apply_the_manys_round_and_serve_it(monkeypatch):
    """The few of a split (3 of 12) made a step the many did not: they re-synced by a state download, seconds at 32
    peers, and began their next round late. Now they ask the many for their round (the same step as theirs, with no
    download) until one has it, and serve it, not their own average, to others."""
    from types import SimpleNamespace

    import collab.modes.sync as sync

    monkeypatch.setattr(sync, "DONORS_POLL", 0.01)
    monkeypatch.setattr(sync, "progress_records", lambda dht, run_id: {})  # no record of the many's next epoch yet
    seen = {"many1": SimpleNamespace(epoch=8), "many2": SimpleNamespace(epoch=9), "few1": SimpleNamespace(epoch=8),
            "nat": SimpleNamespace(epoch=8, client_mode=True), "behind": SimpleNamespace(epoch=6)}
    few, many, own = torch.full((3,), 1.0), torch.full((3,), 2.0), torch.full((3,), 1.5)
    peer, applied, own_steps = _few_of_a_split(few, own, [None, ("many2", [many])], seen)  # not kept at first ask
    peer.finish_gradient_round(SimpleNamespace())
    assert [sorted(donors) for _, donors in peer.grad_averager.asked] == [["many1", "many2"]] * 2
    assert peer.rounds_replayed == 1 and own_steps == [] and torch.equal(applied[-1], many)  # the many's step
    kept = peer.grad_averager.kept  # the many's round, never the few's own average
    assert [epoch for epoch, _ in kept] == [8] and torch.equal(kept[0][1], many)
    # a record of the many's next epoch names a donor too (a peer this one's last read had not shown)
    monkeypatch.setattr(sync, "progress_records", lambda dht, run_id: {"late": SimpleNamespace(epoch=9)})
    peer, applied, own_steps = _few_of_a_split(few, own, [("late", [many])])
    peer.finish_gradient_round(SimpleNamespace())
    assert peer.grad_averager.asked == [(8, ["late"])] and peer.rounds_replayed == 1
    # none of the many has it within DONORS_WAIT: an own step, re-synced later, as before
    monkeypatch.setattr(sync, "DONORS_WAIT", 0.05)
    peer, applied, own_steps = _few_of_a_split(few, own, [], seen)
    peer.finish_gradient_round(SimpleNamespace())
    assert len(peer.grad_averager.asked) >= 2 and peer.rounds_replayed == 0 and own_steps == ["a few peers' gradients"]
    # the few's own average is their step, and no peer's to replay: with no majority (7 + 9 + 11 + 5 of 32), a few that
    # served theirs had others of another few apply it and claim to be in sync
    assert torch.equal(applied[-1], few) and peer.grad_averager.kept == []
    # the many keep their round to serve, and ask nobody
    peer, applied, own_steps = _few_of_a_split(few, own, [], seen)
    peer.tracker.global_progress.num_peers = 5  # 3 of 5
    peer.finish_gradient_round(SimpleNamespace())
    assert peer.grad_averager.asked == [] and own_steps == [] and torch.equal(applied[-1], few)
    assert [(epoch, torch.equal(tensor, few)) for epoch, tensor in peer.grad_averager.kept] == [(8, True)]
    # a forged "average" from a peer of the many is refused: an own step, and the few's own average stays
    peer, applied, own_steps = _few_of_a_split(few, own, [("many1", [torch.full((3,), 1e6)])], seen)
    peer.finish_gradient_round(SimpleNamespace())
    assert peer.rounds_replayed == 0 and own_steps == ["a few peers' gradients"] and torch.equal(applied[-1], few)


def test_a_leaving_peer_stops_waiting_for_a_round_it_fetches():
    """At the end of a 32-peer run the few were fetching the many's round when told to leave; the donors, leaving
    too, answered late, and 5 peers overran their leave's grace. A set stop ends the wait within STOP_LOOK."""
    import threading
    import time
    from types import SimpleNamespace

    from collab.averaging.round_replay import STOP_LOOK, ServedRounds

    averager = object.__new__(ServedRounds)
    averager._outer_pipe = SimpleNamespace(send=lambda message: None)  # the averager's process never answers
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    assert averager.fetch_round(8, ["many1"], timeout=30.0, stop=stop) is None
    assert 0.2 <= time.monotonic() - started < 0.2 + 4 * STOP_LOOK
