"""What a read of a run's records costs the reading peer's DHT process, as the swarm grows: hivemind's validators
checking every record in every answer, against collab's remembered verdicts (collab.records.verdicts); and what the
signers' kind of key costs: Ed25519 (a new identity since 2026-12-05, collab.records.keys) against RSA-2048.

`--nodes` real DHT nodes (each its own process and p2pd, on 127.0.0.1) all hold N signed metrics records under the
run's metrics key, each signed by its own key (`--keys`) as N peers would. One node reads the key `--reads` times, as
collab's peers read the progress and metrics keys, while this script measures the CPU time of that node's process.
Between two reads, `--changing` of the records are replaced by newer ones (a peer's record changes every 0.5-2.5 s
and each peer reads about as often; 12 linreg peers' DHT nodes found 75-87% of the records they checked already
seen, in `dht.records` of their summaries). Each N twice: a reader with hivemind's validators as they come, and one
with the same validators behind RememberedVerdicts; the other nodes are the same. The bytes are those the reader's
node received a read (collab.swarm.dht_traffic).

    python3 benchmarks/record_reads.py [--peers 16,64,256] [--keys ed25519,rsa] [--nodes 6] [--reads 40]
        [--changing 0.33]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import psutil
from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from collab.records.identity import hivemind_reads_ed25519
from collab.records.keys import Ed25519PrivateKey
from collab.records.metrics import METRICS_SUFFIX, MetricsSchema, PeerMetricsRecord
from collab.records.verdicts import RememberedVerdicts
from collab.swarm.dht_traffic import dht_requests, start_counting

RUN = "reads"
KEY = RUN + METRICS_SUFFIX


def validators() -> list:
    return [SchemaValidator(MetricsSchema, prefix=RUN), RSASignatureValidator(RSAPrivateKey())]


KEYS = {"ed25519": Ed25519PrivateKey, "rsa": RSAPrivateKey}


class Signers:
    """N peers' keys, and their metrics records signed as each peer's DHT node would sign them."""

    def __init__(self, peers: int, kind: str):
        self.signatures = [RSASignatureValidator(KEYS[kind]()) for _ in range(peers)]
        self.key_id = DHTID.generate(source=KEY)

    def record(self, index: int, version: int, expiration: float) -> tuple[bytes, bytes, float]:
        signature = self.signatures[index]
        value = PeerMetricsRecord(peer_id=f"peer{index}", role="trainer", epoch=version, loss=5.0,
                                  samples_per_second=100.0, samples_contributed=version * 64, target_batch_size=1024,
                                  client_mode=False, bandwidth_mbps=None, rounds_joined=version, rounds_failed=0,
                                  last_group_size=8, time=get_dht_time()).dict()
        record = DHTRecord(self.key_id.to_bytes(), MSGPackSerializer.dumps(signature.local_public_key),
                           MSGPackSerializer.dumps(value), expiration)
        return record.subkey, signature.sign_value(record), expiration


async def _hold(_dht, node, key_id: DHTID, records: list) -> None:
    """Each record straight into this node's storage, as if the peers had stored it there."""
    for subkey, value, expiration in records:
        node.protocol.storage.store_subkey(key_id, MSGPackSerializer.loads(subkey), value, expiration)


async def _counts(dht, _node):
    return dht.verdicts.counts() if getattr(dht, "verdicts", None) is not None else None


class ReaderDHT(DHT):
    def __init__(self, *args, verdicts=None, **kwargs):
        self.verdicts = verdicts
        super().__init__(*args, **kwargs)


def measure(peers: int, kind: str, nodes: int, reads: int, changing: float, remember: bool) -> dict:
    signers = Signers(peers, kind)
    holders = [DHT(start=True, record_validators=validators())]
    for _ in range(nodes - 2):
        holders.append(DHT(initial_peers=holders[0].get_visible_maddrs(), start=True,
                           record_validators=validators()))
    verdicts = RememberedVerdicts(validators()) if remember else None
    reader = ReaderDHT(initial_peers=holders[0].get_visible_maddrs(), start=True, verdicts=verdicts,
                       record_validators=[verdicts] if remember else validators())
    try:
        expiration = get_dht_time() + 600
        version = [0] * peers
        records = [signers.record(index, 0, expiration) for index in range(peers)]
        _give(holders, signers.key_id, records)
        process = psutil.Process(reader.pid)
        assert len(reader.get(KEY, latest=True).value) == peers  # warm: routing table filled, every record there
        start_counting(reader)
        cpu, wall, per_read = _cpu(process), time.monotonic(), max(1, round(changing * peers))
        for read in range(reads):
            changed = []
            for offset in range(per_read):  # the next few peers' records, newer
                index = (read * per_read + offset) % peers
                version[index] += 1
                changed.append(signers.record(index, version[index], expiration + version[index]))
            _give(holders, signers.key_id, changed)
            found = reader.get(KEY, latest=True)
            assert found is not None and len(found.value) == peers, "a read lost records"
        spent, wall = _cpu(process) - cpu, time.monotonic() - wall
        received = dht_requests(reader)["bytes_received"]
        subkey, value, _ = records[0]
        return {"cpu_ms": 1000 * spent / reads, "wall_ms": 1000 * wall / reads, "kb": received / reads / 1024,
                "record_bytes": len(subkey) + len(value), "counts": reader.run_coroutine(_counts)}
    finally:
        for dht in [reader, *holders]:
            dht.shutdown()


def _give(holders: list, key_id: DHTID, records: list, at_once: int = 8) -> None:
    """A few records per message: hivemind's DHT reads its pipe without blocking, and a message larger than the
    pipe's buffer fails there."""
    for holder in holders:
        for start in range(0, len(records), at_once):
            holder.run_coroutine(partial(_hold, key_id=key_id, records=records[start:start + at_once]))


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default="16,64,256", help="records under the key (one per peer)")
    parser.add_argument("--keys", default="ed25519,rsa", help="the signers' kind of key: ed25519, rsa or both")
    parser.add_argument("--nodes", type=int, default=6, help="DHT nodes, the reader included")
    parser.add_argument("--reads", type=int, default=40)
    parser.add_argument("--changing", type=float, default=0.33, help="share of the records replaced between reads")
    args = parser.parse_args()
    kinds = args.keys.split(",")
    if not set(kinds) <= set(KEYS):
        parser.error(f"--keys {args.keys!r}: choose from {', '.join(KEYS)}")
    hivemind_reads_ed25519()  # as a peer does, before its DHT's process forks
    print(f"{args.nodes} DHT nodes on 127.0.0.1, {args.reads} reads of the metrics key, "
          f"{args.changing:.0%} of the records newer before each read")
    print("| peers (records) | signers' key | bytes/record | KB received/read | hivemind's checks: CPU ms/read | "
          "remembered: CPU ms/read | ratio | records checked / remembered | read wall ms (hivemind / remembered) |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = {}
    for peers in [int(n) for n in args.peers.split(",")]:
        for kind in kinds:
            plain = measure(peers, kind, args.nodes, args.reads, args.changing, remember=False)
            kept = rows[peers, kind] = measure(peers, kind, args.nodes, args.reads, args.changing, remember=True)
            counts = kept["counts"]
            print(f"| {peers} | {kind} | {kept['record_bytes']} | {kept['kb']:.1f} | {plain['cpu_ms']:.1f} | "
                  f"{kept['cpu_ms']:.1f} | {plain['cpu_ms'] / kept['cpu_ms']:.2f} | {counts['checked']} / "
                  f"{counts['remembered']} | {plain['wall_ms']:.0f} / {kept['wall_ms']:.0f} |", flush=True)
    if set(kinds) == set(KEYS):
        print("\n| peers | Ed25519 / RSA: bytes a record | KB a read | CPU a read (remembered) | wall a read |")
        print("|---|---|---|---|---|")
        for peers in sorted({n for n, _ in rows}):
            ed, rsa = rows[peers, "ed25519"], rows[peers, "rsa"]
            print(f"| {peers} | {ed['record_bytes'] / rsa['record_bytes']:.2f} | {ed['kb'] / rsa['kb']:.2f} | "
                  f"{ed['cpu_ms'] / rsa['cpu_ms']:.2f} | {ed['wall_ms'] / rsa['wall_ms']:.2f} |")


if __name__ == "__main__":
    main()
