"""A join through an initial peer too busy to answer in time, on real DHT nodes and p2pd: the first peer's DHT
process is frozen (SIGSTOP; its p2pd still takes connections), as a peer starved of CPU is. 4 of 64 peers started
together on 2 cores failed to join so, twice each: hivemind's DHT node pings the initial peers once, 3 s each, and
collab then told them the peer "answers TCP but not as that libp2p peer" (a new identity)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import collab.swarm.node as node
from collab.errors import UserError
from collab.swarm.node import PeerConfig, Swarm


def _frozen(pid: int, seconds: float) -> threading.Thread:
    os.kill(pid, signal.SIGSTOP)
    thaw = threading.Timer(seconds, os.kill, args=(pid, signal.SIGCONT))
    thaw.start()
    return thaw


def test_a_join_whose_pings_went_unanswered_tries_again_and_joins_once_the_peer_answers(
        tmp_path, no_leftover_processes, monkeypatch):
    run_id = f"slow-bootstrap-{time.time_ns()}"
    monkeypatch.setattr(node, "BOOTSTRAP_PAUSE", 1.0)
    swarms, thaw = [], None
    first = Swarm(PeerConfig(run_id=run_id, host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity=tmp_path / "a.identity"))
    swarms.append(first)
    maddr = first.best_maddr()  # (asked of its DHT process: before it is frozen)
    tries = _counting_tries(monkeypatch)
    try:
        thaw = _frozen(first.dht.pid, 5.0)  # past the first try's pings (3 s), within the second's
        second = Swarm(PeerConfig(run_id=run_id, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                  initial_peers=[maddr], identity=tmp_path / "b.identity"))
        swarms.append(second)
        assert tries[0] == "none of the initial_peers responded to a ping" and tries[-1] == "joined", tries
        assert first.peer_id in {str(p) for p in second.dht.run_coroutine(_known_peers)}

        monkeypatch.setattr(node, "BOOTSTRAP_ATTEMPTS", 2)  # frozen for longer than every try: said as such
        thaw.join()
        thaw, tries[:] = _frozen(first.dht.pid, 60.0), []
        with pytest.raises(UserError) as failed:
            Swarm(PeerConfig(run_id=run_id, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                             initial_peers=[maddr], identity=tmp_path / "c.identity"))
        assert tries == ["none of the initial_peers responded to a ping"] * 2, tries
        assert "answers TCP, but no DHT node there answered a ping in time (2 tries)" in str(failed.value), failed.value
        assert "new identity" not in str(failed.value)
    finally:
        if thaw is not None:
            thaw.cancel()
            os.kill(first.dht.pid, signal.SIGCONT)
        for swarm in reversed(swarms):
            swarm.shutdown()


def _counting_tries(monkeypatch) -> list:
    """How each of the Swarm's tries to start its DHT node ended."""
    tries, dht_class = [], node.OwnGroupDHT

    class Counted(dht_class):
        def __init__(self, *args, **kwargs):
            try:
                super().__init__(*args, **kwargs)
            except Exception as e:
                tries.append("none of the initial_peers responded to a ping" if node.UNANSWERED_PING in str(e)
                             else str(e))
                raise
            tries.append("joined")

    monkeypatch.setattr(node, "OwnGroupDHT", Counted)
    return tries


async def _known_peers(dht, node_):
    return [peer for bucket in node_.protocol.routing_table.buckets for peer in bucket.nodes_to_peer_id.values()]
