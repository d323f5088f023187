"""The embedded default corpus: English prose that ships with every Python installation.

It is assembled from the docstrings of the standard library (read with `ast`, nothing is
imported) and from `pydoc_data.topics` (the language reference's topic texts). Both are part
of CPython and are distributed under the PSF License Agreement. Nothing is downloaded and no
third-party text is copied into this repository; the corpus is built at first use (a few
seconds) and cached.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import re
import sys
import sysconfig
from collections import deque
from pathlib import Path

from collab.data.cache import cache_dir, write_atomically

_MIN_PARAGRAPH_CHARS = 80
_WORDY = re.compile(r"[A-Za-z]{2,}")


def embedded_corpus_path() -> Path:
    """Path of the cached corpus file, building it if needed."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    path = cache_dir() / f"corpus-python{version}-docs.txt"
    if not path.is_file():
        write_atomically(path, "\n\n".join(_paragraphs()).encode())
    return path


def corpus_fingerprint(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()[:12]


def _paragraphs():
    seen: set[str] = set()
    for text in _stdlib_docstrings():
        for paragraph in _split(text):
            if paragraph not in seen:
                seen.add(paragraph)
                yield paragraph
    try:
        from pydoc_data.topics import topics  # large, and read only while the corpus is built
    except ImportError:  # some minimal builds strip pydoc_data
        topics = {}
    for name in sorted(topics):
        for paragraph in _split(topics[name]):
            if paragraph not in seen:
                seen.add(paragraph)
                yield paragraph


def _stdlib_docstrings():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for file in sorted(stdlib.rglob("*.py")):
        parts = set(file.relative_to(stdlib).parts)
        if parts & {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}:
            continue
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node in _statements(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    yield inspect.cleandoc(doc)


_BODIES = {"body", "orelse", "finalbody", "handlers", "cases"}  # the fields that hold statements


def _statements(tree: ast.AST):
    """ast.walk's nodes in ast.walk's order, less expressions: a docstring belongs to a statement, and statements
    sit only in other statements' bodies, so the walk skips the expressions (three quarters of the time it took)."""
    todo = deque([tree])
    while todo:
        node = todo.popleft()
        for field in node._fields:
            if field in _BODIES:
                todo.extend(child for child in getattr(node, field, ()) if isinstance(child, ast.AST))
        yield node


def _split(text: str):
    """Prose paragraphs only: code samples, tables and signatures carry little English."""
    for block in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in block.splitlines()]
        if any(line.startswith((">>>", "...", "$ ")) for line in lines):
            continue
        paragraph = " ".join(line for line in lines if line)
        if len(paragraph) < _MIN_PARAGRAPH_CHARS:
            continue
        letters = sum(len(word) for word in _WORDY.findall(paragraph))
        if letters < 0.6 * len(paragraph):
            continue
        yield paragraph
