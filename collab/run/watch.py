"""A private run's membership, kept current while a peer runs: a thread with a stop event.

Every few seconds it re-stores this peer's invite (others read the members from these), reads the
organizer's newest revocation list and hands it to the DHT process (whose authorizer then refuses the
revoked), and checks this peer's own standing: an invite that expired or was revoked ends the peer
(`lost`), with one line saying why. A revoked peer may be shut out of the DHT before it reads the
revocation itself, so it also asks a member directly, over a libp2p stream, what it thinks of it.
The organizer's peer also publishes the list `collab revoke` wrote into the run folder.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from collab.run.access import AccessList, Invite, Revocations, expired
from collab.run.gate import (
    MEMBERS_SUFFIX,
    REFRESH_SECONDS,
    REVOKED_SUFFIX,
    apply_revocations_in_dht,
    read_members,
    read_revocations,
)
from collab.run.sharing import ask_about_access, close_loop, own_p2p, store_own_copy

MEMBERSHIP_RECORD_LIFETIME = 180.0  # seconds a peer's copy of a membership record lives in the DHT
REPUBLISH_SECONDS = 60.0
PROBE_SECONDS = 10.0
logger = logging.getLogger(__name__)


@dataclass
class PrivateRun:
    """What a peer of a private run holds: its own invite, the members as it knows them, and (the organizer's
    peer only) the run folder's revocation list."""

    invite: Invite
    access: AccessList
    revocations_file: Optional[Path] = None
    lost: Optional[str] = None  # why this peer may no longer take part (set by AccessWatch), one line


def publish(dht, key: str, subkey: bytes, value) -> None:
    store_own_copy(dht, key, subkey, value, MEMBERSHIP_RECORD_LIFETIME)


class AccessWatch:
    def __init__(self, swarm, private: PrivateRun, on_lost: Callable[[str], None]):
        self.swarm, self.private, self.on_lost = swarm, private, on_lost
        private.access.add_invite(private.invite.to_text())  # this peer is a member before its record is read back
        self.lost: Optional[str] = None
        self.on_revoked: list[Callable] = []  # called with each newer revocation list (the averagers want it)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="access-watch", daemon=True)
        self._published = self._probed = float("-inf")

    def start(self) -> "AccessWatch":
        self._refresh()  # the first look before training: members known, revocations applied
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)  # a daemon thread: a DHT read it may be inside must not delay the leave

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)  # hivemind's P2P closes its client through the thread's current loop
        p2p = None
        try:
            while not self._stop.wait(REFRESH_SECONDS / 2):
                try:
                    self._refresh()
                    if self.lost is None and time.monotonic() - self._probed > PROBE_SECONDS:
                        self._probed = time.monotonic()
                        if p2p is None:
                            p2p = loop.run_until_complete(own_p2p(self.swarm.dht))
                        self._probe(loop, p2p)
                except Exception as e:  # a DHT that does not answer now may answer next time
                    logger.debug(f"access watch: {e!r}")
                if self.lost is not None:
                    return
        finally:
            close_loop(loop, p2p)

    def _refresh(self) -> None:
        dht, run_id, access = self.swarm.dht, self.swarm.peer.run_id, self.private.access
        if time.monotonic() - self._published > REPUBLISH_SECONDS:
            publish(dht, run_id + MEMBERS_SUFFIX, self.swarm.public_key, self.private.invite.to_text())
            if access.revocations is not None:  # passed on, so the list outlives the organizer's peer
                publish(dht, run_id + REVOKED_SUFFIX, self.swarm.public_key, access.revocations.model_dump_json())
            self._published = time.monotonic()
        if self.private.revocations_file is not None:
            self._publish_folder_revocations()
        read_members(dht.get(run_id + MEMBERS_SUFFIX, latest=True), access)
        if read_revocations(dht.get(run_id + REVOKED_SUFFIX, latest=True), access):
            self._revoked_now()
            logger.warning(f"Applied the organizer's revocation list: {len(access.revoked)} peer(s) shut out")
        own = self.swarm.peer_id
        if own in access.revoked:
            self._lose("the organizer revoked this peer's invite")
        elif expired(self.private.invite.expires_at):
            self._lose("this peer's invite expired")

    def _publish_folder_revocations(self) -> None:
        path = self.private.revocations_file
        if not path.is_file():
            return
        try:
            listed = Revocations.model_validate_json(path.read_bytes())
        except Exception:
            return
        access = self.private.access
        if access.apply(listed):  # newer than what the swarm has: out now, not at the next republish
            publish(self.swarm.dht, self.swarm.peer.run_id + REVOKED_SUFFIX, self.swarm.public_key,
                    listed.model_dump_json())
            self._revoked_now()
            logger.warning(f"Published the run folder's revocation list: {len(access.revoked)} peer(s) shut out")

    def _revoked_now(self) -> None:
        apply_revocations_in_dht(self.swarm.dht, self.private.access.revoked)
        for callback in self.on_revoked:
            callback(self.private.access.revocations)

    def _probe(self, loop, p2p) -> None:
        others = [peer for peer in self.private.access.expires if peer != self.swarm.peer_id]
        # one member's word is not enough to leave on (it may lie): two agree, or the only other one says so
        asked = random.sample(others, min(2, len(others)))
        answers = [loop.run_until_complete(ask_about_access(p2p, peer)) for peer in asked if not self._stop.is_set()]
        verdicts = {answer["verdict"] for answer in answers if answer is not None}
        if asked and len(verdicts) == 1 and None not in answers and verdicts <= {"revoked", "expired"}:
            self._lose(f"the run's peers say this peer's invite is {verdicts.pop()}")

    def _lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = self.private.lost = (f"{why}: this peer left run {self.swarm.peer.run_id!r}, which is private; ask the organizer "
                         "for a new invite (send them the id 'collab id' prints)")
            self.on_lost(self.lost)
