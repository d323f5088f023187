"""Invites and revocations of a private run: what each check accepts and refuses (no processes)."""

from __future__ import annotations

import time

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from collab.errors import UserError
from collab.records.identity import peer_id_of
from collab.run.access import AccessList, Revocations, make_invite, parse_duration, read_invite
from collab.run.gate import RunAuthorizer


@pytest.fixture(scope="module")
def keys():
    organizer, stranger, peer, other = (RSAPrivateKey() for _ in range(4))
    return dict(organizer=organizer, stranger=stranger, peer=peer, other=other)


def _peer_id(key) -> str:
    return peer_id_of(key.get_public_key())


def test_an_invite_holds_for_its_peer_and_run_until_it_expires(keys):
    invite = make_invite("run", _peer_id(keys["peer"]), keys["organizer"], lifetime=3600)
    text = invite.to_text()
    assert read_invite(text) == invite
    access = AccessList("run", keys["organizer"].get_public_key().to_bytes().decode())
    assert access.add_invite(text, holder=_peer_id(keys["peer"]))
    assert access.verdict(_peer_id(keys["peer"])) == "member"
    assert access.verdict(_peer_id(keys["other"])) == "not invited"
    # a member may store only its own invite; another run's invite or another organizer's counts for nothing
    assert not access.add_invite(text, holder=_peer_id(keys["other"]))
    assert not AccessList("other-run", access.organizer_key).add_invite(text)
    assert not AccessList("run", keys["stranger"].get_public_key().to_bytes().decode()).add_invite(text)
    # expiry, with a few minutes of clock skew tolerated
    assert access.verdict(_peer_id(keys["peer"]), now=invite.expires_at + 120) == "member"
    assert access.verdict(_peer_id(keys["peer"]), now=invite.expires_at + 600) == "expired"


def test_an_altered_or_forged_invite_is_refused(keys):
    invite = make_invite("run", _peer_id(keys["peer"]), keys["organizer"], lifetime=3600)
    longer = invite.model_copy(update=dict(expires_at=invite.expires_at + 10 ** 6)).to_text()
    with pytest.raises(UserError, match="--token has a bad signature: it was altered"):
        read_invite(longer)
    # a stranger signs an invite naming the organizer's key: the signature does not hold
    forged = make_invite("run", _peer_id(keys["other"]), keys["stranger"], lifetime=3600)
    forged = forged.model_copy(update=dict(organizer_key=invite.organizer_key)).to_text()
    with pytest.raises(UserError, match="bad signature"):
        read_invite(forged)
    with pytest.raises(UserError, match="is not a collab invite"):
        read_invite("hello")


def test_revocations_apply_only_when_signed_by_the_organizer_and_newer(keys):
    organizer_key = keys["organizer"].get_public_key().to_bytes().decode()
    access = AccessList("run", organizer_key)
    access.add_invite(make_invite("run", _peer_id(keys["peer"]), keys["organizer"], 3600).to_text())
    forged = Revocations(run_id="run", peer_ids=[_peer_id(keys["peer"])], issued_at=time.time()).signed(keys["stranger"])
    assert not access.apply(forged) and access.verdict(_peer_id(keys["peer"])) == "member"
    real = Revocations(run_id="run", peer_ids=[_peer_id(keys["peer"])], issued_at=time.time()).signed(keys["organizer"])
    assert access.apply(real) and access.verdict(_peer_id(keys["peer"])) == "revoked"
    older = Revocations(run_id="run", peer_ids=[], issued_at=real.issued_at - 1).signed(keys["organizer"])
    assert not access.apply(older) and access.verdict(_peer_id(keys["peer"])) == "revoked"
    tampered = real.model_copy(update=dict(peer_ids=[], issued_at=real.issued_at + 1))
    assert not access.apply(tampered)


def test_the_dht_authorizer_binds_the_invite_to_the_requests_key(keys):
    import asyncio

    peer_invite = make_invite("run", _peer_id(keys["peer"]), keys["organizer"], lifetime=3600)
    server = RunAuthorizer(keys["organizer"], make_invite("run", _peer_id(keys["organizer"]), keys["organizer"], 3600))
    token = asyncio.run(RunAuthorizer(keys["peer"], peer_invite).get_token())
    assert server.is_token_valid(token)
    # someone else presents that invite with their own key: the invite names another peer id
    stolen = asyncio.run(RunAuthorizer(keys["other"], peer_invite).get_token())
    assert not server.is_token_valid(stolen)
    # a self-made invite, and one stretched past its expiry
    own = asyncio.run(RunAuthorizer(keys["stranger"], make_invite("run", _peer_id(keys["stranger"]), keys["stranger"],
                                                                  3600)).get_token())
    assert not server.is_token_valid(own)
    token.expiration_time = str(int(token.expiration_time) + 10 ** 6)
    assert not server.is_token_valid(token)
    late = make_invite("run", _peer_id(keys["other"]), keys["organizer"], lifetime=-3600)
    assert not server.is_token_valid(asyncio.run(RunAuthorizer(keys["other"], late).get_token()))
    server.revoked = frozenset({_peer_id(keys["peer"])})
    assert not server.is_token_valid(asyncio.run(RunAuthorizer(keys["peer"], peer_invite).get_token()))
    assert server.refused == {"invite of another peer": 1, "not invited": 2, "expired": 1, "revoked": 1}


@pytest.mark.parametrize("text, seconds", [("30d", 30 * 86400), ("12h", 43200), ("90m", 5400), ("1.5s", 1.5)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "30", "-1d", "0d", "1w", "d"])
def test_bad_durations_name_the_flag(text):
    with pytest.raises(UserError, match="--expires .* is not a duration"):
        parse_duration(text)


def test_state_is_downloaded_from_members_only(keys):
    """hivemind picks donors from a DHT list that may still name a revoked peer; the averager skips non-members."""
    import asyncio

    from hivemind.p2p import PeerID

    from collab.averaging.members_only import MembersOnly
    from collab.hivemind_hooks.patches import donors_reached_through
    from collab.run.gate import MemberGate

    class Averager:
        @classmethod
        def get_stub(cls, p2p, peer, *, namespace=None):
            return ("stub", peer)

    class Gated(Averager, MembersOnly):
        pass

    averager = object.__new__(Gated)  # no averager process: only the choice of donors is exercised
    averager._parent_pid = -1  # (what hivemind's __del__ reads: not this process's averager)
    averager.gate = MemberGate("run", keys["organizer"].get_public_key().to_bytes().decode())
    averager.gate.access.add_invite(make_invite("run", _peer_id(keys["peer"]), keys["organizer"], 3600).to_text())
    member, stranger = (PeerID.from_base58(_peer_id(keys[name])) for name in ("peer", "other"))

    async def download(stub) -> list:
        return [part async for part in await stub.rpc_download_state(None)]

    # how hivemind's download reaches each donor while MembersOnly.download_state runs
    with donors_reached_through(averager, averager._donor_stub):
        assert averager.get_stub(None, member, namespace="x") == ("stub", member)
        assert asyncio.run(download(averager.get_stub(None, stranger, namespace="x"))) == []
    assert "get_stub" not in vars(averager)  # and afterwards, as before
