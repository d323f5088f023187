"""Ed25519 keys in the shape of hivemind's RSA keys: a peer's identity, its libp2p key and its records' signer.

Every progress and metrics record names its signer's public key in its subkey ("[owner:KEY]") and carries a
signature. With RSA-2048 those two were ~750 of a record's ~880 bytes, and every read of the progress key brings
back every peer's record from each node it asks: at N peers, N x 880 bytes a node, several times a second near an
epoch's end. An Ed25519 public key here is 52 bytes ("ed25519:" and the raw key in base64) and a signature 88
(base64 of 64 bytes), so a progress record is about a third of its RSA size (296 against 877 bytes). On the
developers' machine a signature takes 32 us against 250 (a peer signs each progress store) and a new key 0.2 ms
against 43; a check takes 103 us against 23, mostly answered from memory (collab.records.verdicts).

hivemind knows only RSA: `hivemind.utils.crypto.RSAPublicKey.from_bytes` reads every key its signature validator
and its access tokens name, and PeerID.from_identity every identity file P2P.create checks; the two patches in
collab.hivemind_hooks.patches, installed by collab.records.identity.hivemind_reads_ed25519 (Swarm calls it), make
them read this kind as well, so a swarm may mix peers whose identity files hold either kind (files made
before 2026-12-05 hold RSA keys).
"""

from __future__ import annotations

import base64
import binascii

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

PREFIX = b"ed25519:"  # no "]" can follow in base64: hivemind's "[owner:KEY]" marker stays unambiguous
_RAW = dict(encoding=serialization.Encoding.Raw, format=serialization.PublicFormat.Raw)


class Ed25519PublicKey:
    """hivemind.utils.crypto.PublicKey's interface: verify(data, base64 signature), to_bytes, from_bytes."""

    def __init__(self, key: ed25519.Ed25519PublicKey):
        self._key = key

    def verify(self, data: bytes, signature: bytes) -> bool:
        try:
            self._key.verify(base64.b64decode(signature, validate=True), data)
            return True
        except (ValueError, TypeError, binascii.Error, InvalidSignature):
            return False

    def raw(self) -> bytes:
        return self._key.public_bytes(**_RAW)

    def to_bytes(self) -> bytes:
        return PREFIX + base64.b64encode(self.raw())

    @classmethod
    def from_bytes(cls, key: bytes) -> "Ed25519PublicKey":
        if not isinstance(key, bytes) or not key.startswith(PREFIX):
            raise ValueError("not an Ed25519 public key")
        raw = base64.b64decode(key[len(PREFIX):], validate=True)
        if len(raw) != 32:
            raise ValueError(f"an Ed25519 public key is 32 bytes, not {len(raw)}")
        return cls(ed25519.Ed25519PublicKey.from_public_bytes(raw))


class Ed25519PrivateKey:
    """hivemind.utils.crypto.PrivateKey's interface (sign -> base64 signature, get_public_key); picklable, as
    hivemind sends its validators to the DHT's process."""

    def __init__(self, key: ed25519.Ed25519PrivateKey = None):
        self._key = key if key is not None else ed25519.Ed25519PrivateKey.generate()

    def sign(self, data: bytes) -> bytes:
        return base64.b64encode(self._key.sign(data))

    def get_public_key(self) -> Ed25519PublicKey:
        return Ed25519PublicKey(self._key.public_key())

    def raw(self) -> bytes:
        """The 32-byte seed (libp2p stores it followed by the public key)."""
        return self._key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                       serialization.NoEncryption())

    to_bytes = raw  # as hivemind's RSAPrivateKey.to_bytes: the private key's own bytes (a peer's seeds hash them)

    @classmethod
    def from_raw(cls, seed: bytes) -> "Ed25519PrivateKey":
        return cls(ed25519.Ed25519PrivateKey.from_private_bytes(seed))

    def __getstate__(self):
        return {"seed": self.raw()}

    def __setstate__(self, state):
        self._key = ed25519.Ed25519PrivateKey.from_private_bytes(state["seed"])


def public_key_from_bytes(key: bytes):
    """Either kind of public key from the bytes a record's owner marker or an access token holds (hivemind's
    RSAPublicKey for an OpenSSH "ssh-rsa ..." key); ValueError if they hold neither."""
    if isinstance(key, bytes) and key.startswith(PREFIX):
        return Ed25519PublicKey.from_bytes(key)
    from hivemind.utils.crypto import RSAPublicKey

    return RSAPublicKey.from_bytes(key)
