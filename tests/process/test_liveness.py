"""A crashed peer is told from a quiet one by a real DHT ping (collab.averaging.liveness): its record outlives it by a
minute, its DHT node does not."""

from __future__ import annotations

import signal

import psutil

from collab.process.reaper import hivemind_sockets, remove_sockets_of
from collab.averaging.liveness import PING_EVERY, QUIET_SECONDS, GoneWatch, Quiet, ping
from collab.swarm.node import OwnGroupDHT, shut_down_dht


def test_a_killed_peer_answers_no_ping_and_is_taken_as_gone_a_live_one_is_not(no_leftover_processes):
    first = OwnGroupDHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    others = [OwnGroupDHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs(),
                          start=True) for _ in range(2)]
    live, victim = (dht.peer_id.to_base58() for dht in others)
    try:
        assert ping(first, [live, victim]) == {live: True, victim: True}
        processes = [psutil.Process(others[1].pid), *psutil.Process(others[1].pid).children(recursive=True)]
        sockets = hivemind_sockets(processes)
        for process in processes:  # kill -9 of the DHT's process and its p2pd: a crash, no goodbye
            process.send_signal(signal.SIGKILL)
        psutil.wait_procs(processes, timeout=10)
        remove_sockets_of(sockets)
        assert ping(first, [live, victim]) == {live: True, victim: False}

        watch = GoneWatch(lambda peers: ping(first, peers))
        quiet = [Quiet(live, QUIET_SECONDS + 1, False), Quiet(victim, QUIET_SECONDS + 1, False)]
        assert watch.update(quiet, now=0.0) == set()
        assert watch.update(quiet, now=PING_EVERY) == {victim}
    finally:
        for dht in [first, others[0]]:
            shut_down_dht(dht)
        others[1].join(5)
