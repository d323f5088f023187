"""Fixtures of the tests that start processes of their own."""

from __future__ import annotations

import hivemind
import pytest

from collab.swarm.node import dht_sockets, shut_down_dht


@pytest.fixture()
def dht(no_leftover_processes):
    """A real DHT node on 127.0.0.1 (its process and p2pd), shut down after the test unless the test ended it."""
    node = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True, shutdown_timeout=1.0)
    sockets = dht_sockets(node)
    yield node
    # as a peer's Swarm leaves: killing an averager alone kills hivemind's DHT process too (EOFError on its pipe),
    # and its p2pd ends by itself; the files they listened on are removed all the same
    shut_down_dht(node, sockets)
