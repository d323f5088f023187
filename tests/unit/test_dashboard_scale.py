"""The dashboard with 1,000 peers: /api/run's figures over all of them, its pages, its latency, and a collector
whose memory stays bounded however many peers come and go.

The peers are synthetic but their records are real: each is signed with the peer's own RSA key and checked
by the run's validators (schema and signature) as a DHT node checks it (benchmarks/dashboard_scale.py), and
the collector reads them through read_run_state, as it reads a live swarm.
"""

from __future__ import annotations

import asyncio
import gzip
import re
import statistics
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from benchmarks.dashboard_scale import SignedRecordsDHT, collector_bytes, synthetic_peers
from collab.dashboard.app import create_app
from collab.dashboard.collector import PEER_HISTORY_POINTS, Collector
from collab.dashboard.snapshot import MAX_PEERS, SORT_KEYS
from collab.swarm.state import PeerState, RunState

PEERS = 1000
STATIC = Path(__file__).resolve().parents[2] / "dashboard" / "static"


@pytest.fixture(scope="module")
def swarm():
    """1,000 peers, each with its metrics and progress records signed and accepted by the run's validators."""
    peers = synthetic_peers(PEERS)
    dht = SignedRecordsDHT("run")
    for index, peer in enumerate(peers):
        dht.publish(peer, index)
    return peers, dht


@pytest.fixture(scope="module")
def served(swarm):
    collector = Collector("run", dht=swarm[1])
    collector.collect_once()
    return collector, TestClient(create_app(collector, manage_collector=False))


def test_api_run_counts_every_peer_and_sums_over_all_of_them(swarm, served):
    peers, _ = swarm
    collector, client = served
    response = client.get("/api/run")
    assert response.status_code == 200 and response.headers["content-encoding"] == "gzip"
    run = response.json()
    assert run["rejected_records"] == 0, run["rejected_by_reason"]  # every signature checks out
    assert {p["peer_id"] for p in run["peers"]} == {p.peer_id for p in peers}
    assert run["peers_total"] == run["peers_listed"] == run["num_peers"] == PEERS and run["peers_not_listed"] == 0
    assert run["peers_online"] == PEERS and run["clients"] == run["num_clients"] == 334  # every third peer
    assert run["samples_per_second"] == pytest.approx(sum(10.0 + i % 50 for i in range(PEERS)))
    assert run["median_loss"] == pytest.approx(statistics.median(2.0 + (i % 97) / 100 for i in range(PEERS)))
    top = sorted((1000 * (1 + i % 300) for i in range(PEERS)), reverse=True)[:10]
    assert [entry["samples_contributed"] for entry in run["leaderboard"]] == top
    # gzipped once per collection: the whole run is ~0.7 MB of JSON, ~10x less on the wire
    raw = client.get("/api/run", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in raw.headers and raw.json() == run
    assert len(gzip.compress(raw.content)) < len(raw.content) / 5


def test_pages_are_the_right_slices_in_every_order(served):
    collector, client = served
    everyone = client.get("/api/run").json()
    ids = sorted(p["peer_id"] for p in everyone["peers"])
    first = client.get("/api/run?offset=0&limit=50").json()
    assert [p["peer_id"] for p in first["peers"]] == ids[:50]
    assert first["page"] == {"offset": 0, "limit": 50, "sort": "peer_id", "order": "asc", "total": PEERS}
    # the figures are the whole run's on every page
    for key in ("peers_total", "peers_online", "samples_per_second", "median_loss", "leaderboard", "global_epoch"):
        assert first[key] == everyone[key], key
    assert [p["peer_id"] for p in client.get("/api/run?offset=950&limit=100").json()["peers"]] == ids[950:]
    past_the_end = client.get("/api/run?offset=1000").json()
    assert past_the_end["peers"] == [] and past_the_end["page"]["total"] == PEERS

    fastest = client.get("/api/run?sort=samples_per_second&order=desc&limit=20").json()["peers"]
    rates = [p["samples_per_second"] for p in fastest]
    assert rates == sorted(rates, reverse=True) and rates[0] == max(p["samples_per_second"] for p in everyone["peers"])
    walked = [p["peer_id"] for offset in (0, 500)
              for p in client.get(f"/api/run?offset={offset}&limit=500&sort=loss&order=desc").json()["peers"]]
    assert sorted(walked) == ids  # every peer on exactly one page
    losses = [collector.view.by_id[peer].loss for peer in walked]
    assert losses == sorted(losses, reverse=True)


@pytest.mark.parametrize("query, names", [
    ("limit=0", "limit"), ("limit=501", "limit"), ("limit=ten", "limit"), ("offset=-5", "offset"),
    ("offset=1e3", "offset"), ("sort=speed", "sort"), ("order=up", "order"), ("page=2", "page"),
    ("limit=5&limit=6", "limit"), ("%zz", "offset, limit"),
])
def test_bad_page_parameters_get_one_line_that_says_what_to_fix(served, query, names):
    _, client = served
    response = client.get(f"/api/run?{query}")
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert names in detail and ("e.g." in detail or "takes" in detail or "give it once" in detail), detail
    assert "\n" not in detail and "Traceback" not in detail


def test_bad_parameters_before_the_first_snapshot_are_still_named():
    client = TestClient(create_app(Collector("run"), manage_collector=False))
    assert client.get("/api/run?limit=0").status_code == 422
    assert client.get("/api/run?limit=5").status_code == 503


def test_fastapi_validation_errors_become_one_line(served):
    collector, _ = served
    app = create_app(collector, manage_collector=False)

    @app.get("/probe")
    def probe(count: int):
        return count

    response = TestClient(app).get("/probe?count=many")
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert isinstance(detail, str) and detail.startswith("query count: ") and "\n" not in detail, detail


def test_api_run_p99_is_under_100_ms_while_the_collector_rereads_1000_peers(swarm):
    """Requests on one event loop, as uvicorn serves them, while the collector's thread re-reads the 1,000 records
    (~0.2 s of Python each time, holding the GIL) as often as it can: the p99 is what that contention costs.
    The client takes the bytes as they come (no gzip to undo): what is timed is the server's answer."""
    collector = Collector("run", dht=swarm[1], interval=0.05).start()

    async def p99(client: httpx.AsyncClient, path: str) -> float:
        measured, collections = [], collector.collections
        # 1,000 requests at least (the p99 is the 10th slowest, not the 2nd), across two collections at least
        while len(measured) < 1000 or (collector.collections < collections + 2 and len(measured) < 50_000):
            started = time.perf_counter()
            response = await client.get(path)
            measured.append(time.perf_counter() - started)
            assert response.status_code == 200, response.text
        assert collector.collections >= collections + 2, "the collector did not re-read the records meanwhile"
        return sorted(measured)[int(0.99 * len(measured))] * 1000

    async def measure() -> dict[str, float]:
        transport = httpx.ASGITransport(app=create_app(collector, manage_collector=False))
        async with httpx.AsyncClient(transport=transport, base_url="http://dashboard",
                                     headers={"Accept-Encoding": "identity"}) as client:
            return {path: await p99(client, path)
                    for path in ("/api/run", "/api/run?offset=100&limit=50&sort=loss&order=desc")}

    try:
        while collector.view is None:
            time.sleep(0.05)
        measured = asyncio.run(measure())
    finally:
        collector.stop()
    assert all(ms < 100 for ms in measured.values()), f"p99 in ms with {PEERS} peers: {measured}"


def churning_state(at: float, first: int, live: int, **peer) -> RunState:
    """`live` peers, ids first..first+live-1, as read_run_state would list them at time `at`."""
    peers = [PeerState(peer_id=f"peer{i:05d}", role="trainer", client_mode=False, samples_per_second=1.0, epoch=3,
                       loss=4.0, samples_contributed=i, contribution=0.0, samples_accumulated=0, bandwidth_mbps=None,
                       rounds_joined=3, rounds_failed=0, last_seen=0.0, online=True, straggler=False, **peer)
             for i in range(first, first + live)]
    return RunState(run_id="run", global_epoch=3, samples_accumulated=0, target_batch_size=256,
                    samples_per_second=float(live), eta_seconds=None, num_peers=live, num_clients=0,
                    rejected_records=0, peers=peers, time=at)


def test_5000_peers_coming_and_going_leave_at_most_the_cap_in_memory():
    collector = Collector("run")
    client = TestClient(create_app(collector, manage_collector=False))
    collector.ingest(churning_state(0.0, 0, 1000))
    collector.ingest(churning_state(3.0, 0, 1000))
    held_at_1000 = collector_bytes(collector)
    first = 0
    for step in range(2, 18):  # 250 leave and 250 arrive every 3 s: 5,000 distinct peers in under a minute
        first += 250
        collector.ingest(churning_state(3.0 * step, first, 1000))
    assert first + 1000 == 5000
    assert len(collector.peer_history) == MAX_PEERS  # the live 1,000 and the 1,000 seen most recently
    assert collector.peer_histories_dropped == 5000 - MAX_PEERS
    assert collector.peer_json("peer00000") is None and collector.peer_json("peer04999") is not None
    health = client.get("/healthz").json()
    assert health["peer_histories"] == MAX_PEERS and health["peer_histories_dropped"] == 3000
    held = collector_bytes(collector)
    assert held < 2 * held_at_1000, f"held {held} bytes after 5,000 peers, {held_at_1000} at 1,000"


def test_a_swarm_over_the_cap_is_counted_whole_and_listed_in_part():
    collector = Collector("run", max_peers=300)
    client = TestClient(create_app(collector, manage_collector=False))
    state = churning_state(0.0, 0, 1000)
    for i, peer in enumerate(state.peers):
        peer.last_seen = float(i % 100)
        peer.online = i % 100 < 90
    collector.ingest(state)
    run = client.get("/api/run").json()
    assert len(run["peers"]) == run["peers_listed"] == 300 and run["peers_not_listed"] == 700
    assert run["peers_total"] == 1000 and run["peers_online"] == 900  # counted over all of them
    assert {p["last_seen"] for p in run["peers"]} == set(map(float, range(30)))  # the most recently seen
    assert len(collector.peer_history) == 300
    metrics = client.get("/metrics").text
    assert re.search(r'collab_dashboard_peers_not_listed\{run_id="run"\} 700', metrics)
    assert "counted above but not listed" in (STATIC / "app.js").read_text()  # and the page says so


def test_a_peers_history_is_capped_and_in_time_order():
    collector = Collector("run")
    for step in range(PEER_HISTORY_POINTS + 50):
        collector.ingest(churning_state(float(step), 7, 1, batches_dropped=0))
    points = collector.peer_json("peer00007")
    assert len(points) == PEER_HISTORY_POINTS
    assert [p["time"] for p in points] == [float(t) for t in range(50, PEER_HISTORY_POINTS + 50)]
    assert points[-1] == dict(time=float(PEER_HISTORY_POINTS + 49), epoch=3, samples_per_second=1.0, loss=4.0,
                              samples_contributed=7)


def test_the_page_pages_and_sorts_by_what_the_api_takes():
    """The page's contract with /api/run (tests/swarm/test_dashboard.py drives it in a browser)."""
    html, script = (STATIC / "index.html").read_text(), (STATIC / "app.js").read_text()
    for element in ("peers-prev", "peers-next", "peers-range"):
        assert f'id="{element}"' in html
    columns = re.findall(r'<th data-sort="([a-z_]+)"', html)
    assert len(columns) == 10 and set(columns) == set(SORT_KEYS)
    assert "/api/run?${new URLSearchParams(table)}" in script and "const PAGE_SIZE = 50;" in script
