"""Joining the swarm: identity, the DHT with signed and schema-checked records, the join command.

A peer's identity is one RSA key (collab.records.identity): its libp2p key, from which its peer id derives
(`--identity PATH` keeps it across restarts: same peer id, and its old metrics record is overwritten,
not duplicated), and the key that signs its DHT records, so that no record can claim another's id.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Optional

import hivemind
import psutil
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import SchemaValidator
from hivemind.p2p import P2P
from hivemind.utils.multiaddr import Multiaddr
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from collab.config import RUN_ID_PATTERN
from collab.errors import UserError
from collab.hivemind_hooks.dht_node import store_walks_without_values, stores_remember_nodes
from collab.hivemind_hooks.patches import (cancelled_enters_exit, death_safe_locks, dht_takes_requests,
                                           failed_p2pd_starts_leave_no_file, p2pd_starts_given,
                                           pipe_reads_take_whole_messages, sign_progress_with)
from collab.process.lifecycle import quiet_orphaned_requests
from collab.process.reaper import end_processes, hivemind_sockets, is_running, remove_sockets_of
from collab.records.identity import Identity, hivemind_reads_ed25519, load_or_create_identity
from collab.records.metrics import METRICS_SUFFIX, PROGRESS_SUFFIX, MetricsSchema
from collab.records.shared_reads import start_sharing
from collab.records.verdicts import RememberedVerdicts
from collab.run.sharing import ask_about_access
from collab.swarm.dht_traffic import start_counting
from collab.swarm.dial import why_not_joined
from collab.swarm.rejoin import Rejoiner


class PeerConfig(BaseModel):
    """How this peer connects: everything here comes from CLI flags, none of it from the run config."""

    model_config = ConfigDict(extra="forbid")

    run_id: str = Field(pattern=RUN_ID_PATTERN)
    initial_peers: list[str] = Field(default_factory=list)
    host_maddrs: list[str] = Field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce_maddrs: list[str] = Field(default_factory=list)
    client_mode: bool = False
    identity: Optional[Path] = None
    startup_timeout: float = Field(60.0, gt=0, description="p2pd can need more than 15 s on a busy machine")

    @property
    def initial_peer_ids(self) -> list[str]:
        """The peer ids the --initial-peers multiaddrs end with (/p2p/ID): whom to ask before the DHT says more."""
        return [maddr.rsplit("/p2p/", 1)[-1] for maddr in self.initial_peers if "/p2p/" in maddr]

    @field_validator("initial_peers", "host_maddrs", "announce_maddrs")
    @classmethod
    def _valid_multiaddrs(cls, values: list[str], info):
        flag = "--" + info.field_name.replace("_", "-")
        for value in values:
            try:
                Multiaddr(value)
            except Exception:
                raise ValueError(f"{flag} {value!r} is not a multiaddr; expected e.g. /ip4/1.2.3.4/tcp/31337") from None
            if info.field_name == "initial_peers" and "/p2p/" not in value:
                raise ValueError(f"{flag} {value!r} lacks the peer id; copy the full /ip4/…/tcp/…/p2p/… address")
        return values


def peer_config_from_flags(**flags) -> PeerConfig:
    try:
        return PeerConfig(**flags)
    except ValidationError as e:
        err = e.errors()[0]
        if err["loc"] == ("run_id",):
            raise UserError(
                f"--run-id {flags.get('run_id')!r} is invalid; use 1-64 letters, digits, '_' or '-' "
                "(no dots: hivemind's DHT keys forbid them)"
            ) from None
        raise UserError(err["msg"].removeprefix("Value error, ")) from None


BOOTSTRAP_ATTEMPTS = 3  # a join through the initial peers, at most this many times, when they were only slow:
# p2pd's own dial of them failed, or its DHT node's pings of them (hivemind: 3 s each; 4 of 64 peers starting
# together on 2 cores failed twice so)
SLOW_BOOTSTRAP = ("failed to connect to bootstrap peers", "none of the initial_peers responded to a ping")
UNANSWERED_PING = SLOW_BOOTSTRAP[1]
BOOTSTRAP_PAUSE = 5.0  # seconds between two attempts
# hivemind's DHT keeps a copy of every value a read finds (cache_locally), answers other nodes' finds from it, and
# stores it on one more node (cache_nearest). Every collab read asks for the latest value (latest=True), which walks
# the whole beam and merges what each node holds, so the copies never spare a read; they multiply it: once every
# peer has read the progress key, every node a read asks answers with all N records (N^2 bytes a read), and each
# read that found something newer stores all N on another node. Without copies a read gets them from the key's 5
# replicas only. 12 linreg peers, 60 s, two runs each: 739 and 711 DHT KB per peer and epoch with the copies, 375
# and 274 without; 5-6 epochs against 7-11
NO_RECORD_COPIES = dict(cache_locally=False, cache_nearest=0)


class OwnGroupDHT(hivemind.DHT):
    """A DHT whose process (and the p2pd it spawns) leaves the terminal's process group.

    Ctrl-C sends SIGINT to the whole foreground group; p2pd would die at once and the peer could
    not say goodbye to the swarm. In a group of its own it stays up until this peer shuts it down.
    It is still our child: collab.process.lifecycle and collab.peers.launcher reap it by parentage and session.
    `verdicts`: its record validator, kept at hand for the counts (collab.swarm.dht_traffic reads its process's copy).
    Records stay on their key's nearest nodes (NO_RECORD_COPIES) unless the caller says otherwise.
    `sockets`: its process's and its p2pd's socket files once it started (dht_sockets; with start=True), for
    shut_down_dht to remove even if those processes die first (then they can no longer be asked).
    """

    def __init__(self, *args, verdicts: Optional[RememberedVerdicts] = None, **kwargs):
        self.verdicts = verdicts  # before hivemind's __init__, which forks the DHT's process when start=True
        super().__init__(*args, **{**NO_RECORD_COPIES, **kwargs})
        # started and ready (start=True), p2pd's files exist; otherwise shut_down_dht reads them then
        self.sockets: Optional[dict[int, list[str]]] = dht_sockets(self) if self.is_alive() else None

    def run(self) -> None:
        os.setpgid(0, 0)
        pipe_reads_take_whole_messages(self)
        super().run()


async def _lighter_stores(_dht, node) -> None:
    store_walks_without_values(node)  # (in the DHT's process)
    stores_remember_nodes(node)


class Swarm:
    """This peer's DHT node, its signing key and the run's record validators."""

    def __init__(self, peer: PeerConfig, identity: Optional[Identity] = None, extra_validators: Iterable = (),
                 authorizer=None):
        """`authorizer`: in a private run, this peer's invite as hivemind's DHT access token (collab.run.gate)."""
        quiet_orphaned_requests()
        death_safe_locks()  # before the DHT's process, the first this peer forks, inherits them
        cancelled_enters_exit()
        failed_p2pd_starts_leave_no_file()
        p2pd_starts_given(peer.startup_timeout)  # hivemind's check that the identity is free too
        hivemind_reads_ed25519()  # identity files, records and access tokens of either kind of key

        self.peer = peer
        self.identity = identity if identity is not None else load_or_create_identity(peer.identity)
        self.signing_key = self.identity.key
        sign_progress_with(self.signing_key)  # the key this peer's id derives from: readers can check records
        signature = RSASignatureValidator(self.signing_key)
        self.public_key: bytes = signature.local_public_key
        # each record another node sends is checked once, not once per node and per read (collab.records.verdicts)
        verdicts = RememberedVerdicts([SchemaValidator(MetricsSchema, prefix=peer.run_id), signature,
                                       *extra_validators])
        p2p_options = dict(
            host_maddrs=peer.host_maddrs,
            announce_maddrs=peer.announce_maddrs or None,
            startup_timeout=peer.startup_timeout,
        )
        try:
            for attempt in range(BOOTSTRAP_ATTEMPTS):
                try:
                    with self.identity.file_for_p2pd() as identity_path:  # p2pd reads it at start
                        self.dht = OwnGroupDHT(
                            initial_peers=peer.initial_peers or None,
                            client_mode=peer.client_mode,
                            record_validators=[verdicts],
                            verdicts=verdicts,
                            # by the time the DHT is shut down the goodbyes are sent; do not wait 3 s for a busy loop
                            shutdown_timeout=1.0,
                            start=True,
                            authorizer=authorizer,
                            identity_path=str(identity_path),
                            **p2p_options,
                        )
                    break
                except Exception as e:
                    # p2pd dials the initial peers once, and the DHT node pings them once, with fixed timeouts: on a
                    # busy machine (a peer starved of CPU) a live initial peer can miss them. Again, then say so
                    if attempt + 1 == BOOTSTRAP_ATTEMPTS or not any(slow in str(e) for slow in SLOW_BOOTSTRAP):
                        raise
                    time.sleep(BOOTSTRAP_PAUSE)
        except Exception as e:
            if peer.initial_peers:  # refused because the run is private (and this peer's invite is none, or void)?
                _refuse_if_private(self.identity, peer)
            raise UserError(_explain_dht_failure(e, peer)) from None
        self.peer_id: str = self.dht.peer_id.to_base58()
        assert self.peer_id == self.identity.peer_id, "p2pd derived another peer id from the identity key"
        self._rejoiner = Rejoiner(self.dht, peer.initial_peers)
        # a store's walk carries no records back, and a key's next stores within seconds go where it found
        self.dht.run_coroutine(_lighter_stores)
        start_counting(self.dht)  # its requests to the swarm, per RPC (collab.swarm.dht_traffic)
        # one stream of reads of each key whose value is every peer's record: the progress key (hivemind's tracker,
        # collab's rounds) and the metrics key (read_run_state: --wait-peers polls it, the dashboard, the plan keeper)
        start_sharing(self.dht, [peer.run_id + PROGRESS_SUFFIX, peer.run_id + METRICS_SUFFIX])

    def rejoin(self) -> int:
        """Ask again for peers the DHT lost (collab.swarm.rejoin), at most every REJOIN_EVERY s; how many answered so
        far."""
        before = self._rejoiner.found_back
        self._rejoiner.maybe_run()
        if self._rejoiner.found_back > before:
            print(f"Reached {self._rejoiner.found_back - before} peer(s) again that had been unreachable "
                  "(a network split healed)", flush=True)
        return self._rejoiner.found_back

    def join_command(self, run_key: Optional[str] = None) -> str:
        """The exact command another participant runs to join this swarm: with the run's key, nothing else."""
        words = ["collab", "join", "--run-id", self.peer.run_id, "--initial-peers", self.best_maddr()]
        if run_key is not None:
            words += ["--run-key", run_key]
        return shlex.join(words)

    def best_maddr(self) -> str:
        """A multiaddr others can dial: announced first, then a non-loopback address, then loopback."""
        addrs = [str(a) for a in self.dht.get_visible_maddrs()]
        if self.peer.announce_maddrs:
            ours = [a for a in addrs if any(a.startswith(m) for m in self.peer.announce_maddrs)]
            addrs = ours or addrs
        tcp = [a for a in addrs if "/tcp/" in a and "/p2p-circuit" not in a] or addrs
        public = [a for a in tcp if not re.match(r"/ip4/127\.|/ip6/::1/", a)]
        return (public or tcp)[0]

    def shutdown(self) -> None:
        # idempotent: the trainer shuts down the swarm it was given, and so does `collab join` on its way out; a
        # DHT process killed "the hard way" may still look alive a moment later, and its pipe is closed by then
        if getattr(self, "_shut", False):
            return
        self._shut = True
        shut_down_dht(self.dht)


DHT_PIPE_WAIT = 1.0  # seconds a leave waits for the DHT's process to make room in its pipe for the "_shutdown"


def dht_sockets(dht) -> dict[int, list[str]]:
    """The socket files of the DHT's process and its p2pd (collab.process.reaper.hivemind_sockets)."""
    try:
        process = psutil.Process(dht.pid)
        return hivemind_sockets([process, *process.children(recursive=True)])
    except psutil.Error:
        return {}


def shut_down_dht(dht, sockets: Optional[dict[int, list[str]]] = None) -> None:
    """hivemind's shutdown, unless the DHT's process stopped reading its pipe (collab.hivemind_hooks.patches,
    dht_takes_requests): hivemind would send it "_shutdown" and block for good. Then the process is ended, as
    hivemind ends one that does not shut down in time, and its p2pd with it (hivemind's shutdown would have ended
    that daemon; here it also ends by itself once the pipe it logs to is closed, but once its parent is gone it is
    nobody's child for the peer's exit to reap if it does not). Whichever way it ends, even dead already, the
    socket files in `sockets` (dht_sockets' answer; by default those an OwnGroupDHT read as it started) are removed."""
    try:
        daemons = psutil.Process(dht.pid).children(recursive=True)
    except psutil.Error:
        daemons = []
    # hivemind removes its socket files only where its own shutdown finishes: a DHT process it ends for being late
    # (shutdown_timeout), or one ended here, leaves its p2pd client's file in /tmp, and p2pd's (`sockets`: as
    # dht_sockets read them when the DHT started; read now if not given and not known)
    if sockets is None:
        sockets = getattr(dht, "sockets", None)
    sockets = dht_sockets(dht) if sockets is None else sockets
    if not dht.is_alive():  # it died (of a pipe that an averager broke as it was killed, in hivemind): p2pd with it
        remove_sockets_of(sockets)
        return
    if dht_takes_requests(dht, within=DHT_PIPE_WAIT):
        dht.shutdown()
        # hivemind ends one that overran its shutdown_timeout with a SIGTERM, and leaves its p2pd running: it would
        # end by itself later and leave its file. Told to end now, not waited for (a leave has 7 s in all)
        for daemon in (p for p in daemons if is_running(p)):
            try:
                daemon.terminate()
            except psutil.Error:
                pass
        remove_sockets_of(sockets)
        return
    logging.getLogger(__name__).warning("The DHT's process stopped taking requests: ending it and its p2pd")
    dht.terminate()
    dht.join(DHT_PIPE_WAIT)
    if dht.is_alive():  # a loop blocked in a C call runs no signal handler: SIGTERM waits for it
        dht.kill()
        dht.join(DHT_PIPE_WAIT)
    end_processes(daemons, timeout=DHT_PIPE_WAIT)
    remove_sockets_of(sockets, still_running=[dht] if dht.is_alive() else [])


def _explain_dht_failure(error: Exception, peer: PeerConfig) -> str:
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    if peer.initial_peers:
        # p2pd's own words ("Daemon failed to start: <timestamp> ...") say nothing a volunteer can act on: they go to
        # the debug log, and a TCP connect to each initial peer says which one failed, how, and what to check
        logging.getLogger(__name__).debug(f"the DHT node did not join: {text}")
        pinged = BOOTSTRAP_ATTEMPTS if UNANSWERED_PING in text else 0
        return f"could not join the swarm: {why_not_joined(peer.initial_peers, pinged=pinged)}"
    return f"could not start the DHT node ({text}); check --host-maddrs (is the port free?)"


def _refuse_if_private(identity: Identity, peer: PeerConfig) -> None:
    """The DHT of a private run answers nobody without an invite: ask an initial peer directly (over a libp2p
    stream, which needs none) whether that is why, so the user reads how to get in rather than 'unreachable'."""
    async def ask() -> Optional[dict]:
        with identity.file_for_p2pd() as path:
            p2p = await P2P.create(initial_peers=peer.initial_peers, host_maddrs=peer.host_maddrs,
                                   identity_path=str(path), startup_timeout=20)
        try:
            for maddr in peer.initial_peers:
                answer = await ask_about_access(p2p, maddr.rsplit("/p2p/", 1)[-1], timeout=30)
                if answer is not None:
                    return answer
            return None
        finally:
            await p2p.shutdown()

    # only on the way to an error, so it may take its time: on a busy machine (peers training beside more
    # processes starting) 20 s in all can be too little, and the user would read "unreachable"
    try:  # in a thread of its own: the caller may be inside an event loop (the dashboard's)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(lambda: asyncio.run(asyncio.wait_for(ask(), timeout=60))).result()
    except Exception:
        return
    if answer is None or not answer["private"] or answer["verdict"] == "member":
        return
    why = {"revoked": "the organizer revoked its invite", "expired": "its invite expired"}.get(
        answer["verdict"], "it has no invite")
    raise UserError(f"run {peer.run_id!r} is private and this peer ({identity.peer_id}) may not join: {why}. Send "
                    "your peer id ('collab id' prints it) to the run's organizer and join with the invite they send: "
                    "--token-file FILE")
