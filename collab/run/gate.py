"""Enforcing a private run inside hivemind: on every DHT request, and on every averaging RPC.

- The DHT: hivemind's TokenAuthorizerBase signs each request and response with the sender's key and
  attaches its access token; `RunAuthorizer` makes that token the organizer-signed invite, bound to
  the sender's own key (the invited peer id must be the id of the key that signed the request), and
  refuses expired and revoked ones. A request without a valid invite is never answered or stored.
- Averaging: hivemind's averaging RPCs carry no auth, but libp2p authenticates the remote peer id of
  each stream, and hivemind hands it to the handler. `MembersOnly` refuses join_group, aggregate_part
  and download_state from a peer id that is not a member, and refuses to average in a group (as
  leader or follower) that holds one. Members are read from the DHT (`MEMBERS_SUFFIX`: each member
  stores its own invite) and the organizer's revocation list (`REVOKED_SUFFIX`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Optional

from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase

from collab.identity import peer_id_of, signer_peer_id
from collab.reply_streams import replies_in_flight
from collab.run.access import AccessList, Invite, expired, invite_payload, newest_revocations, signed_by

MEMBERS_SUFFIX = "_members"
REVOKED_SUFFIX = "_revoked"
REFRESH_SECONDS = 10.0  # how stale a peer's view of the members may get: a revocation applies within this (+ DHT)
REPLY_DRAIN = 3.0  # seconds a leaving averager waits for groupmates to read the averaged parts it holds
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
        from hivemind.utils.crypto import RSAPublicKey

        raw = token.SerializeToString()
        known = self._valid.get(raw)
        if known is None:
            try:
                expires_at = int(token.expiration_time)
                key_owner = peer_id_of(RSAPublicKey.from_bytes(token.public_key))
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
    from functools import partial

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


class _NoState:
    """A donor that is not asked: its download yields nothing."""

    async def rpc_download_state(self, _request):
        async def nothing():
            return
            yield

        return nothing()


class NotAMember(MatchmakingException):
    """A group that holds a non-member: hivemind's averager gives this round up (and retries, time permitting)."""


class MembersOnly:
    """A DecentralizedAverager mixin: with a `gate`, averaging only with the run's members."""

    gate: Optional[MemberGate] = None

    async def _allows(self, peer_id: PeerID, what: str, refresh: bool = True) -> bool:
        return self.gate is None or peer_id == self.peer_id or await self.gate.allows(self.dht, peer_id, what, refresh)

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if not await self._allows(context.remote_id, "a join request"):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if self.gate is not None and not await self._groupmate(context.remote_id):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_aggregate_part(stream, context):
            yield message

    async def _groupmate(self, peer_id: PeerID) -> bool:
        # a groupmate of a running round was checked with its group (_aggregate_with_group), unless revoked since
        in_group = any(peer_id in runner.ordered_peer_ids for runner in self._runners())
        return (in_group and self.gate.access.allows(peer_id.to_base58())) or \
            await self._allows(peer_id, "tensor parts", refresh=False)

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest, context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if not await self._allows(context.remote_id, "a state download"):
            return  # nothing: the asker moves on to the next donor
        async for message in super().rpc_download_state(request, context):
            yield message

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        # as a follower this checks the leader's member list before sending a byte; as a leader, its own group
        for peer_id in group_info.peer_ids:
            if not await self._allows(peer_id, "a place in an averaging group", refresh=False):
                raise NotAMember(f"the group holds {peer_id}, who is not a member of this private run")
        return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)

    async def _load_state_from_peers(self, future, timeout=None):
        # hivemind picks donors from the DHT's list of averagers, which may still hold a revoked peer's entry:
        # download only from members (its one call of self.get_stub, below, is where a donor is chosen)
        if self.gate is not None:
            await self.gate.refresh(self.dht)
            self.get_stub = self._donor_stub
        return await super()._load_state_from_peers(future, timeout=timeout)

    def _donor_stub(self, p2p, peer: PeerID, *, namespace=None):
        verdict = self.gate.access.verdict(peer.to_base58())
        if verdict == "member":
            return type(self).get_stub(p2p, peer, namespace=namespace)
        self.gate.refuse(peer.to_base58(), "an offer of its state", verdict)
        return _NoState()  # hivemind hears "no state" and asks the next donor

    async def _apply_revocations(self, revocations) -> None:
        """Sent by the trainer (through hivemind's pipe to this averager's process) when the organizer revokes
        someone: refuse them now, not at the next re-read, and end a round in flight that holds them (it would
        stall until its timeout: its members refuse the revoked peer's parts)."""
        if self.gate is None or not self.gate.access.apply(revocations):
            return
        for runner in self._runners():
            revoked = [str(p) for p in runner.ordered_peer_ids if str(p) in self.gate.access.revoked]
            if revoked:
                runner.finalize(exception=NotAMember(f"the group holds {revoked[0]}, whose invite was revoked"))

    def _runners(self) -> list:
        futures = list(getattr(self, "_running_groups", {}).values())
        return [f.result() for f in futures if f.done() and not f.cancelled() and f.exception() is None]

    async def _shutdown(self, timeout) -> None:
        # hivemind's shutdown iterates over the running groups with `.finalize(cancel=True)`, but each is an
        # asyncio.Future holding the AllReduceRunner, and finalize returns None: a shutdown mid-round raised
        # AttributeError (then TypeError) in its thread. End them here, and hand it none. First, briefly, let
        # the groupmates read the averaged parts this peer still holds for them (p2pd goes with this peer)
        await replies_in_flight(min(REPLY_DRAIN, timeout / 2) if timeout else REPLY_DRAIN)
        for runner in self._runners():
            runner.finalize(cancel=True)
        self._running_groups.clear()
        await super()._shutdown(timeout)
