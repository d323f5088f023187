"""Prepare a corpus once: read its documents, tokenize them with the run's tokenizer, and write token shards
(collab.data.shards) with a record of where to resume.

Sources: text files or folders of them (.txt, .md, .text: a document per paragraph, paragraphs separated by a
blank line), JSON Lines (.jsonl: a document per line, its `text` field), Parquet (.parquet: its `text` column),
`hf:NAME` (a Hugging Face dataset, streamed) and `embedded` (the offline default corpus). Files are read as
streams, never whole. The tokenizer is a `tokenizers` fast tokenizer, whose batch encoding runs on every core.

After each shard, `prepare-state.json` in the output folder records the shards written and the document (and
token within it) the next shard starts at; a preparation interrupted and run again with the same sources and
tokenizer resumes there. Anything else in the state (another source, another tokenizer, another shard size) starts
over.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
from tokenizers import Tokenizer

from collab.data import stream_hf_dataset
from collab.data.cache import write_atomically
from collab.data.corpus import embedded_corpus_path
from collab.data.paths import HF_PREFIX, TEXT_SUFFIXES, dataset_files
from collab.data.shards import ShardInfo, ShardWriter, file_sha256
from collab.errors import UserError

STATE_NAME = "prepare-state.json"
BATCH_DOCUMENTS = 1024  # documents per call of the tokenizer's batch encoding (its threads share each batch)
POOL_FROM_BYTES = 32e6  # a corpus this large is tokenized by a process per core (starting them takes seconds)
MAX_UNKNOWN = 0.05  # a tokenizer that maps more of the data than this to its unknown token does not cover it


@dataclass
class PreparedCorpus:
    shards: list[ShardInfo]
    total_tokens: int
    bytes_read: int  # bytes of text tokenized in this call (a resumed preparation skips what was done)
    seconds: float

    @property
    def megabytes_per_second(self) -> float:
        return self.bytes_read / 1e6 / max(self.seconds, 1e-9)


def source_files(spec: str) -> list[Path]:
    """The files of a comma-separated --dataset (text, .jsonl or .parquet; folders searched), sorted."""
    if spec == "embedded":
        return [embedded_corpus_path()]
    return dataset_files(spec, (*TEXT_SUFFIXES, ".jsonl", ".parquet"), ".txt, .md, .jsonl or .parquet files")


def _paragraphs(path: Path) -> Iterator[str]:
    lines: list[str] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                lines.append(line)
            elif lines:
                yield "".join(lines).strip()
                lines = []
    if lines:
        yield "".join(lines).strip()


def _json_lines(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line).get(field)
            except (ValueError, AttributeError):
                raise UserError(f"{path}:{number} is not a JSON object; a .jsonl dataset holds one per line") from None
            if isinstance(text, str) and text.strip():
                yield text


def _parquet_rows(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq  # optional (collab[hf]): only .parquet sources need it
    except ImportError:
        raise UserError("reading .parquet needs pyarrow; pip install 'collab[hf]'") from None
    table = pq.ParquetFile(path)
    if field not in table.schema_arrow.names:
        raise UserError(f"{path} has no '{field}' column (columns: {', '.join(table.schema_arrow.names)}); "
                        "pass a text dataset")
    for batch in table.iter_batches(columns=[field], batch_size=BATCH_DOCUMENTS):
        yield from (text for text in batch.column(0).to_pylist() if isinstance(text, str) and text.strip())


def documents(spec: str, field: str = "text") -> Iterator[str]:
    """Every document of a --dataset, in a fixed order (files sorted, rows as stored)."""
    if spec.startswith(HF_PREFIX):
        for row in stream_hf_dataset(spec[len(HF_PREFIX):]):
            text = row.get(field)
            if isinstance(text, str) and text.strip():
                yield text
        return
    for path in source_files(spec):
        if path.suffix == ".jsonl":
            yield from _json_lines(path, field)
        elif path.suffix == ".parquet":
            yield from _parquet_rows(path, field)
        else:
            yield from _paragraphs(path)


def source_fingerprint(spec: str) -> dict:
    """What must be unchanged for a preparation to resume: each file's path, size and modification time."""
    if spec.startswith(HF_PREFIX):
        return {"dataset": spec}
    return {"files": [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in source_files(spec)]}


def _batches(texts: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def prepare_corpus(spec: str, tokenizer_file: Path, out: Path, shard_tokens: int, separator: Optional[int] = None,
                   field: str = "text", progress: Optional[Callable[[int, int], None]] = None) -> PreparedCorpus:
    """Tokenize every document of `spec` into shards of `shard_tokens` tokens in `out`, each document followed by
    `separator` when one is given (a causal LM's end-of-text id). `progress(bytes, tokens)` is called as the
    reading starts (0, 0) and after each batch. Resumes an interrupted preparation of the same source and tokenizer."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    unknown_token = getattr(tokenizer.model, "unk_token", None)
    unknown_id = tokenizer.token_to_id(unknown_token) if unknown_token else None
    out.mkdir(parents=True, exist_ok=True)
    key = {"source": source_fingerprint(spec), "tokenizer": file_sha256(tokenizer_file), "field": field,
           "shard_tokens": shard_tokens, "separator": separator}
    state_path = out / STATE_NAME
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    if state.get("key") != key or state.get("done"):
        state = {"key": key, "shards": [], "next_document": 0, "skip_tokens": 0, "done": False}
    shards = [ShardInfo(**s) for s in state["shards"]]
    writer = ShardWriter(out, vocab, shard_tokens, first_index=len(shards))
    started, read, tokens_seen, unknown = time.monotonic(), 0, 0, 0  # unknown: ids read as the unknown token
    first, skip = state["next_document"], state["skip_tokens"]

    def save(next_document: int, skip_tokens: int, done: bool = False) -> None:
        state.update(shards=[asdict(s) for s in shards], next_document=next_document, skip_tokens=skip_tokens,
                     done=done)
        write_atomically(state_path, json.dumps(state, indent=1).encode())

    def pending() -> Iterator[tuple[int, list[str]]]:  # (index of its first document, batch) from `first` on
        index = 0
        for batch in _batches(documents(spec, field), BATCH_DOCUMENTS):
            if index + len(batch) > first:  # done before the interruption: not even tokenized again
                yield index, batch
            index += len(batch)

    index = first
    if progress is not None:
        progress(0, 0)
    for index, batch, encoded, batch_unknown in _encoded(pending(), tokenizer_file, _workers(spec), unknown_id):
        if unknown_id is not None:  # judged before anything of the batch is written: nothing half-done is left
            unknown += batch_unknown
            _check_coverage(spec, unknown_token, unknown, tokens_seen + sum(map(len, encoded)))
        for text, ids in zip(batch, encoded):
            if index < first:
                index += 1
                continue
            if separator is not None:
                ids = np.append(ids, separator)
            offset = skip if index == first else 0
            written = writer.add(ids[offset:], starts_document=offset == 0)
            if written:
                shards.extend(written)
                save(index, len(ids) - writer.filled)  # what this document still has in the writer's buffer
            read += len(text.encode("utf-8"))
            tokens_seen += len(ids) - offset
            index += 1
        if progress is not None:
            progress(read, tokens_seen)
    last = writer.finish()
    if last is not None:
        shards.append(last)
    if not shards:
        raise UserError(f"dataset '{spec}' holds no text; point --dataset at text, .jsonl or .parquet files")
    save(index, 0, done=True)
    return PreparedCorpus(shards, sum(s.tokens for s in shards), read, time.monotonic() - started)


def _workers(spec: str) -> int:
    """Processes that tokenize: one per core for a corpus worth starting them for (a hub dataset's size is unknown)."""
    if spec.startswith(HF_PREFIX):
        return max(1, os.cpu_count() or 1)
    size = sum(p.stat().st_size for p in source_files(spec))
    return max(1, os.cpu_count() or 1) if size >= POOL_FROM_BYTES else 1


_worker_tokenizer = None


def _start_worker(tokenizer_file: str) -> None:
    global _worker_tokenizer
    os.environ["RAYON_NUM_THREADS"] = os.environ["RAYON_RS_NUM_CPUS"] = "1"  # one process per core already
    _worker_tokenizer = Tokenizer.from_file(tokenizer_file)


def _encode(tokenizer, batch: list[str], unknown_id: Optional[int]) -> tuple[np.ndarray, np.ndarray, int]:
    """A batch's ids as one flat array and each document's length (cheap to send between processes), and how many
    are the unknown token's."""
    # the batch encoding without offsets (tokenizers >= 0.20): a sixth faster than encode_batch, the same ids
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    rows = [e.ids for e in encode(batch, add_special_tokens=False)]
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
    return flat, lengths, int((flat == unknown_id).sum()) if unknown_id is not None else 0


def _encode_in_worker(batch: list[str], unknown_id: Optional[int]):
    return _encode(_worker_tokenizer, batch, unknown_id)


def _encoded(pending: Iterator[tuple[int, list[str]]], tokenizer_file: Path, workers: int,
             unknown_id: Optional[int]) -> Iterator[tuple[int, list[str], list[np.ndarray], int]]:
    """(index, batch, each document's ids, unknown ids) for every pending batch, in order: encoded here, or by
    `workers` processes (at most two batches each in flight, so memory stays bounded)."""
    def split(flat: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
        return np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else []

    if workers <= 1:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        for index, batch in pending:
            flat, lengths, unknown = _encode(tokenizer, batch, unknown_id)
            yield index, batch, split(flat, lengths), unknown
        return
    context = multiprocessing.get_context("spawn")  # not fork: a forked tokenizer's threads could hang
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                             initargs=(str(tokenizer_file),)) as pool:
        in_flight: deque = deque()
        for index, batch in pending:
            in_flight.append((index, batch, pool.submit(_encode_in_worker, batch, unknown_id)))
            if len(in_flight) >= 2 * workers:
                index, batch, future = in_flight.popleft()
                flat, lengths, unknown = future.result()
                yield index, batch, split(flat, lengths), unknown
        while in_flight:
            index, batch, future = in_flight.popleft()
            flat, lengths, unknown = future.result()
            yield index, batch, split(flat, lengths), unknown


def _check_coverage(spec: str, unknown_token: Optional[str], unknown: int, seen: int) -> None:
    if seen and unknown / seen > MAX_UNKNOWN:
        raise UserError(f"the run's tokenizer reads {unknown / seen:.0%} of dataset '{spec}' as {unknown_token}: it "
                        "does not cover this text; set task.tokenizer to a tokenizer trained on it")
