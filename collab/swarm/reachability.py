"""Asking swarm peers' probes (collab.swarm.probe): can they dial this peer back, how far is its clock off, how fast is
its link. Each sync function runs its questions in a thread with its own event loop and client of the DHT's p2pd (the
caller may be inside an event loop of its own), with a bound on the whole.

Every reply is from another peer: bounded in size, schema-checked, and a peer that does not answer (gone, a client,
an older collab, rate-limited) is counted as not answering, never as evidence either way.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable, Literal, Optional, TypeVar

from hivemind.p2p import P2P, PeerID
from pydantic import BaseModel

from collab.run.sharing import close_loop, own_p2p
from collab.swarm.probe import (CHUNK, DIAL_TIMEOUT, MAX_DIALS, MAX_REPLY_BYTES, MAX_TRANSFER, PROBE_PROTOCOL,
                                ProbeReply, ProbeRequest, ports_to_dial, read_frame, tcp_port, write_frame)

MAX_ASKED = 5  # peers asked to dial back (as Petals does): enough for a majority, few enough to be quick
ASK_TIMEOUT = DIAL_TIMEOUT + 7.0  # a dial-back or clock question, stream opening included
FIRST_TRANSFER = 512 * 1024  # the first bandwidth probe, to size the second for about TRANSFER_SECONDS
TRANSFER_SECONDS = 2.0
TRANSFER_ATTEMPTS = 2  # per direction
MAX_SKEW = 3.0  # seconds: hivemind's DHT expirations and matchmaking deadlines assume clocks within this

T = TypeVar("T")


class Reachability(BaseModel):
    """Whether swarm peers can dial this peer: "public" when at least half of those that answered connected."""

    verdict: Literal["public", "not reachable", "unknown"]
    reason: str  # one line; with the fix when not public
    ports: list[int]
    asked: int
    answered: int
    connected: int
    observed: list[str]  # where the peers that answered see this peer
    nat: Optional[str] = None  # what the observed addresses say of a NAT in front of this peer (None: nothing seen)

    @property
    def unanswered(self) -> bool:
        """Peers were asked to dial a listening peer back and none answered: nothing is known yet."""
        return self.verdict == "unknown" and bool(self.ports) and self.asked > 0 and self.answered == 0


class ClockSample(BaseModel):
    peer: str
    skew: float  # seconds: their clock minus ours (positive: ours is behind)
    rtt: float  # seconds


class Bandwidth(BaseModel):
    peer: str
    download_mbps: Optional[float] = None
    upload_mbps: Optional[float] = None
    error: Optional[str] = None


def skew_and_rtt(t_send: float, theirs: float, t_recv: float) -> tuple[float, float]:
    """Their clock against ours, assuming the reply was made halfway through the round trip (NTP's estimate; wrong
    by at most half the round trip)."""
    return theirs - (t_send + t_recv) / 2, t_recv - t_send


def typical_skew(samples: list[ClockSample]) -> Optional[float]:
    """The median skew: one peer with a wrong clock does not make ours look wrong."""
    return statistics.median(s.skew for s in samples) if samples else None


def judge(ports: list[int], replies: list[Optional[ProbeReply]]) -> Reachability:
    """The verdict from the dial-back replies of the peers asked (None: no answer)."""
    asked = len(replies)
    answers = [r for r in replies if r is not None and r.ok and r.dials]
    connected = sum(any(d.ok for d in r.dials) for r in answers)
    observed = list(dict.fromkeys(r.observed for r in answers if r.observed))
    where = "/".join(map(str, ports)) or "no port"
    common = dict(ports=ports, asked=asked, answered=len(answers), connected=connected, observed=observed)
    if not ports:
        return Reachability(verdict="unknown", reason="this peer listens on no TCP address to check: pass "
                            "--host-maddrs /ip4/0.0.0.0/tcp/31337", **common)
    if not answers:
        return Reachability(verdict="unknown", reason=f"none of the {asked} swarm peers asked could dial back (they "
                            "are clients, relayed or run an older collab): cannot tell whether others reach you on "
                            f"TCP {where}", **common)
    if connected * 2 >= len(answers):
        return Reachability(verdict="public", reason=f"reachable on TCP {where} from {connected} of {len(answers)} "
                            "peers", **common)
    errors = sorted({d.error for r in answers for d in r.dials if not d.ok and d.error})
    why = f" ({', '.join(errors)})" if errors else ""
    return Reachability(
        verdict="not reachable", **common,
        reason=f"not reachable on {where} from {len(answers) - connected} of {len(answers)} peers{why}: forward TCP "
               f"{ports[0]} to this machine or pass --announce-maddrs with the address that is forwarded")


def _in_own_loop(dht, work: Callable[[P2P], Awaitable[T]], timeout: float) -> T:
    def run() -> T:
        loop = asyncio.new_event_loop()
        p2p = None
        try:
            p2p = loop.run_until_complete(own_p2p(dht))
            return loop.run_until_complete(asyncio.wait_for(work(p2p), timeout))
        finally:
            close_loop(loop, p2p)

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()


async def _ask(p2p: P2P, peer: str, request: ProbeRequest, then=None):
    """Open a probe stream, send `request`, read the reply; `then(reply, reader, writer)` continues on the stream."""
    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), PROBE_PROTOCOL)
    try:
        await write_frame(writer, request.model_dump_json().encode())
        reply = ProbeReply.model_validate_json(await read_frame(reader, MAX_REPLY_BYTES))
        return reply if then is None or not reply.ok else await then(reply, reader, writer)
    finally:
        writer.close()


async def _or_none(coroutine: Awaitable[T], timeout: float) -> Optional[T]:
    try:
        return await asyncio.wait_for(coroutine, timeout)
    except Exception:  # gone, not serving probes, too slow, or garbage: no answer
        return None


def one_per_port(maddrs: list[str]) -> list[str]:
    """The first TCP multiaddr (without its /p2p/ part) for each distinct port, at most MAX_DIALS of them."""
    chosen: dict[int, str] = {}
    for maddr in maddrs:
        port = tcp_port(maddr)
        if port is not None and port not in chosen and len(chosen) < MAX_DIALS:
            chosen[port] = maddr.split("/p2p/", 1)[0][:200]
    return list(chosen.values())


def check_reachability(dht, peers: list[str], own_maddrs: list[str]) -> Reachability:
    """Ask up to MAX_ASKED of `peers` to dial this peer back on the TCP ports of `own_maddrs` (its listen or announced
    multiaddrs); they dial only the host they see this peer at."""
    maddrs = one_per_port([str(m) for m in own_maddrs])
    ports = ports_to_dial(maddrs)
    asked = list(dict.fromkeys(peers))[:MAX_ASKED]
    if not ports or not asked:
        return judge(ports, [None] * len(asked))
    request = ProbeRequest(kind="dial", maddrs=maddrs)

    async def work(p2p: P2P) -> list[Optional[ProbeReply]]:
        return list(await asyncio.gather(*(_or_none(_ask(p2p, peer, request), ASK_TIMEOUT) for peer in asked)))

    try:
        replies = _in_own_loop(dht, work, ASK_TIMEOUT + 5)
    except Exception:
        replies = [None] * len(asked)
    found = judge(ports, replies)
    found.nat = nat_behaviour(maddrs, found.observed)
    return found


def nat_behaviour(own_maddrs: list[str], observed: list[str]) -> Optional[str]:
    """A NAT in front of this peer, from where the swarm sees it: another host than any it listens on means one; the
    same port means it keeps ports (a forwarded port works as is), another port that it rewrites them (a port to
    forward must be set up on the router, and hole punching rarely works)."""
    own = [(host, port) for host, port in map(_host_port, own_maddrs) if host]
    seen = [(host, port) for host, port in map(_host_port, observed) if host]
    if not own or not seen:
        return None
    hosts = {host for host, _ in own}
    outside = [(host, port) for host, port in seen if host not in hosts]
    if not outside:
        return None
    ports = {port for _, port in own}
    where = ", ".join(f"{host}:{port}" for host, port in outside[:3])
    if all(port in ports for _, port in outside):
        return f"behind NAT: the swarm sees this peer at {where}, its listening port kept"
    return f"behind NAT: the swarm sees this peer at {where}, its port rewritten (a port-changing NAT)"


def _host_port(maddr: str) -> tuple[Optional[str], Optional[int]]:
    parts = maddr.split("/")
    if len(parts) >= 5 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp" and parts[4].isdigit():
        return parts[2], int(parts[4])
    return None, None


def peers_to_ask(swarm) -> list[str]:
    """The swarm peers this peer can ask now: its initial peers, those its p2pd is connected to, then those in its
    DHT routing table (at join the connections are often to the initial peer alone: a verdict from one peer)."""
    peers = dict.fromkeys([*swarm.peer.initial_peer_ids, *connected_peers(swarm.dht), *routing_peers(swarm.dht)])
    return [peer for peer in peers if peer != swarm.peer_id]


async def _in_routing_table(_dht, node) -> list[str]:
    return [peer.to_base58() for peer in list(node.protocol.routing_table.peer_id_to_uid)]


def routing_peers(dht) -> list[str]:
    """The peer ids in this DHT node's routing table (run in the DHT's process)."""
    try:
        return dht.run_coroutine(_in_routing_table)
    except Exception:  # a node shutting down: nobody more to ask
        return []


ASK_AGAIN_AFTER = 3.0  # seconds before a peer asks again for a dial-back nobody answered


def ask_to_dial_back(swarm, peers: Optional[list[str]] = None,
                     stop: Optional[threading.Event] = None) -> Reachability:
    """check_reachability for a collab.swarm.node.Swarm, on the addresses its p2pd listens on or announces. When
    nobody answered, it asks once more ASK_AGAIN_AFTER later (sooner if `stop` is set: then it returns what it has):
    peers that start with this one (a local swarm, a busy machine) may not serve the question yet, and "unknown"
    joins as a full peer, which a NAT'd one must not (a CI run's peer found nobody; its neighbour, a second later,
    found the organizer)."""
    own = [str(maddr) for maddr in swarm.dht.get_visible_maddrs()]
    found = check_reachability(swarm.dht, peers_to_ask(swarm) if peers is None else peers, own)
    if found.unanswered and not (stop or threading.Event()).wait(ASK_AGAIN_AFTER):
        found = check_reachability(swarm.dht, peers_to_ask(swarm) if peers is None else peers, own)
    return found


def measure_clocks(dht, peers: list[str]) -> list[ClockSample]:
    """This peer's clock against each of (up to MAX_ASKED of) `peers` that answers."""
    asked = list(dict.fromkeys(peers))[:MAX_ASKED]

    async def one(p2p: P2P, peer: str) -> Optional[ClockSample]:
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), PROBE_PROTOCOL)
        try:  # the stream is open before the clock starts: the round trip is the question's alone
            t_send = time.time()
            await write_frame(writer, ProbeRequest(kind="clock").model_dump_json().encode())
            reply = ProbeReply.model_validate_json(await read_frame(reader, MAX_REPLY_BYTES))
            t_recv = time.time()
        finally:
            writer.close()
        if not reply.ok or reply.time is None or not math.isfinite(reply.time):
            return None
        skew, rtt = skew_and_rtt(t_send, reply.time, t_recv)
        return ClockSample(peer=peer, skew=skew, rtt=rtt)

    async def work(p2p: P2P) -> list[ClockSample]:
        found = await asyncio.gather(*(_or_none(one(p2p, peer), ASK_TIMEOUT) for peer in asked))
        return [sample for sample in found if sample is not None]

    try:
        return _in_own_loop(dht, work, ASK_TIMEOUT + 5)
    except Exception:
        return []


def mbps(size: int, seconds: float) -> float:
    return size * 8 / max(seconds, 1e-6) / 1e6


def next_size(first_mbps: float) -> int:
    """The second probe's size: about TRANSFER_SECONDS at the first one's rate, within [FIRST_TRANSFER, MAX_TRANSFER]."""
    return int(min(MAX_TRANSFER, max(FIRST_TRANSFER, first_mbps * 1e6 / 8 * TRANSFER_SECONDS)))


async def _download(p2p: P2P, peer: str, size: int) -> float:
    async def receive(reply, reader, writer) -> float:
        declared = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
        if declared != size:  # never more than asked for
            raise ValueError(f"{peer} sends {declared} bytes, not the {size} asked for")
        left = size
        while left:
            left -= len(await reader.readexactly(min(CHUNK, left)))
        return time.monotonic()

    started = time.monotonic()
    ended = await _ask(p2p, peer, ProbeRequest(kind="download", size=size), then=receive)
    if not isinstance(ended, float):
        raise ValueError(ended.error or "refused")
    return mbps(size, ended - started)


async def _upload(p2p: P2P, peer: str, size: int) -> float:
    async def send(reply, reader, writer) -> float:
        started = time.monotonic()
        await write_frame(writer, bytes(size))
        done = ProbeReply.model_validate_json(await read_frame(reader, MAX_REPLY_BYTES))
        if done.received != size:
            raise ValueError(f"{peer} read {done.received} of {size} bytes")
        return mbps(size, time.monotonic() - started)

    result = await _ask(p2p, peer, ProbeRequest(kind="upload", size=size), then=send)
    if not isinstance(result, float):
        raise ValueError(result.error or "refused")
    return result


def measure_bandwidth(dht, peer: str, timeout: float = 60.0) -> Bandwidth:
    """Download and upload to `peer`: a small probe, then one sized for about TRANSFER_SECONDS (at most 8 MiB)."""
    async def work(p2p: P2P) -> Bandwidth:
        result = Bandwidth(peer=peer)
        for field, measure in (("download_mbps", _download), ("upload_mbps", _upload)):
            for _ in range(TRANSFER_ATTEMPTS):  # one stream cut short is no measure of the link
                try:
                    first = await measure(p2p, peer, FIRST_TRANSFER)
                    setattr(result, field, round(await measure(p2p, peer, next_size(first)), 2))
                    break
                except Exception as e:
                    why = f"{type(e).__name__}: {str(e)[:120]}" if str(e) else type(e).__name__
            else:
                result.error = f"{field.split('_')[0]}: {why}"
        return result

    try:
        return _in_own_loop(dht, work, timeout)
    except Exception as e:
        return Bandwidth(peer=peer, error=f"no answer within {timeout:.0f} s" if isinstance(e, asyncio.TimeoutError)
                         else type(e).__name__)


def connected_peers(dht) -> list[str]:
    """The peer ids this peer's p2pd is connected to now (the DHT's neighbours), to ask."""
    async def work(p2p: P2P) -> list[str]:
        return [info.peer_id.to_base58() for info in await p2p.list_peers()]

    try:
        return _in_own_loop(dht, work, 10)
    except Exception:
        return []
