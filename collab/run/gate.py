"""Enforcing a private run inside hivemind: on every DHT request, and on every averaging RPC.

- The DHT: hivemind's TokenAuthorizerBase signs each request and response with the sender's key and
  attaches its access token; `RunAuthorizer` makes that token the organizer-signed invite, bound to
  the sender's own key (the invited peer id must be the id of the key that signed the request), and
  refuses expired and revoked ones. A request without a valid invite is never answered or stored.
- Averaging: `MemberGate` says who is a member, read from the DHT (`MEMBERS_SUFFIX`: each member stores
  its own invite) and the organizer's revocation list (`REVOKED_SUFFIX`); collab.averaging.members_only
  enforces it on every averaging RPC and in every group.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from typing import Optional

from hivemind.p2p import PeerID
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase

from collab.records.identity import peer_id_of, signer_peer_id
from collab.records.keys import public_key_from_bytes
from collab.run.access import AccessList, Invite, expired, invite_payload, newest_revocations, signed_by

MEMBERS_SUFFIX = "_members"
REVOKED_SUFFIX = "_revoked"
REFRESH_SECONDS = 10.0  # how stale a peer's view of the members may get: a revocation applies within this (+ DHT)
UNKNOWN_RETRY_SECONDS = 1.0  # a peer id not yet known triggers a re-read, at most this often
logger = logging.getLogger(__name__)


class RunAuthorizer(TokenAuthorizerBase):
    """hivemind's DHT authorizer with a run's invites as access tokens."""

    def __init__(self, identity_key, invite: Invite):
        super().__init__(identity_key)
        self.invite = invite
        self.revoked: frozenset[str] = frozenset()  # set in the DHT process by `apply_revocations_in_dht`
        self._valid: dict[bytes, tuple[str, int]] = {}  # token bytes -> (peer id, expiry), checked once
        self.refused: dict[str, int] = {}  # by reason

    async def get_token(self) -> AccessToken:
        return AccessToken(username=self.invite.peer_id, public_key=self.local_public_key.to_bytes(),
                           expiration_time=str(self.invite.expires_at), signature=self.invite.signature_bytes())

    def is_token_valid(self, access_token: AccessToken) -> bool:
        verdict = self._check(access_token)
        if verdict != "member":
            self.refused[verdict] = self.refused.get(verdict, 0) + 1
        return verdict == "member"

    def _check(self, token: AccessToken) -> str:
        raw = token.SerializeToString()
        known = self._valid.get(raw)
        if known is None:
            try:
                expires_at = int(token.expiration_time)
                key_owner = peer_id_of(public_key_from_bytes(token.public_key))
            except Exception:
                return "malformed"
            if key_owner != token.username:
                return "invite of another peer"  # the invite names one peer id; the request is signed by another
            if not signed_by(self.invite.organizer_key, invite_payload(self.invite.run_id, token.username, expires_at),
                             token.signature):
                return "not invited"
            if len(self._valid) > 10_000:
                self._valid.clear()
            known = self._valid[raw] = (token.username, expires_at)
        peer_id, expires_at = known
        if peer_id in self.revoked:
            return "revoked"
        return "expired" if expired(expires_at) else "member"

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return False  # an invite is what it is; when it expires or is revoked, the peer leaves (collab.run.watch)


async def _set_revoked(revoked: frozenset, _dht, node) -> None:
    node.protocol.authorizer.revoked = revoked


def apply_revocations_in_dht(dht, revoked: frozenset) -> None:
    """The DHT runs in its own process: hand it the revoked peer ids."""
    dht.run_coroutine(partial(_set_revoked, frozenset(revoked)), return_future=True)


def read_members(found, access: AccessList) -> None:
    """Invites from a DHT get of `run_id + MEMBERS_SUFFIX` (subkey: the holder's signing key) into `access`."""
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    for subkey, item in list(entries.items())[:100_000]:
        access.add_invite(getattr(item, "value", None), holder=signer_peer_id(subkey))


def read_revocations(found, access: AccessList) -> bool:
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    blobs = [getattr(item, "value", None) for item in entries.values()]
    return access.apply(newest_revocations(blobs, access.run_id, access.organizer_key))


class MemberGate:
    """The averager process's view of the members, re-read from the DHT when stale or asked about a stranger.
    Concurrent askers share one read: a groupmate's parts that arrive while a read is in flight wait for it,
    rather than being refused on the view from before it."""

    def __init__(self, run_id: str, organizer_key: str):
        self.access = AccessList(run_id, organizer_key)
        self._read_at = float("-inf")
        self._reading: Optional[asyncio.Future] = None
        self._said: dict[str, float] = {}

    async def refresh(self, dht) -> None:
        """Re-read the members now (or wait for a read in flight)."""
        if self._reading is not None:
            await asyncio.shield(self._reading)
            return
        self._reading = asyncio.ensure_future(self._read(dht))
        try:
            await asyncio.shield(self._reading)
        finally:
            self._reading = None

    def refuse(self, name: str, what: str, verdict: str) -> None:
        if time.monotonic() - self._said.get(name, float("-inf")) > 60:  # attributed, but not a line per request
            self._said[name] = time.monotonic()
            logger.warning(f"Refused {what} from peer {name}: {verdict} (this run is private)")

    async def allows(self, dht, peer_id: PeerID, what: str, refresh: bool = True) -> bool:
        """`refresh=False`: a known member passes on the current view (inside an all-reduce, where a DHT read would
        cost time; revocations reach this process at once anyway, pushed by the trainer)."""
        name = peer_id.to_base58()
        age = time.monotonic() - self._read_at
        known = self.access.allows(name)
        if self._reading is not None and not known:
            await asyncio.shield(self._reading)
        elif (refresh and age > REFRESH_SECONDS) or (not known and age > UNKNOWN_RETRY_SECONDS):
            await self.refresh(dht)
        verdict = self.access.verdict(name)
        if verdict == "member":
            return True
        self.refuse(name, what, verdict)
        return False

    async def _read(self, dht) -> None:
        self._read_at = time.monotonic()
        run_id = self.access.run_id
        try:
            members = await dht.get(run_id + MEMBERS_SUFFIX, latest=True, return_future=True)
            revoked = await dht.get(run_id + REVOKED_SUFFIX, latest=True, return_future=True)
        except Exception as e:  # keep the last view: a DHT hiccup must not let strangers in, nor shut members out
            logger.debug(f"could not read the run's members: {e!r}")
            return
        read_members(members, self.access)
        read_revocations(revoked, self.access)
