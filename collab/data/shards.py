"""Token shards: a corpus tokenized once into fixed-size files that every peer memory-maps.

A shard is one file: a 64-byte header, the flat token ids in the smallest unsigned type that holds the vocabulary
(uint16 up to 65,536 ids, else uint32), then the offsets at which documents start within the shard (uint64). A
document may run on into the next shard; its start is recorded once, where it begins. Tokens are read through
`numpy.memmap`, so a peer's memory does not grow with the corpus: the page cache holds what it reads.

Writing goes through `ShardWriter`, which fills shards of exactly `shard_tokens` tokens (the last one shorter) and
writes each atomically; the caller (collab.data.prepare) records after each shard where the next token comes from,
so an interrupted preparation resumes there. Reading goes through `Shard`, which checks the header against the
file's size: a truncated file is refused, not read short.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from collab.data.cache import write_atomically
from collab.data.paths import SHARD_LIST
from collab.errors import UserError

MAGIC = b"COLLABSH"
VERSION = 1
HEADER = struct.Struct("<8sIIQQ32x")  # magic, version, bytes per token, tokens, documents; 64 bytes
SUFFIX = ".shard"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer type that holds every id of a vocabulary of `vocab_size`."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@dataclass(frozen=True)
class ShardInfo:
    """What the manifest says of one shard: its file name, its token count and the sha256 of the whole file."""

    name: str
    tokens: int
    sha256: str


def shard_name(index: int) -> str:
    return f"{index:05d}{SUFFIX}"


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_shard(path: Path, tokens: np.ndarray, doc_starts: np.ndarray) -> ShardInfo:
    """Write one shard atomically (a reader never sees half a file) and describe it."""
    header = HEADER.pack(MAGIC, VERSION, tokens.dtype.itemsize, len(tokens), len(doc_starts))
    pad = (-(HEADER.size + tokens.nbytes)) % 8
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            for block in (header, tokens.tobytes(), b"\0" * pad, doc_starts.astype("<u8").tobytes()):
                f.write(block)
                digest.update(block)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep the run's data from its other readers
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return ShardInfo(name=path.name, tokens=len(tokens), sha256=digest.hexdigest())


class Shard:
    """One shard file, memory-mapped: `tokens` (uint16 or uint32) and `doc_starts` (uint64), read lazily."""

    def __init__(self, path: Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(HEADER.size)
        if len(head) < HEADER.size:
            raise ValueError(f"{self.path.name}: {size} bytes, shorter than a shard's header")
        magic, version, itemsize, tokens, docs = HEADER.unpack(head)
        if magic != MAGIC or version != VERSION or itemsize not in (2, 4):
            raise ValueError(f"{self.path.name}: not a collab token shard (version {VERSION})")
        tokens_end = HEADER.size + tokens * itemsize
        docs_at = tokens_end + (-tokens_end) % 8
        if size != docs_at + 8 * docs:
            raise ValueError(f"{self.path.name}: {size} bytes where its header says {docs_at + 8 * docs} "
                             "(truncated or corrupt)")
        dtype = np.dtype(np.uint16) if itemsize == 2 else np.dtype(np.uint32)
        self.tokens = np.memmap(self.path, dtype=dtype.newbyteorder("<"), mode="r", offset=HEADER.size,
                                shape=(tokens,)) if tokens else np.zeros(0, dtype)
        self.doc_starts = np.memmap(self.path, dtype="<u8", mode="r", offset=docs_at,
                                    shape=(docs,)) if docs else np.zeros(0, np.uint64)

    def __len__(self) -> int:
        return len(self.tokens)


class ShardWriter:
    """Documents in, shards of exactly `shard_tokens` tokens out (the last one shorter), in `folder`.

    `add(ids)` appends one document's ids (with whatever separator the caller put at its end) and returns the
    shards that filled up; `finish()` writes the last, partial one. `first_index` numbers the shards of a resumed
    preparation after those already written."""

    def __init__(self, folder: Path, vocab_size: int, shard_tokens: int, first_index: int = 0):
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens must be at least 1, got {shard_tokens}")
        self.folder, self.shard_tokens, self.index = Path(folder), shard_tokens, first_index
        self.folder.mkdir(parents=True, exist_ok=True)
        self.dtype = token_dtype(vocab_size)
        self.vocab_size = vocab_size
        self._buffer = np.empty(shard_tokens, self.dtype)
        self._filled = 0
        self._starts: list[int] = []

    def add(self, ids, starts_document: bool = True) -> list[ShardInfo]:
        ids = np.asarray(ids)
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"token ids outside the vocabulary of {self.vocab_size}")
        written, at = [], 0
        if starts_document and len(ids):
            self._starts.append(self._filled)
        while at < len(ids):
            take = min(len(ids) - at, self.shard_tokens - self._filled)
            self._buffer[self._filled:self._filled + take] = ids[at:at + take]
            self._filled += take
            at += take
            if self._filled == self.shard_tokens:
                written.append(self._flush())
        return written

    @property
    def filled(self) -> int:
        """Tokens waiting in the next shard (all from the documents added since the last shard was written)."""
        return self._filled

    def finish(self) -> Optional[ShardInfo]:
        return self._flush() if self._filled else None

    def _flush(self) -> ShardInfo:
        info = write_shard(self.folder / shard_name(self.index), self._buffer[:self._filled],
                           np.asarray(self._starts, dtype=np.uint64))
        self.index, self._filled, self._starts = self.index + 1, 0, []
        return info


def open_shards(folder: Path, infos: list[ShardInfo]) -> list[Shard]:
    """The shards a manifest lists, each found in `folder` and matching its listed token count."""
    shards = []
    for info in infos:
        path = Path(folder) / info.name
        if not path.is_file():
            raise UserError(f"shard {info.name} is missing from {folder}; prepare the data again with collab init")
        try:
            shard = Shard(path)
        except ValueError as e:
            raise UserError(f"{e}; prepare the data again with collab init") from None
        if len(shard) != info.tokens:
            raise UserError(f"shard {info.name} holds {len(shard)} tokens where the manifest says {info.tokens}; "
                            "prepare the data again with collab init")
        shards.append(shard)
    return shards


def write_shard_list(folder: Path, infos: list[ShardInfo]) -> None:
    """The list of a folder's shards, in order, as the manifest has it: what a reader of the folder goes by."""
    write_atomically(Path(folder) / SHARD_LIST, json.dumps({"shards": [asdict(i) for i in infos]}, indent=1).encode())
    os.chmod(Path(folder) / SHARD_LIST, 0o644)


def read_shard_list(folder: Path) -> list[ShardInfo]:
    path = Path(folder) / SHARD_LIST
    try:
        return [ShardInfo(name=str(s["name"]), tokens=int(s["tokens"]), sha256=str(s["sha256"]))
                for s in json.loads(path.read_text())["shards"]]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{path} is not a list of token shards; prepare the data again with collab init") from None
