"""Signed metrics records between two real DHT nodes: read, and forged, malformed or impostor ones refused and
attributed."""

from __future__ import annotations

import time

import pytest
from hivemind.utils.timed_storage import get_dht_time

from collab.records.metrics import PeerMetricsRecord, metrics_key, publish
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
