"""A sender a live reducer left out of its round replays its group's round (collab.averaging.left_out): when a
reducer says so, what a served round must agree with, and the trainer asking its groupmates (no sockets here; the
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

from collab.averaging.left_out import LeftOutOfRound, disagreement, left_out_error
from collab.averaging.round_replay import RoundAnswers, ServedRounds
from collab.modes.round_failures import round_failure


def _peer_ids(n: int) -> list[PeerID]:
    return [PeerID(bytes([0x12, 0x20, i]) + bytes(31)) for i in range(n)]  # (well-formed multihashes)


def _reducer(banned: int, senders: int = 4, failed: bool = False, parts: int = 3, replies=None):
    """A TellsLeftOut runner as a reducer (no sockets): `banned` of its `senders` banned, the first among them the
    sender asking; its round failed or not; hivemind's handler answering `replies` (codes)."""
    from hivemind.proto import averaging_pb2

    from collab.averaging import left_out
    from collab.hivemind_hooks.allreduce import RunnerHooks

    ids = _peer_ids(senders)

    class Inner(RunnerHooks):  # hivemind's handler, under the mixin
        async def serve_aggregate_part(self, stream, context):
            for code in replies if replies is not None else [averaging_pb2.AVERAGED_PART] * parts:
                yield averaging_pb2.AveragingData(code=code)

    class Reducer(left_out.TellsLeftOut, Inner):
        def __init__(self):  # (hivemind's constructor skipped)
            pass

    reducer = Reducer()
    future = concurrent.futures.Future()
    if failed:
        future.set_exception(AllreduceException("this reducer's own round failed"))
    reducer._future, reducer.banned_senders, reducer.sender_peer_ids = future, set(ids[:banned]), ids
    reducer.tensor_part_reducer = SimpleNamespace(num_parts=parts)

    async def answers():
        context = SimpleNamespace(remote_id=ids[0])
        return [(m.code, m.peer_id) async for m in reducer.serve_aggregate_part(None, context)]
    return asyncio.run(answers())


def test_a_reducer_says_left_out_only_when_most_of_its_group_has_the_round():
    """Its answer to a banned sender is marked LEFT_OUT while its own round goes on and it banned under half the
    senders; not when its round failed or it gave up on most senders (a starved reducer at 32 peers: 31 lost it,
    and their retry without it was right: then the few it kept lose its last reply, and retry too); and never to a
    sender it did not ban."""
    from hivemind.proto import averaging_pb2

    from collab.averaging.left_out import LEFT_OUT

    error, part = averaging_pb2.INTERNAL_ERROR, averaging_pb2.AVERAGED_PART
    # the stream hivemind ends short (a banned sender's later parts are not reduced) gets a last word
    assert _reducer(banned=1, replies=[part]) == [(part, b""), (error, LEFT_OUT)]
    # hivemind's own INTERNAL_ERROR (the sender's next part timed out) is marked
    assert _reducer(banned=1, replies=[error]) == [(error, LEFT_OUT)]
    for unmarked in (dict(banned=2), dict(banned=1, failed=True), dict(banned=0)):
        assert _reducer(replies=[part], **unmarked) == [(part, b"")], unmarked
        assert _reducer(replies=[error], **unmarked) == [(error, b"")], unmarked
    assert _reducer(banned=1) == [(part, b"")] * 3  # every reply sent: nothing to say
    # most senders left out: the few it kept lose its last reply (a lost reducer: they retry with the rest)
    assert _reducer(banned=2) == [(part, b"")] * 2 + [(error, b"")]


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
    asker.keep_partial_round(None, None, None)  # let go after a later round (robust_rounds): no agreement asked
    assert fetch([ids[0]]).round[0] == ids[0]


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
