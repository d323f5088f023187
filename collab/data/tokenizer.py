"""Tokenizers: the embedded one (BPE trained once on the embedded corpus) or a user's.

`spec` is "embedded", a path to a tokenizer.json, a local tokenizer folder, or a Hugging Face
hub name (real runs). ALBERT needs [CLS], [SEP], [MASK] and [PAD]; a tokenizer without them is
rejected with a clear message rather than failing deep inside the collator.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from collab.data.cache import cache_dir, write_atomically
from collab.data.corpus import corpus_fingerprint, embedded_corpus_path
from collab.data.paths import require_tokenizer_file
from collab.errors import UserError

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
MODEL_INPUT_NAMES = ["input_ids", "token_type_ids", "attention_mask"]


ALBERT_NEEDS = ("cls_token", "sep_token", "mask_token", "pad_token")


def load_tokenizer(spec: str, vocab_size: int, special_tokens: Optional[dict[str, str]] = None,
                   needs: tuple[str, ...] = ALBERT_NEEDS) -> PreTrainedTokenizerBase:
    """The run's tokenizer; `needs`: the special tokens the task cannot do without (ALBERT's by default)."""
    if spec == "embedded":
        tokenizer = _wrap(embedded_tokenizer_file(vocab_size))
    elif spec.endswith(".json"):
        require_tokenizer_file(spec)
        tokenizer = _wrap(Path(spec), special_tokens)
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(spec, model_input_names=MODEL_INPUT_NAMES)
        except (OSError, ValueError) as e:
            raise UserError(
                f"cannot load tokenizer '{spec}' ({str(e).splitlines()[0]}); pass --tokenizer embedded, "
                "a tokenizer.json, a local tokenizer folder or a reachable hub name"
            ) from None
    missing = [name for name in needs if getattr(tokenizer, name) is None]
    if missing:
        raise UserError(f"tokenizer '{spec}' lacks {', '.join(missing)}, which the task needs; pass a tokenizer that "
                        f"has them (--tokenizer)")
    if "mask_token" not in needs and tokenizer.eos_token is None and tokenizer.sep_token is None:
        raise UserError(f"tokenizer '{spec}' has no eos (or sep) token to end documents with; pass a tokenizer that "
                        "has one (--tokenizer)")
    if tokenizer.pad_token is None:  # a causal LM never pads (sequences are packed), but collators ask for one
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.sep_token
    return tokenizer


def embedded_tokenizer_file(vocab_size: int) -> Path:
    corpus = embedded_corpus_path()
    path = cache_dir() / f"tokenizer-bpe{vocab_size}-{corpus_fingerprint(corpus)}.json"
    if not path.is_file():
        write_atomically(path, _train_bpe(corpus, vocab_size).to_str().encode())
    return path


def _train_bpe(corpus: Path, vocab_size: int):
    # BPE trains in seconds on the ~1 MB corpus (Unigram, ALBERT's original choice, is 10-20x slower).
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(), pre_tokenizers.Punctuation()])
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2)
    tokenizer.train([str(corpus)], trainer)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    # the ALBERT layout, so that a saved checkpoint's tokenizer(a, b) produces what the model was trained on
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return tokenizer


def run_tokenizer_file(spec: str, vocab_size: int) -> tuple[Path, dict[str, str]]:
    """The run's tokenizer as one tokenizer.json every peer gets byte for byte (collab.run), and its special
    tokens: the embedded one or a tokenizer.json as they are; a folder or hub tokenizer exported to the cache."""
    if spec == "embedded" or spec.endswith(".json"):
        require_tokenizer_file(spec)
        path = embedded_tokenizer_file(vocab_size) if spec == "embedded" else Path(spec)
        return path, dict(DEFAULT_SPECIAL_TOKENS)
    tokenizer = load_tokenizer(spec, vocab_size)
    data = tokenizer.backend_tokenizer.to_str().encode()
    path = cache_dir() / f"tokenizer-{hashlib.sha256(data).hexdigest()[:16]}.json"
    if not path.is_file():
        write_atomically(path, data)
    return path, {name: getattr(tokenizer, name) for name in DEFAULT_SPECIAL_TOKENS}


# the embedded tokenizer's [SEP] also ends a document for a causal LM (its eos)
DEFAULT_SPECIAL_TOKENS = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                          "mask_token": "[MASK]", "eos_token": "[SEP]"}


def _wrap(file: Path, special_tokens: Optional[dict[str, str]] = None) -> PreTrainedTokenizerFast:
    # without model_input_names, transformers 5 returns no token_type_ids
    return PreTrainedTokenizerFast(tokenizer_file=str(file), model_input_names=MODEL_INPUT_NAMES,
                                   **(special_tokens or DEFAULT_SPECIAL_TOKENS))
