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
to hivemind's own, walk and all.

Reads of those keys (`read_near`, through collab.swarm.node.OwnGroupDHT.get) ask the same nodes and merge their
answers as hivemind's walk would (patches.merged_answers): 5 answers of N records, where the walk had every node of a
swarm under 20 answer (N^2 per read, and min(N, 20) x N above). A swarm smaller than 5 nodes is walked again every
SMALL_SWARM_WALK_EVERY seconds, so that a newcomer is stored to and read from at once; a read that no node answers
falls back to hivemind's walk.

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

from collab.hivemind_hooks.patches import merged_answers

WALK_EVERY = 30.0  # seconds: how long the nearest nodes a walk found are stored to and read from without walking again
# ... when the walk found a whole set of num_replicas nodes. A walk that found fewer saw a swarm that small: it asks
# every node anyway (cheap), and a newcomer must be stored to and read from within seconds, not half a minute
SMALL_SWARM_WALK_EVERY = 3.0

_nearest: dict[DHTID, tuple[float, dict, int]] = {}  # in the DHT's process: key id -> (when walked, {node id: peer
# id} still answering, how many the walk found)
_unanswered: dict[DHTID, float] = {}  # in the DHT's process: node id -> when it last did not answer
_counts: Counter = Counter()  # in the DHT's process: "walked", "direct", "refused", "fallback", "unanswered", "read",
# "read fallback"


def store_near(dht, key: str, subkey: Any, value: Any, expiration_time: float):
    """From any process holding the DHT: store `value` under `key`/`subkey` on the key's nearest nodes, walking
    the DHT only when the last walk is older than WALK_EVERY. Returns hivemind's MPFuture of whether any node took
    it (awaitable, as DHT.store's)."""
    return dht.run_coroutine(partial(_store, key=key, subkey=subkey, value=value, expiration_time=expiration_time),
                             return_future=True)


def read_near(dht, key: str):
    """From any process holding the DHT: the latest value of `key` as DHT.get(key, latest=True) returns it (a
    dictionary key's subkeys merged, newest first, signatures checked and stripped), read from the nodes stores go to
    (this one's own storage included) instead of a walk that has every node answer. Returns hivemind's MPFuture."""
    return dht.run_coroutine(partial(_read, key=key), return_future=True)


def counts() -> dict:
    """In the DHT's process, since it started: stores made straight to the nearest nodes ("direct"; "refused" where
    every node refused the record), walks made for them, fallbacks to hivemind's store (no node answered), requests
    that got no answer, and reads from the nearest nodes ("read"; "read fallback": none answered, hivemind's walk)."""
    return dict(_counts)


async def _store(_dht, node, key: str, subkey: Any, value: Any, expiration_time: float) -> bool:
    key_id = DHTID.generate(source=key)
    targets = await _targets(node, key_id)
    record = _signed_record(node, key_id, subkey, value, expiration_time)
    results = await asyncio.gather(*(_store_on(node, node_id, peer_id, key_id, subkey, record)
                                     for node_id, peer_id in list(targets.items())))
    for node_id, result in zip(list(targets), results):
        if result is None:
            _lost(key_id, node_id)
    answered = [result for result in results if result is not None]
    if answered:
        # every node that answered refused it: it holds a newer one for the subkey (this peer's next store, begun
        # while this one waited, came first: the reporter does not wait for a store to end), or the record fails
        # the run's validators. Neither is what a walk would change
        _counts["direct" if any(answered) else "refused"] += 1
        return any(answered)
    _counts["fallback"] += 1
    return await node.store(key, value, expiration_time, subkey=subkey)


async def _read(_dht, node, key: str):
    key_id = DHTID.generate(source=key)
    targets = await _targets(node, key_id)
    others = [(node_id, peer_id) for node_id, peer_id in targets.items() if node_id != node.node_id]
    replies = await asyncio.gather(*(node.protocol.call_find(peer_id, [key_id]) for _, peer_id in others))
    answers = []
    for (node_id, _), reply in zip(others, replies):
        if reply is None or key_id not in reply:
            _lost(key_id, node_id)
        else:
            answers.append((node_id, reply[key_id][0]))
    if others and not answers:  # the nodes that hold the key are gone: hivemind's walk finds who holds it now
        _counts["read fallback"] += 1
        return await node.get(key, latest=True)
    _counts["read"] += 1
    return merged_answers(node, key_id, answers)


async def _targets(node, key_id: DHTID) -> dict:
    """The key's nearest nodes that still answer, {node id: peer id}, from the last walk while it is fresh."""
    walked_at, targets, found = _nearest.get(key_id, (float("-inf"), None, 0))
    fresh_for = WALK_EVERY if found >= node.num_replicas else SMALL_SWARM_WALK_EVERY
    if targets is None or time.monotonic() - walked_at > fresh_for or _someone_nearer(node, key_id, targets):
        targets = await _walk(node, key_id)
        _nearest[key_id] = (time.monotonic(), targets, len(targets))
        _counts["walked"] += 1
    return targets


def _someone_nearer(node, key_id: DHTID, targets: dict) -> bool:
    """Whether this node's routing table knows a node the last walk did not find that belongs among the key's
    nearest: a peer that joined since (a swarm under 20 nodes is all in every routing table). Peers that start
    together walk while the others still join; a walk kept for WALK_EVERY would have left those that walked first
    storing to and reading from nodes the later ones do not (at 12 peers, 7 new, all 5 nearest are new 3% of the
    time), each deaf to the other for half a minute."""
    known = node.protocol.routing_table.get_nearest_neighbors(key_id, node.num_replicas, exclude=node.node_id)
    farthest = max((key_id.xor_distance(node_id) for node_id in targets), default=None)
    full = len(targets) >= node.num_replicas
    return any(node_id not in targets and node_id not in _unanswered
               and (not full or key_id.xor_distance(node_id) < farthest) for node_id, _ in known)


def _lost(key_id: DHTID, node_id: DHTID) -> None:
    """A node that did not answer: asked no more until it answers a walk again; with fewer than half of the nodes
    the walk found left, the next store or read walks."""
    _unanswered[node_id] = time.monotonic()
    _counts["unanswered"] += 1
    walked_at, targets, found = _nearest.get(key_id, (float("-inf"), {}, 0))
    targets.pop(node_id, None)
    if len(targets) < (found + 1) // 2:
        _nearest.pop(key_id, None)


async def _walk(node, key_id: DHTID) -> dict:
    """The key's num_replicas nearest nodes, {node id: peer id}, less those that lately did not answer: a walk
    still returns a node that has died (the nodes it asks still list it) until their routing tables drop it."""
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
