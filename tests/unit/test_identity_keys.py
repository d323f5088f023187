"""A peer's Ed25519 identity: its file, its peer id, the records it signs as hivemind checks them, beside RSA peers.

The real p2pd's agreement on the peer id is in tests/process/test_dht_records.py (a DHT started on such a file)."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.proto import crypto_pb2, dht_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from collab.errors import UserError
from collab.records.identity import (_serialized, hivemind_reads_ed25519, load_or_create_identity, peer_id_of,
                                    signer_peer_id)
from collab.records.keys import PREFIX, Ed25519PrivateKey
from collab.run.access import make_invite
from collab.run.gate import RunAuthorizer


@pytest.fixture(autouse=True, scope="module")
def either_kind():
    hivemind_reads_ed25519()  # as collab.swarm.node does before its DHT


def _record(validator: RSASignatureValidator, value: dict) -> DHTRecord:
    """A progress-like record as hivemind's DHT stores it: the owner's key in the subkey, the value signed."""
    unsigned = DHTRecord(key=b"run_progress", subkey=MSGPackSerializer.dumps(validator.local_public_key),
                         value=MSGPackSerializer.dumps(value), expiration_time=get_dht_time() + 30)
    return DHTRecord(unsigned.key, unsigned.subkey, validator.sign_value(unsigned), unsigned.expiration_time)


PROGRESS = dict(peer_id="x" * 52, epoch=12, samples_accumulated=480, samples_per_second=812.5,
                time=1796470000.25, client_mode=False)


def test_a_new_identity_is_ed25519_in_libp2ps_format_and_loads_again_as_itself(tmp_path):
    path = tmp_path / "peer.identity"
    made = load_or_create_identity(path)
    assert isinstance(made.key, Ed25519PrivateKey)
    message = crypto_pb2.PrivateKey.FromString(path.read_bytes())
    assert message.key_type == crypto_pb2.KeyType.Ed25519 and len(message.data) == 64  # seed, then public key
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    again = load_or_create_identity(path)
    assert again.peer_id == made.peer_id and again.peer_id.startswith("12D3KooW")  # libp2p's inlined Ed25519 ids
    assert again.key.get_public_key().to_bytes() == made.key.get_public_key().to_bytes()
    assert load_or_create_identity(None).peer_id != made.peer_id


def test_an_older_rsa_identity_file_still_loads_with_its_peer_id(tmp_path):
    rsa = RSAPrivateKey()
    path = tmp_path / "old.identity"
    path.write_bytes(_serialized(rsa))
    loaded = load_or_create_identity(path)
    assert loaded.peer_id == peer_id_of(rsa.get_public_key()) and loaded.peer_id.startswith("Qm")


def test_a_bad_identity_file_is_one_line_that_names_the_flag(tmp_path):
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"not a key")
    with pytest.raises(UserError, match="is not a peer identity file; pass another --identity path"):
        load_or_create_identity(garbage)
    key, other = Ed25519PrivateKey(), Ed25519PrivateKey()  # a seed with someone else's public key after it
    torn = tmp_path / "torn"
    torn.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519,
                                           data=key.raw() + other.get_public_key().raw()).SerializeToString())
    with pytest.raises(UserError, match="is not a peer identity file"):
        load_or_create_identity(torn)
    secp = tmp_path / "secp"
    secp.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Secp256k1, data=b"\1" * 32).SerializeToString())
    with pytest.raises(UserError, match="must be Ed25519 or RSA"):
        load_or_create_identity(secp)


def test_hivemind_checks_ed25519_records_beside_rsa_ones_and_refuses_altered_ones():
    ed, rsa = RSASignatureValidator(Ed25519PrivateKey()), RSASignatureValidator(RSAPrivateKey())
    reader = RSASignatureValidator(Ed25519PrivateKey())  # another peer's DHT: checks what it is sent
    for validator in (ed, rsa):
        record = _record(validator, PROGRESS)
        assert reader.validate(record)
        signature = record.value[record.value.index(b"[signature:"):]
        altered = MSGPackSerializer.dumps(dict(PROGRESS, samples_accumulated=10 ** 6)) + signature
        assert not reader.validate(DHTRecord(record.key, record.subkey, altered, record.expiration_time))
        assert not reader.validate(DHTRecord(record.key, record.subkey, record.value, record.expiration_time + 60))
    # one signer's value under another's key
    ed_record, rsa_record = _record(ed, PROGRESS), _record(rsa, PROGRESS)
    assert not reader.validate(DHTRecord(ed_record.key, rsa_record.subkey, ed_record.value, ed_record.expiration_time))
    stranger = RSASignatureValidator(Ed25519PrivateKey())
    assert not reader.validate(DHTRecord(ed_record.key, _record(stranger, PROGRESS).subkey, ed_record.value,
                                         ed_record.expiration_time))
    # and the reader attributes each record to its signer's own peer id
    assert signer_peer_id(ed_record.subkey) == peer_id_of(ed._private_key.get_public_key())
    assert signer_peer_id(rsa_record.subkey) == peer_id_of(rsa._private_key.get_public_key())
    assert signer_peer_id(MSGPackSerializer.dumps(b"[owner:" + PREFIX + b"AAAA]")) is None  # a key too short


def test_an_ed25519_record_is_about_a_third_of_an_rsa_one():
    ed = _record(RSASignatureValidator(Ed25519PrivateKey()), PROGRESS)
    rsa = _record(RSASignatureValidator(RSAPrivateKey()), PROGRESS)
    size = {name: len(r.subkey) + len(r.value) for name, r in (("ed25519", ed), ("rsa", rsa))}
    assert size["ed25519"] < 0.45 * size["rsa"], size


def test_a_private_runs_requests_signed_by_ed25519_keys_pass_hiveminds_checks():
    organizer, member, thief = RSAPrivateKey(), Ed25519PrivateKey(), Ed25519PrivateKey()
    server_key = Ed25519PrivateKey()

    def invite(key):
        return make_invite("run", peer_id_of(key.get_public_key()), organizer, lifetime=3600)

    server = RunAuthorizer(server_key, invite(server_key))
    client = RunAuthorizer(member, invite(member))

    async def exchange(client, alter: bool = False) -> bool:
        request = dht_pb2.PingRequest()
        await client.sign_request(request, server.local_public_key)
        if alter:  # its body changed after signing
            request.validate = not request.validate
        return await server.validate_request(request)

    assert asyncio.run(exchange(client))
    assert not asyncio.run(exchange(client, alter=True))  # hivemind's check of the Ed25519 signature refuses it
    stolen = asyncio.run(RunAuthorizer(thief, invite(member)).get_token())  # a member's invite, another's key
    assert not server.is_token_valid(stolen)
    assert server.refused == {"invite of another peer": 1}
