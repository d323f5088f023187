"""Who a peer is: one RSA key that is both its libp2p identity (its peer id) and the key that signs its records.

hivemind signs DHT records with an RSA key named in each record's subkey ("[owner:ssh-rsa ...]"), and
libp2p derives a peer id from its own key. When the two keys are different, a record's `peer_id`
field is only what the sender wrote: a fresh key could claim another peer's id and take over its row
on the dashboard. With one key, a reader recomputes the peer id from the signer's public key and
ignores a record that claims any other (`signer_peer_id`).
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
    key: "object"  # hivemind.utils.crypto.RSAPrivateKey
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
    """The key in `path` (hivemind's identity format, created if missing), or a new one for this run only."""
    from hivemind.utils.crypto import RSAPrivateKey

    if path is not None and Path(path).is_file():
        key = _read_identity(Path(path))
        return Identity(key, peer_id_of(key.get_public_key()), Path(path))
    key = RSAPrivateKey()
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_serialized(key))
        path.chmod(0o600)
    return Identity(key, peer_id_of(key.get_public_key()), path)


def _serialized(key) -> bytes:
    from hivemind.proto import crypto_pb2

    return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString()


def _read_identity(path: Path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from hivemind.proto import crypto_pb2

    try:
        message = crypto_pb2.PrivateKey.FromString(path.read_bytes())
        private = serialization.load_der_private_key(message.data, password=None)
    except Exception:
        raise UserError(f"{path} is not a peer identity file; pass another --identity path (a new one is "
                        "created if the file does not exist)") from None
    if message.key_type != crypto_pb2.KeyType.RSA or not isinstance(private, rsa.RSAPrivateKey):
        raise UserError(f"{path} holds a non-RSA key; collab signs records with the identity key, which must be "
                        "RSA: pass a new --identity path")
    return wrap_rsa_key(private)


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
    """The libp2p peer id (base58) of an RSA public key (hivemind's RSAPublicKey), as libp2p computes it."""
    from cryptography.hazmat.primitives import serialization
    from hivemind.p2p import PeerID
    from hivemind.proto import crypto_pb2
    from multihash import coerce_code, encode

    der = public_key._public_key.public_bytes(encoding=serialization.Encoding.DER,
                                              format=serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(encode(hashlib.sha256(encoded).digest(), coerce_code("sha2-256"))).to_base58()


def signer_peer_id(subkey) -> Optional[str]:
    """The peer id of the key that signed a DHT record, from the record's subkey; None if it names no key."""
    from hivemind.utils.crypto import RSAPublicKey

    if not isinstance(subkey, bytes):
        return None
    found = _OWNER.findall(subkey)
    if len(found) != 1:
        return None
    try:
        return peer_id_of(RSAPublicKey.from_bytes(found[0]))
    except Exception:
        return None
