"""Two real averagers (DHT, p2pd, hivemind's averager processes) on 127.0.0.1, one of them run with a hivemind
method replaced: how the lab and tests/swarm/test_matchmaking.py stage a race that only CPU starvation makes by itself."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Callable, Optional

import hivemind
import psutil

from collab.averaging.robust_rounds import CheckedRounds
from collab.process.reaper import hivemind_sockets, remove_sockets_of
from collab.swarm.node import OwnGroupDHT, shut_down_dht


class StateRounds(CheckedRounds):
    """collab's checked rounds as a state averager runs them (what the leave tests stage)."""
    kind = "state"


def start_averager_pair(stack: ExitStack, make: Callable[[hivemind.DHT, int], Any],
                        patch: Optional[tuple[int, type, str, Callable[[Callable], Callable]]] = None,
                        count: int = 2) -> list:
    """Averagers 0 to count - 1, each on its own DHT node of one new swarm, shut down by `stack`. `make(dht, i)`
    builds averager i (started). patch = (i, cls, name, wrap): averager i alone runs with cls.name replaced by
    wrap(original). hivemind forks an averager's process when it starts, so a class patched only around that
    start stays patched in that one process."""
    averagers, first = [], None
    for i in range(count):
        dht = OwnGroupDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                           initial_peers=first.get_visible_maddrs() if first else [])
        stack.callback(shut_down_dht, dht)  # (a peer's leave: no socket file left in /tmp)
        first = first or dht
        patched = patch is not None and patch[0] == i
        if patched:
            _, cls, name, wrap = patch
            original = getattr(cls, name)
            setattr(cls, name, wrap(original))
        try:
            averager = make(dht, i)
        finally:
            if patched:
                setattr(cls, name, original)
        stack.callback(shut_down_averager, averager)
        averagers.append(averager)
    return averagers


def shut_down_averager(averager) -> None:
    """Shut down a started averager, hivemind's own class included: that one leaves its client of p2pd open, and its
    socket file in /tmp (collab's close it: collab.hivemind_hooks.averager), which is removed here."""
    try:
        sockets = hivemind_sockets([psutil.Process(averager.pid)]) if averager.is_alive() else {}
    except psutil.Error:
        sockets = {}
    averager.shutdown()
    averager.join(5)
    remove_sockets_of(sockets)
