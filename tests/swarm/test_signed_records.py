"""Signed metrics records between two real DHT nodes: read, and forged, malformed or impostor ones refused and
attributed."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hivemind.utils.timed_storage import get_dht_time

from collab.records.metrics import PeerMetricsRecord, metrics_key, publish
from collab.records.shared_reads import shared_counts
from collab.swarm.node import PeerConfig, Swarm
from collab.swarm.state import read_run_state
from tests.conftest import METRICS_RECORD, wait_for


@pytest.fixture()
def two_nodes(run_id, no_leftover_processes):
    first = Swarm(PeerConfig(run_id=run_id, host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    second = None
    try:
        second = Swarm(PeerConfig(run_id=run_id, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                  initial_peers=[str(a) for a in first.dht.get_visible_maddrs()]))
        yield first, second
    finally:
        for node in (second, first):
            if node is not None:
                node.shutdown()


def test_signed_records_are_read_and_forged_or_malformed_ones_refused(two_nodes, run_id):
    first, second = two_nodes
    record = PeerMetricsRecord(**{**METRICS_RECORD, "peer_id": first.peer_id, "time": time.time()})
    publish(first.dht, run_id, first.public_key, record, expiration=60)

    expiration = get_dht_time() + 60
    # the second node tries to overwrite the first one's record: its signature does not match that key
    forged = second.dht.store(metrics_key(run_id), dict(record.dict(), loss=0.001), expiration,
                              subkey=first.public_key)
    # and to publish nonsense under its own key: the schema refuses it
    malformed = second.dht.store(metrics_key(run_id), dict(record.dict(), loss="NaN", epoch=-1), expiration,
                                 subkey=second.public_key)
    assert forged is False and malformed is False

    state = wait_for(lambda: (lambda s: s if s.peers else None)(read_run_state(second.dht, run_id)), timeout=30,
                     interval=0.5, what="the first node's record")
    assert [p.peer_id for p in state.peers] == [first.peer_id]
    assert state.peers[0].loss == pytest.approx(5.2) and state.peers[0].samples_contributed == 4096
    assert state.target_batch_size == 2048 and state.global_epoch == 3

    # a validly signed record (the second node's own key) that claims the first node's id: readers ignore it
    impostor = dict(record.dict(), loss=0.001, samples_contributed=10**9, time=time.time())
    assert second.dht.store(metrics_key(run_id), impostor, expiration, subkey=second.public_key) is True
    state = wait_for(lambda: (lambda s: s if s.rejected_records else None)(read_run_state(first.dht, run_id)),
                     timeout=30, interval=0.5, what="the impostor's record to reach a reader")
    assert state.rejected_by_reason == {"peer id is not the signer's": 1}
    assert state.rejected_by_signer == {second.peer_id: 1}
    assert [(p.peer_id, p.loss, p.samples_contributed) for p in state.peers] == [(first.peer_id, 5.2, 4096)]


def test_a_peers_reads_of_the_metrics_key_go_through_its_shared_stream(two_nodes, run_id):
    """read_run_state's metrics reads (--wait-peers polls them from every peer; the dashboard, the plan keeper) join
    a read under way or take one just made, as the progress key's do: at 24 peers they had been 65% of the DHT bytes
    of a swarm's start."""
    first, second = two_nodes
    record = PeerMetricsRecord(**{**METRICS_RECORD, "peer_id": first.peer_id, "time": time.time()})
    publish(first.dht, run_id, first.public_key, record, expiration=60)
    wait_for(lambda: read_run_state(second.dht, run_id).peers, timeout=30, interval=0.5, what="the first record")
    before = shared_counts(second.dht, metrics_key(run_id))
    with ThreadPoolExecutor(4) as pool:  # four readers at once, as a peer's threads read
        states = list(pool.map(lambda _: read_run_state(second.dht, run_id), range(4)))
    assert all([p.peer_id for p in s.peers] == [first.peer_id] for s in states)
    after = shared_counts(second.dht, metrics_key(run_id))
    spared = after["served"] + after["joined"] - before["served"] - before["joined"]
    assert after["walked"] - before["walked"] + spared == 4 and spared >= 1, (before, after)
