"""hivemind's DHT node, patched in the DHT's own process: its requests counted, a store's walk without values and
its nodes remembered for the key's next stores, the latest reads of a hot key shared and read from the key's nearest
replicas. Part of collab.hivemind_hooks (listed there): one function each, with one line on why; nothing here runs at
import time.
"""

from __future__ import annotations

import asyncio
import time
from contextvars import ContextVar
from typing import Callable, Mapping, Optional

from hivemind.dht.node import _SearchState
from hivemind.dht.routing import DHTID


def count_dht_requests(protocol, count: Callable) -> None:
    """hivemind's DHTProtocol reaches every other node through its get_stub: each request it sends (rpc_find,
    rpc_store, rpc_ping) is counted by `count(rpc, request, reply)` (reply None for a request that failed), so a
    peer's DHT traffic can be measured as the swarm grows. Once per DHT node, in the DHT's process."""
    if getattr(protocol, "_collab_counted", False):
        return
    inner = protocol.get_stub

    class CountedStub:
        def __init__(self, stub):
            self._stub = stub

        def __getattr__(self, name: str):
            method = getattr(self._stub, name)
            if not name.startswith("rpc_"):
                return method

            async def counted(request, *args, **kwargs):
                reply = None
                try:
                    reply = await method(request, *args, **kwargs)
                    return reply
                finally:
                    count(name, request, reply)
            return counted

    protocol.get_stub = lambda peer: CountedStub(inner(peer))
    protocol._collab_counted = True


_walking_to_store: ContextVar[bool] = ContextVar("collab_walking_to_store", default=False)


def twin_key(key_id: DHTID) -> DHTID:
    """The id one bit from `key_id` (its lowest flipped): it has the same nearest nodes (XOR distances to it keep
    their order unless two nodes differ in that bit alone), and nothing is stored under it."""
    return DHTID(key_id ^ 1)


# a store's beam: hivemind's (its bucket size, 20) visits every node of a swarm of up to 21 on each store, though the
# value goes to the nearest num_replicas (5) of them. Readers' walks keep the full beam, so a record on the 5 nearest
# nodes the walker found is still read
STORE_BEAM = 5


def store_walks_without_values(node) -> None:
    """hivemind's store first walks the DHT for the key's nearest nodes, and each node the walk asks answers with
    everything it holds under the key, which the walk throws away: under the progress key, every peer's signed
    record, each checked by the walker, so (N - 1) x N records per store. Its walk asks for the key's twin instead
    (`twin_key`): the same nodes answer with the same neighbours, and no values; and it keeps a beam of STORE_BEAM
    (unless the store names its own), hivemind's own stores included (its averagers' declarations). Reads (get) are
    unchanged. Once per DHT node, in the DHT's process."""
    if getattr(node, "_collab_store_walks", False):
        return
    store_many, call_find = node.store_many, node._call_find_with_blacklist

    async def store_many_walking_to_the_twin(*args, **kwargs):
        kwargs.setdefault("beam_size", STORE_BEAM)
        walking = _walking_to_store.set(True)  # the walk's tasks, made inside, inherit it
        try:
            return await store_many(*args, **kwargs)
        finally:
            _walking_to_store.reset(walking)

    async def find(peer_id, keys):
        if not _walking_to_store.get():
            return await call_find(peer_id, keys)
        twins = {twin_key(key): key for key in keys}
        response = await call_find(peer_id, list(twins))
        if not response:
            return response
        return {twins[twin]: (None, neighbours) for twin, (_nothing, neighbours) in response.items()}

    node.store_many, node._call_find_with_blacklist = store_many_walking_to_the_twin, find
    node._collab_store_walks = True


# seconds the nodes a store's walk found serve the same key's next stores (a peer stores its progress record every
# half second mid-epoch); readers' nearest reads look for the key's nodes anew as often (shared_reads.FULL_READ_EVERY)
STORE_NODES_FOR = 15.0


def stores_remember_nodes(node, seconds: float = STORE_NODES_FOR, clock: Callable[[], float] = time.monotonic) -> None:
    """hivemind's store walks the DHT for the key's nearest nodes before every store: a peer storing its progress
    record every half second walked for the same nodes each time (with 16 linreg peers, 41% of the swarm's DHT
    requests were these walks). The nodes a store's walk found (up to STORE_BEAM, nearest first) serve that key's
    stores for `seconds`, while this node's routing table agrees: each is still in it (hivemind drops a node that did
    not answer a request, a store included) and it knows no nearer node than the farthest of them (one that joined
    since). Else the store walks again. Reads are unchanged. Once per DHT node, in the DHT's process, after
    store_walks_without_values."""
    if getattr(node, "_collab_store_nodes", False):
        return
    find_nearest = node.find_nearest_nodes
    known: dict[DHTID, tuple[float, dict]] = {}  # key id -> when its walk ended, its nearest nodes (DHT id -> peer id)

    def still_nearest(key_id: DHTID, nodes: dict) -> bool:
        table = node.protocol.routing_table
        if not all(node_id in table for node_id in nodes):
            return False
        farthest = max(key_id.xor_distance(node_id) for node_id in nodes)
        nearer = table.get_nearest_neighbors(key_id, len(nodes), exclude=node.node_id)
        return all(node_id in nodes for node_id, _ in nearer if key_id.xor_distance(node_id) < farthest)

    async def find_nearest_nodes(queries, *args, found_callback=None, node_to_peer_id=None, **kwargs):
        if not _walking_to_store.get() or args or found_callback is None or node_to_peer_id is None:
            return await find_nearest(queries, *args, found_callback=found_callback,
                                      node_to_peer_id=node_to_peer_id, **kwargs)
        now = clock()
        for key_id in [key_id for key_id, (when, _) in known.items() if now - when >= seconds]:
            del known[key_id]
        remembered = {key_id: known[key_id][1] for key_id in queries
                      if key_id in known and still_nearest(key_id, known[key_id][1])}

        async def remembering(key_id: DHTID, nearest: list, visited: set):
            if nearest:  # (a lone node's walk finds nobody: nothing worth remembering)
                known[key_id] = (clock(), {node_id: node_to_peer_id[node_id] for node_id in nearest})
            return await found_callback(key_id, nearest, visited)

        async def from_memory(key_id: DHTID, nodes: dict):
            node_to_peer_id.update(nodes)
            await found_callback(key_id, list(nodes), set())
            return key_id, nodes

        walks = []
        rest = [key_id for key_id in queries if key_id not in remembered]
        if rest:
            walks.append(find_nearest(rest, found_callback=remembering, node_to_peer_id=node_to_peer_id, **kwargs))
        found = await asyncio.gather(*walks, *(from_memory(key_id, nodes) for key_id, nodes in remembered.items()))
        walked = found.pop(0) if rest else {}
        return {**walked, **dict(found)}

    node.find_nearest_nodes = find_nearest_nodes
    node._collab_store_nodes = True


def share_latest_reads(node, read: Callable) -> None:
    """A DHT node's reads of a key's latest values (get with latest=True and nothing else) go through `read(key)`
    (collab.records.shared_reads), which may answer with one already under way or just made, so hivemind's own
    reads (its progress tracker's) and collab's share one stream of reads. Others are unchanged. Once per DHT node,
    in the DHT's process."""
    if getattr(node, "_collab_shared_reads", False):
        return
    get = node.get

    async def get_sharing(key, latest: bool = False, **kwargs):
        if latest and not kwargs:
            return await read(key)
        return await get(key, latest=latest, **kwargs)

    node.get = get_sharing
    node._collab_shared_reads = True


async def read_from_nodes(node, key, nodes: Mapping[DHTID, object]) -> tuple[Optional[object], int]:
    """`key`'s latest values from `nodes` alone (DHT id -> peer id; this node's own storage where it is one of
    them), asked at once: hivemind's get merges what every node of its walk holds, here only these answer. Merged
    as get merges (its _SearchState: the newest record of each subkey, each checked by the protocol's validators
    as it arrives). Returns what they hold (get's ValueWithExpiration; None for nothing) and how many answered."""
    key_id = DHTID.generate(source=key)
    search = _SearchState(key_id, float("inf"), serializer=node.protocol.serializer,
                          record_validator=node.protocol.record_validator)
    answered = 0
    if node.node_id in nodes:
        search.add_candidate(node.protocol.storage.get(key_id), source_node_id=node.node_id)
        answered += 1
    others = [(node_id, peer_id) for node_id, peer_id in nodes.items() if node_id != node.node_id]
    replies = await asyncio.gather(*(node._call_find_with_blacklist(peer_id, [key_id]) for _, peer_id in others))
    for (node_id, _), reply in zip(others, replies):
        if reply and key_id in reply:
            answered += 1
            search.add_candidate(reply[key_id][0], source_node_id=node_id)
    search.finish_search()
    return await search.future, answered


async def nearest_nodes(node, key, k: int) -> dict:
    """The `k` nodes nearest to `key` (DHT id -> peer id, nearest first; this node among them where it is one and
    stores values, not a client), found by a walk that asks for the key's twin: the same nodes answer, no values."""
    twin = twin_key(DHTID.generate(source=key))
    return (await node.find_nearest_nodes([twin], k_nearest=k, exclude_self=node.protocol.client_mode))[twin]
