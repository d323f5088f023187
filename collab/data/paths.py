"""Local data paths, checked without torch: a --dataset or --tokenizer that does not exist fails at once, not
after the seconds that importing torch and transformers take."""

from __future__ import annotations

from pathlib import Path

from collab.errors import UserError

HF_PREFIX = "hf:"
SHARDS_PREFIX = "shards:"  # a folder of token shards and their list (collab.data.shards), as `collab init` made it
SHARD_LIST = "shards.json"


def dataset_parts(spec: str, what: str) -> list[Path]:
    """The local files and folders of a comma-separated --dataset (none for `embedded` or hf:NAME), each of
    which must exist; `what` names the files a part may be ("text files", "image files")."""
    if spec == "embedded" or spec.startswith(HF_PREFIX):
        return []
    if spec.startswith(SHARDS_PREFIX):
        folder = Path(spec[len(SHARDS_PREFIX):]).expanduser()
        if not (folder / SHARD_LIST).is_file():
            raise UserError(f"{folder} holds no {SHARD_LIST}: it is not a folder of token shards; prepare one with "
                            "'collab init RUN --dataset PATH'")
        return []
    parts = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        path = Path(part).expanduser()
        if not path.exists():
            raise UserError(f"dataset path {part} does not exist; pass --dataset embedded, {what} or folders, "
                            "or hf:NAME")
        parts.append(path)
    return parts


TEXT_SUFFIXES = (".txt", ".md", ".text")  # what a folder's text files are called


def dataset_files(spec: str, suffixes: tuple[str, ...], what: str) -> list[Path]:
    """The files of a comma-separated --dataset whose names end in `suffixes` (folders searched, sorted), or one line
    naming what the dataset should hold (`what`)."""
    files: list[Path] = []
    for path in dataset_parts(spec, what):
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes))
        else:
            files.append(path)
    if not files:
        raise UserError(f"dataset '{spec}' holds no {what}; point --dataset at them")
    return files


def require_tokenizer_file(spec: str) -> None:
    """A --tokenizer that names a tokenizer.json must be a file (a folder or hub name is checked on loading)."""
    if spec.endswith(".json") and not Path(spec).is_file():
        raise UserError(f"tokenizer file {spec} does not exist; pass an existing tokenizer.json with --tokenizer")
