"""Can hivemind peers behind a real NAT take part as full peers, through a relay? Evidence, as a table.

Topology (collab.peers.netns, `nat: router`; root only):

    P  public  10.77.0.2            relay service on, reachability forced public
    A  home    192.168.2.2 behind router 10.77.0.3 (MASQUERADE, no port forwarding)
    B  home    192.168.3.2 behind router 10.77.0.4 (another router: a double NAT between A and B)

Each peer is one process in its namespace running a hivemind.DHT (client_mode=False everywhere) whose p2pd the
script configures like this (the home peers: relay client, auto relay with P as the only trusted relay, AutoNAT,
reachability forced private). Then, in order:

  (a) does A get a relay reservation and a /p2p-circuit address?        A's get_visible_maddrs(latest=True)
  (b) can B call A (unary protobuf handler, binary stream) through P?   and how many bytes/s a stream carries
  (c) is hole punching (DCUtR) attempted, does it succeed?              p2pd's holepunch log; B's addrs for A
  (d) does A's DHT node (client_mode=False) serve others?               B pings A and stores on A directly
  (e) do averagers on P, A, B (none in client mode) average together?   one round of 3, every part reduced

Usage:  python benchmarks/nat_relay.py [--megabytes 16] [--size 100000] [--relay-data-limit N] [--keep-logs DIR]
p2pd's log for each peer (GOLOG_LOG_LEVEL below) lands in DIR/<role>.p2pd.log.

What it showed here (hivemind 1.1.12's p2pd; issue 37 has the numbers):
- P reserves a slot for A and B within a second, but only with -relayDiscovery=0 on A and B (with p2pd's default,
  -trustedRelays goes to a peer source and the reservation came after ~3 min).
- Neither A nor B advertises a /p2p-circuit address, and no hole punching starts ("waiting until we have at least
  one public address"): libp2p counts 10.77.0.x as private. So the others are given A's and B's relayed addresses.
- Through P: unary calls, DHT ping/store on A and averaging among P, A and B (nobody in client mode) work while a
  relayed connection has carried less than 128 KiB each way; then P resets it ("relayed 131072 bytes"), whatever
  -relayDataLimit says (1 GiB and 32 KiB gave the same cut).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PORT = 31337
GOLOG = ("error,p2p-holepunch=debug,autorelay=debug,relay=debug,p2p-circuit=debug,autonat=debug,"
         "basichost=info,p2p-config=info")
# the relay service's caps on P, passed to p2pd (hivemind's P2P.create does not expose them)
RELAY_CAPS = dict(relayService=True, relayMaxReservations=8, relayMaxCircuits=16, relayDataLimit=1 << 30,
                  relayTimeLimit="30m", relayBufferSize=1 << 20)


# ------------------------------------------------------------------------------------------------ peer side

def _wait_file(path: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:g} s for {path.name}")
        time.sleep(0.2)
    time.sleep(0.1)
    return path.read_text()


async def _await_file(path: Path, timeout: float) -> str:
    """_wait_file without blocking the event loop, which serves this peer's handlers meanwhile."""
    return await asyncio.to_thread(_wait_file, path, timeout)


def _capture_p2pd_log(path: Path) -> None:
    """hivemind logs p2pd's (json) output at DEBUG under its p2p_daemon logger: keep all of it in a file."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(caller)s %(message)s", defaults={"caller": "-"}))
    log = logging.getLogger("hivemind.p2p.p2p_daemon")
    log.setLevel(logging.DEBUG)
    log.addHandler(handler)


def peer_main(role: str, workdir: Path, megabytes: int, size: int, relay_discovery: bool,
              relay_data_limit: int = 0) -> None:
    os.environ["GOLOG_LOG_LEVEL"] = GOLOG
    import hivemind
    import torch
    from hivemind.p2p import P2P, P2PContext
    from hivemind.proto import test_pb2

    _capture_p2pd_log(workdir / f"{role}.p2pd.log")
    result: dict = {"role": role}
    out = workdir / f"{role}.json"

    def save():
        out.write_text(json.dumps(result, default=str))

    if role == "P":
        original = P2P._make_process_args
        caps = dict(RELAY_CAPS, **({"relayDataLimit": relay_data_limit} if relay_data_limit else {}))
        result["relay_caps"] = caps
        P2P._make_process_args = staticmethod(lambda *a, **kw: original(*a, **kw, **caps))
        kwargs = dict(use_relay=True, auto_nat=True, force_reachability="public")
        initial = []
    else:
        relay = _wait_file(workdir / "P.maddr", 120).strip()
        initial = [relay]
        kwargs = dict(use_relay=True, use_auto_relay=True, trusted_relays=[relay], auto_nat=True,
                      force_reachability="private")
        if not relay_discovery:
            # p2pd takes -trustedRelays as autorelay's *static* relays only with -relayDiscovery=0; with its default
            # (1) they are fed to a peer source and autorelay waits out its boot delay (~3 min) before reserving
            original = P2P._make_process_args
            P2P._make_process_args = staticmethod(lambda *a, **kw: original(*a, **kw, relayDiscovery=False))
            result["extra_p2pd_flags"] = "-relayDiscovery=0"
    result["p2p_kwargs"] = {k: v for k, v in kwargs.items()}
    started = time.monotonic()
    for attempt in range(1, 4):  # "failed to connect to bootstrap peers" was seen once in a few starts here
        try:
            dht = hivemind.DHT(initial_peers=initial, host_maddrs=[f"/ip4/0.0.0.0/tcp/{PORT}"], client_mode=False,
                               start=True, **kwargs)
            break
        except Exception as e:
            result.setdefault("dht_start_failures", []).append(f"{type(e).__name__}: {e}"[:200])
            if attempt == 3:
                save()
                raise
    result["dht_start_s"] = round(time.monotonic() - started, 2)

    async def main():
        p2p = await dht.replicate_p2p()
        if role == "P":
            maddrs = [str(m) for m in await p2p.get_visible_maddrs(latest=True)]
            result["maddrs"] = maddrs
            (workdir / "P.maddr").write_text(next(m for m in maddrs if "/ip4/10.77.0.2/" in m))
        else:
            # (a) a reservation would show as a /p2p-circuit address among the visible ones
            deadline, circuit = time.monotonic() + 30, []
            while time.monotonic() < deadline and not circuit:
                maddrs = [str(m) for m in await p2p.get_visible_maddrs(latest=True)]
                circuit = [m for m in maddrs if "p2p-circuit" in m]
                if not circuit:
                    await asyncio.sleep(1)
            result["maddrs"], result["circuit_after_s"] = maddrs, (round(time.monotonic() - started, 1)
                                                                   if circuit else None)
        result["peer_id"] = str(p2p.peer_id)
        save()
        (workdir / f"{role}.up").write_text(str(p2p.peer_id))
        if role != "P":
            # the address a home peer has through its reservation on P (libp2p does not advertise it here: see (a))
            relay_maddr = (await _await_file(workdir / "P.maddr", 10)).strip()
            (workdir / f"{role}.circuit").write_text(f"{relay_maddr}/p2p-circuit/p2p/{p2p.peer_id}")

        if role == "A":
            async def unary(request: test_pb2.TestRequest, context: P2PContext) -> test_pb2.TestResponse:
                return test_pb2.TestResponse(number=request.number + 1)

            async def sink(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
                expected, received = int.from_bytes(await reader.readexactly(8), "big"), 0
                while received < expected and (chunk := await reader.read(1 << 16)):
                    received += len(chunk)
                writer.write(f"{received}\n".encode())
                await writer.drain()
                writer.close()

            await p2p.add_protobuf_handler("nat.unary", unary, test_pb2.TestRequest)
            await p2p.add_binary_stream_handler("nat.sink", sink)
            (workdir / "A.handlers").write_text("ok")

        if role == "B":
            from hivemind.p2p import PeerID
            a_id = PeerID.from_base58(await _await_file(workdir / "A.up", 300))
            await _await_file(workdir / "A.handlers", 60)
            # (b) unary: first with only what libp2p found out by itself, then with A's relayed address given
            t = time.monotonic()
            try:
                await asyncio.wait_for(p2p.call_protobuf_handler(a_id, "nat.unary", test_pb2.TestRequest(number=1),
                                                                 test_pb2.TestResponse), 30)
                result["unary_without_circuit_addr"] = f"ok in {time.monotonic() - t:.2f} s"
            except Exception as e:
                result["unary_without_circuit_addr"] = f"FAILED: {type(e).__name__}: {e}"[:300]
            t = time.monotonic()
            result["connect_via_circuit"] = await _connect_circuit(p2p, workdir, "A")
            result["addrs_for_A_after_connect"] = await _addrs_for(p2p, a_id)
            t = time.monotonic()
            try:
                response = await asyncio.wait_for(
                    p2p.call_protobuf_handler(a_id, "nat.unary", test_pb2.TestRequest(number=41),
                                              test_pb2.TestResponse), 20)
                result["unary"] = f"ok ({response.number}) in {time.monotonic() - t:.2f} s"
            except Exception as e:
                result["unary"] = f"FAILED after {time.monotonic() - t:.1f} s: {type(e).__name__}: {e}"[:400]
            result["addrs_for_A_after_unary"] = await _addrs_for(p2p, a_id)
            # (b) stream throughput: a small stream, then a large one, each on a fresh relayed connection
            for label, nbytes in (("stream_100kB", 100_000), ("stream", megabytes << 20)):
                result[f"{label}_reconnect"] = await _connect_circuit(p2p, workdir, "A")
                t = time.monotonic()
                try:
                    _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(a_id, "nat.sink"), 20)
                    opened = time.monotonic()
                    block = b"x" * (1 << 14)
                    writer.write(nbytes.to_bytes(8, "big"))  # the sink answers once it has this many bytes
                    for sent in range(0, nbytes, len(block)):
                        writer.write(block[:nbytes - sent])
                        await asyncio.wait_for(writer.drain(), 30)
                    acked = int((await asyncio.wait_for(reader.readline(), 30)).strip() or 0)
                    seconds = time.monotonic() - opened
                    result[label] = (f"{acked} of {nbytes} bytes acknowledged in {seconds:.2f} s = "
                                     f"{acked * 8 / 1e6 / seconds:.1f} Mbit/s (open {opened - t:.2f} s)")
                    writer.close()
                except Exception as e:
                    result[label] = f"FAILED after {time.monotonic() - t:.1f} s: {type(e).__name__}: {e}"[:300]
            result["dht_reconnect"] = await _connect_circuit(p2p, workdir, "A")
            # (c) hole punching: DCUtR runs in the background once the relayed connection is up; look again later
            await asyncio.sleep(5)
            result["addrs_for_A_after_5s"] = await _addrs_for(p2p, a_id)
            # (d) A's DHT node serves: ping it and store on it directly, then a plain get
            a_ping = await dht.run_coroutine(functools.partial(_ping_and_store, a_id), return_future=True)
            result["dht_on_A"] = a_ping
            save()
            (workdir / "B.dht_done").write_text("ok")

        if role == "A":
            await _await_file(workdir / "B.dht_done", 400)
            stored = await dht.run_coroutine(_local_value, return_future=True)
            result["dht_stored_on_A"] = stored

        # (e) one averaging round of three, nobody in client mode
        for other in ("P", "A", "B"):
            await _await_file(workdir / f"{other}.up", 200)
        # everyone learns the home peers' relayed addresses (B already has A's)
        for home in ("A", "B"):
            if home != role and not (role == "B" and home == "A"):
                result[f"connect_{home}_via_circuit"] = await _connect_circuit(p2p, workdir, home)
        if role != "B":
            await _await_file(workdir / "B.dht_done", 400)
        value = {"P": 1.0, "A": 2.0, "B": 3.0}[role]
        tensor = torch.full((size,), value)
        averager = hivemind.averaging.DecentralizedAverager(
            [tensor], dht, prefix="natlab", target_group_size=3, min_group_size=3, min_matchmaking_time=10,
            request_timeout=10, start=True, client_mode=False)
        result["averager_client_mode"] = averager.client_mode
        (workdir / f"{role}.avg_ready").write_text("ok")
        for other in ("P", "A", "B"):
            await _await_file(workdir / f"{other}.avg_ready", 200)
        t = time.monotonic()
        try:
            gathered = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                None, lambda: averager.step(gather=role, timeout=60)), 75)
            with averager.get_tensors() as tensors:
                error = float((tensors[0] - 2.0).abs().max())
            result["averaging"] = (f"group of {len(gathered) if gathered else 0}, max |x - 2| = {error:.2e}, "
                                   f"{time.monotonic() - t:.1f} s" if gathered else
                                   f"no group after {time.monotonic() - t:.1f} s")
        except Exception as e:
            result["averaging"] = f"FAILED after {time.monotonic() - t:.1f} s: {type(e).__name__}: {e}"[:400]
        result["final_peers"] = {str(info.peer_id)[-6:]: [str(a) for a in info.addrs] for info in await p2p.list_peers()}
        save()
        (workdir / f"{role}.done").write_text("ok")
        # stay up until everyone is done: a peer leaving early would break the others' last checks
        for other in ("P", "A", "B"):
            await _await_file(workdir / f"{other}.done", 300)
        averager.shutdown()

    try:
        asyncio.run(main())
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
        save()
        raise
    finally:
        dht.shutdown()


class _CircuitAddr:
    """/ip4/X/tcp/N/p2p/RELAY/p2p-circuit[/p2p/PEER] as the bytes p2pd parses. hivemind's Multiaddr.to_bytes()
    writes a /p2p/ value as a CID (0x01 0x72 + multihash), which p2pd's go-multiaddr rejects ("length greater than
    remaining number of bytes in buffer"): the value must be the bare multihash."""

    def __init__(self, text: str):
        import base58
        from hivemind.utils.multiaddr import Multiaddr
        head, relay = text.split("/p2p/")[0], text.split("/p2p/")[1].split("/")[0]
        multihash = base58.b58decode(relay)
        # 421 (p2p) and 290 (p2p-circuit) as varints
        self.data = (Multiaddr(head).to_bytes() + bytes([0xa5, 0x03, len(multihash)]) + multihash
                     + bytes([0xa2, 0x02]))
        self.text = text

    def to_bytes(self) -> bytes:
        return self.data


async def _connect_circuit(p2p, workdir: Path, home: str) -> str:
    from hivemind.p2p import PeerID
    address = (await _await_file(workdir / f"{home}.circuit", 300)).strip()
    peer_id = PeerID.from_base58(address.rsplit("/", 1)[-1])
    t = time.monotonic()
    try:
        await asyncio.wait_for(p2p._client.connect(peer_id, [_CircuitAddr(address)]), 60)
        return f"ok in {time.monotonic() - t:.2f} s"
    except Exception as e:
        return f"FAILED after {time.monotonic() - t:.1f} s: {type(e).__name__}: {e}"[:300]


async def _addrs_for(p2p, peer_id) -> list[str]:
    return [str(a) for info in await p2p.list_peers() if info.peer_id == peer_id for a in info.addrs]


async def _ping_and_store(a_id, dht, node):
    from hivemind.dht.routing import DHTID
    from hivemind.utils import get_dht_time
    out = {}
    t = time.monotonic()
    pinged = await node.protocol.call_ping(a_id, validate=False)
    out["ping"] = f"{'ok' if pinged is not None else 'no answer'} in {time.monotonic() - t:.2f} s"
    key = DHTID.generate(source="nat-lab-key")
    t = time.monotonic()
    stored = await node.protocol.call_store(a_id, keys=[key], values=[b"from B"],
                                            expiration_time=get_dht_time() + 300)
    out["store"] = f"{stored} in {time.monotonic() - t:.2f} s"
    out["A_in_B_routing_table"] = a_id in node.protocol.routing_table.uid_to_peer_id.values()
    return out


async def _local_value(dht, node):
    from hivemind.dht.routing import DHTID
    found = node.protocol.storage.get(DHTID.generate(source="nat-lab-key"))
    return None if found is None else found.value.decode()


# ------------------------------------------------------------------------------------------------ orchestrator

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["P", "A", "B"])
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--megabytes", type=int, default=1, help="the large stream (a 100 kB one goes first)")
    parser.add_argument("--size", type=int, default=5000, help="floats averaged in (e): 5000 stays under the cap")
    parser.add_argument("--keep-logs", type=Path)
    parser.add_argument("--relay-data-limit", type=int, default=0, help="P's -relayDataLimit instead of 1 GiB")
    parser.add_argument("--relay-discovery", action="store_true",
                        help="leave p2pd's -relayDiscovery at its default (1): reservations wait ~3 min")
    args = parser.parse_args()
    if args.role:
        return peer_main(args.role, args.workdir, args.megabytes, args.size, args.relay_discovery,
                         args.relay_data_limit)

    sys.path.insert(0, str(ROOT))
    from collab.peers.netns import NetworkLab, namespaces_unavailable_reason
    from collab.peers.profiles import LinkSpec
    reason = namespaces_unavailable_reason()
    if reason:
        raise SystemExit(f"cannot build the lab: {reason}")
    workdir = args.keep_logs or Path(tempfile.mkdtemp(prefix="nat-relay-"))
    workdir.mkdir(parents=True, exist_ok=True)
    links = [LinkSpec(), LinkSpec(nat="router"), LinkSpec(nat="router")]
    processes = []
    started = time.monotonic()
    with NetworkLab(links) as lab:
        try:
            for index, role in enumerate("PAB"):
                log = open(workdir / f"{role}.log", "w")
                processes.append(subprocess.Popen(
                    [*lab.command_prefix(index), sys.executable, __file__, "--role", role, "--workdir", str(workdir),
                     "--megabytes", str(args.megabytes), "--size", str(args.size),
                     "--relay-data-limit", str(args.relay_data_limit),
                     *(["--relay-discovery"] if args.relay_discovery else [])],
                    stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
                log.close()
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and any(p.poll() is None for p in processes):
                if any(p.poll() not in (None, 0) for p in processes):  # one failed: the others would wait for it
                    deadline = min(deadline, time.monotonic() + 10)
                time.sleep(1)
        finally:
            for p in processes:
                if p.poll() is None:
                    p.kill()
                p.wait(timeout=30)
    results = {}
    for role in "PAB":
        path = workdir / f"{role}.json"
        results[role] = json.loads(path.read_text()) if path.exists() else {"error": "no result"}
    print(f"lab: P public 10.77.0.2; A 192.168.2.2 behind 10.77.0.3; B 192.168.3.2 behind 10.77.0.4 "
          f"(MASQUERADE); {time.monotonic() - started:.0f} s; logs in {workdir}")
    print(f"P2P.create kwargs and extra p2pd flags per peer, and what each saw (full records: {workdir}/*.json):")
    for role, record in results.items():
        print(f"{role}:")
        for key, value in record.items():
            if key not in ("role", "maddrs", "peer_id", "final_peers"):
                print(f"  {key:28} {value}")
        print(f"  {'visible maddrs':28} {', '.join(record.get('maddrs', [])) or '-'}")
    _holepunch_summary(workdir)


def _holepunch_summary(workdir: Path) -> None:
    for role in "PAB":
        path = workdir / f"{role}.p2pd.log"
        lines = path.read_text().splitlines() if path.exists() else []
        interesting = [line for line in lines if any(word in line.lower() for word in
                                                     ("holepunch", "hole punch", "dcutr", "reserv", "relay",
                                                      "reachability")) and "relay_finder.go:37" not in line]
        print(f"--- {role}'s p2pd: {len(lines)} log lines, {len(interesting)} about relays/hole punching; last 12:")
        for line in interesting[-12:]:
            print("   ", line[:300])


if __name__ == "__main__":
    main()
