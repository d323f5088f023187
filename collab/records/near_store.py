"""A record stored straight to the nodes that hold its key, found by a walk at most every WALK_EVERY seconds.

hivemind's store walks the DHT for the nodes nearest the key before every store, and each node the walk asks
answers with everything it holds under the key. Under the progress key that is every peer's signed record (~0.8 KB
each), and every node holds them all (every tracker's read caches the key). With hivemind's beam of 20, a walk asks
every node of a swarm under 20, so one store cost N - 1 requests and (N - 1) x N records: a peer's store traffic grew
with N^2, and its progress stores (every 0.5-2.5 s mid-epoch, every micro-batch near an epoch's end) were most of its
DHT bytes (docs/benchmarks.md, "Stores and reads that asked every node").

Here the walk's answer, the key's `num_replicas` nearest nodes, is kept, and a store goes straight to them: 5
requests of one record each. The walk is made again after WALK_EVERY seconds (a node that joined since, nearer
the key, gets the stores from then on; until then the readers, whose walks ask the 20 nearest, still find the
records on the nodes that had them). A node that does not answer is stored to no more, and left out of the walks for
WALK_EVERY; when fewer than half the nodes are left, the next store walks. A store that no node answered falls back
to hivemind's own, walk and all. Readers are unchanged: a read still walks and merges every answer.

Runs in the DHT's process (hivemind's run_coroutine): the walks' answers live there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from functools import partial
from typing import Any, Optional

from hivemind.dht.crypto import DHTRecord
from hivemind.dht.routing import DHTID

WALK_EVERY = 30.0  # seconds: how long the nearest nodes a walk found are stored to without walking again

_nearest: dict[DHTID, tuple[float, dict]] = {}  # in the DHT's process: key id -> (when walked, {node id: peer id})
_unanswered: dict[DHTID, float] = {}  # in the DHT's process: node id -> when it last did not answer a store
_counts: Counter = Counter()  # in the DHT's process: "walked", "direct", "refused", "fallback", "unanswered"


def store_near(dht, key: str, subkey: Any, value: Any, expiration_time: float):
    """From any process holding the DHT: store `value` under `key`/`subkey` on the key's nearest nodes, walking
    the DHT only when the last walk is older than WALK_EVERY. Returns hivemind's MPFuture of whether any node took
    it (awaitable, as DHT.store's)."""
    return dht.run_coroutine(partial(_store, key=key, subkey=subkey, value=value, expiration_time=expiration_time),
                             return_future=True)


def counts() -> dict:
    """In the DHT's process, since it started: stores made straight to the nearest nodes ("direct"; "refused" where
    every node refused the record), walks made for them, fallbacks to hivemind's store (no node answered), and
    store requests that got no answer."""
    return dict(_counts)


async def _store(_dht, node, key: str, subkey: Any, value: Any, expiration_time: float) -> bool:
    key_id = DHTID.generate(source=key)
    walked_at, targets = _nearest.get(key_id, (float("-inf"), None))
    if targets is None or time.monotonic() - walked_at > WALK_EVERY:
        targets = await _walk(node, key_id)
        _nearest[key_id] = (time.monotonic(), targets)
        _counts["walked"] += 1
    record = _signed_record(node, key_id, subkey, value, expiration_time)
    results = await asyncio.gather(*(_store_on(node, node_id, peer_id, key_id, subkey, record)
                                     for node_id, peer_id in list(targets.items())))
    for node_id, result in zip(list(targets), results):
        if result is None:  # no answer: stored to no more until it answers a walk again
            _unanswered[node_id] = time.monotonic()
            targets.pop(node_id)
            _counts["unanswered"] += 1
    if len(targets) < (node.num_replicas + 1) // 2:
        _nearest.pop(key_id, None)  # too few left: walk again next time
    answered = [result for result in results if result is not None]
    if answered:
        # every node that answered refused it: it holds a newer one for the subkey (this peer's next store, begun
        # while this one waited, came first: the reporter does not wait for a store to end), or the record fails
        # the run's validators. Neither is what a walk would change
        _counts["direct" if any(answered) else "refused"] += 1
        return any(answered)
    _counts["fallback"] += 1
    return await node.store(key, value, expiration_time, subkey=subkey)


async def _walk(node, key_id: DHTID) -> dict:
    """The key's num_replicas nearest nodes, {node id: peer id}, less those that lately did not answer a store: a
    walk still returns a node that has died (the nodes it asks still list it) until their routing tables drop it."""
    now = time.monotonic()
    for node_id in [n for n, at in _unanswered.items() if now - at > WALK_EVERY]:
        del _unanswered[node_id]
    # hivemind counts itself among a key's nearest nodes, as its own store does; a client's own storage serves
    # nobody, so a client stores to others only
    found = await node.find_nearest_nodes([key_id], k_nearest=node.num_replicas + len(_unanswered),
                                          exclude_self=node.protocol.client_mode)
    alive = [(node_id, peer_id) for node_id, peer_id in found.get(key_id, {}).items() if node_id not in _unanswered]
    return dict(alive[:node.num_replicas])


def _signed_record(node, key_id: DHTID, subkey: Any, value: Any, expiration_time: float) -> DHTRecord:
    """The record as hivemind's store_many builds it: serialized, then signed by every validator that signs (the
    peer's RSA key: readers check that the signer is the subkey's owner)."""
    serializer, validator = node.protocol.serializer, node.protocol.record_validator
    record = DHTRecord(key_id.to_bytes(), serializer.dumps(subkey), serializer.dumps(value), expiration_time)
    if validator is not None:
        record = dataclasses.replace(record, value=validator.sign_value(record))
    return record


async def _store_on(node, node_id: DHTID, peer_id, key_id: DHTID, subkey: Any, record: DHTRecord) -> Optional[bool]:
    """Whether the node took the record; None if it did not answer."""
    if node_id == node.node_id:  # this node's own storage, checked as any other node would check the record
        validator = node.protocol.record_validator
        if validator is not None and not validator.validate(record):
            return False
        return node.protocol.storage.store(key_id, record.value, record.expiration_time, subkey=subkey)
    stored = await node.protocol.call_store(peer_id, keys=[key_id], values=[record.value],
                                            expiration_time=[record.expiration_time], subkeys=[subkey])
    return None if stored is None else bool(stored[0])
