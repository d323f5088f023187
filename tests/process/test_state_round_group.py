"""A state-averaging round begins once every peer training has joined (collab.averaging.robust_rounds), not after
hivemind's whole matchmaking_time: the next step waits for that round, every average_state_every epochs.

Two real state averagers on a real DHT, no group size configured, a long matchmaking_time. The progress records
are this test's (two peers training; collab's reading of the signed records is tested elsewhere): the round and
its matchmaking are hivemind's. Without the group target the leader waits out MATCHMAKING_TIME (checked)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from collab.averaging.replica import RecordingStateAverager
from collab.swarm.node import OwnGroupDHT, shut_down_dht
from tests.conftest import filled_state_averager, held_values

MATCHMAKING_TIME = 8.0  # what hivemind's leader waits for more peers, without a group target


class TwoPeersTraining(RecordingStateAverager):
    def _signed_progress(self) -> dict:  # (read in the averager's process, a fork of this one)
        return {"peer-a": SimpleNamespace(epoch=3, client_mode=False),
                "peer-b": SimpleNamespace(epoch=3, client_mode=False)}


def _averager(dht, prefix: str, value: float) -> RecordingStateAverager:
    return filled_state_averager(dht, prefix, value, cls=TwoPeersTraining, min_matchmaking_time=MATCHMAKING_TIME,
                                 request_timeout=1.0)


def test_a_state_round_begins_once_the_peers_training_have_joined(no_leftover_processes):
    prefix = f"state-group-{time.time_ns()}"
    # collab's DHT (its pipe reads): with hivemind's, a read in flight as an averager shut down killed the DHT's process
    # in a CI run (collab.hivemind_hooks.patches._WholeMessages)
    first = OwnGroupDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = OwnGroupDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs())
    averagers = [_averager(first, prefix, 1.0), _averager(second, prefix, 3.0)]
    try:
        took = {}

        def step(averager):
            began = time.monotonic()
            averager.step(averaging_round=True, averaging_opts=dict(timeout=3 * MATCHMAKING_TIME))
            took[averager] = time.monotonic() - began

        steps = [threading.Thread(target=step, args=(a,), daemon=True) for a in averagers]  # a hung step: no hang
        for thread in steps:
            thread.start()
        for thread in steps:
            thread.join(4 * MATCHMAKING_TIME)
        assert not any(thread.is_alive() for thread in steps), "a state round did not end"

        assert [a.gathered_since(0) for a in averagers] == [2, 2]
        for averager in averagers:  # both hold the mean: the round really averaged
            assert held_values(averager) == {2.0}
        assert max(took.values()) < MATCHMAKING_TIME / 2, took  # not hivemind's whole search
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in (second, first):
            shut_down_dht(dht)
