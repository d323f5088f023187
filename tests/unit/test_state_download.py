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
    # alone in the swarm, or asked to leave: no retry
    calls, load = _tries([TimeoutError()])
    assert not state_download.download_with_retries(load, alone=lambda: True, stop=stop) and len(calls) == 1
    stop.set()
    calls, load = _tries([TimeoutError()])
    assert not state_download.download_with_retries(load, alone=never, stop=stop) and calls == []
