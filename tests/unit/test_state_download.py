"""A catch-up's donors (collab.averaging.state_download) on hivemind's own download loop, with the network replaced by
stubs: a
donor whose stream never opens (across a network split, frozen, behind NAT) is given up after DIAL_TIMEOUT and the
next donor serves the state. hivemind awaits that stream unbounded: a peer asked the same unreachable donor for
minutes and never trained again (CI, the split test)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Callable

import torch
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer, ValueWithExpiration

import collab.averaging.state_download as state_download

UNREACHABLE, REACHABLE, ME = (PeerID(bytes([0x12, 0x20, n]) + bytes(31)) for n in (1, 2, 3))
STATE = torch.arange(6, dtype=torch.float32)


class _Unreachable:
    async def rpc_download_state(self, _request):
        await asyncio.Event().wait()  # the dial that p2pd gives up only after ~20 s


class _Donor:
    async def rpc_download_state(self, _request):
        async def messages():
            yield averaging_pb2.DownloadData(tensor_part=serialize_torch_tensor(STATE),
                                             metadata=MSGPackSerializer.dumps({"epoch": 7}))
        return messages()


class _Averager(state_download.CheckedDownloads, DecentralizedAverager):
    """Only what hivemind's _load_state_from_peers reads: no DHT, no p2pd, no process."""

    asked: list = []
    peer_id = ME  # a property in hivemind's averager (its id from the DHT)

    @classmethod
    def get_stub(cls, p2p, peer, *, namespace=None):
        cls.asked.append(peer)
        return _Unreachable() if peer == UNREACHABLE else _Donor()


def _averager() -> _Averager:
    _Averager.asked = []
    averager = object.__new__(_Averager)
    priorities = {UNREACHABLE.to_bytes(): ValueWithExpiration(8.0, float("inf")),  # declares the highest epoch
                  REACHABLE.to_bytes(): ValueWithExpiration(7.0, float("inf"))}
    key_manager = SimpleNamespace(prefix="run_state_averager")
    averager.__dict__.update(
        _matchmaking=SimpleNamespace(group_key_manager=key_manager, request_timeout=3.0), next_chunk_timeout=5.0,
        prefix="run_state_averager", _p2p=None, _parent_pid=-1,
        dht=SimpleNamespace(get=lambda key, latest=True: ValueWithExpiration(priorities, float("inf"))
                            if key.endswith(".all_averagers") else None))
    return averager


def test_an_unreachable_donor_is_given_up_and_the_next_one_serves_the_state(monkeypatch):
    monkeypatch.setattr(state_download, "DIAL_TIMEOUT", 0.5)
    averager = _averager()

    async def download():
        future = asyncio.get_running_loop().create_future()
        # bounded: without the dial's timeout this waits on the unreachable donor for good
        await asyncio.wait_for(averager._load_state_from_peers(future, timeout=10.0), timeout=10.0)
        return future.result()

    started = time.monotonic()
    metadata, tensors = asyncio.run(download())
    assert _Averager.asked == [UNREACHABLE, REACHABLE], _Averager.asked  # highest priority first, then the next
    assert time.monotonic() - started < 5.0
    assert metadata["epoch"] == 7 and metadata[state_download.DONOR_KEY] == REACHABLE.to_base58()
    assert torch.equal(tensors[0], STATE)


def _tries(outcomes: list) -> tuple[list, Callable[[], bool]]:
    """A download that gives the next outcome each time (an exception is raised), and the list of its calls."""
    calls = []

    def load():
        calls.append(time.monotonic())
        outcome = outcomes[min(len(calls), len(outcomes)) - 1]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome
    return calls, load


def test_a_catch_up_gives_up_after_unanswered_downloads_and_one_with_a_deadline_asks_until_then(monkeypatch):
    monkeypatch.setattr(state_download, "RETRY_PAUSE", 0.01)
    never, stop = (lambda: False), threading.Event()
    # no donor answers: hivemind would retry forever; a catch-up without deadline trains on after 3 tries
    calls, load = _tries([TimeoutError("no answer")])
    assert not state_download.download_with_retries(load, alone=never, stop=stop)
    assert len(calls) == state_download.UNANSWERED_DOWNLOADS == 3
    # two unanswered, then a donor serves: loaded
    calls, load = _tries([TimeoutError(), TimeoutError(), True])
    assert state_download.download_with_retries(load, alone=never, stop=stop) and len(calls) == 3
    # an answer without a state ends a catch-up at once; with a deadline it keeps asking until then
    calls, load = _tries([False])
    assert not state_download.download_with_retries(load, alone=never, stop=stop) and len(calls) == 1
    calls, load = _tries([False])
    started = time.monotonic()
    assert not state_download.download_with_retries(load, alone=never, stop=stop, deadline=started + 0.3)
    assert len(calls) > 5 and 0.3 <= time.monotonic() - started < 2.0
    # alone in the swarm (every other record gone: a donor still listed left), or asked to leave: no try at all
    calls, load = _tries([TimeoutError()])
    assert not state_download.download_with_retries(load, alone=lambda: True, stop=stop) and calls == []
    # left alone while it tried: no retry
    left = iter([False, True])
    calls, load = _tries([TimeoutError()])
    assert not state_download.download_with_retries(load, alone=lambda: next(left), stop=stop) and len(calls) == 1
    stop.set()
    calls, load = _tries([TimeoutError()])
    assert not state_download.download_with_retries(load, alone=never, stop=stop) and calls == []


def _receiver(epochs_served: list, global_epoch: int):
    """Just what SwarmOptimizer._download_a_stepped_state reads: each download loads the next epoch of
    `epochs_served` (None: no donor had a state)."""
    served = iter(epochs_served)
    state_averager = SimpleNamespace(local_epoch=0, asked=0)

    def load_state_from_peers(timeout=None):
        state_averager.asked += 1
        epoch = next(served)
        if epoch is None:
            return False
        state_averager.local_epoch = epoch
        return True

    state_averager.load_state_from_peers = load_state_from_peers
    return SimpleNamespace(state_averager=state_averager, tracker=SimpleNamespace(global_epoch=global_epoch),
                           stop=threading.Event(), load_state_timeout=1.0)


def test_a_state_one_epoch_behind_the_swarm_is_asked_for_again(monkeypatch):
    """A donor that had yet to make its step served the epoch before (collab.averaging.served_state): the receiver
    asks again and loads the stepped state; a state at the swarm's epoch is loaded once; retries are bounded."""
    import collab.modes.base as base

    monkeypatch.setattr(base, "MID_STEP_PAUSE", 0.01)

    class Receiver(SimpleNamespace):
        local_epoch = property(lambda self: self.state_averager.local_epoch)
        _download_a_stepped_state = base.SwarmOptimizer._download_a_stepped_state

    def download(epochs_served, global_epoch):
        peer = Receiver(**vars(_receiver(epochs_served, global_epoch)))
        return peer._download_a_stepped_state(), peer.local_epoch, peer.state_averager.asked

    assert download([7, 8], global_epoch=8) == (True, 8, 2)  # the donor mid-step, then stepped
    assert download([8], global_epoch=8) == (True, 8, 1)  # in step: one download
    assert download([5], global_epoch=8) == (True, 5, 1)  # further behind: not a donor mid-step (hivemind's own path)
    assert download([None], global_epoch=8) == (False, 0, 1)
    assert download([7, None], global_epoch=8) == (True, 7, 2)  # a retry that found nobody keeps the state loaded
    stuck = [7] * (1 + base.MID_STEP_RETRIES)
    assert download(stuck, global_epoch=8) == (True, 7, 1 + base.MID_STEP_RETRIES)  # bounded; hivemind's catch-up
