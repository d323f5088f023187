"""Metrics records on the wire: the schema bounds, signatures, and reading the run state from a real DHT."""

from __future__ import annotations

import math
import time

import pytest
from hivemind.utils.timed_storage import get_dht_time
from pydantic import v1

from collab.records.metrics import PeerMetricsRecord, metrics_key, publish
from collab.swarm.node import PeerConfig, Swarm
from collab.swarm.state import read_run_state
from tests.conftest import wait_for

GOOD = dict(peer_id="12D3KooWTest", role="trainer", epoch=3, loss=5.2, samples_per_second=12.5,
            samples_contributed=4096, target_batch_size=2048, client_mode=False, bandwidth_mbps=None,
            rounds_joined=2, rounds_failed=0, last_group_size=3, time=1.7e9)


@pytest.mark.parametrize("field, value", [
    ("loss", math.nan), ("loss", math.inf), ("loss", -1.0), ("samples_per_second", 1e30),
    ("samples_contributed", -5), ("epoch", "3"), ("role", "boss"), ("client_mode", "yes"),
    ("unexpected", 1),
])
def test_schema_rejects_absurd_values(field, value):
    with pytest.raises(v1.ValidationError):
        PeerMetricsRecord(**{**GOOD, field: value})
    assert PeerMetricsRecord(**GOOD).epoch == 3


def test_a_loss_outside_the_records_bounds_is_published_as_missing_and_said_once(capsys):
    from collab.records import metrics

    metrics._said_out_of_bounds.clear()
    assert metrics.loss_for_record(5.25) == 5.25 and metrics.loss_for_record(None) is None
    for diverged in (2e6, -0.5, math.nan, math.inf):
        assert metrics.loss_for_record(diverged) is None
        PeerMetricsRecord(**{**GOOD, "loss": metrics.loss_for_record(diverged)})  # a valid record, not a crash
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and "loss 2000000.0 is outside what a metrics record carries" in said[0], said
    assert metrics.rate_for_record(math.inf) == 0.0 and metrics.rate_for_record(12.5) == 12.5


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
    record = PeerMetricsRecord(**{**GOOD, "peer_id": first.peer_id, "time": time.time()})
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
