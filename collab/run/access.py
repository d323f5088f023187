"""Who may take part in a private run: invites and revocations, both signed by the organizer's key.

An invite binds one peer id (its libp2p identity, `collab id`) to a run until it expires; it is the
organizer's signature over (run id, peer id, expiry), so any peer checks it with the public key in the
manifest, and no one but the key's holder can make one. A revocation list is signed the same way and
names peer ids whose invites no longer count. Neither holds a secret: an invite is useless to anyone
without the private key of the peer id it names (libp2p proves that key on every connection, and
hivemind's DHT authorizer on every request).
"""

from __future__ import annotations

import base64
import json
import re
import time
from typing import Iterable, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from collab.errors import UserError
from collab.run.manifest import fingerprint

INVITE_PREFIX = "collab-invite:"
CLOCK_SKEW = 300.0  # seconds another peer's clock may be off: an invite expires that much later for everyone
MAX_INVITE_CHARS = 4096
MAX_REVOKED = 100_000
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, flag: str = "--expires") -> float:
    """'30d', '12h', '90m', '45s' -> seconds."""
    match = _DURATION.match(text.strip())
    if match is None or float(match.group(1)) <= 0:
        raise UserError(f"{flag} {text!r} is not a duration; use a number and a unit, e.g. 30d, 12h, 90m")
    return float(match.group(1)) * _UNIT[match.group(2)]


def _payload(kind: str, **fields) -> bytes:
    # the kind keeps an invite's signature from passing as a revocation's, and the reverse
    return json.dumps({"kind": kind, **fields}, sort_keys=True, separators=(",", ":")).encode()


def invite_payload(run_id: str, peer_id: str, expires_at: int) -> bytes:
    return _payload("collab-invite", run_id=run_id, peer_id=peer_id, expires_at=int(expires_at))


class Invite(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_id: str = Field(max_length=64)
    peer_id: str = Field(max_length=128)
    expires_at: int
    organizer_key: str = Field(max_length=2048)  # OpenSSH; the run key is its fingerprint
    signature: str = Field(max_length=2048)  # base64 of the organizer's signature of invite_payload

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.organizer_key.encode())

    def to_text(self) -> str:
        return INVITE_PREFIX + base64.urlsafe_b64encode(self.model_dump_json().encode()).decode()

    def signature_bytes(self) -> bytes:
        return base64.b64decode(self.signature)


def make_invite(run_id: str, peer_id: str, organizer_key, lifetime: float, now: Optional[float] = None) -> Invite:
    expires_at = int((time.time() if now is None else now) + lifetime)
    signature = organizer_key.sign(invite_payload(run_id, peer_id, expires_at))
    return Invite(run_id=run_id, peer_id=peer_id, expires_at=expires_at,
                  organizer_key=organizer_key.get_public_key().to_bytes().decode(),
                  signature=base64.b64encode(signature).decode())


def read_invite(text: str, where: str = "--token") -> Invite:
    """The invite in `text` (what `collab invite` printed), its signature checked; a UserError if it is none."""
    text = text.strip()
    try:
        if not text.startswith(INVITE_PREFIX) or len(text) > MAX_INVITE_CHARS:
            raise ValueError
        invite = Invite.model_validate_json(base64.urlsafe_b64decode(text[len(INVITE_PREFIX):]))
    except (ValueError, ValidationError):
        raise UserError(f"{where} is not a collab invite (it starts with {INVITE_PREFIX!r}); copy the whole line "
                        "'collab invite' printed") from None
    if not signed_by(invite.organizer_key, invite_payload(invite.run_id, invite.peer_id, invite.expires_at),
                     invite.signature_bytes()):
        raise UserError(f"{where} has a bad signature: it was altered; ask the organizer for a new invite")
    return invite


def signed_by(organizer_key: str, payload: bytes, signature: bytes) -> bool:
    from hivemind.utils.crypto import RSAPublicKey  # heavy (hivemind, torch): command modules import this module

    try:
        return RSAPublicKey.from_bytes(organizer_key.encode()).verify(payload, signature)
    except Exception:
        return False


def signature_holds(organizer_key: str, payload: bytes, signature_base64: str) -> bool:
    """A record's base64 signature is the organizer key's signature of its payload."""
    try:
        signature = base64.b64decode(signature_base64, validate=True)
    except ValueError:
        return False
    return signed_by(organizer_key, payload, signature)


def expired(expires_at: float, now: Optional[float] = None) -> bool:
    return (time.time() if now is None else now) > expires_at + CLOCK_SKEW


class Revocations(BaseModel):
    """Peer ids whose invites no longer count, as of `issued_at`; each list replaces the one before."""

    model_config = ConfigDict(extra="forbid")

    run_id: str = Field(max_length=64)
    peer_ids: list[str] = Field(default_factory=list, max_length=MAX_REVOKED)
    issued_at: float
    signature: str = ""

    def payload(self) -> bytes:
        return _payload("collab-revocations", run_id=self.run_id, peer_ids=sorted(self.peer_ids),
                        issued_at=self.issued_at)

    def signed(self, organizer_key) -> "Revocations":
        return signed_record(self, organizer_key)

    def valid_for(self, run_id: str, organizer_key: str) -> bool:
        return self.run_id == run_id and signature_holds(organizer_key, self.payload(), self.signature)


def newest_revocations(blobs: Iterable, run_id: str, organizer_key: str) -> Optional[Revocations]:
    """The newest validly signed list among DHT values (others' copies may be old, malformed or forged)."""
    return newest_signed(Revocations, ((None, blob) for blob in blobs), run_id, organizer_key, 64 * MAX_REVOKED)


def signed_record(record: BaseModel, organizer_key):
    """`record` (with a `payload()` and a `signature` field) signed with the organizer's key."""
    unsigned = record.model_copy(update=dict(signature=""))
    return unsigned.model_copy(update=dict(signature=base64.b64encode(organizer_key.sign(unsigned.payload()))
                                           .decode()))


def newest_signed(model, entries: Iterable, run_id: str, organizer_key: str, max_bytes: int, rejected=None):
    """The newest (by `issued_at`) record of `model` validly signed with the organizer's key among (signer, blob) DHT
    entries; the others (old copies aside) are counted in `rejected` (collab.records.untrusted.Rejections) if
    given."""
    best = None
    for signer, blob in entries:
        candidate = None
        if isinstance(blob, (bytes, str)) and len(blob) <= max_bytes:
            try:
                candidate = model.model_validate_json(blob)
            except ValidationError:
                candidate = None
        if candidate is None or not candidate.valid_for(run_id, organizer_key):
            if rejected is not None:
                rejected.add(f"{model.__name__} not signed with the run's key", signer)
            continue
        if best is None or candidate.issued_at > best.issued_at:
            best = candidate
    return best


class AccessList:
    """A private run's members as one peer knows them: the valid invites it has seen, minus the revoked."""

    def __init__(self, run_id: str, organizer_key: str):
        self.run_id, self.organizer_key = run_id, organizer_key
        self.expires: dict[str, int] = {}  # peer id -> its invite's expiry
        self.revoked: frozenset[str] = frozenset()
        self.revocations: Optional[Revocations] = None

    def verdict(self, peer_id: str, now: Optional[float] = None) -> str:
        """'member', 'revoked', 'expired' or 'not invited'."""
        if peer_id in self.revoked:
            return "revoked"
        if peer_id not in self.expires:
            return "not invited"
        return "expired" if expired(self.expires[peer_id], now) else "member"

    def allows(self, peer_id: str) -> bool:
        return self.verdict(peer_id) == "member"

    def add_invite(self, invite_text, holder: Optional[str] = None) -> bool:
        """Count an invite from another peer's record (`holder`: who stored it; it may only store its own)."""
        if not isinstance(invite_text, str) or len(invite_text) > MAX_INVITE_CHARS:
            return False
        try:
            invite = read_invite(invite_text)
        except UserError:
            return False
        if (invite.run_id != self.run_id or invite.organizer_key != self.organizer_key
                or (holder is not None and holder != invite.peer_id)):
            return False
        self.expires[invite.peer_id] = max(invite.expires_at, self.expires.get(invite.peer_id, 0))
        return True

    def apply(self, revocations: Optional[Revocations]) -> bool:
        """Take a newer revocation list; True if it changed anything."""
        if revocations is None or (self.revocations is not None
                                   and revocations.issued_at <= self.revocations.issued_at):
            return False
        if not revocations.valid_for(self.run_id, self.organizer_key):
            return False
        self.revocations, self.revoked = revocations, frozenset(revocations.peer_ids)
        return True
