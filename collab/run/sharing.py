"""How peers share a run's manifest and files: the manifest in the DHT, files over libp2p streams.

Every peer that holds the verified manifest stores it in the DHT under its own key (so nobody can
overwrite another's copy, and it outlives the organizer's peer) and serves the run's files (the
tokenizer, and the token shards it holds: collab.run.shard_fetch) to peers that ask. A joining peer reads the manifest, checks it (collab.run.manifest),
and fetches each file from the peers that hold it, checking its sha256 before using it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from hivemind.p2p import P2P, PeerID
from hivemind.utils.timed_storage import get_dht_time

from collab.errors import UserError
from collab.hivemind_hooks.patches import close_p2p_client, p2pd_address
from collab.records.identity import signer_peer_id
from collab.run.manifest import Manifest, verify

MANIFEST_SUFFIX = "_manifest"
MANIFEST_EXPIRATION = 600.0  # seconds; every holder re-stores it well before
MAX_MANIFEST_BYTES = 256 * 1024
MAX_FILE_BYTES = 64 * 1024 * 1024
FILE_PROTOCOL = "collab-run-file"
TOKENIZER_NAME = "tokenizer.json"
ACCESS_NAME = "access"  # not a file: the server's verdict on the asker (is the run private, is it a member)
SHARD_UPLOADS = 4  # shards sent at once: more would split the uplink thinner and hold more of them in memory


def store_own_copy(dht, key: str, subkey: bytes, value, lifetime: float) -> None:
    """Store (without waiting) this peer's copy of a run record under its own signing key (`subkey`): nobody
    else can overwrite it, and readers know who holds it (manifest, invites, revocation list)."""
    dht.store(key=key, subkey=subkey, value=value, expiration_time=get_dht_time() + lifetime, return_future=True)


def publish_manifest(dht, run_id: str, subkey: bytes, blob: bytes) -> None:
    store_own_copy(dht, run_id + MANIFEST_SUFFIX, subkey, blob, MANIFEST_EXPIRATION)


def fetch_manifest(dht, run_id: str, run_key: Optional[str], timeout: float = 30.0,
                   stop: Optional[threading.Event] = None) -> tuple[Manifest, bytes, list[str]]:
    """The run's manifest (checked against `run_key` when given), its signed bytes, and who holds it."""
    deadline = time.monotonic() + timeout
    problems: list[str] = []
    while True:
        found = dht.get(run_id + MANIFEST_SUFFIX, latest=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        valid: dict[str, tuple[Manifest, bytes, list[str]]] = {}
        problems = []
        for subkey, item in entries.items():
            blob = getattr(item, "value", None)
            if not isinstance(blob, bytes) or len(blob) > MAX_MANIFEST_BYTES:
                continue
            try:
                manifest = verify(blob, run_id, run_key)
            except UserError as e:
                problems.append(str(e))
                continue
            holder = signer_peer_id(subkey)
            known = valid.setdefault(manifest.fingerprint + manifest.canonical().hex(), (manifest, blob, []))
            if holder is not None:
                known[2].append(holder)
        if len({m.fingerprint for m, _, _ in valid.values()}) > 1:
            keys = ", ".join(sorted({m.fingerprint for m, _, _ in valid.values()}))
            raise UserError(f"peers of run {run_id!r} offer manifests signed by different keys ({keys}); pass "
                            "--run-key with the organizer's key from your join line")
        if valid:  # one organizer; if it re-issued the manifest, its newest
            return max(valid.values(), key=lambda entry: entry[0].created_at)
        if problems or time.monotonic() > deadline or (stop is not None and stop.wait(1.0)):
            break
        if stop is None:
            time.sleep(1.0)
    if problems:
        raise UserError(problems[0])
    raise UserError(f"no peer of run {run_id!r} offered its manifest within {timeout:.0f} s; check --run-id and "
                    "--initial-peers (the organizer's peers must run collab 0.2 or later)")


class StreamService:
    """A service other peers reach through the DHT's p2pd, run by a thread with its own event loop: start() waits
    until it listens, stop() ends it. A failure to start is kept in .error: serving others is a courtesy and must
    never end this peer. Subclasses register their handlers in _listen()."""

    def __init__(self, dht, name: str):
        self.dht = dht
        self.error: Optional[str] = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self):
        self._thread.start()
        self._ready.wait(30)
        return self

    async def _listen(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._listen())
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            self._ready.set()
            close_loop(self._loop, getattr(self, "_p2p", None))  # a client that began listening: its file in /tmp
            return
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            close_loop(self._loop, getattr(self, "_p2p", None))

    def stop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)  # the thread closes its client of p2pd (the daemon itself is the DHT's)


class RunFileServer(StreamService):
    """Serves the run's files (name -> path) from a thread with its own event loop: to any peer that asks, or in
    a private run (`access`) to members only. Anyone may ask about themselves (ACCESS_NAME): a stranger learns
    that the run is private and how to get in, a revoked peer that it was revoked."""

    def __init__(self, dht, files: dict[str, Path], access=None,
                 shards: Optional[Callable[[str], Optional[Path]]] = None):
        self.files = {name: Path(path) for name, path in files.items()}
        self.shards = shards  # a shard's name -> its verified file here, or None (collab.run.shard_fetch.RunShards)
        self._uploads: Optional[asyncio.Semaphore] = None  # made in the server's own loop
        self.access = access  # collab.run.access.AccessList, kept current by collab.run.watch; None: open run
        super().__init__(dht, "run-file-server")

    async def _listen(self) -> None:
        self._p2p = await own_p2p(self.dht)
        self._uploads = asyncio.Semaphore(SHARD_UPLOADS)
        await self._p2p.add_binary_stream_handler(FILE_PROTOCOL, self._serve)

    async def _serve(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            name = (await asyncio.wait_for(P2P.receive_raw_data(reader), timeout=10)).decode()
            verdict = "member" if self.access is None else self.access.verdict(stream_info.peer_id.to_base58())
            path, shard = (self.files.get(name), None) if verdict == "member" else (None, None)
            if verdict == "member" and path is None and self.shards is not None:
                path = shard = self.shards(name)
            if shard is not None:  # tens of MB: read off the serving loop, and only a few at once
                async with self._uploads:
                    data = await asyncio.get_running_loop().run_in_executor(None, shard.read_bytes)
                    await P2P.send_raw_data(data, writer)
                    await writer.drain()
                return
            data = path.read_bytes() if path is not None and path.is_file() else b""
            if name == ACCESS_NAME:
                data = json.dumps({"private": self.access is not None, "verdict": verdict}).encode()
            await P2P.send_raw_data(data, writer)
            await writer.drain()
        except Exception:
            pass  # a peer that hung up or sent garbage: nothing to do
        finally:
            writer.close()


def close_loop(loop, p2p=None) -> None:
    """Close a thread's event loop and its client of p2pd (`p2p`, from own_p2p; the daemon is the DHT's), letting
    what that cancels finish first: nothing is left pending to complain at exit."""

    async def finish() -> None:  # inside the loop: hivemind cancels its tasks through the running loop
        if p2p is not None:
            close_p2p_client(p2p)
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    try:
        loop.run_until_complete(finish())
    finally:
        loop.close()


async def own_p2p(dht):
    """A client of the DHT's p2pd for the calling event loop (hivemind's cached replica is bound to another). If this
    process is killed, its watcher removes the client's socket file (collab.process.reaper)."""
    return await P2P.replicate(p2pd_address(dht))


def fetch_run_file(dht, holders: list[str], name: str, sha256: str, timeout: float = 60.0) -> bytes:
    """The run's file `name` from the first holder whose copy matches `sha256`."""
    loop = asyncio.new_event_loop()
    p2p = None
    try:
        p2p = loop.run_until_complete(own_p2p(dht))
        return _fetch(loop, p2p, holders, name, sha256, timeout)
    finally:
        close_loop(loop, p2p)


async def ask_for_file(p2p, peer: str, name: str, limit: int = MAX_FILE_BYTES) -> bytes:
    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), FILE_PROTOCOL)
    try:
        await P2P.send_raw_data(name.encode(), writer)
        header = await reader.readexactly(P2P.HEADER_LEN)
        size = int.from_bytes(header, P2P.BYTEORDER)
        if size > limit:
            raise ValueError(f"{size} bytes is more than a run file may be")
        return await reader.readexactly(size)
    finally:
        writer.close()


async def ask_about_access(p2p, peer: str, timeout: float = 10) -> Optional[dict]:
    """What `peer` says about this peer's place in the run: {"private": bool, "verdict": str}, or None."""
    try:
        answer = json.loads(await asyncio.wait_for(ask_for_file(p2p, peer, ACCESS_NAME, limit=4096), timeout=timeout))
    except Exception:
        return None
    ok = isinstance(answer, dict) and isinstance(answer.get("private"), bool) and isinstance(answer.get("verdict"), str)
    return answer if ok else None


def _fetch(loop, p2p, holders: list[str], name: str, sha256: str, timeout: float) -> bytes:
    def ask(peer: str):
        return ask_for_file(p2p, peer, name)

    deadline = time.monotonic() + timeout
    wrong = 0
    while time.monotonic() < deadline:
        for peer in holders:
            try:
                wait = max(1.0, min(30.0, deadline - time.monotonic()))
                data = loop.run_until_complete(asyncio.wait_for(ask(peer), timeout=wait))
            except Exception:
                continue  # gone, unreachable (behind NAT), or too slow: ask the next one
            if hashlib.sha256(data).hexdigest() == sha256:
                return data
            wrong += 1
        time.sleep(1.0)
    if wrong:
        raise UserError(f"the run's {name} from its peers does not match the manifest's sha256 ({wrong} copies); "
                        "nothing was trained - ask the organizer")
    raise UserError(f"no peer of the run could send its {name} within {timeout:.0f} s; try again later")
