"""The organizer's run folder (`collab init`): signing key, config, tokenizer, signed manifest.

    RUN_ID/organizer.key   the organizer's RSA key (mode 0600): whoever holds it defines the run
    RUN_ID/config.yaml     the config the manifest was made from
    RUN_ID/tokenizer.json  the run's tokenizer (trained at init for `embedded`)
    RUN_ID/manifest.json   the signed manifest every peer checks against the key's fingerprint
    RUN_ID/revoked.json    (private runs) the signed list of peer ids whose invites were revoked
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from collab.errors import UserError
from collab.records.identity import rsa_key_from_der
from collab.run.manifest import Manifest, SignedManifest, make_manifest, run_tokenizer, sign, verify

KEY, CONFIG, TOKENIZER, MANIFEST = "organizer.key", "config.yaml", "tokenizer.json", "manifest.json"
REVOKED = "revoked.json"  # written by 'collab revoke'; the organizer's peer publishes it


@dataclass
class Run:
    """A run as its organizer (or the first peer of a quick-start run) holds it."""

    manifest: Manifest
    signed: bytes
    organizer_key: object  # hivemind RSAPrivateKey
    tokenizer_file: Optional[Path]
    folder: Optional[Path] = None  # None: made on the fly by a first peer, for this run only

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint


def ephemeral_run(run_id: str, config, private: bool = False) -> Run:
    """A first peer started without `collab init`: a key and a manifest made now, for this run only."""
    from hivemind.utils.crypto import RSAPrivateKey

    key = RSAPrivateKey()
    manifest = make_manifest(run_id, config, key, private)
    tokenizer = run_tokenizer(config)
    return Run(manifest, sign(manifest, key).to_bytes(), key, tokenizer[0] if tokenizer else None)


def create_run_folder(run_id: str, config_path: Path, config, folder: Path, private: bool) -> Run:
    from hivemind.utils.crypto import RSAPrivateKey

    if folder.exists() and any(folder.iterdir()):
        raise UserError(f"{folder} already exists and is not empty; pick another --dir, or remove it to start over "
                        "(its organizer.key is the run's identity: keep a copy)")
    folder.mkdir(parents=True, exist_ok=True)
    key = RSAPrivateKey()
    key_path = folder / KEY
    key_path.touch(mode=0o600)
    key_path.write_bytes(key.to_bytes())
    shutil.copyfile(config_path, folder / CONFIG)
    tokenizer = run_tokenizer(config)
    if tokenizer is not None:
        shutil.copyfile(tokenizer[0], folder / TOKENIZER)
    manifest = make_manifest(run_id, config, key, private)
    signed = sign(manifest, key).to_bytes()
    (folder / MANIFEST).write_bytes(signed)
    return Run(manifest, signed, key, folder / TOKENIZER if tokenizer else None, folder)


def load_run_folder(folder: Path) -> Run:
    if not (folder / MANIFEST).is_file() or not (folder / KEY).is_file():
        raise UserError(f"{folder} is not a run folder (no {MANIFEST} or {KEY}); make one with "
                        "'collab init RUN_ID', or pass the folder it printed with --run")

    try:
        key = rsa_key_from_der((folder / KEY).read_bytes())
    except (ValueError, TypeError):
        raise UserError(f"{folder / KEY} is not a valid organizer key; restore it from your copy") from None
    signed = (folder / MANIFEST).read_bytes()
    try:
        run_id = Manifest.model_validate_json(SignedManifest.model_validate_json(signed).manifest).run_id
    except Exception:
        raise UserError(f"{folder / MANIFEST} is malformed; restore it, or make a new run with 'collab init'") from None
    manifest = verify(signed, run_id, None)
    if manifest.organizer_key != key.get_public_key().to_bytes().decode():
        raise UserError(f"{folder / MANIFEST} was not signed by {folder / KEY}; the folder was mixed up with "
                        "another run's")
    tokenizer = folder / TOKENIZER if manifest.tokenizer_sha256 else None
    if tokenizer is not None and not tokenizer.is_file():
        raise UserError(f"{tokenizer} is missing; restore it from your copy of the run folder")
    if tokenizer is not None and hashlib.sha256(tokenizer.read_bytes()).hexdigest() != manifest.tokenizer_sha256:
        raise UserError(f"{tokenizer} is not the tokenizer the manifest was signed with (it changed after "
                        "'collab init'); restore it, or make a new run")
    return Run(manifest, signed, key, tokenizer, folder)
