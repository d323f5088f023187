"""The organizer's run folder (`collab init`): signing key, config, tokenizer, signed manifest.

    RUN_ID/organizer.key   the organizer's RSA key (mode 0600): whoever holds it defines the run
    RUN_ID/config.yaml     the config the manifest was made from
    RUN_ID/tokenizer.json  the run's tokenizer (trained at init for `embedded`)
    RUN_ID/manifest.json   the signed manifest every peer checks against the key's fingerprint
    RUN_ID/data/           (with --dataset) the corpus as token shards, which the manifest lists with their sha256
    RUN_ID/revoked.json    (private runs) the signed list of peer ids whose invites were revoked
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from collab.data.paths import SHARD_LIST
from collab.errors import UserError
from collab.records.identity import rsa_key_from_der
from collab.run.manifest import (DataManifest, Manifest, ShardEntry, SignedManifest, make_manifest, run_tokenizer, sign,
                                 verify)

# hivemind (with torch) is imported inside the functions that make a key, and numpy and tokenizers inside
# prepare_data: the command modules import this module, so 'collab --help' would wait for them

KEY, CONFIG, TOKENIZER, MANIFEST = "organizer.key", "config.yaml", "tokenizer.json", "manifest.json"
DATA = "data"
EMBEDDED_SHARD_TOKENS = 1 << 16  # the embedded corpus (about 450k tokens) in a few shards, fetched in well under a second
SHARD_TOKENS = 1 << 24  # tokens per shard: 32 MiB of uint16 ids, a few seconds to fetch on a home uplink
REVOKED = "revoked.json"  # written by 'collab revoke'; the organizer's peer publishes it


@dataclass
class Run:
    """A run as its organizer (or the first peer of a quick-start run) holds it."""

    manifest: Manifest
    signed: bytes
    organizer_key: object  # hivemind RSAPrivateKey
    tokenizer_file: Optional[Path]
    folder: Optional[Path] = None  # None: made on the fly by a first peer, for this run only
    shards_folder: Optional[Path] = None  # where its token shards are, if the manifest lists any

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint


def ephemeral_run(run_id: str, config, private: bool = False) -> Run:
    """A first peer started without `collab init`: a key and a manifest made now, for this run only. On the embedded
    corpus, the run's data is that corpus as token shards (made once per machine and tokenizer), which volunteers
    fetch from the swarm as they would a real run's: the quick start takes the same path."""
    from hivemind.utils.crypto import RSAPrivateKey

    key = RSAPrivateKey()
    tokenizer = run_tokenizer(config)
    data = embedded_shards(config, tokenizer) if tokenizer is not None else None
    manifest = make_manifest(run_id, config, key, private, data[0] if data else None)
    return Run(manifest, sign(manifest, key).to_bytes(), key, tokenizer[0] if tokenizer else None,
               shards_folder=data[1] if data else None)


def embedded_shards(config, tokenizer: tuple[Path, dict]) -> Optional[tuple[DataManifest, Path]]:
    """The embedded corpus as the run's token shards, in this machine's cache, when the run reads it (and not when
    each peer brings its own --dataset)."""
    if config.task.data.dataset != "embedded":
        return None
    from collab.data.cache import cache_dir
    from collab.data.shards import file_sha256, read_shard_list

    end = _end_token(config, tokenizer[1])
    folder = cache_dir() / "shards" / f"embedded-{file_sha256(tokenizer[0])[:16]}-{end or 'plain'}"
    if (folder / SHARD_LIST).is_file():  # written last: the preparation finished
        infos = read_shard_list(folder)
        return DataManifest(shard_tokens=EMBEDDED_SHARD_TOKENS, total_tokens=sum(i.tokens for i in infos),
                            separator=_token_id(tokenizer[0], end),
                            shards=[ShardEntry(name=i.name, tokens=i.tokens, sha256=i.sha256) for i in infos]), folder
    return prepare_data("embedded", tokenizer[0], folder, EMBEDDED_SHARD_TOKENS, end_token=end), folder


def create_run_folder(run_id: str, config_path: Path, config, folder: Path, private: bool,
                      dataset: Optional[str] = None, shard_tokens: int = SHARD_TOKENS, progress=None,
                      shards_url: Optional[str] = None) -> Run:
    """Make the run's folder. With `dataset`, tokenize it into the folder's token shards first (`progress(bytes,
    tokens)` after each batch); an init interrupted while doing so resumes when run again on the same folder."""
    from hivemind.utils.crypto import RSAPrivateKey

    interrupted = (folder / KEY).is_file() and (folder / DATA).is_dir() and not (folder / MANIFEST).exists()
    if folder.exists() and any(folder.iterdir()) and not (interrupted and dataset is not None):
        raise UserError(f"{folder} already exists and is not empty; pick another --dir, or remove it to start over "
                        "(its organizer.key is the run's identity: keep a copy)")
    folder.mkdir(parents=True, exist_ok=True)
    key_path = folder / KEY
    if interrupted:
        key = rsa_key_from_der(key_path.read_bytes())
    else:
        key = RSAPrivateKey()
        key_path.touch(mode=0o600)
        key_path.write_bytes(key.to_bytes())
    shutil.copyfile(config_path, folder / CONFIG)
    tokenizer = run_tokenizer(config)
    if tokenizer is not None:
        shutil.copyfile(tokenizer[0], folder / TOKENIZER)
    data = None
    if dataset is not None:
        if tokenizer is None:
            raise UserError(f"task {config.task.name} reads no text: --dataset prepares a text task's corpus; "
                            "leave it out, or set the task's data.dataset in the config")
        data = prepare_data(dataset, folder / TOKENIZER, folder / DATA, shard_tokens, progress,
                            _end_token(config, tokenizer[1]))
        data.url = shards_url
    manifest = make_manifest(run_id, config, key, private, data)
    signed = sign(manifest, key).to_bytes()
    (folder / MANIFEST).write_bytes(signed)
    return Run(manifest, signed, key, folder / TOKENIZER if tokenizer else None, folder,
               folder / DATA if data is not None else None)


def prepare_data(dataset: str, tokenizer_file: Path, out: Path, shard_tokens: int, progress=None,
                 end_token: Optional[str] = None) -> DataManifest:
    """The corpus as token shards in `out`, each document followed by `end_token` if given, and what the manifest
    says of them."""
    # numpy and tokenizers: only when a corpus is prepared, not for `collab --help` (which imports this module)
    from collab.data.prepare import prepare_corpus
    from collab.data.shards import write_shard_list

    separator = _token_id(tokenizer_file, end_token)
    prepared = prepare_corpus(dataset, tokenizer_file, out, shard_tokens, separator=separator, progress=progress)
    write_shard_list(out, prepared.shards)  # what the organizer's own peer reads the folder by
    return DataManifest(shard_tokens=shard_tokens, total_tokens=prepared.total_tokens, separator=separator,
                        shards=[ShardEntry(name=s.name, tokens=s.tokens, sha256=s.sha256) for s in prepared.shards])


def _end_token(config, special_tokens: dict) -> Optional[str]:
    """A causal LM learns where a document ends: in its shards each is followed by the end-of-text token."""
    if config.task.name != "causal-lm":
        return None
    return special_tokens.get("eos_token") or special_tokens.get("sep_token")


def _token_id(tokenizer_file: Path, token: Optional[str]) -> Optional[int]:
    if token is None:
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_file)).token_to_id(token)


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
    return Run(manifest, signed, key, tokenizer, folder, folder / DATA if manifest.data is not None else None)
