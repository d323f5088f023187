"""A sender a live reducer left out of its round replays its group's round (collab.averaging.left_out): which answers
mean "left out", what a served round must agree with, and the trainer asking its groupmates (no sockets here; the
round through real averagers is tests/swarm/test_hostile_averagers.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing as mp
import pickle
import threading
from types import SimpleNamespace

import torch
from hivemind.averaging.partition import AllreduceException
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer

from collab.averaging.left_out import LeftOutOfRound, disagreement, left_out_error, left_this_peer_out
from collab.averaging.round_replay import RoundAnswers, ServedRounds
from collab.modes.round_failures import round_failure


def _peer_ids(n: int) -> list[PeerID]:
    return [PeerID(bytes([0x12, 0x20, i]) + bytes(31)) for i in range(n)]  # (well-formed multihashes)


def test_only_a_live_reducers_answers_mean_left_out():
    """hivemind's reducer ends a late sender's stream short or answers INTERNAL_ERROR (and so does a finished group,
    collab.averaging.known_groups.ENDED_HERE); a reducer that timed out, died or was cancelled is a lost reducer."""
    assert left_this_peer_out(AllreduceException("12D3KooWabc sent INTERNAL_ERROR"))
    assert left_this_peer_out(AllreduceException("peer 12D3KooWabc sent 0 parts, but we expected 1"))
    for lost in (TimeoutError(), AllreduceException("12D3KooWabc sent CANCELLED"),
                 AllreduceException("12D3KooWabc sent BAD_GROUP_ID"), ConnectionResetError("stream reset")):
        assert not left_this_peer_out(lost), lost


def test_the_failure_names_the_reducer_and_crosses_processes_with_the_groupmates_to_ask():
    ids = _peer_ids(4)
    error = left_out_error(ids, ids[3], {1})
    assert error.by == [ids[1].to_base58()]
    assert sorted(error.members) == sorted(p.to_base58() for p in (ids[0], ids[2]))  # not itself, not the reducer
    assert f"...{ids[1].to_base58()[-6:]} left this peer out" in str(error) and "next_chunk_timeout" in str(error)
    again = pickle.loads(pickle.dumps(error))  # (an MPFuture pickles it from the averager's process)
    assert isinstance(again, LeftOutOfRound) and again.members == error.members and again.by == error.by
    assert round_failure(again) == "left out by a reducer"


def test_a_served_round_must_agree_with_every_part_the_group_did_send():
    """Only the span of the reducer that left this peer out is taken on the donor's word."""
    partial = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([5.0, 6.0])]
    got = [torch.tensor([True, True, False, False]), torch.tensor([True, True])]
    honest = [torch.tensor([1.0, 2.0, -7.0, 9.0]), torch.tensor([5.0, 6.0 + 1e-7])]  # the lost span differs: fine
    assert disagreement(honest, partial, got) is None
    forged = [torch.tensor([1.0, 2.5, 3.0, 4.0]), partial[1]]
    assert disagreement(forged, partial, got) == "an average that differs from the parts this peer's group sent it " \
                                                 "(tensor 0)"
    assert disagreement([partial[0]], partial, got) == "an average of the wrong shape"
    assert disagreement([partial[0], torch.zeros(3)], partial, got) == "an average of the wrong shape"
    # a huge value in the donor's own span does not buy it a looser check elsewhere
    inflated = [torch.tensor([1.0, 2.01, 1e9, 4.0]), partial[1]]
    assert disagreement(inflated, partial, got) is not None


def _served(rounds: dict) -> ServedRounds:
    """An averager (no process, no sockets) whose stub reaches the ServedRounds in `rounds` by peer id."""
    one = object.__new__(ServedRounds)
    one.serializer, one.prefix, one._p2p = MSGPackSerializer, "run", None
    one.prepare_served_round([torch.zeros(4)])
    one.get_stub = lambda p2p, peer, namespace: SimpleNamespace(
        rpc_download_round=lambda request: _awaitable(rounds[peer.to_base58()].rpc_download_round(request, None)))
    return one


async def _awaitable(stream):
    return stream


def test_a_groupmate_whose_round_disagrees_is_refused_and_the_next_one_asked():
    ids = [p.to_base58() for p in _peer_ids(3)]
    rounds = {}
    for peer, values in zip(ids, ([9.0, 9.0, 9.0, 9.0], [1.0, 2.0, 3.0, 8.0], [1.0, 2.0, 3.0, 8.0])):
        donor = _served(rounds)
        donor._served[0].copy_(torch.tensor(values))
        donor._served_epoch = mp.Value("i", 5, lock=False)
        rounds[peer] = donor
    asker = _served(rounds)
    asker.keep_partial_round(5, [torch.tensor([1.0, 2.0, 3.0, 4.0])], [torch.tensor([True, True, True, False])])
    asker.banned = lambda peer_id: peer_id.to_base58() == ids[2]

    def fetch(donors):
        future = concurrent.futures.Future()  # (an MPFuture in the averager's process; same calls)
        asyncio.run(asker._fetch_round(5, donors, 5.0, future))
        return future.result(timeout=1)

    answers = fetch(ids)
    assert answers.refused == [(ids[0], "an average that differs from the parts this peer's group sent it (tensor 0)")]
    assert answers.round[0] == ids[1] and torch.equal(answers.round[1][0], torch.tensor([1.0, 2.0, 3.0, 8.0]))
    answers = fetch([ids[2], ids[0]])  # the banned groupmate is not asked at all
    assert answers.round is None and [donor for donor, _ in answers.refused] == [ids[0]]


def test_a_peer_left_out_asks_its_groupmates_for_the_round_and_applies_it(monkeypatch):
    """finish_gradient_round: the groupmates are asked (one this peer caught cheating is not), a refused answer is
    counted against its donor, and the round applied is the one served: no own step, no re-sync."""
    import collab.modes.sync as sync
    from collab.modes.sync import CollabOptimizer

    monkeypatch.setattr(sync, "progress_records", lambda dht, run_id: {})
    own, theirs = torch.ones(4), torch.full((4,), 0.5)
    asked, applied, own_steps, refused, failures = [], [], [], [], []
    answers = [RoundAnswers(refused=[("mate1", "an average that differs")]), RoundAnswers(round=("mate2", [theirs]))]
    buffers = [own.clone()]

    def fetch_round(epoch, donors, timeout, stop=None):
        asked.append(list(donors))
        return answers.pop(0)

    averager = SimpleNamespace(
        serves_rounds=True, measures_noise=False, _own_gradients=[own], get_tensors=lambda: _Held(buffers),
        fetch_round=fetch_round, load_replayed_=lambda tensors: buffers[0].copy_(tensors[0]),
        keep_round=lambda epoch, group=(): None, adopt_step_group=lambda epoch, group: None)
    peer = object.__new__(CollabOptimizer)

    def left_out(control):
        raise LeftOutOfRound("reducer(s) ...abcdef left this peer out", ["mate1", "mate2", "cheat"], ["reducer"])

    peer.__dict__.update(
        grad_averager=averager, state_averager=SimpleNamespace(local_epoch=8), delay_grad_averaging=False,
        tracker=SimpleNamespace(global_progress=SimpleNamespace(num_peers=5), records_seen={}),
        rejections=SimpleNamespace(add=lambda *a: refused.append(a), caught_ever=lambda: {"cheat"}),
        averaging_timeout=30.0, stop=threading.Event(), in_sync=lambda: True, downloaded_at_epoch=None,
        rounds_replayed=0, run_id="run", load_state_timeout=5.0, _parent_pid=-1,
        dht=SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "me")),
        averaging_log=SimpleNamespace(failure=failures.append), traffic=SimpleNamespace(end_round=lambda **k: None),
        _wait_for_round=left_out, load_averaged_gradients=lambda: applied.append(buffers[0].clone()),
        _record_own_step=lambda why, whose="": own_steps.append(why))
    monkeypatch.setattr(sync, "DONORS_POLL", 0.01)
    peer.finish_gradient_round(object())
    assert failures == ["left out by a reducer"]
    assert sorted(asked[0]) == ["mate1", "mate2"] and "reducer" not in asked[1]
    assert refused == [("mate1", "an average that differs", "a replayed round")]
    assert not own_steps and len(applied) == 1 and torch.equal(applied[0], theirs) and peer.rounds_replayed == 1


class _Held:
    def __init__(self, buffers):
        self.buffers = buffers

    def __enter__(self):
        return self.buffers

    def __exit__(self, *exc):
        return False
