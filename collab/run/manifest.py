"""A run's manifest: everything that makes peers train the same model, signed by the run's organizer.

Peers that disagree on the model, the tokenizer or the math cannot train together, and hivemind
only compares tensor shapes: two tokenizers with the same vocabulary size (the embedded one built
under another Python's standard library) train on, garbled. So a run is defined by a manifest: the
run id, the whole run-wide config, the tokenizer's sha256, the collab version, the model-init seed,
when it was made and whether the run is private, signed with the organizer's key. A volunteer's
join line carries that key's fingerprint (`--run-key`); its peer fetches the manifest from the swarm,
checks the signature, and takes model, tokenizer and math from it. What is truly per peer
(`PER_PEER`) stays local.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from collab import __version__
from collab.config import FIELD_TO_FLAG, RunConfig, describe_validation_error
from collab.data.paths import SHARDS_PREFIX
from collab.errors import UserError

FORMAT = 1
# a peer's own business: what it computes on and where it keeps its files. The manifest's values are the
# organizer's suggestion; a peer's flags or config file override them. Everything else is the run's.
PER_PEER = ("training.micro_batch_size", "training.device", "training.precision", "training.compile",
            "training.data_workers", "training.devices", "task.data.dataset", "averaging.bandwidth", "checkpoint.dir",
            "checkpoint.every_epochs", "checkpoint.keep")
NOT_SHARED = ("checkpoint.dir",)  # a path on the organizer's machine
TOKENIZER_FIELD = "task.data.tokenizer"  # the run's tokenizer is a file every peer gets from the swarm
DATASET_FIELD = "task.data.dataset"  # per peer, unless the manifest lists the run's token shards


class ShardEntry(BaseModel):
    """One token shard of the run's corpus (collab.data.shards): peers fetch it by name and check its sha256."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[0-9]{5}\.shard$")
    tokens: int = Field(ge=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class DataManifest(BaseModel):
    """The run's corpus as prepared by `collab init --dataset`: its shards, in order, and how they were cut."""

    model_config = ConfigDict(extra="forbid")

    shard_tokens: int = Field(ge=1)  # every shard holds this many tokens, the last one up to it
    total_tokens: int = Field(ge=1)
    separator: Optional[int] = Field(None, ge=0)  # the id after each document, if any
    url: Optional[str] = Field(None, pattern=r"^https?://[^\s]+/$", max_length=2048)  # where the shards also live
    shards: list[ShardEntry] = Field(min_length=1)


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: int = FORMAT
    run_id: str
    config: dict  # RunConfig.model_dump(mode="json") without NOT_SHARED
    tokenizer_sha256: Optional[str] = Field(None, pattern=r"^[0-9a-f]{64}$")  # None: the task has no tokenizer
    tokenizer_special_tokens: Optional[dict[str, str]] = None
    collab_version: str
    seed: int  # the model-initialisation seed (training.seed), so every peer starts from the same weights
    created_at: float
    private: bool = False
    organizer_key: str  # the organizer's RSA public key, OpenSSH format
    data: Optional[DataManifest] = None  # None: each peer reads the task's dataset itself

    def canonical(self) -> bytes:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.organizer_key.encode())


class SignedManifest(BaseModel):
    """The manifest as it travels and is stored: its canonical bytes and the organizer's signature of them."""

    model_config = ConfigDict(extra="forbid")

    manifest: str
    signature: str  # base64

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()


def fingerprint(openssh_public_key: bytes) -> str:
    """What a join line carries (`--run-key`): 32 hex digits of the sha256 of the organizer's public key."""
    return hashlib.sha256(openssh_public_key.strip()).hexdigest()[:32]


def sign(manifest: Manifest, organizer_key) -> SignedManifest:
    data = manifest.canonical()
    return SignedManifest(manifest=data.decode(), signature=base64.b64encode(organizer_key.sign(data)).decode())


def verify(blob: bytes, run_id: str, run_key: Optional[str]) -> Manifest:
    """The manifest in `blob` if its signature holds and it is `run_id`'s (and `run_key`'s, if given); else a
    UserError that says which check failed."""
    from hivemind.utils.crypto import RSAPublicKey  # heavy (hivemind, torch): command modules import this module

    try:
        signed = SignedManifest.model_validate_json(blob)
        manifest = Manifest.model_validate_json(signed.manifest)
        public_key = RSAPublicKey.from_bytes(manifest.organizer_key.encode())
        signature = base64.b64decode(signed.signature, validate=True)
    except (ValidationError, ValueError, TypeError):
        raise UserError("the run's manifest is malformed; ask the organizer for a current join line") from None
    if manifest.format != FORMAT:
        raise UserError(f"the run's manifest has format {manifest.format}, this collab ({__version__}) reads "
                        f"format {FORMAT}; install the collab version the run uses ({manifest.collab_version})")
    if run_key is not None and manifest.fingerprint != run_key:
        raise UserError(f"the run's manifest is signed by key {manifest.fingerprint}, not --run-key {run_key}; "
                        "check the join line (or someone is impersonating the organizer)")
    if not public_key.verify(signed.manifest.encode(), signature):
        raise UserError(f"the run's manifest has a bad signature (key {manifest.fingerprint}): it was altered; "
                        "ask the organizer for a current join line")
    if manifest.run_id != run_id:
        raise UserError(f"the manifest is for run {manifest.run_id!r}, not --run-id {run_id!r}; check the join line")
    return manifest


def run_tokenizer(config: RunConfig) -> Optional[tuple[Path, dict[str, str]]]:
    """The run's tokenizer file and special tokens, for a task that has a tokenizer."""
    data = getattr(config.task, "data", None)
    if getattr(data, "tokenizer", None) is None:
        return None
    from collab.data.tokenizer import run_tokenizer_file  # transformers: `collab status` reads manifests without it

    return run_tokenizer_file(data.tokenizer, data.vocab_size)


def make_manifest(run_id: str, config: RunConfig, organizer_key, private: bool = False,
                  data: Optional[DataManifest] = None) -> Manifest:
    tokenizer = run_tokenizer(config)
    shared = run_wide(config)
    if shared["averaging"]["aggregation"] == "auto":  # an open run admits anyone: its averaging must be robust
        shared["averaging"]["aggregation"] = "mean" if private else "centered_clip"
    return Manifest(
        run_id=run_id,
        config=shared,
        tokenizer_sha256=hashlib.sha256(tokenizer[0].read_bytes()).hexdigest() if tokenizer else None,
        tokenizer_special_tokens=tokenizer[1] if tokenizer else None,
        collab_version=__version__,
        seed=config.training.seed,
        created_at=time.time(),
        private=private,
        organizer_key=organizer_key.get_public_key().to_bytes().decode(),
        data=data,
    )


def run_wide(config: RunConfig) -> dict:
    data = config.model_dump(mode="json")
    for dotted in NOT_SHARED:
        _pop(data, dotted)
    return data


def config_for_peer(manifest: Manifest, user_settings: dict, tokenizer_file: Optional[Path],
                    shards: Optional[Path] = None) -> RunConfig:
    """The manifest's config, with the PER_PEER settings this peer's user gave, the run's tokenizer file and, for a
    run whose corpus the manifest lists, the folder of its token shards (`shards`) as the dataset.
    (Anything else the user gave must agree with the manifest: `contradictions`.)"""
    data = json.loads(json.dumps(manifest.config))
    for dotted in PER_PEER:
        value = _get(user_settings, dotted)
        if value is not _MISSING and _has_parent(data, dotted):
            _put(data, dotted, value)
    if tokenizer_file is not None:
        _put(data, TOKENIZER_FIELD, str(tokenizer_file))
        _put(data, "task.data.special_tokens", manifest.tokenizer_special_tokens)
    if shards is not None:
        _put(data, DATASET_FIELD, f"{SHARDS_PREFIX}{shards}")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise UserError(f"the run's manifest holds a config this collab cannot use ({describe_validation_error(e)});"
                        f" install the collab version the run uses ({manifest.collab_version})") from None


HF_DATASETS = "https://huggingface.co/datasets/"


def shards_url(spec: str) -> str:
    """Where `collab init --shards-url` says the shards also live: a URL prefix, or hf:REPO for a hub dataset repo."""
    if spec.startswith("hf:"):
        return f"{HF_DATASETS}{spec[3:].strip('/')}/resolve/main/"
    if not spec.startswith(("http://", "https://")) or any(c.isspace() for c in spec):
        raise UserError(f"--shards-url {spec!r} is neither an http(s):// URL prefix nor hf:REPO; pass where the "
                        "shards' files can be downloaded from")
    return spec if spec.endswith("/") else spec + "/"


def user_value(user_settings: dict, dotted: str) -> Any:
    """What the user's config file or flags set `dotted` to (check user_sets first)."""
    return _get(user_settings, dotted)


def user_sets(user_settings: dict, dotted: str) -> bool:
    """Whether the user's config file or flags set `dotted` (a dotted key such as task.data.dataset)."""
    return _get(user_settings, dotted) is not _MISSING


def contradictions(manifest: Manifest, local_raw: dict, source: Optional[str]) -> list[str]:
    """One line per run-wide setting the user gave (`local_raw`: their config file's keys, flags applied) that
    differs from the manifest's. `source`: where the file came from (None: there was none, only flags)."""
    found = []
    for dotted, value in _leaves(local_raw):
        theirs = _get(manifest.config, dotted)
        if dotted in PER_PEER or theirs == value:
            continue
        if dotted == "training.target_batch_size" and value == "auto" and \
                _get(manifest.config, "training.auto_target.enabled") is True:
            continue  # a manifest stores auto as its starting target and auto_target.enabled
        shown = "(not set)" if theirs is _MISSING else json.dumps(theirs)
        flag = FIELD_TO_FLAG.get(dotted)
        if source is None:  # no config file: it came from a flag
            found.append(f"{flag} {value} differs from the run's manifest ({dotted} = {shown})")
        else:
            found.append(f"{dotted} is {json.dumps(value)} in {source}{f' or {flag}' if flag else ''}, "
                         f"but the run's manifest says {shown}")
    return found


_MISSING = object()


def _leaves(data: dict, prefix: str = ""):
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _leaves(value, dotted + ".")
        else:
            yield dotted, value


def _get(data: dict, dotted: str) -> Any:
    node: Any = data
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return _MISSING
        node = node[key]
    return node


def _has_parent(data: dict, dotted: str) -> bool:
    parent = dotted.rpartition(".")[0]
    return isinstance(_get(data, parent), dict)


def _put(data: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def _pop(data: dict, dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for key in parents:
        node = node.get(key)
        if not isinstance(node, dict):
            return
    node.pop(leaf, None)
