"""`collab doctor` against a real peer on 127.0.0.1 (a DHT node holding the run's manifest and serving probes), and the
probe's bounds against a real asker: it dials back only the host it sees, refuses oversized or malformed requests
unanswered, and rate-limits an asker."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from hivemind.p2p import P2P, PeerID

from collab.config import load_config
from collab.run.folder import ephemeral_run
from collab.run.sharing import publish_manifest
from collab.swarm import reachability
from collab.swarm.node import PeerConfig, Swarm
from collab.swarm.probe import ASKER_BUDGETS, PROBE_PROTOCOL, ProbeRequest, ProbeServer
from tests.conftest import run_cli

LOCAL = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture()
def serving_peer(run_id, no_leftover_processes):
    """A peer of run `run_id` on 127.0.0.1: its DHT node, the run's manifest in it, and its probe server."""
    peer = Swarm(PeerConfig(run_id=run_id, host_maddrs=LOCAL))
    server = None
    try:
        server = ProbeServer(peer.dht).start()
        assert server.error is None, server.error
        yield peer
    finally:
        if server is not None:
            server.stop()
        peer.shutdown()


def test_doctor_finds_a_local_peer_ready(serving_peer, run_id, micro_config):
    run = ephemeral_run(run_id, load_config(micro_config))
    publish_manifest(serving_peer.dht, run_id, serving_peer.public_key, run.signed)
    started = time.monotonic()
    result = run_cli("doctor", "--run-id", run_id, "--initial-peers", serving_peer.best_maddr(),
                     "--host-maddrs", *LOCAL, "--json", timeout=90)
    took = time.monotonic() - started
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    report = json.loads(result.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ready"] is True
    assert checks["initial peer"]["status"] == "ok" and checks["initial peer"]["data"]["reached"] is True
    assert checks["manifest"]["data"]["fingerprint"] == run.fingerprint
    assert checks["reachability"]["data"]["verdict"] == "public", checks["reachability"]
    assert abs(checks["clock"]["data"]["skew_s"]) < 0.5
    measured = checks["bandwidth"]["data"]
    assert (measured.get("download_mbps") or 0) > 0 and (measured.get("upload_mbps") or 0) > 0, checks["bandwidth"]
    assert checks["torch"]["status"] in ("ok", "warn")  # on a CPU machine: "no GPU: trains on CPU", a warning
    assert took < 60, f"doctor took {took:.0f} s"


async def _raw(p2p: P2P, peer: str, frame: bytes) -> bytes:
    """Send one frame as is; what comes back before the server closes the stream (b"" when it answers nothing)."""
    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), PROBE_PROTOCOL)
    try:
        writer.write(frame)
        await writer.drain()
        return await asyncio.wait_for(reader.read(1 << 16), 10)
    finally:
        writer.close()


def _frame(data: bytes) -> bytes:
    return len(data).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + data


def test_the_probe_bounds_what_an_asker_gets(serving_peer, run_id):
    asker = Swarm(PeerConfig(run_id=run_id, host_maddrs=LOCAL, initial_peers=[serving_peer.best_maddr()]))
    try:
        port = int(asker.best_maddr().split("/tcp/")[1].split("/")[0])
        # an address on another host: the server dials the host it sees this asker at (127.0.0.1), on that port
        found = reachability.check_reachability(asker.dht, [serving_peer.peer_id], [f"/ip4/192.0.2.7/tcp/{port}"])
        assert found.verdict == "public" and found.ports == [port], found
        assert all(o.startswith("/ip4/127.0.0.1/") for o in found.observed), found.observed

        huge = ProbeRequest(kind="clock").model_dump_json().encode() + b" " * 5000
        bad = [
            _frame(huge),  # longer than a request may be: refused unread
            _frame(b'{"kind": "download", "size": 9000000}'),  # more than 8 MiB
            _frame(b'{"kind": "dial", "maddrs": ["/ip4/127.0.0.1/tcp/1", "/ip4/127.0.0.1/tcp/2", '
                   b'"/ip4/127.0.0.1/tcp/3", "/ip4/127.0.0.1/tcp/4", "/ip4/127.0.0.1/tcp/5"]}'),  # 5 addresses
            _frame(b'{"kind": "scan"}'),
            (1 << 40).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER),  # a length header alone, a terabyte
        ]

        async def ask_all(p2p: P2P) -> list[bytes]:
            return [await _raw(p2p, serving_peer.peer_id, frame) for frame in bad]

        answers = reachability._in_own_loop(asker.dht, ask_all, 60)
        assert answers == [b""] * len(bad)

        # the asker's dial-back budget (3 at once, one more every 20 s) is spent by its next questions
        burst = int(ASKER_BUDGETS["dial"][0])
        verdicts = [reachability.check_reachability(asker.dht, [serving_peer.peer_id], [asker.best_maddr()])
                    for _ in range(burst)]
        assert verdicts[-1].answered == 0, verdicts  # refused: rate-limited, so no evidence either way
        assert reachability.measure_clocks(asker.dht, [serving_peer.peer_id]), "the clock is not the dial's budget"
    finally:
        asker.shutdown()


class CutShortOnce(ProbeServer):
    """A probe server whose first download stream ends half way (a reset stream, a peer that restarted)."""

    cut = 0

    async def _send(self, writer, size: int) -> None:
        if self.cut == 0:
            self.cut += 1
            writer.write(size.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + bytes(size // 2))
            await writer.drain()
            raise ConnectionResetError("cut short")
        await super()._send(writer, size)


def test_one_transfer_cut_short_is_measured_again(run_id, no_leftover_processes):
    server_peer = Swarm(PeerConfig(run_id=run_id, host_maddrs=LOCAL))
    server = asker = None
    try:
        server = CutShortOnce(server_peer.dht).start()
        asker = Swarm(PeerConfig(run_id=run_id, host_maddrs=LOCAL, initial_peers=[server_peer.best_maddr()]))
        found = reachability.measure_bandwidth(asker.dht, server_peer.peer_id)
        assert server.cut == 1, "the server did not cut the first download"
        assert found.download_mbps and found.download_mbps > 0 and found.upload_mbps > 0, found
        assert found.error is None, found
    finally:
        if asker is not None:
            asker.shutdown()
        if server is not None:
            server.stop()
        server_peer.shutdown()
