"""Who a peer is: one key that is both its libp2p identity (its peer id) and the key that signs its records.

hivemind signs DHT records with the key named in each record's subkey ("[owner:KEY]"), and libp2p derives a peer
id from its own key. When the two keys are different, a record's `peer_id` field is only what the sender wrote: a
fresh key could claim another peer's id and take over its row on the dashboard. With one key, a reader recomputes
the peer id from the signer's public key and ignores a record that claims any other (`signer_peer_id`).

A new identity is an Ed25519 key (collab.records.keys: a record a third of its RSA size); an identity file made
before 2026-12-05 holds an RSA key, which still works, in a swarm of either kind.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from collab.errors import UserError

# hivemind (with torch), cryptography and multihash are imported inside the functions that use them: the command
# modules import this module (through collab.run.credentials and collab.run.folder), so 'collab --help' does

_OWNER = re.compile(rb"\[owner:(.+?)\]")  # hivemind.dht.crypto.RSASignatureValidator's marker


@dataclass
class Identity:
    key: "object"  # collab.records.keys.Ed25519PrivateKey, or hivemind's RSAPrivateKey (an older identity file)
    peer_id: str  # base58, as libp2p derives it from `key`
    path: Optional[Path] = None  # the identity file (--identity); None: this key lives for this run only

    @contextmanager
    def file_for_p2pd(self) -> Iterator[Path]:
        """A path p2pd can read the key from: the identity file, or a private temporary one removed after."""
        if self.path is not None:
            yield self.path
            return
        fd, name = tempfile.mkstemp(prefix="collab-identity-")  # mode 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_serialized(self.key))
            yield Path(name)
        finally:
            Path(name).unlink(missing_ok=True)


def load_or_create_identity(path: Optional[Path]) -> Identity:
    """The key in `path` (libp2p's private key format, created if missing), or a new one for this run only."""
    from collab.records.keys import Ed25519PrivateKey

    if path is not None and Path(path).is_file():
        key = _read_identity(Path(path))
        return Identity(key, peer_id_of(key.get_public_key()), Path(path))
    key = Ed25519PrivateKey()
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_serialized(key))
        path.chmod(0o600)
    return Identity(key, peer_id_of(key.get_public_key()), path)


def _serialized(key) -> bytes:
    """libp2p's PrivateKey message, which p2pd reads (-id): an Ed25519 key as its seed and public key, 64 bytes."""
    from hivemind.proto import crypto_pb2

    from collab.records.keys import Ed25519PrivateKey

    if isinstance(key, Ed25519PrivateKey):
        pair = key.raw() + key.get_public_key().raw()
        message = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=pair)
    else:
        message = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes())
    return message.SerializeToString()


def _read_identity(path: Path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from hivemind.proto import crypto_pb2

    not_one = UserError(f"{path} is not a peer identity file; pass another --identity path (a new one is created "
                        "if the file does not exist)")
    try:
        message = crypto_pb2.PrivateKey.FromString(path.read_bytes())
    except Exception:
        raise not_one from None
    if message.key_type not in (crypto_pb2.KeyType.Ed25519, crypto_pb2.KeyType.RSA):
        raise UserError(f"{path} holds a {crypto_pb2.KeyType.Name(message.key_type)} key; collab signs records with "
                        "the identity key, which must be Ed25519 or RSA: pass a new --identity path")
    try:
        if message.key_type == crypto_pb2.KeyType.Ed25519:
            return _ed25519_key(message.data)
        private = serialization.load_der_private_key(message.data, password=None)
        if not isinstance(private, rsa.RSAPrivateKey):
            raise ValueError("not an RSA key")
    except Exception:
        raise not_one from None
    return wrap_rsa_key(private)


def _ed25519_key(data: bytes):
    """The key of an Ed25519 identity file's data (libp2p's: the seed, then the public key); ValueError if torn."""
    from collab.records.keys import Ed25519PrivateKey

    key = Ed25519PrivateKey.from_raw(data[:32])
    if len(data) != 64 or key.get_public_key().raw() != data[32:]:
        raise ValueError("the seed and the public key do not match")
    return key


def rsa_key_from_der(data: bytes):
    """hivemind's RSAPrivateKey from DER bytes (RSAPrivateKey.to_bytes()); ValueError if they hold none."""
    from cryptography.hazmat.primitives import serialization

    return wrap_rsa_key(serialization.load_der_private_key(data, password=None))


def wrap_rsa_key(private):
    """hivemind's RSAPrivateKey around a `cryptography` RSA key (hivemind has no constructor that takes one)."""
    from hivemind.utils.crypto import RSAPrivateKey

    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = private
    return key


def peer_id_of(public_key) -> str:
    """The libp2p peer id (base58) of a public key (Ed25519, or hivemind's RSAPublicKey), as libp2p computes it: a
    key's protobuf encoding, inlined when it is short (Ed25519's: the "identity" multihash), else its sha2-256."""
    from cryptography.hazmat.primitives import serialization
    from hivemind.p2p import PeerID
    from hivemind.proto import crypto_pb2
    from multihash import coerce_code, encode

    from collab.records.keys import Ed25519PublicKey

    if isinstance(public_key, Ed25519PublicKey):
        encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.Ed25519, data=public_key.raw()).SerializeToString()
        return PeerID(bytes([0x00, len(encoded)]) + encoded).to_base58()  # 0x00: the identity multihash
    der = public_key._public_key.public_bytes(encoding=serialization.Encoding.DER,
                                              format=serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(encode(hashlib.sha256(encoded).digest(), coerce_code("sha2-256"))).to_base58()


def hivemind_reads_ed25519() -> None:
    """hivemind's readers of public keys (record signatures, access tokens) and of identity files (P2P.create) read
    Ed25519 ones too (collab.hivemind_hooks.patches). In every process that starts a DHT, before it does."""
    from collab.hivemind_hooks.patches import identities_also_read_by, public_keys_also_read_by
    from collab.records.keys import PREFIX, Ed25519PublicKey

    public_keys_also_read_by(PREFIX, Ed25519PublicKey.from_bytes)
    identities_also_read_by(peer_id_of_ed25519_file)


def peer_id_of_ed25519_file(data: bytes) -> Optional[str]:
    """The peer id of an Ed25519 identity file's bytes; None for any other (hivemind reads RSA ones itself)."""
    from hivemind.proto import crypto_pb2

    try:
        message = crypto_pb2.PrivateKey.FromString(data)
        if message.key_type != crypto_pb2.KeyType.Ed25519:
            return None
        return peer_id_of(_ed25519_key(message.data).get_public_key())
    except Exception:
        return None


def signer_peer_id(subkey) -> Optional[str]:
    """The peer id of the key that signed a DHT record, from the record's subkey; None if it names no key."""
    from collab.records.keys import public_key_from_bytes

    if not isinstance(subkey, bytes):
        return None
    found = _OWNER.findall(subkey)
    if len(found) != 1:
        return None
    try:
        return peer_id_of(public_key_from_bytes(found[0]))
    except Exception:
        return None
