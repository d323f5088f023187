"""A probe every reachable peer serves: dial-back, clock and bandwidth, so another peer can tell whether it is
reachable, how far its clock is off, and how fast its link is (`collab doctor`, the reachability check at join).

One libp2p stream per question ("collab-probe"): the asker sends one length-prefixed JSON ProbeRequest, the server
answers one length-prefixed JSON ProbeReply, and for `download` a payload follows it, for `upload` the asker sends one
after the reply said go. Everything the asker sends is bounded (request size, addresses, payload) and every asker is
rate-limited (per peer id, and in all: peer ids cost nothing to make).

Dial-back dials only the host this server sees the asker at (the remote address p2pd reports for the stream: go-libp2p's
`Conn().RemoteMultiaddr()`), on the ports the asker lists: the check answers "can the world reach you on your port",
and the probe cannot be turned on a third party's host. A relayed asker (a /p2p-circuit connection) gets no dial.
(hivemind's protobuf handlers get a P2PContext with the remote peer id only; a binary stream handler gets p2pd's
StreamInfo, whose `addr` is that remote address: hence one binary stream protocol.) Limits: an asker behind a
carrier-grade NAT shares its public IP with strangers, and the dial reaches whatever that IP forwards the port to;
an asker that reaches us over IPv6 is checked over IPv6 only.
The client side is collab.swarm.reachability.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections import OrderedDict
from typing import Annotated, Literal, Optional

from hivemind.p2p import P2P
from pydantic import BaseModel, ConfigDict, Field

from collab.run.sharing import StreamService, own_p2p

PROBE_PROTOCOL = "collab-probe"
MAX_REQUEST_BYTES = 4096  # a request is a kind, a size and at most 4 short addresses
MAX_REPLY_BYTES = 16384
MAX_DIALS = 4  # addresses dialled back per request
DIAL_TIMEOUT = 3.0  # seconds per dial-back, all dialled at once
MAX_TRANSFER = 8 * 1024 * 1024  # bytes one bandwidth probe may move either way
CHUNK = 64 * 1024
REQUEST_TIMEOUT = 10.0  # seconds for an asker to send its request
TRANSFER_TIMEOUT = 60.0  # a full 8 MiB at >= 1.1 Mbit/s; a slower asker asks for less (collab.swarm.reachability)
MAX_STREAMS = 16  # probes served at once; more are dropped at once
MAX_TRANSFERS = 2  # bandwidth probes at once: more would split the uplink and measure nothing
MAX_ASKERS = 1024  # peer ids whose budgets are remembered (the oldest forgotten first): bounded memory


class ProbeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["dial", "clock", "download", "upload"]
    # dial: the asker's listen addresses (only their ports are used: the host dialled is the one the server sees)
    maddrs: list[Annotated[str, Field(max_length=200)]] = Field(default_factory=list, max_length=MAX_DIALS)
    size: int = Field(0, ge=0, le=MAX_TRANSFER)  # download/upload: payload bytes


class Dial(BaseModel):
    model_config = ConfigDict(extra="forbid")

    port: int = Field(ge=1, le=65535)
    ok: bool
    ms: Optional[float] = Field(None, ge=0, le=60_000)
    error: Optional[str] = Field(None, max_length=64)  # "refused", "timed out", "unreachable"


class ProbeReply(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ok: bool
    error: Optional[str] = Field(None, max_length=200)  # why not (rate-limited, bad request, relayed)
    time: Optional[float] = None  # clock: the server's wall clock, time.time()
    observed: Optional[str] = Field(None, max_length=300)  # dial: where the server sees the asker
    dials: list[Dial] = Field(default_factory=list, max_length=MAX_DIALS)
    received: Optional[int] = Field(None, ge=0, le=MAX_TRANSFER)  # upload: bytes the server read


class Budget:
    """A token bucket: `burst` at most, refilled at `per_second`. take(n) is False when it lacks n."""

    def __init__(self, burst: float, per_second: float, now: Optional[float] = None):
        self.burst, self.per_second = burst, per_second
        self.level, self.at = burst, time.monotonic() if now is None else now

    def take(self, amount: float, now: Optional[float] = None) -> bool:
        now = time.monotonic() if now is None else now
        self.level = min(self.burst, self.level + max(0.0, now - self.at) * self.per_second)
        self.at = max(self.at, now)
        if amount > self.level:
            return False
        self.level -= amount
        return True


# per asker: a doctor run asks 1 dial, ~5 clocks, ~17 MiB; a join asks 1 dial. Generous for those, useless for abuse
ASKER_BUDGETS = {"dial": (3, 1 / 20), "clock": (20, 1.0), "bytes": (40 * 2**20, 40 * 2**20 / 60)}
# in all, whoever asks: a swarm of sybils still gets no more than this from one peer
TOTAL_BUDGETS = {"dial": (30, 1.0), "clock": (200, 20.0), "bytes": (256 * 2**20, 256 * 2**20 / 60)}


class Limits:
    """Per-asker and total budgets; `allow(asker, what, amount)` takes from both or from neither."""

    def __init__(self, max_askers: int = MAX_ASKERS, now: Optional[float] = None):
        self.max_askers = max_askers
        self.askers: OrderedDict[str, dict[str, Budget]] = OrderedDict()
        self.total = {what: Budget(*spec, now=now) for what, spec in TOTAL_BUDGETS.items()}

    def allow(self, asker: str, what: str, amount: float = 1.0, now: Optional[float] = None) -> bool:
        own = self.askers.pop(asker, None) or {w: Budget(*spec, now=now) for w, spec in ASKER_BUDGETS.items()}
        self.askers[asker] = own  # newest last
        while len(self.askers) > self.max_askers:
            self.askers.popitem(last=False)
        mine, everyone = own[what], self.total[what]
        if amount > mine.burst or amount > everyone.burst:
            return False
        if not mine.take(amount, now):
            return False
        if not everyone.take(amount, now):
            mine.level += amount  # not spent after all
            return False
        return True


_TCP = re.compile(r"^/(ip4|ip6|dns|dns4|dns6)/([^/]+)/tcp/(\d{1,5})(/|$)")


def tcp_port(maddr: str) -> Optional[int]:
    """The TCP port of a /ip4|/ip6|/dns.../tcp/PORT multiaddr (not a relayed one), else None."""
    match = _TCP.match(maddr)
    if match is None or "/p2p-circuit" in maddr:
        return None
    port = int(match.group(3))
    return port if 1 <= port <= 65535 else None


def observed_host(maddr: str) -> Optional[str]:
    """The IP a direct connection's remote multiaddr names (what we may dial back), else None (relayed, DNS...)."""
    match = _TCP.match(maddr)
    if match is None or match.group(1) not in ("ip4", "ip6") or "/p2p-circuit" in maddr:
        return None
    return match.group(2)


def ports_to_dial(maddrs: list[str]) -> list[int]:
    """The distinct TCP ports of the asker's addresses, in order, at most MAX_DIALS."""
    ports = list(dict.fromkeys(p for p in map(tcp_port, maddrs) if p is not None))
    return ports[:MAX_DIALS]


async def dial(host: str, port: int, timeout: float = DIAL_TIMEOUT) -> Dial:
    """A plain TCP connect, closed at once: is anything listening there that the world can reach?"""
    started = time.monotonic()
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except asyncio.TimeoutError:
        return Dial(port=port, ok=False, error="timed out")
    except ConnectionRefusedError:
        return Dial(port=port, ok=False, error="refused")
    except OSError:
        return Dial(port=port, ok=False, error="unreachable")
    writer.close()
    return Dial(port=port, ok=True, ms=round((time.monotonic() - started) * 1000, 1))


async def read_frame(reader: asyncio.StreamReader, limit: int) -> bytes:
    """One length-prefixed frame, refused before reading it when it is longer than `limit`."""
    size = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
    if size > limit:
        raise ValueError(f"a frame of {size} bytes is more than {limit}")
    return await reader.readexactly(size)


async def write_frame(writer: asyncio.StreamWriter, data: bytes) -> None:
    await P2P.send_raw_data(data, writer)


class ProbeServer(StreamService):
    """Answers probes from a thread with its own event loop, through a client of the DHT's p2pd (as
    collab.run.sharing.RunFileServer serves files). start() and stop(); a failure to start is kept in .error: serving
    probes is a courtesy to others and never ends this peer."""

    def __init__(self, dht):
        self.limits = Limits()
        self._block = b""  # random bytes to send, made once: incompressible on any link
        super().__init__(dht, "probe-server")

    async def _listen(self) -> None:
        self._p2p = await own_p2p(self.dht)
        self._streams = asyncio.Semaphore(MAX_STREAMS)
        self._transfers = asyncio.Semaphore(MAX_TRANSFERS)
        self._block = os.urandom(CHUNK)
        await self._p2p.add_binary_stream_handler(PROBE_PROTOCOL, self._serve)

    async def _serve(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._streams.locked():  # busy: the asker tries another peer
            writer.close()
            return
        try:
            async with self._streams:
                request = ProbeRequest.model_validate_json(
                    await asyncio.wait_for(read_frame(reader, MAX_REQUEST_BYTES), REQUEST_TIMEOUT))
                await self._answer(request, stream_info.peer_id.to_base58(), str(stream_info.addr), reader, writer)
        except Exception:
            pass  # an asker that hung up, was too slow or sent garbage: nothing to do
        finally:
            writer.close()

    async def _answer(self, request: ProbeRequest, asker: str, remote: str, reader, writer) -> None:
        what = "bytes" if request.kind in ("download", "upload") else request.kind
        if not self.limits.allow(asker, what, request.size if what == "bytes" else 1):
            return await self._reply(writer, ProbeReply(ok=False, error=f"rate-limited: ask for {request.kind} later"))
        if request.kind == "clock":
            return await self._reply(writer, ProbeReply(ok=True, time=time.time()))
        if request.kind == "dial":
            return await self._reply(writer, await self._dial_back(remote, request.maddrs))
        if self._transfers.locked():
            return await self._reply(writer, ProbeReply(ok=False, error="busy measuring another peer: try later"))
        async with self._transfers:
            await self._reply(writer, ProbeReply(ok=True))
            if request.kind == "download":
                await asyncio.wait_for(self._send(writer, request.size), TRANSFER_TIMEOUT)
            else:
                received = await asyncio.wait_for(self._discard(reader, request.size), TRANSFER_TIMEOUT)
                await self._reply(writer, ProbeReply(ok=True, received=received))

    async def _dial_back(self, remote: str, maddrs: list[str]) -> ProbeReply:
        host = observed_host(remote)
        if host is None:
            return ProbeReply(ok=False, observed=remote[:300], error="reached through a relay: cannot dial back")
        dials = await asyncio.gather(*(dial(host, port) for port in ports_to_dial(maddrs)))
        return ProbeReply(ok=True, observed=remote[:300], dials=list(dials))

    async def _send(self, writer: asyncio.StreamWriter, size: int) -> None:
        writer.write(size.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
        for offset in range(0, size, CHUNK):
            writer.write(self._block[:min(CHUNK, size - offset)])
            await writer.drain()

    @staticmethod
    async def _discard(reader: asyncio.StreamReader, size: int) -> int:
        declared = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
        if declared != size:  # only what the request announced, and the budget allowed
            raise ValueError(f"upload of {declared} bytes announced as {size}")
        left = size
        while left:
            left -= len(await reader.readexactly(min(CHUNK, left)))
        return size

    @staticmethod
    async def _reply(writer: asyncio.StreamWriter, reply: ProbeReply) -> None:
        await write_frame(writer, reply.model_dump_json(exclude_none=True).encode())

