"""A peer's disk cache of the run's token shards: each shard checked against the manifest's sha256 before it is kept,
kept within a byte budget (the least recently used go first), and a damaged file noticed and dropped.

The cache is a folder per corpus (named by the digest of its shard list), so two runs never mix their shards. A
shard is written atomically after its sha256 matched, so a file in the cache was whole once; a later truncation
(a full disk, a crash of another tool) shows as a size that does not match its header, and the shard is dropped
and fetched again. Use marks a shard recently used (its modification time), which orders eviction.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Iterable, Optional

from collab.data.shards import SUFFIX, Shard, ShardInfo, write_shard_list


class ShardRefused(Exception):
    """Bytes offered as a shard that are not the shard the manifest lists (wrong sha256)."""


class ShardCache:
    """Shards of one corpus in `folder`, at most `budget_bytes` of them (None: no bound)."""

    def __init__(self, folder: Path, infos: list[ShardInfo], budget_bytes: Optional[int] = None):
        self.folder, self.infos, self.budget = Path(folder), {i.name: i for i in infos}, budget_bytes
        self.folder.mkdir(parents=True, exist_ok=True)
        write_shard_list(self.folder, infos)  # a reader of the folder (collab.data.text) goes by this list

    def holds(self, name: str) -> bool:
        """Whether the shard is here and whole (a truncated or foreign file is dropped: fetch it again)."""
        path = self.folder / name
        if not path.is_file():
            return False
        try:
            checked = path.stat()
            whole = len(Shard(path)) == self.infos[name].tokens
        except FileNotFoundError:
            return False  # dropped meanwhile by another thread's check of the same damaged file
        except ValueError:
            whole = False
        if not whole:
            # only the file checked: the prefetching thread may have put a whole one in its place meanwhile (a CI
            # run dropped that one, and fetched the shard a third time)
            try:
                now = path.stat()
                if (now.st_ino, now.st_size, now.st_mtime_ns) == (checked.st_ino, checked.st_size, checked.st_mtime_ns):
                    path.unlink()
            except FileNotFoundError:
                pass
        return whole

    def held(self) -> list[str]:
        return [name for name in self.infos if self.holds(name)]

    def put(self, name: str, data: bytes, keep: Iterable[str] = ()) -> Path:
        """Keep `data` as shard `name` if its sha256 is the manifest's (else ShardRefused), then evict the least
        recently used shards beyond the budget, never one in `keep` (those about to be read)."""
        info = self.infos.get(name)
        if info is None:
            raise ShardRefused(f"{name} is not a shard of this run")
        if hashlib.sha256(data).hexdigest() != info.sha256:
            raise ShardRefused(f"{name} does not match the manifest's sha256")
        path = self.folder / name
        self.evict(keep={name, *keep}, incoming=len(data))  # room first: the cache never holds more than its budget
        tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        return path

    def used(self, name: str) -> None:
        """Mark a shard as just read: eviction takes the least recently used first."""
        now = time.time()
        try:
            os.utime(self.folder / name, (now, now))
        except FileNotFoundError:
            pass

    def evict(self, keep: Iterable[str] = (), incoming: int = 0) -> list[str]:
        """Delete the least recently used shards until the cache is within its budget with `incoming` bytes more;
        returns what went."""
        if self.budget is None:
            return []
        keep = set(keep)
        files = sorted((p for p in self.folder.glob(f"*{SUFFIX}") if p.name in self.infos),
                       key=lambda p: p.stat().st_mtime)
        total, gone = sum(p.stat().st_size for p in files), []
        for path in files:
            if total + incoming <= self.budget:
                break
            if path.name in keep:
                continue
            total -= path.stat().st_size
            path.unlink(missing_ok=True)
            gone.append(path.name)
        return gone
