"""A peer's readers of the progress key share its reads (collab.records.shared_reads), on real DHT nodes (p2pd).

hivemind's tracker reads the key with dht.get; collab's readers (its sync thread, donor waits, averager processes)
with read_progress. A read of either kind that the peer made less than share_for(N) seconds ago answers collab's
readers without a walk: no find request leaves the node, and what they get is what that read found. The reads the
stream does make ask the key's nearest nodes (READ_REPLICAS of them) and walk only when those fail."""

from __future__ import annotations

import threading
import time

from hivemind.utils import get_dht_time

import collab.records.shared_reads as shared_reads
from collab.records.metrics import PROGRESS_SUFFIX
from collab.swarm.dht_traffic import dht_requests, start_counting
from collab.swarm.node import OwnGroupDHT, shut_down_dht
from collab.records.shared_reads import READ_REPLICAS, recent_or_new, share_for, shared_counts, start_sharing

RUN = "shared"
KEY = RUN + PROGRESS_SUFFIX  # a key dht_requests names
WAIT = 30  # seconds: every store is bounded


def bounded(call, *args):
    """`call(*args)` (a call into a DHT's process), waited for WAIT seconds at most."""
    answer: list = []
    thread = threading.Thread(target=lambda: answer.append(call(*args)), daemon=True)
    thread.start()
    thread.join(WAIT)
    assert answer, f"{call.__name__} did not answer within {WAIT} s"
    return answer[0]


def finds(dht) -> int:
    """The find requests this node has sent for the progress key (its reads' walks)."""
    return dht_requests(dht, RUN, timeout=WAIT)["by_key"].get(KEY, {}).get("requests", 0)


def store(dht, subkey: str) -> None:
    assert dht.store(KEY, subkey=subkey, value=subkey, expiration_time=get_dht_time() + 60,
                     return_future=True).result(timeout=WAIT)


def test_readers_take_a_read_made_less_than_the_period_ago_and_walk_after_it(no_leftover_processes, monkeypatch):
    # three records read as a swarm of 24 would be: shared for 1.5 s, long enough for a store on a busy machine
    monkeypatch.setattr(shared_reads, "PEERS_PER_READ", 1)  # (before the DHTs fork their processes)
    ours = theirs = None
    try:
        ours = OwnGroupDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        theirs = OwnGroupDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=ours.get_visible_maddrs())
        start_counting(ours)
        start_sharing(ours, [KEY])
        for subkey in ("a", "b", "c"):
            store(theirs, subkey)

        began = time.monotonic()
        assert set(bounded(recent_or_new, ours, KEY).value) == {"a", "b", "c"}
        walks = finds(ours)
        assert walks > 0, "the first read walked nowhere"
        store(theirs, "d")
        again = bounded(recent_or_new, ours, KEY)
        assert time.monotonic() - began < share_for(3), "the machine was too slow for this test's period"
        assert set(again.value) == {"a", "b", "c"}, "a read within the period walked again"
        assert finds(ours) == walks

        # a fresh read (hivemind's tracker's dht.get) walks, and collab's readers then take what it found
        assert set(bounded(ours.get, KEY, True).value) == {"a", "b", "c", "d"}
        walks = finds(ours)
        assert set(bounded(recent_or_new, ours, KEY).value) == {"a", "b", "c", "d"}
        assert finds(ours) == walks
        assert {k: v for k, v in bounded(shared_counts, ours).items() if k in ('walked', 'served', 'joined')} \
            == dict(walked=2, served=2, joined=0)

        time.sleep(share_for(4))  # the period is over: a reader walks again
        store(theirs, "e")
        assert set(bounded(recent_or_new, ours, KEY).value) == {"a", "b", "c", "d", "e"}
        assert finds(ours) > walks

        # a DHT that does not share (the dashboard's): every read walks
        start_counting(theirs)
        before = dht_requests(theirs, RUN, timeout=WAIT)["by_key"].get(KEY, {}).get("requests", 0)
        bounded(recent_or_new, theirs, KEY)
        assert dht_requests(theirs, RUN, timeout=WAIT)["by_key"][KEY]["requests"] > before
        assert bounded(shared_counts, theirs) is None
    finally:
        for dht in (theirs, ours):
            if dht is not None:
                shut_down_dht(dht)


async def _nearest(_dht, _node) -> list:
    """In the DHT's process: the peer ids of the nearest nodes its shared reads ask."""
    return [str(peer) for peer in shared_reads._reads.nearest[KEY][1].values()]


def key_traffic(dht) -> tuple[int, int]:
    row = dht_requests(dht, RUN, timeout=WAIT)["by_key"].get(KEY, {})
    return row.get("requests", 0), row.get("bytes", 0)


def test_the_streams_reads_ask_the_keys_nearest_nodes_and_walk_when_one_is_gone(no_leftover_processes):
    dhts = []
    try:
        ours = OwnGroupDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        dhts.append(ours)
        for _ in range(4):
            dhts.append(OwnGroupDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                    initial_peers=ours.get_visible_maddrs()))
        start_counting(ours)
        start_sharing(ours, [KEY])
        for i, dht in enumerate(dhts[1:]):  # every node holds every record: hivemind stores on 5 nodes
            store(dht, f"peer{i}")

        assert set(bounded(ours.get, KEY, True).value) == {f"peer{i}" for i in range(4)}  # the first read walks
        walk = key_traffic(ours)
        assert walk[0] >= 3, "the walk asked fewer nodes than hold the key"
        nearest = bounded(ours.run_coroutine, _nearest)
        assert len(nearest) == READ_REPLICAS

        store(dhts[1], "peer4")  # a record newer than the walk: the nearest nodes hold it too
        assert set(bounded(ours.get, KEY, True).value) == {f"peer{i}" for i in range(5)}
        after = key_traffic(ours)
        asked = READ_REPLICAS - (str(ours.peer_id) in nearest)  # this node, where it is one, answers from memory
        assert after[0] - walk[0] == asked, "a read asked other nodes than the key's nearest"
        assert after[1] - walk[1] < 0.75 * walk[1], "a read from the nearest cost as much as a walk"
        counts = bounded(shared_counts, ours)
        assert (counts["from_nearest"], counts["full_walks"], counts["records_from_nearest"]) == (1, 1, 5)

        # one of the nearest leaves: the next read walks, finds every record on the others, and finds the nearest anew
        gone = next(dht for dht in dhts[1:] if str(dht.peer_id) in nearest)
        shut_down_dht(gone)
        dhts.remove(gone)
        assert set(bounded(ours.get, KEY, True).value) == {f"peer{i}" for i in range(5)}
        counts = bounded(shared_counts, ours)
        assert (counts["fell_back"], counts["full_walks"]) == (1, 2)
        assert str(gone.peer_id) not in bounded(ours.run_coroutine, _nearest)
    finally:
        for dht in reversed(dhts):
            shut_down_dht(dht)
