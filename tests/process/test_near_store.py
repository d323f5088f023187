"""A record stored straight to its key's nearest nodes (collab.records.near_store), on real DHT nodes (p2pd): one walk,
then stores of one record each, which a plain hivemind reader finds, signed; a target that dies is walked around.
The requests are counted by collab.swarm.dht_traffic in the writer's DHT process."""

from __future__ import annotations

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time

from collab.records.metrics import PROGRESS_SUFFIX
from collab.records import near_store
from collab.swarm.dht_traffic import dht_requests, start_counting

KEY = "near_progress"
NODES = 7


async def _node_id(_dht, node):
    return node.node_id


async def _near_counts(_dht, _node):
    return near_store.counts()


@pytest.fixture()
def swarm():
    nodes = []
    try:
        for _ in range(NODES):
            initial = nodes[0].get_visible_maddrs() if nodes else None
            nodes.append(hivemind.DHT(initial_peers=initial, record_validators=[RSASignatureValidator()], start=True))
        yield nodes
    finally:
        for node in nodes:
            node.shutdown()


def _progress_key_requests(dht) -> dict:
    """Requests the writer's node sent for KEY, by RPC (find, store), and their bytes in all."""
    report = dht_requests(dht, run_id=KEY.removesuffix(PROGRESS_SUFFIX), timeout=10)
    assert report is not None
    return {"requests": report["by_key"].get(KEY, {}).get("requests", 0),
            "bytes": report["by_key"].get(KEY, {}).get("bytes", 0),
            "find": report["by_rpc"].get("find", {}).get("requests", 0),
            "store": report["by_rpc"].get("store", {}).get("requests", 0)}


def test_stores_go_straight_to_the_keys_nearest_nodes_and_readers_find_them(swarm):
    writer, reader = swarm[0], swarm[-1]
    subkey = RSASignatureValidator().local_public_key  # the writer's process-wide key: its records' owner
    start_counting(writer)
    expiration = get_dht_time() + 60

    def store(n: int) -> bool:
        return near_store.store_near(writer, KEY, subkey, {"n": n}, expiration + n).result(timeout=30)

    def read() -> dict:
        found = reader.get(KEY, latest=True)
        assert found is not None
        return {key: entry.value for key, entry in found.value.items()}

    assert store(0)
    first = _progress_key_requests(writer)
    assert first["find"] >= NODES - 2, first  # the walk: hivemind's beam of 20 asks every other node
    for n in range(1, 6):
        assert store(n)
    direct = _progress_key_requests(writer)
    # no walk for 5 stores: each went to the key's nearest nodes (5, this node among them or not), one record each
    assert direct["find"] == first["find"], (first, direct)
    assert 5 * 4 <= direct["store"] - first["store"] <= 5 * 5, (first, direct)
    assert read() == {subkey: {"n": 5}}  # signed: a reader with its own validator took it

    # hivemind's own store of the same record walks every time: what one direct store saves
    plain = writer.store(KEY, {"n": 6}, expiration + 6, subkey=subkey)
    walked = _progress_key_requests(writer)
    assert plain and walked["find"] >= direct["find"] + NODES - 2, (direct, walked)
    per_plain_store = walked["bytes"] - direct["bytes"]
    per_direct_store = (direct["bytes"] - first["bytes"]) / 5
    print(f"bytes for {KEY}: a direct store {per_direct_store:.0f}, hivemind's store {per_plain_store}")
    assert per_direct_store < per_plain_store / 2, (per_direct_store, per_plain_store)

    # the key's nearest node (not the writer or the reader) dies: the next store still lands on the others, and the
    # one after goes to them only (the others still list the dead node, so a walk would bring it back)
    key_id = DHTID.generate(source=KEY)
    others = sorted(swarm[1:-1], key=lambda dht: key_id.xor_distance(dht.run_coroutine(_node_id)))
    others[0].shutdown()
    assert store(7)
    assert store(8)
    counts = writer.run_coroutine(_near_counts)
    assert counts == {"walked": 1, "direct": 8, "unanswered": 1}, counts  # stores 0-5, 7 and 8
    assert read() == {subkey: {"n": 8}}
    # a store that ends after a newer one (the reporter does not wait for one to end) is refused, and not walked for
    late = near_store.store_near(writer, KEY, subkey, {"n": 7.5}, expiration + 7.5).result(timeout=30)
    counts = writer.run_coroutine(_near_counts)
    assert late is False and counts["refused"] == 1 and counts.get("fallback", 0) == 0, counts
    assert read() == {subkey: {"n": 8}}
