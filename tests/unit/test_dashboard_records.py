"""Records that reach a reader untrusted (malformed, claiming another peer's id, from the future, absurd
epochs) are ignored, counted by reason and by signer; they never break the API, the charts or /metrics.

These feed `read_run_state` through a stand-in for DHT.get that returns what hivemind returns
(ValueWithExpiration of subkey -> ValueWithExpiration): the parsing and counting is collab's own.
The real-DHT path is covered in test_dashboard.py and test_metrics.py.
"""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import ValueWithExpiration
from prometheus_client.parser import text_string_to_metric_families

from collab.dashboard.app import create_app
from collab.dashboard.collector import Collector
from collab.records.identity import load_or_create_identity
from collab.records.untrusted import Rejections
from collab.swarm.state import read_run_state

GOOD = dict(role="trainer", version="0.1.0", epoch=4, loss=6.5, samples_per_second=20.0,
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


@pytest.fixture(scope="module")
def keys():
    """Signers: the subkey hivemind stores a record under, and the peer id that key derives."""
    made = []
    for _ in range(8):
        identity = load_or_create_identity(None)
        made.append((RSASignatureValidator(identity.key).local_public_key, identity.peer_id))
    return made


def progress(peer_id: str, epoch: int, now: float) -> dict:
    return dict(peer_id=PeerID.from_base58(peer_id).to_bytes(), epoch=epoch, samples_accumulated=10,
                samples_per_second=5.0, time=now, client_mode=False)


def hostile_state(keys):
    now = time.time()
    (good, good_id), (thief, _), (future, future_id), (nan, nan_id), (huge, huge_id), (extra, extra_id), \
        (a, a_id), (b, b_id) = keys
    return read_run_state(RecordedDHT({"run_metrics": {
        good: dict(GOOD, peer_id=good_id, time=now),
        thief: dict(GOOD, peer_id=good_id, loss=0.01, samples_contributed=10**9, time=now),  # another's id
        future: dict(GOOD, peer_id=future_id, time=now + 10**6),  # "online" for ever
        nan: dict(GOOD, peer_id=nan_id, loss=float("nan"), time=now),
        huge: dict(GOOD, peer_id=huge_id, samples_per_second=1e30, time=now),
        extra: dict(GOOD, peer_id=extra_id, admin=True, time=now),
        b"unsigned": dict(GOOD, peer_id="12D3KooWNoKey", time=now),
    }, "run_progress": {
        good: progress(good_id, 4, now), a: progress(a_id, 4, now), b: progress(b_id, 5, now),
        huge: progress(huge_id, 10**6, now),  # drags the global epoch to a million
        b"garbage": {"peer_id": b"x", "epoch": "many"},
    }}), "run")


def test_untrusted_records_are_ignored_counted_and_attributed(keys):
    state = hostile_state(keys)
    good_id, thief_id = keys[0][1], keys[1][1]
    assert {p.peer_id for p in state.peers} == {good_id, keys[6][1], keys[7][1]}
    row = next(p for p in state.peers if p.peer_id == good_id)
    # the record that claimed the good peer's id changed nothing readers show
    assert row.loss == 6.5 and row.samples_contributed == 900 and row.contribution == 1.0
    assert state.global_epoch == 5 and state.target_batch_size == 256
    assert state.rejected_records == 8
    assert state.rejected_by_reason == {"peer id is not the signer's": 2, "time in the future": 1, "malformed": 4,
                                        "epoch far ahead of the others": 1}, state.rejected_by_reason
    assert state.rejected_by_signer[thief_id] == 1 and state.rejected_by_signer["unsigned"] == 2


def test_api_page_and_metrics_answer_with_hostile_records(keys):
    collector = Collector("run")
    collector.ingest(hostile_state(keys))
    client = TestClient(create_app(collector, manage_collector=False))
    run = client.get("/api/run").json()
    assert run["rejected_records"] == 8 and len(run["peers"]) == 3
    assert run["rejected_by_reason"]["time in the future"] == 1
    points = client.get("/api/history").json()["points"]
    assert points[-1]["loss"] == 6.5 and points[-1]["samples_per_second"] < 1e6
    assert client.get("/").status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    assert families["collab_rejected_records"].samples[0].value == 8


def test_api_before_the_first_snapshot_and_unknown_routes():
    client = TestClient(create_app(Collector("run"), manage_collector=False))
    response = client.get("/api/run")
    assert response.status_code == 503
    assert response.json()["detail"].startswith("no snapshot of the run yet")
    assert client.get("/api/peers/nobody").status_code == 404
    assert client.get("/healthz").json()["snapshot_age_seconds"] is None
    assert client.get("/metrics").status_code == 200


def test_the_trainers_progress_tracker_ignores_untrusted_records_before_hivemind_reads_them(keys):
    """hivemind's tracker takes the highest epoch it reads as the swarm's: a forged record must not reach it."""
    from collab.modes.tracker import trusted_progress

    now = time.time()
    (a, a_id), (b, b_id), (c, c_id), (thief, _), (fake, fake_id) = keys[:5]
    entries = {a: progress(a_id, 7, now), b: progress(b_id, 7, now), c: progress(c_id, 8, now),
               thief: progress(a_id, 9, now),  # signed by one key, claiming another's id
               fake: progress(fake_id, 10**6, now),  # a million epochs ahead of everyone
               b"gone": None}  # hivemind's goodbye: not a rejection
    metadata = {k: ValueWithExpiration(v, now + 60) for k, v in entries.items()}
    rejected = Rejections()
    trusted = trusted_progress(metadata, rejected, set())
    assert set(trusted) == {a, b, c}
    assert dict(rejected.by_reason) == {"peer id is not the signer's": 1, "epoch far ahead of the others": 1}


def test_history_forgets_gone_peers_so_1000_short_lived_peers_do_not_grow_memory():
    import tracemalloc

    from collab.swarm.state import PeerState, RunState

    def state_at(t: float, peer_index: int) -> RunState:
        peer = PeerState(peer_id=f"fake{peer_index}", role="trainer", client_mode=False, samples_per_second=1.0,
                         epoch=1, loss=5.0, samples_contributed=8, contribution=1.0, samples_accumulated=8,
                         bandwidth_mbps=None, rounds_joined=0, rounds_failed=0, last_seen=0.0, online=True,
                         straggler=False)
        return RunState(run_id="run", global_epoch=1, samples_accumulated=8, target_batch_size=256,
                        samples_per_second=1.0, eta_seconds=None, num_peers=1, num_clients=0, rejected_records=0,
                        peers=[peer], time=t)

    collector = Collector("run", history_size=50, forget_after=60.0)
    for i in range(200):  # warm up: the run history's deque fills to its bound
        collector.ingest(state_at(3.0 * i, i))
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i in range(200, 1200):  # 1000 peers, each seen once, 3 s apart
        collector.ingest(state_at(3.0 * i, i))
    grown = sum(stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    assert len(collector.peer_history) <= 21, len(collector.peer_history)  # only peers seen in the last 60 s
    assert collector.peer_json("fake1199") is not None and collector.peer_json("fake200") is None
    assert grown < 100_000, f"the collector grew by {grown} bytes over 1000 short-lived peers"


def test_the_others_median_is_the_one_statistics_gives_without_building_each_peers_list():
    import random
    import statistics

    from collab.records.untrusted import _median_high_without

    rng = random.Random(0)
    for _ in range(3000):
        epochs = sorted(rng.randint(0, 6) for _ in range(rng.randint(1, 9)))
        own = rng.choice(epochs)
        others = list(epochs)
        others.remove(own)
        if others:
            assert _median_high_without(epochs, own) == statistics.median_high(others), (epochs, own)
        assert _median_high_without(epochs, None) == statistics.median_high(epochs)


def test_a_half_of_a_split_that_trained_ahead_is_believed_and_a_few_forgers_are_not():
    """A 2 + 2 split: the fast half ends 5 epochs ahead; the median of each reader's others is the slow half's, so the
    median rule alone dropped the fast half's records (each fast peer's partner's, and the slow half's view of both),
    and the slow half never re-synced from it. Forged epochs still need a quarter of the voters behind them."""
    from types import SimpleNamespace

    from collab.records.untrusted import drop_implausible_epochs

    now = time.time()

    def records(*epochs):
        return {f"peer{i}": SimpleNamespace(epoch=e, time=now) for i, e in enumerate(epochs)}

    def dropped(items):
        rejected = Rejections()
        kept = drop_implausible_epochs(items, rejected, now)
        assert rejected.total == len(items) - len(kept)
        return sorted(set(items) - set(kept))

    assert dropped(records(8, 8, 3, 3)) == []  # the split's two halves, the fast one 5 ahead
    assert dropped(records(9, 3, 3, 3)) == ["peer0"]  # one peer alone 6 ahead of three: nobody backs it
    assert dropped(records(10**6, 4, 4, 5)) == ["peer0"]
    honest = [4] * 10
    assert dropped(records(10**6, 10**6, *honest)) == ["peer0", "peer1"]  # two colluding forgers of twelve
    assert dropped(records(*[10**6] * 4, *honest)) == [f"peer{i}" for i in range(4)]  # four of fourteen
    # a stale voter does not vote: a peer of the fast half alone with two long-gone slow records is kept
    items = records(8, 3, 3)
    for gone in ("peer1", "peer2"):
        items[gone].time = now - 1000
    assert dropped(items) == []
