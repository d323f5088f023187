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
        self.kept, self.asked, self.noted, self.groups, self.adopted = [], [], [], [], []

    def get_tensors(self):
        from contextlib import nullcontext
        return nullcontext(self.buffers)

    def keep_round(self, epoch, group=()):
        self.kept.append((epoch, self.buffers[0].clone()))
        self.groups.append(sorted(group))

    def adopt_step_group(self, epoch, group):
        self.adopted.append((epoch, sorted(group)))

    def note_few(self, epoch, members):
        self.noted.append((epoch, list(members)))

    def fetch_round(self, epoch, donors, timeout, stop=None):
        from collab.averaging.round_replay import RoundAnswers

        self.asked.append((epoch, list(donors)))
        answer = self.answers.pop(0) if self.answers else None
        return answer if isinstance(answer, RoundAnswers) else RoundAnswers(round=answer)

    def load_replayed_(self, tensors):
        self.buffers[0].copy_(tensors[0])


def _few_of_a_split(averaged, own, answers, records_seen=None):
    """A CollabOptimizer (its constructor skipped) at epoch 8 whose round averaged with 3 of the 12 peers training."""
    import threading
    from types import SimpleNamespace

    from collab.modes.sync import CollabOptimizer

    peer = object.__new__(CollabOptimizer)
    applied, own_steps, refused = [], [], []
    group = [SimpleNamespace(to_base58=lambda i=i: f"few{i}") for i in range(3)]
    tracker = SimpleNamespace(global_progress=SimpleNamespace(num_peers=12), records_seen=records_seen or {})
    peer.__dict__.update(
        grad_averager=_Averager(averaged, own, answers), state_averager=SimpleNamespace(local_epoch=8),
        tracker=tracker, delay_grad_averaging=False, rejections=SimpleNamespace(add=lambda *a: refused.append(a)),
        averaging_timeout=30.0, refused=refused,
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


def test_the_few_stop_waiting_once_the_other_few_show_that_no_group_won(monkeypatch):
    """A round split with no majority (7 + 14 + 8 + 3 of 32): nobody keeps it, and each few waited the whole
    DONORS_WAIT for it. Now a few that is asked says which group it was in; once the groups known leave too few peers
    for any group to have won, the asker steps on its own at once. A forged claim (it names a peer of the asker's own
    group) is refused, counted against its sender, and does not end the wait."""
    import time
    from types import SimpleNamespace

    import collab.modes.sync as sync
    from collab.averaging.round_replay import RoundAnswers

    monkeypatch.setattr(sync, "DONORS_POLL", 0.01)
    monkeypatch.setattr(sync, "progress_records", lambda dht, run_id: {})
    seen = {f"p{i}": SimpleNamespace(epoch=8) for i in range(3, 12)}
    few, own = torch.full((3,), 1.0), torch.full((3,), 1.5)
    forged = RoundAnswers(fews=[("p3", ["p3", "few1"])])  # few1 is in this peer's own group of 3
    other_few = RoundAnswers(fews=[("p4", ["p4", "p5", "p6", "p7"])])  # 3 + 4 of 12 known: 5 unknown, no majority
    peer, applied, own_steps = _few_of_a_split(few, own, [forged, RoundAnswers(), other_few], seen)
    started = time.monotonic()
    peer.finish_gradient_round(SimpleNamespace())
    assert time.monotonic() - started < sync.DONORS_WAIT / 2  # not the whole wait
    assert len(peer.grad_averager.asked) == 3 and own_steps == ["a few peers' gradients"] and peer.rounds_replayed == 0
    assert torch.equal(applied[-1], few) and peer.grad_averager.kept == []
    assert peer.grad_averager.noted == [(8, ["few0", "few1", "few2"])]  # it told its own askers the same
    assert [(donor, what) for donor, _, what in peer.refused] == [("p3", "a split round's group")]
    # the peers of a known group are asked no more: they have no round to give
    last_donors = set(peer.grad_averager.asked[-1][1])
    assert not last_donors & {"few0", "few1", "few2"}
    # a group that leaves half the peers unknown (3 + 3 of 12: 6 unknown) could be beaten by one of 6: it waits on
    monkeypatch.setattr(sync, "DONORS_WAIT", 0.2)
    reads = []
    monkeypatch.setattr(sync, "progress_records", lambda dht, run_id: reads.append(1) or {})
    peer, applied, own_steps = _few_of_a_split(few, own, [RoundAnswers(fews=[("p4", ["p4", "p5", "p6"])])], seen)
    peer.finish_gradient_round(SimpleNamespace())
    looks = len(peer.grad_averager.asked)
    assert looks > 3 and peer.refused == []
    assert not any("p4" in donors for _, donors in peer.grad_averager.asked[1:])
    # while the last read names peers to ask, the progress key is read once every DONORS_READ_EVERY looks, not each
    assert len(reads) == -(-looks // sync.DONORS_READ_EVERY)


def test_a_claim_of_a_split_rounds_group_is_checked():
    from collab.averaging.split_rounds import KnownGroups

    known = KnownGroups(frozenset({"a", "b", "c"}))
    assert known.add("d", "d,e") == "a malformed claim of its round's group"
    assert known.add("d", []) == "a malformed claim of its round's group"
    assert known.add("d", ["d", 7]) == "a malformed claim of its round's group"
    assert known.add("d", ["e", "f"]) == "a claim of a group it is not in, or that names a peer twice"
    assert known.add("d", ["d", "d"]) == "a claim of a group it is not in, or that names a peer twice"
    assert known.add("d", ["d", "a"]) == "a claim of a group that overlaps another group of the same round"
    assert known.add("d", ["d", "e"]) is None and known.add("e", ["e", "d"]) is None  # the same group twice: no news
    assert known.add("f", ["f", "e"]) == "a claim of a group that overlaps another group of the same round"
    assert known.sizes() == [3, 2]
    assert known.no_group_won(9)  # 5 of 9 in known groups: 4 unknown
    assert not known.no_group_won(10)  # 5 unknown of 10: one group of 5 would be an even split's half
    assert not known.no_group_won(12)


def test_a_few_tells_its_askers_its_group_and_a_donor_its_round():
    """What rpc_download_round sends, read back by _ask_for_round as the asker's process does (no sockets): a peer
    that kept nothing but was among the few of a round says which group; one that kept a round sends it."""
    import asyncio
    import multiprocessing as mp
    from types import SimpleNamespace

    from hivemind.utils.serializer import MSGPackSerializer

    from collab.averaging.round_replay import ServedRounds

    def averager():
        one = object.__new__(ServedRounds)
        one.serializer, one.prefix, one._p2p = MSGPackSerializer, "run", None
        one.prepare_served_round([torch.zeros(4, 3), torch.zeros(5)])
        return one

    donor, asker = averager(), averager()
    asker.get_stub = lambda p2p, peer, namespace: SimpleNamespace(
        rpc_download_round=lambda request: _as_awaitable(donor.rpc_download_round(request, None)))

    def ask(epoch):
        return asyncio.run(asker._ask_for_round(None, timeout=5.0, epoch=epoch))

    assert ask(8) == (None, None)  # nothing kept, no few: nothing to say
    asyncio.run(donor._note_few(8, ["d", "e"]))
    assert ask(8) == (None, {"epoch": 8, "members": ["d", "e"]})
    for kept, tensor in zip(donor._served, (torch.ones(4, 3), torch.full((5,), 2.0))):
        kept.copy_(tensor)
    donor._served_epoch = mp.Value("i", 9, lock=False)
    got, few = ask(9)
    assert got[0] == 9 and torch.equal(got[1][0], torch.ones(4, 3)) and torch.equal(got[1][1], torch.full((5,), 2.0))
    assert got[2] is None  # no group noted for epoch 9's round
    asyncio.run(donor._note_served_group(9, ["a", "b", "c"]))
    assert ask(9)[0][2] == ["a", "b", "c"]
    asyncio.run(donor._note_served_group(7, ["a", "b"]))  # an older round's group is not epoch 9's
    assert ask(9)[0][2] is None
    assert few == {"epoch": 8, "members": ["d", "e"]}
    assert ask(8) == (None, {"epoch": 8, "members": ["d", "e"]})  # epoch 9's round is not epoch 8's


async def _as_awaitable(stream):
    return stream


def test_a_peer_that_replays_the_manys_round_plans_the_next_round_from_the_manys_group(monkeypatch):
    """The few of a split that replayed the many's round planned the next round's leader from their own few's group
    (collab.averaging.planned_leader.on_the_swarms_step), another leader than the many's, and the next round split
    again (26 + 6 at 32 peers). The donor names the group that made the round; the peer that replays it takes that
    group as its step's, and serves it on. A group that does not name its donor is refused and counted."""
    from types import SimpleNamespace

    import collab.modes.sync as sync
    from collab.averaging.round_replay import RoundAnswers

    monkeypatch.setattr(sync, "progress_records", lambda dht, run_id: {})
    seen = {f"p{i}": SimpleNamespace(epoch=8) for i in range(3, 12)}
    few, own, many = torch.full((3,), 1.0), torch.full((3,), 1.5), torch.full((3,), 2.0)
    group = [f"p{i}" for i in range(3, 12)]
    peer, applied, own_steps = _few_of_a_split(few, own, [RoundAnswers(round=("p3", [many]), group=group)], seen)
    peer.finish_gradient_round(SimpleNamespace())
    averager = peer.grad_averager
    assert peer.rounds_replayed == 1 and averager.adopted == [(8, sorted(group))] and averager.groups == [sorted(group)]
    for forged in (["p4", "p5"], ["p3", "p3"], "p3"):
        peer, applied, own_steps = _few_of_a_split(few, own, [RoundAnswers(round=("p3", [many]), group=forged)], seen)
        peer.finish_gradient_round(SimpleNamespace())
        assert peer.rounds_replayed == 1 and peer.grad_averager.adopted == [] and peer.grad_averager.groups == [[]]
        assert [(donor, what) for donor, _, what in peer.refused] == [("p3", "a replayed round's group")]
    # the many keep their round with their own group, to serve
    peer, applied, own_steps = _few_of_a_split(few, own, [], seen)
    peer.tracker.global_progress.num_peers = 5  # 3 of 5
    peer.finish_gradient_round(SimpleNamespace())
    assert peer.grad_averager.groups == [["few0", "few1", "few2"]] and peer.grad_averager.adopted == []


def test_a_peer_that_found_no_group_applies_the_round_its_epochs_peers_made(monkeypatch):
    """64 peers on 2 cores: 37 of 58 failed rounds were "no group found" while the rest of the swarm averaged. Each
    such peer stepped on its own gradients and then downloaded the whole state. Now it is a few of one: it says so to
    its askers, asks the peers of its epoch for their round, and applies it (the swarm's step, with no download). A
    peer the last read showed alone on its epoch asks nobody and steps on its own, as before."""
    from types import SimpleNamespace

    import collab.modes.sync as sync

    def no_group(control):
        raise RuntimeError("Averaging step failed: could not find a group")

    monkeypatch.setattr(sync, "DONORS_POLL", 0.01)
    monkeypatch.setattr(sync, "progress_records", lambda dht, run_id: {})
    own, many = torch.full((3,), 1.5), torch.full((3,), 2.0)
    on_its_epoch = {"many1": SimpleNamespace(epoch=8), "many2": SimpleNamespace(epoch=9)}
    for seen, replayed in ((on_its_epoch, True), ({"behind": SimpleNamespace(epoch=6)}, False)):
        peer, applied, own_steps = _few_of_a_split(own, own, [None, ("many2", [many])], seen)
        failures, own_loads = [], []
        peer.__dict__.update(
            _wait_for_round=no_group, client_mode=False, averaging_log=SimpleNamespace(failure=failures.append),
            load_own_gradients=lambda: own_loads.append(1))
        peer.tracker.peers_seen = [(record.epoch, False) for record in seen.values()] + [(8, False)]
        peer.grad_averager.matchmaking_kwargs = {"min_matchmaking_time": 3.0}
        peer.finish_gradient_round(SimpleNamespace())
        assert failures == ["no group found"]  # still counted as the failed round it was
        if replayed:
            assert peer.grad_averager.noted == [(8, ["few0"])]
            assert [sorted(donors) for _, donors in peer.grad_averager.asked] == [["many1", "many2"]] * 2
            assert peer.rounds_replayed == 1 and own_steps == [] and own_loads == [] and torch.equal(applied[-1], many)
        else:
            assert peer.grad_averager.asked == [] and peer.rounds_replayed == 0
            assert own_loads == [1] and len(own_steps) == 1


def test_the_few_stop_asking_once_the_swarm_is_past_the_next_epoch(monkeypatch):
    """A donor keeps only the last round it applied. 12 peers on 2 cores: three starved peers, a few of epoch 0's
    round, asked the many for it for the whole DONORS_WAIT (15 s) while the many made three more epochs, then
    downloaded; they joined one round of four. Once a fresh read shows every other peer past epoch + 1, nobody has
    the round: the few step at once. A read that still shows one on epoch + 1 keeps them asking."""
    import time
    from types import SimpleNamespace

    import collab.modes.sync as sync

    monkeypatch.setattr(sync, "DONORS_POLL", 0.01)
    monkeypatch.setattr(sync, "DONORS_WAIT", 0.3)
    few, own = torch.full((3,), 1.0), torch.full((3,), 1.5)
    seen = {f"many{i}": SimpleNamespace(epoch=8) for i in range(9)}  # the trainer's last read, before they moved on
    moved_on = {f"many{i}": SimpleNamespace(epoch=10 + i % 2) for i in range(9)}
    moved_on.update({f"few{i}": SimpleNamespace(epoch=8) for i in range(3)})  # (this peer's own group stays behind)
    monkeypatch.setattr(sync, "progress_records", lambda dht, run_id: moved_on)
    peer, applied, own_steps = _few_of_a_split(few, own, [], seen)
    started = time.monotonic()
    peer.finish_gradient_round(SimpleNamespace())
    assert time.monotonic() - started < 0.2 and peer.grad_averager.asked == []
    assert own_steps == ["a few peers' gradients"] and peer.rounds_replayed == 0
    one_left = {**moved_on, "many0": SimpleNamespace(epoch=9)}  # it keeps epoch 8's round: asked until the wait ends
    monkeypatch.setattr(sync, "progress_records", lambda dht, run_id: one_left)
    peer, applied, own_steps = _few_of_a_split(few, own, [], seen)
    peer.finish_gradient_round(SimpleNamespace())
    assert len(peer.grad_averager.asked) >= 2 and any("many0" in donors for _, donors in peer.grad_averager.asked)
