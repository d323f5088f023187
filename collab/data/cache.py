"""Where collab keeps what it builds once per machine (embedded corpus, tokenizer, token ids)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """$COLLAB_CACHE_DIR, else $XDG_CACHE_HOME/collab, else ~/.cache/collab."""
    root = os.environ.get("COLLAB_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "collab")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_atomically(path: Path, data: bytes) -> None:
    """Several peers on one machine may build the same cache file at once: last rename wins, none sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
