"""Text sources and the sentence-order windows ALBERT trains on.

A source is the embedded corpus, local text files (a file, a folder of *.txt, or several,
comma-separated), `hf:NAME` for a Hugging Face dataset (streamed; a local dataset folder
works too), or `shards:FOLDER`, the run's token shards as `collab init --dataset` prepared them.
Small sources are tokenized once into one tensor and sampled at random offsets; hub datasets are
streamed and shuffled through a buffer; shards are memory-mapped and read in the order
collab.data.order gives this peer. Each peer draws with its own seed, so no two peers see the data
in the same order.
"""

from __future__ import annotations

import hashlib
import io
import random
from pathlib import Path
from typing import Iterator, Optional

import torch
from transformers import PreTrainedTokenizerBase

from collab.data import stream_hf_dataset
from collab.data.cache import cache_dir, write_atomically
from collab.data.corpus import corpus_fingerprint, embedded_corpus_path
from collab.data.feed import ShardFeed
from collab.data.order import start_for_peer
from collab.data.paths import HF_PREFIX, SHARDS_PREFIX, TEXT_SUFFIXES, dataset_files, dataset_parts
from collab.errors import UserError


def local_text_files(spec: str) -> list[Path]:
    if spec == "embedded":
        return [embedded_corpus_path()]
    return dataset_files(spec, TEXT_SUFFIXES, ".txt or .md files")


def tokenize_files(files: list[Path], tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """All files as one 1-D tensor of token ids (paragraph boundaries are simply concatenated)."""
    key = hashlib.sha1(_tokenizer_fingerprint(tokenizer))
    for file in files:
        key.update(str(file.resolve()).encode())
        key.update(corpus_fingerprint(file).encode())
    cached = cache_dir() / f"tokens-{key.hexdigest()[:16]}.pt"
    if cached.is_file():
        return torch.load(cached)
    paragraphs = [p for file in files for p in file.read_text(encoding="utf-8", errors="replace").split("\n\n") if p.strip()]
    ids: list[int] = []
    for start in range(0, len(paragraphs), 1000):
        for row in tokenizer(paragraphs[start : start + 1000], add_special_tokens=False)["input_ids"]:
            ids.extend(row)
    tokens = torch.tensor(ids, dtype=torch.int32)
    buffer = io.BytesIO()
    torch.save(tokens, buffer)
    write_atomically(cached, buffer.getvalue())
    return tokens


def _tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> bytes:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.to_str().encode()
    return repr(sorted(tokenizer.get_vocab().items())).encode()


def random_windows(tokens: torch.Tensor, length: int, seed: int) -> Iterator[torch.Tensor]:
    if len(tokens) <= length:
        raise UserError(f"the dataset has only {len(tokens)} tokens, fewer than one sequence ({length}); add text")
    rng = random.Random(seed)
    while True:
        start = rng.randrange(0, len(tokens) - length)
        yield tokens[start : start + length].long()


def streamed_windows(name: str, tokenizer: PreTrainedTokenizerBase, length: int, seed: int,
                     text_column: str = "text", buffer_size: int = 10_000) -> Iterator[torch.Tensor]:
    """Windows from a Hugging Face dataset, streamed: a real run's corpus does not fit in memory."""
    dataset = stream_hf_dataset(name)
    columns = list(dataset.features or {})
    if columns and text_column not in columns:
        raise UserError(f"dataset '{name}' has no '{text_column}' column (columns: {', '.join(columns)}); "
                        "pass a text dataset with --dataset hf:NAME")
    epoch = 0
    pending: list[int] = []
    while True:
        windows = 0
        for row in dataset.shuffle(seed=seed + epoch, buffer_size=buffer_size):
            text: Optional[str] = row.get(text_column)
            if not isinstance(text, str) or not text:
                continue
            pending.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
            while len(pending) >= length:
                windows += 1
                yield torch.tensor(pending[:length], dtype=torch.long)
                del pending[:length]
        if windows == 0:  # a whole pass gave nothing: another would not either (an empty or text-less dataset)
            raise UserError(f"dataset '{name}' has no text in its '{text_column}' column, not even one sequence of "
                            f"{length} tokens; pass a dataset with text (--dataset hf:NAME)")
        epoch += 1


def shard_windows(folder: Path, length: int, seed: int) -> Iterator[torch.Tensor]:
    """Windows of the token shards in `folder`, in the order of a peer whose own seed is `seed` (the ring of shards is
    the same for every peer of the run; `seed` sets where this peer enters it). A peer of a run reads through the
    ShardFeed its trainer made (collab.data.feed), which also fetches and resumes."""
    feed = ShardFeed.from_folder(folder, 0.0)
    feed.start = start_for_peer(feed.seed, str(seed))
    return feed.windows(length)


def token_windows(spec: str, tokenizer: PreTrainedTokenizerBase, length: int, seed: int,
                  feed: Optional[ShardFeed] = None) -> Iterator[torch.Tensor]:
    """Windows of `length` tokens from the dataset `spec`, or from the run's shards through `feed` when given."""
    if feed is not None:
        return feed.windows(length)
    if spec.startswith(SHARDS_PREFIX):
        dataset_parts(spec, "token shards")  # the folder and its list exist
        return shard_windows(Path(spec[len(SHARDS_PREFIX):]).expanduser(), length, seed)
    if spec.startswith(HF_PREFIX):
        return streamed_windows(spec[len(HF_PREFIX):], tokenizer, length, seed)
    return random_windows(tokenize_files(local_text_files(spec), tokenizer), length, seed)


def sentence_order_example(window: torch.Tensor, cls_id: int, sep_id: int, rng: random.Random) -> dict:
    """[CLS] A [SEP] B [SEP] from one window; half the time A and B are swapped (label 1).

    ALBERT's sentence-order prediction: both segments are consecutive text, so the only signal
    is their order, unlike BERT's next-sentence task that a topic shift gives away.
    """
    n = len(window)
    cut = rng.randint(n // 4, 3 * n // 4)
    first, second = window[:cut], window[cut:]
    swapped = rng.random() < 0.5
    if swapped:
        first, second = second, first
    cls, sep = torch.tensor([cls_id]), torch.tensor([sep_id])
    input_ids = torch.cat([cls, first, sep, second, sep])
    token_type_ids = torch.cat([torch.zeros(len(first) + 2, dtype=torch.long), torch.ones(len(second) + 1, dtype=torch.long)])
    return {
        "input_ids": input_ids,
        "token_type_ids": token_type_ids,
        "attention_mask": torch.ones_like(input_ids),
        "sentence_order_label": torch.tensor(int(swapped)),
    }
