"""The dashboard at 1,000 peers, without a swarm: synthetic peers' signed records, read and served as a live run's.

Each synthetic peer has its own Ed25519 key, as a new peer does; its metrics and progress records are signed with
it by hivemind's RSASignatureValidator and checked by the validators every honest DHT node of the run runs (the run's
schemas and the signature) before a reader may see them. `SignedRecordsDHT.get` answers as hivemind's
DHT.get does, and the dashboard's collector reads it through collab.swarm.state.read_run_state every
interval, as it reads a live swarm (tests/unit/test_dashboard_scale.py uses the same peers).

The benchmark serves 1,000 such peers from `collab dashboard`'s own server (a process of its own) and puts
concurrent keep-alive clients on GET /api/run: all of it (gzipped, as browsers and httpx ask; and plain)
and one page of 50 peers (what the page polls). Then, in this process, the collector's memory with 1,000
peers and after 5,000 distinct peers have come and gone.

    python3 benchmarks/dashboard_scale.py [--peers 1000] [--churned 5000] [--clients 50] [--seconds 10]

Goal: p99 < 100 ms at 1,000 peers, 0 errors; the collector's memory bounded however many peers come and go.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import hashlib
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Optional

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.optim.progress_tracker import TrainingProgressSchema
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import ValueWithExpiration

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from collab.records.identity import hivemind_reads_ed25519, peer_id_of  # noqa: E402
from collab.records.keys import Ed25519PrivateKey  # noqa: E402
from collab.records.metrics import PROGRESS_SUFFIX, MetricsSchema, PeerMetricsRecord, metrics_key  # noqa: E402

EXPIRATION = 300.0  # seconds, as collab peers publish their metrics


def keys(count: int, seed: int = 0) -> Iterator:
    """`count` distinct Ed25519 keys (collab.records.keys, a new peer's kind), the same for the same seed."""
    for index in range(count):
        yield Ed25519PrivateKey.from_raw(hashlib.sha256(f"synthetic-{seed}-{index}".encode()).digest())


@dataclass
class SyntheticPeer:
    key: object  # collab.records.keys.Ed25519PrivateKey
    peer_id: str  # base58, derived from the key as libp2p does
    subkey: bytes  # "[owner:ed25519:...]": the subkey its records are stored under

    @classmethod
    def from_key(cls, key) -> "SyntheticPeer":
        return cls(key, peer_id_of(key.get_public_key()), RSASignatureValidator(key).local_public_key)


def synthetic_peers(count: int, seed: int = 0) -> list[SyntheticPeer]:
    return [SyntheticPeer.from_key(key) for key in keys(count, seed)]


def metrics_record(peer: SyntheticPeer, index: int, now: float, epoch: int = 40) -> dict:
    """A plausible trainer's record, varied by `index`, with every field, as collab.records.metrics.publish stores it
    (the run's schema refuses a record that needs conversions, defaults included)."""
    return PeerMetricsRecord(peer_id=peer.peer_id, role="trainer", version="0.2.1", epoch=epoch - index % 2,
                loss=2.0 + (index % 97) / 100, samples_per_second=10.0 + index % 50,
                samples_contributed=1000 * (1 + index % 300), target_batch_size=4096, client_mode=index % 3 == 0,
                bandwidth_mbps=None, rounds_joined=epoch, rounds_failed=index % 4, last_group_size=16,
                time=now - index % 60, mb_per_round=1.5, fewer_bytes_than_fp32=4.0).dict()


def progress_record(peer: SyntheticPeer, index: int, now: float, epoch: int = 40) -> dict:
    """What hivemind's ProgressTracker publishes (LocalTrainingProgress)."""
    return dict(peer_id=PeerID.from_base58(peer.peer_id).to_bytes(), epoch=epoch - index % 2,
                samples_accumulated=index % 64, samples_per_second=10.0 + index % 50, time=now - index % 60,
                client_mode=index % 3 == 0)


class SignedRecordsDHT:
    """The run's records as a reader's DHT node holds them: each signed by its peer and checked on arrival."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.records: dict[str, dict[bytes, ValueWithExpiration]] = {}
        hivemind_reads_ed25519()  # as a peer's node reads Ed25519 keys
        # what an honest node of the run checks every record against (collab.swarm.node, hivemind's tracker)
        self.validator = CompositeValidator([SchemaValidator(MetricsSchema, prefix=run_id),
                                             SchemaValidator(TrainingProgressSchema, prefix=run_id),
                                             RSASignatureValidator(next(keys(1, seed=1)))])

    def store(self, peer: SyntheticPeer, key: str, value: dict, expiration_time: float) -> None:
        """Sign `value` with the peer's key as hivemind does, and keep it only if the run's validators accept it."""
        serializer = DHTProtocol.serializer
        record = DHTRecord(DHTID.generate(source=key).to_bytes(), serializer.dumps(peer.subkey),
                           serializer.dumps(value), expiration_time)
        signed = replace(record, value=RSASignatureValidator(peer.key).sign_value(record))
        if not self.validator.validate(signed):
            raise ValueError(f"the run's validators refused {peer.peer_id}'s record under {key}")
        stored = serializer.loads(self.validator.strip_value(signed))
        self.records.setdefault(key, {})[peer.subkey] = ValueWithExpiration(stored, expiration_time)

    def publish(self, peer: SyntheticPeer, index: int, now: Optional[float] = None) -> None:
        """The peer's metrics and progress records, as a training collab peer publishes them."""
        now = time.time() if now is None else now
        self.store(peer, metrics_key(self.run_id), metrics_record(peer, index, now), now + EXPIRATION)
        self.store(peer, self.run_id + PROGRESS_SUFFIX, progress_record(peer, index, now), now + EXPIRATION)

    def forget(self, peer: SyntheticPeer) -> None:
        """The peer's records expired: it left the run."""
        for entries in self.records.values():
            entries.pop(peer.subkey, None)

    def get(self, key, latest: bool = False) -> Optional[ValueWithExpiration]:
        """As hivemind.DHT.get answers for a dictionary key: {subkey: ValueWithExpiration}, or None."""
        now = time.time()
        entries = {subkey: item for subkey, item in self.records.get(key, {}).items() if item.expiration_time > now}
        if not entries:
            return None
        return ValueWithExpiration(entries, max(item.expiration_time for item in entries.values()))


def held_bytes(*roots) -> int:
    """The bytes of every object reachable from `roots` (classes, modules and functions aside), each counted once."""
    import gc
    from types import FunctionType, ModuleType

    seen, stack, total = set(), list(roots), 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, ModuleType, FunctionType)):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def collector_bytes(collector) -> int:
    """What the collector keeps between collections: the snapshot it serves and the run's and peers' history."""
    return held_bytes(collector.view, collector.history, collector.peer_history)


# --- the benchmark -----------------------------------------------------------------------------------------------

RUN_ID = "scale"


def serve(port: int, peers: int) -> None:
    """`collab dashboard`'s server (collab.dashboard.server.serve_forever) on `peers` synthetic peers."""
    from collab.dashboard.collector import Collector
    from collab.dashboard.server import serve_forever

    dht = SignedRecordsDHT(RUN_ID)
    for index, peer in enumerate(synthetic_peers(peers)):
        dht.publish(peer, index)
    serve_forever(Collector(RUN_ID, dht=dht, interval=3.0), "127.0.0.1", port)


async def keep_alive_client(port: int, request: bytes, deadline: float, latencies: list, errors: list) -> None:
    """One connection, one request at a time, as a browser tab polls (a light client: on 2 cores, the load generator
    shares the CPU with the server, and httpx's per-request cost would be what is measured)."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    except OSError:
        errors.append("connect")
        return
    try:
        while time.monotonic() < deadline:
            started = time.perf_counter()
            writer.write(request)
            head = (await reader.readuntil(b"\r\n\r\n")).lower()
            length = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            await reader.readexactly(length)
            latencies.append(time.perf_counter() - started)
            if not head.startswith(b"http/1.1 200"):
                errors.append(head.split(b"\r\n", 1)[0].decode())
    except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as e:
        errors.append(type(e).__name__)
    finally:
        writer.close()


def load(port: int, path: str, gzip_ok: bool, clients: int, seconds: float) -> dict:
    request = (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               f"Accept-Encoding: {'gzip' if gzip_ok else 'identity'}\r\n\r\n").encode()
    latencies: list[float] = []
    errors: list[str] = []

    async def all_clients():
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(keep_alive_client(port, request, deadline, latencies, errors) for _ in range(clients)))

    asyncio.run(all_clients())
    latencies.sort()
    quantile = (lambda q: latencies[min(len(latencies) - 1, int(len(latencies) * q))] * 1000) if latencies else None
    return dict(count=len(latencies), rps=len(latencies) / seconds, p50=quantile(0.5), p99=quantile(0.99),
                errors=len(errors))


def payload_bytes(port: int, path: str, gzip_ok: bool) -> int:
    import httpx

    headers = {"Accept-Encoding": "gzip" if gzip_ok else "identity"}
    with httpx.stream("GET", f"http://127.0.0.1:{port}{path}", headers=headers, timeout=10) as response:
        return sum(len(chunk) for chunk in response.iter_raw())


def event_loop_cpu(pid: int) -> float:
    import psutil

    return next(t.user_time + t.system_time for t in psutil.Process(pid).threads() if t.id == pid)


def latency_rows(peers: int, clients: int, seconds: float) -> list[tuple]:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", HIVEMIND_LOGLEVEL="ERROR")
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--peers", str(peers)], env=env,
                              stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/run?limit=1", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the dashboard served no snapshot of the synthetic peers within 300 s")
            time.sleep(1)
        rows = []
        for label, path, gzip_ok in (("all, gzip", "/api/run", True), ("all, plain", "/api/run", False),
                                     ("page of 50", "/api/run?offset=500&limit=50&sort=loss&order=desc", False)):
            # the CPU its event loop (the main thread; the collector reads in another) spent per request: what a
            # machine busy with others' work cannot inflate much, unlike the latencies
            before = event_loop_cpu(server.pid)
            result = load(port, path, gzip_ok, clients, seconds)
            result["cpu_us"] = (event_loop_cpu(server.pid) - before) / max(1, result["count"]) * 1e6
            rows.append((label, payload_bytes(port, path, gzip_ok), result))
        return rows
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait()


def memory_rows(peers: int, churned: int, step: int) -> list[tuple]:
    """The collector's memory with `peers` peers, after `churned` distinct ones came and went (`step` at a time,
    each collection), and with `churned` at once."""
    import psutil

    from collab.dashboard.collector import Collector

    process = psutil.Process()
    rows = [("no collector yet", 0, 0, 0, 0, 0, 0, process.memory_info().rss, 0.0)]  # hivemind and torch imported
    everyone = synthetic_peers(churned, seed=2)
    dht = SignedRecordsDHT(RUN_ID)
    collector = Collector(RUN_ID, dht=dht)

    def row(label: str, distinct: int) -> None:
        started = time.process_time()  # CPU seconds: on a shared machine, wall time says more about the others
        collector.collect_once()
        seconds = time.process_time() - started
        run = collector.snapshot
        rows.append((label, distinct, run.peers_total, run.peers_listed, len(collector.peer_history),
                     collector.peer_histories_dropped, collector_bytes(collector), process.memory_info().rss,
                     seconds))

    for index in range(peers):
        dht.publish(everyone[index], index)
    for _ in range(2):
        collector.collect_once()
    row(f"{peers} peers", peers)
    arrived = peers
    while arrived < churned:  # `step` leave and as many new ones arrive, every collection
        for index in range(arrived, min(churned, arrived + step)):
            dht.forget(everyone[index - peers])
            dht.publish(everyone[index], index)
        arrived = min(churned, arrived + step)
        collector.collect_once()
    row(f"{churned} came and went", churned)
    for index, peer in enumerate(everyone):
        dht.publish(peer, index)
    row(f"{churned} at once", churned)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--churned", type=int, default=5000, help="distinct peers that come and go (memory)")
    parser.add_argument("--clients", type=int, default=50, help="concurrent keep-alive clients on /api/run")
    parser.add_argument("--seconds", type=float, default=10.0, help="of load, for each kind of request")
    parser.add_argument("--serve", type=int, default=None, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve, args.peers)
        return

    rows = latency_rows(args.peers, args.clients, args.seconds)
    print(f"GET /api/run with {args.peers} synthetic signed peers: {args.clients} keep-alive clients x "
          f"{args.seconds:.0f} s each (the collector re-reading all records every 3 s), {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f} (others' work on this machine inflates the latencies)")
    print(f"{'request':<12} {'bytes':>9} {'requests/s':>11} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7} "
          f"{'loop CPU us/req':>15}  goal p99 < 100 ms")
    for label, size, r in rows:
        met = "met" if r["p99"] is not None and r["p99"] < 100 and r["errors"] == 0 else "NOT met"
        print(f"{label:<12} {size:>9} {r['rps']:>11.0f} {r['p50']:>8.1f} {r['p99']:>8.1f} {r['errors']:>7} "
              f"{r['cpu_us']:>15.0f}  {met}")
    print()
    from collab.dashboard.snapshot import MAX_PEERS

    print(f"the collector's memory (cap: {MAX_PEERS} peers listed and with a history)")
    print("(read: peers in the records; series: peers with a history; dropped: histories dropped for the cap, so far;"
          " held: the collector's snapshot and histories; RSS: this process, the synthetic swarm's records included;"
          " collect: CPU seconds of one read of the records and its snapshot)")
    print(f"{'peers':<22} {'distinct':>8} {'read':>6} {'listed':>7} {'series':>7} {'dropped':>8} {'held MB':>8} "
          f"{'RSS MB':>7} {'collect s':>9}")
    for label, distinct, total, listed, series, dropped, held, rss, seconds in memory_rows(
            args.peers, args.churned, step=max(1, args.peers // 4)):
        print(f"{label:<22} {distinct:>8} {total:>6} {listed:>7} {series:>7} {dropped:>8} {held / 2**20:>8.1f} "
              f"{rss / 2**20:>7.0f} {seconds:>9.2f}")


if __name__ == "__main__":
    main()
