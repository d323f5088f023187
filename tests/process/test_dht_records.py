"""Where records go and what walks and reads carry, on real DHT nodes (p2pd).

A store's walk asks for the key's twin (collab.hivemind_hooks.dht_node.store_walks_without_values): the record lands
on exactly the nodes hivemind's own walk picks, readers find it, and the walk brings back no records, where
hivemind's brings back every record under the key from every node it asks. The key's next stores go to the nodes
that walk found, without a walk of their own (stores_remember_nodes), until a nearer node joins or one of them leaves.

Reads leave no copies (collab.swarm.node.NO_RECORD_COPIES): after every node has read a key, only the key's 5
replicas hold its records, and a read brings them back from those 5 alone. A hivemind node with its defaults, beside
them, keeps a copy of what it read and answers other nodes' finds with it: the copies that made every read of the
progress key carry every record from every node."""

from __future__ import annotations

import time
from functools import partial

import hivemind
import pytest
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time

from collab.hivemind_hooks.dht_node import STORE_BEAM, store_walks_without_values, stores_remember_nodes
from collab.records.metrics import METRICS_SUFFIX, PROGRESS_SUFFIX, PeerMetricsRecord, publish
from collab.swarm.dht_traffic import dht_requests, start_counting
from collab.swarm.node import OwnGroupDHT, shut_down_dht
from tests.conftest import METRICS_RECORD

RUN = "walks"
KEY = RUN + PROGRESS_SUFFIX  # a key dht_requests names
KEY_ID = DHTID.generate(source=KEY)
NODES = 7
WAIT = 30  # seconds: every call into a DHT's process is bounded
RECORD = "x" * 800  # about a signed progress record


async def _node_id(_dht, node):
    return node.node_id


async def _holds(_dht, node, subkey, key: str = KEY) -> bool:
    found = node.protocol.storage.get(DHTID.generate(source=key))
    return found is not None and subkey in found.value.data


async def _patch(_dht, node) -> None:
    store_walks_without_values(node)


async def _patch_remembering(_dht, node) -> None:
    store_walks_without_values(node)
    stores_remember_nodes(node)


async def _knows(_dht, node, node_id) -> bool:
    return node_id in node.protocol.routing_table


def _in_process(dht, coroutine):
    """`coroutine(dht, node)` run in the DHT's process, its result waited for WAIT seconds at most."""
    return dht.run_coroutine(coroutine, return_future=True).result(timeout=WAIT)


def _start(nodes: list, count: int, make=hivemind.DHT, **options) -> None:
    """`count` more nodes joined to the first of `nodes` (the caller shuts them all down, even if one fails)."""
    for _ in range(count):
        initial = nodes[0].get_visible_maddrs() if nodes else None
        nodes.append(make(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True, **options))


@pytest.fixture()
def swarm():
    nodes = []
    try:
        _start(nodes, NODES)
        yield nodes
    finally:
        for node in nodes:
            shut_down_dht(node)


@pytest.fixture()
def collab_swarm():
    """NODES of collab's nodes, then one with hivemind's defaults whose id is the farthest from the key: never one of
    its replicas."""
    nodes = []
    try:
        _start(nodes, NODES, OwnGroupDHT)
        _start(nodes, 1, node_id=DHTID(KEY_ID ^ (DHTID.MAX - 1)))
        yield nodes
    finally:
        for node in nodes:
            shut_down_dht(node)


def _walk_of_one_store(writer, subkey: str) -> dict:
    """The writer stores one record; what its requests for the key (and for its twin) carried."""
    before = dht_requests(writer, run_id=RUN, timeout=10)["by_key"]
    assert writer.store(KEY, RECORD, get_dht_time() + 60, subkey=subkey, return_future=True).result(timeout=WAIT)
    after = dht_requests(writer, run_id=RUN, timeout=10)["by_key"]

    def grew(name: str) -> dict:
        old, new = before.get(name, {}), after.get(name, {})
        return {field: new.get(field, 0) - old.get(field, 0) for field in ("requests", "bytes")}
    return {"key": grew(KEY), "twin": grew(f"{KEY} (walks for its nodes)")}


def test_a_store_walks_to_the_same_nodes_without_bringing_back_their_records(swarm):
    for i, node in enumerate(swarm):  # every node holds several peers' records under the key
        assert node.store(KEY, RECORD, get_dht_time() + 60, subkey=f"peer{i}", return_future=True).result(timeout=WAIT)
    patched, plain = swarm[1], swarm[2]
    for node in (patched, plain):
        start_counting(node)
    _in_process(patched, _patch)

    walked_plain = _walk_of_one_store(plain, "plain")
    walked_patched = _walk_of_one_store(patched, "patched")
    print(f"one store's requests for {KEY}: hivemind's {walked_plain}, collab's {walked_patched}")
    # hivemind's walk asks for the key itself, and every node it asks answers with the records it holds
    assert walked_plain["key"]["requests"] >= NODES - 2 and walked_plain["twin"]["requests"] == 0, walked_plain
    # collab's asks for the twin only, of at most STORE_BEAM nodes: the key itself is named by the stores alone (one
    # request per target node)
    assert 1 <= walked_patched["twin"]["requests"] <= STORE_BEAM, walked_patched
    assert walked_patched["key"]["requests"] <= 5, walked_patched  # num_replicas: the stores
    plain_per_find = walked_plain["key"]["bytes"] / walked_plain["key"]["requests"]
    twin_per_find = walked_patched["twin"]["bytes"] / walked_patched["twin"]["requests"]
    assert plain_per_find > 3 * len(RECORD) and twin_per_find < len(RECORD), (plain_per_find, twin_per_find)

    # both records landed on the key's 5 nearest nodes: the twin's nearest are the key's
    nearest = sorted(swarm, key=lambda dht: KEY_ID.xor_distance(_in_process(dht, _node_id)))[:5]
    for subkey in ("plain", "patched"):
        holders = [dht for dht in swarm if _in_process(dht, partial(_holds, subkey=subkey))]
        assert set(holders) == set(nearest), subkey
    # and a reader that walks the key finds every record
    found = swarm[-1].get(KEY, latest=True, return_future=True).result(timeout=WAIT)
    assert found is not None and {"plain", "patched", *(f"peer{i}" for i in range(NODES))} <= set(found.value)


def test_collabs_own_records_walk_a_narrower_beam_and_still_land_on_the_nearest_nodes(swarm):
    """hivemind's store walk visits its whole beam (20 nodes: here all 6 others) to store on the nearest 5; a patched
    node's stores (collab's records, hivemind's own declarations) walk a beam of STORE_BEAM, land on the same 5
    nodes, and are read back."""
    key = RUN + METRICS_SUFFIX
    writer = swarm[3]
    start_counting(writer)
    _in_process(writer, _patch)
    twin = f"{key} (walks for its nodes)"
    before = dht_requests(writer, run_id=RUN, timeout=10)["by_key"].get(twin, {}).get("requests", 0)
    publish(writer, RUN, b"writer", PeerMetricsRecord(**METRICS_RECORD), 60)
    key_id = DHTID.generate(source=key)
    holders, deadline = [], get_dht_time() + WAIT
    while len(holders) < 5 and get_dht_time() < deadline:  # publish() does not wait for its store
        holders = [dht for dht in swarm if _in_process(dht, partial(_holds, subkey=b"writer", key=key))]
    walked = dht_requests(writer, run_id=RUN, timeout=10)["by_key"][twin]["requests"] - before
    assert walked <= STORE_BEAM < NODES - 1, f"the walk asked {walked} nodes, not at most {STORE_BEAM}"
    nearest = sorted(swarm, key=lambda dht: key_id.xor_distance(_in_process(dht, _node_id)))[:5]
    assert set(holders) == set(nearest)
    found = swarm[0].get(key, latest=True, return_future=True).result(timeout=WAIT)
    assert found is not None and list(found.value) == [b"writer"], found


async def _holds_any(_dht, node) -> bool:
    """Whether this node would answer a find for KEY with records: from its storage or from its cache."""
    return node.protocol.storage.get(KEY_ID) is not None or node.protocol.cache.get(KEY_ID) is not None


def _read(dht) -> set:
    found = dht.get(KEY, latest=True, return_future=True).result(timeout=WAIT)
    return set(found.value) if found is not None else set()


def test_reads_leave_the_records_on_the_keys_replicas_alone(collab_swarm):
    ours, plain = collab_swarm[:NODES], collab_swarm[NODES]
    subkeys = {f"peer{i}" for i in range(NODES)}
    for i, node in enumerate(ours):
        assert node.store(KEY, RECORD, get_dht_time() + 60, subkey=f"peer{i}", return_future=True).result(timeout=WAIT)
    replicas = sorted(collab_swarm, key=lambda dht: KEY_ID.xor_distance(_in_process(dht, _node_id)))[:5]
    assert plain not in replicas
    others = [node for node in ours if node not in replicas]

    # every node reads the key, twice, and finds every record
    for node in ours:
        assert _read(node) >= subkeys and _read(node) >= subkeys
    holders = [node for node in collab_swarm if _in_process(node, _holds_any)]
    assert set(holders) == set(replicas), (f"{len(holders)} nodes hold the key's records after the reads, "
                                           f"not its {len(replicas)} replicas")

    # a read brings the records back from the replicas alone: one copy each, not one from every node it asks
    reader = others[0]
    start_counting(reader)
    assert _read(reader) >= subkeys
    read = dht_requests(reader, run_id=RUN, timeout=10)["by_key"][KEY]
    assert read["bytes"] < 5 * NODES * len(RECORD) * 1.2, read

    # hivemind's defaults keep a copy: the plain node, no replica, answers finds with the records once it has read
    assert _read(plain) >= subkeys
    assert _in_process(plain, _holds_any), "hivemind's node kept no copy: this test no longer shows what it prevents"


def _store_and_walks(writer, subkey: str) -> int:
    """The writer stores one record under KEY; how many nodes its walk for the key's nodes asked."""
    twin = f"{KEY} (walks for its nodes)"
    before = dht_requests(writer, run_id=RUN, timeout=10)["by_key"].get(twin, {}).get("requests", 0)
    assert writer.store(KEY, RECORD, get_dht_time() + 60, subkey=subkey, return_future=True).result(timeout=WAIT)
    return dht_requests(writer, run_id=RUN, timeout=10)["by_key"].get(twin, {}).get("requests", 0) - before


def _holders(swarm: list, subkey: str) -> set:
    return {dht for dht in swarm if _in_process(dht, partial(_holds, subkey=subkey))}


def _nearest(swarm: list, k: int = 5) -> set:
    return set(sorted(swarm, key=lambda dht: KEY_ID.xor_distance(_in_process(dht, _node_id)))[:k])


def test_a_keys_next_stores_go_where_its_walk_found_until_a_nearer_node_joins_or_one_leaves(swarm):
    writer = swarm[3]
    start_counting(writer)
    _in_process(writer, _patch_remembering)
    walked = [_store_and_walks(writer, f"w{i}") for i in range(4)]
    assert walked[0] >= 1 and walked[1:] == [0, 0, 0], f"nodes asked by each of four stores' walks: {walked}"
    for i in range(4):  # each on the key's 5 nearest nodes, as a walk would have put it
        assert _holders(swarm, f"w{i}") == _nearest(swarm), i

    # a node nearer to the key than all of them joins (through the writer, which so knows it): the next store walks
    # and lands on it
    swarm.append(hivemind.DHT(initial_peers=writer.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                              node_id=DHTID(KEY_ID ^ 2), start=True))
    newcomer_id = _in_process(swarm[-1], _node_id)
    deadline = time.monotonic() + WAIT  # (the writer adds it to its routing table as its first request is answered)
    while not _in_process(writer, partial(_knows, node_id=newcomer_id)):
        assert time.monotonic() < deadline, "the writer never learned of the node that joined through it"
        time.sleep(0.1)
    assert _store_and_walks(writer, "after-join") >= 1
    assert _holders(swarm, "after-join") == _nearest(swarm)

    # one of its nodes leaves: the first store that finds it gone (hivemind then drops it from the routing table)
    # still lands on the 4 others, and the next walks again (or that first one does, where something else found the
    # node gone before it); the last lands on the key's 5 nearest nodes that are left
    leaver = next(dht for dht in sorted(_nearest(swarm), key=swarm.index) if dht is not writer)
    swarm.remove(leaver)
    shut_down_dht(leaver)
    walked = [_store_and_walks(writer, subkey) for subkey in ("after-leave-0", "after-leave-1", "after-leave-2")]
    assert sum(walked) >= 1, f"no store walked after one of the key's nodes left: {walked}"
    assert _holders(swarm, "after-leave-2") == _nearest(swarm)
