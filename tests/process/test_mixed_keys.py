"""A swarm of an RSA peer (an identity file made before Ed25519) and an Ed25519 peer that joins it, on real DHT nodes
and p2pd: the joiner's start reads its identity file (hivemind asks whether another peer runs with it), p2pd derives
the peer id collab computes for each kind (Swarm asserts it at its start), each node's validators accept the other
kind's signed records, and each record is attributed to its signer's own peer id."""

from __future__ import annotations

import time

from hivemind.utils.crypto import RSAPrivateKey

from collab.records.identity import _serialized, load_or_create_identity, signer_peer_id
from collab.records.keys import Ed25519PrivateKey
from collab.records.metrics import PeerMetricsRecord, metrics_key, publish
from collab.swarm.node import PeerConfig, Swarm
from tests.conftest import METRICS_RECORD

WAIT = 20.0  # seconds for both records to be readable from both nodes


def _attributed(swarm: Swarm, run_id: str) -> dict:
    """{signer's peer id: the peer id the record claims} of each record a read of the metrics key finds."""
    found = swarm.dht.get(metrics_key(run_id), latest=True)
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    return {signer_peer_id(subkey): item.value.get("peer_id") for subkey, item in entries.items()
            if isinstance(item.value, dict)}


def test_ed25519_and_rsa_peers_read_each_others_signed_records(tmp_path, no_leftover_processes):
    run_id = f"mixed-keys-{time.time_ns()}"
    (tmp_path / "rsa.identity").write_bytes(_serialized(RSAPrivateKey()))
    swarms = []
    try:
        first = Swarm(PeerConfig(run_id=run_id, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                 identity=tmp_path / "rsa.identity"))
        swarms.append(first)
        load_or_create_identity(tmp_path / "new.identity")  # the file exists before the start, as a volunteer's does
        second = Swarm(PeerConfig(run_id=run_id, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                  initial_peers=[first.best_maddr()], identity=tmp_path / "new.identity"))
        swarms.append(second)
        assert isinstance(first.identity.key, RSAPrivateKey) and first.peer_id.startswith("Qm")
        assert isinstance(second.identity.key, Ed25519PrivateKey) and second.peer_id.startswith("12D3KooW")
        for swarm in swarms:
            record = PeerMetricsRecord(**dict(METRICS_RECORD, peer_id=swarm.peer_id))
            publish(swarm.dht, run_id, swarm.public_key, record, expiration=60)
        expected = {swarm.peer_id: swarm.peer_id for swarm in swarms}
        deadline, seen = time.monotonic() + WAIT, {}
        while time.monotonic() < deadline:
            seen = {swarm.peer_id: _attributed(swarm, run_id) for swarm in swarms}
            if all(found == expected for found in seen.values()):
                break
            time.sleep(0.3)
        assert all(found == expected for found in seen.values()), seen
        assert len(second.public_key) < 100 < len(first.public_key)  # "[owner:ed25519:...]" against an RSA key's
    finally:
        for swarm in reversed(swarms):
            swarm.shutdown()
