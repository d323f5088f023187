"""Records that reach a reader malformed (a rogue node near the key, another collab version) are
ignored and counted; absurd values never break the API, the charts' data or /metrics.

These feed `read_run_state` through a stand-in for DHT.get that returns what hivemind returns
(ValueWithExpiration of subkey -> ValueWithExpiration): the parsing and counting is collab's own.
The real-DHT path is covered in test_dashboard.py and test_metrics.py.
"""

from __future__ import annotations

import time

from fastapi.testclient import TestClient
from hivemind.utils.timed_storage import ValueWithExpiration
from prometheus_client.parser import text_string_to_metric_families

from collab.state import read_run_state
from dashboard.app import create_app
from dashboard.collector import Collector

GOOD = dict(peer_id="12D3KooWGood", role="trainer", version="0.1.0", epoch=4, loss=6.5, samples_per_second=20.0,
            samples_contributed=900, target_batch_size=256, client_mode=False, bandwidth_mbps=None,
            rounds_joined=4, rounds_failed=0, last_group_size=2, time=0.0)


class RecordedDHT:
    def __init__(self, records: dict[str, dict]):
        self.records = records

    def get(self, key, latest=False):
        entries = self.records.get(key)
        if entries is None:
            return None
        return ValueWithExpiration({k: ValueWithExpiration(v, time.time() + 60) for k, v in entries.items()},
                                   time.time() + 60)


def hostile_state():
    now = time.time()
    return read_run_state(RecordedDHT({"run_metrics": {
        b"good": dict(GOOD, time=now),
        b"nan": dict(GOOD, peer_id="nan", loss=float("nan"), time=now),
        b"huge": dict(GOOD, peer_id="huge", samples_per_second=1e30, time=now),
        b"negative": dict(GOOD, peer_id="neg", samples_contributed=-4, time=now),
        b"string": "definitely not a record",
        b"extra": dict(GOOD, peer_id="extra", admin=True, time=now),
    }, "run_progress": {b"garbage": {"peer_id": b"x", "epoch": "many"}}}), "run")


def test_malformed_records_are_ignored_and_counted():
    state = hostile_state()
    assert [p.peer_id for p in state.peers] == ["12D3KooWGood"]
    assert state.rejected_records == 6
    assert state.peers[0].contribution == 1.0 and state.target_batch_size == 256


def test_api_page_and_metrics_answer_with_hostile_records():
    collector = Collector("run")
    collector.ingest(hostile_state())
    client = TestClient(create_app(collector, manage_collector=False))
    run = client.get("/api/run").json()
    assert run["rejected_records"] == 6 and len(run["peers"]) == 1
    points = client.get("/api/history").json()["points"]
    assert points[-1]["loss"] == 6.5 and points[-1]["samples_per_second"] < 1e6
    assert client.get("/").status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    assert families["collab_rejected_records"].samples[0].value == 6


def test_api_before_the_first_snapshot_and_unknown_routes():
    client = TestClient(create_app(Collector("run"), manage_collector=False))
    response = client.get("/api/run")
    assert response.status_code == 503
    assert response.json()["detail"].startswith("no snapshot of the run yet")
    assert client.get("/api/peers/nobody").status_code == 404
    assert client.get("/healthz").json()["snapshot_age_seconds"] is None
    assert client.get("/metrics").status_code == 200
