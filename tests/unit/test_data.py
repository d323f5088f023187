"""Data: the embedded corpus and tokenizer, sentence-order examples, local and Hugging Face sources."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from collab.config import load_config
from collab.data.corpus import embedded_corpus_path
from collab.data.text import local_text_files, sentence_order_example, token_windows
from collab.data.tokenizer import embedded_tokenizer_file, load_tokenizer
from collab.errors import UserError
from collab.tasks import build_task

VOCAB = 1000


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("embedded", VOCAB)


def test_embedded_corpus_is_english_prose():
    text = embedded_corpus_path().read_text()
    assert len(text) > 500_000  # about 1.3 MB on CPython 3.11
    words = text.split()
    common = sum(w.lower() in {"the", "of", "and", "to", "is", "a"} for w in words)
    assert common / len(words) > 0.1  # English prose, not code


def test_the_corpus_walk_finds_every_docstring_ast_walk_finds_in_its_order():
    # the corpus is built from the docstrings the walk finds, in its order: the same bytes as ast.walk gave, so a
    # cached tokenizer (named by the corpus's hash) stays valid
    import ast
    import sysconfig

    from collab.data.corpus import _statements

    source = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text() + \
        '\nif x:\n    try:\n        pass\n    except E:\n        def f():\n            """in a handler"""\n' \
        '    finally:\n        class C:\n            """in a finally"""\n' \
        'match y:\n    case 1:\n        async def g():\n            """in a case"""\n'
    tree = ast.parse(source)
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    expected = [node for node in ast.walk(tree) if isinstance(node, kinds)]
    assert [node for node in _statements(tree) if isinstance(node, kinds)] == expected
    assert len(expected) > 100 and {"in a handler", "in a finally", "in a case"} <= {
        ast.get_docstring(node) for node in expected}


def test_embedded_tokenizer_has_albert_specials_and_round_trips(tokenizer):
    assert len(tokenizer) == VOCAB
    encoded = tokenizer("Return the number of items.", "Raise an error.")
    tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"])
    assert tokens[0] == "[CLS]" and tokens.count("[SEP]") == 2
    assert set(encoded["token_type_ids"]) == {0, 1}
    assert tokenizer.decode(encoded["input_ids"], skip_special_tokens=True).startswith("return the number")
    assert embedded_tokenizer_file(VOCAB) == embedded_tokenizer_file(VOCAB)  # cached, not retrained


def test_sentence_order_example_swaps_half_the_time():
    window = torch.arange(100, 160)
    rng = random.Random(0)
    examples = [sentence_order_example(window, 2, 3, rng) for _ in range(400)]
    swapped = sum(int(e["sentence_order_label"]) for e in examples)
    assert 150 < swapped < 250
    for e in examples[:20]:
        ids = e["input_ids"].tolist()
        assert ids[0] == 2 and ids[-1] == 3 and ids.count(3) == 2 and len(ids) == 63
        sep = ids.index(3)
        first, second = ids[1:sep], ids[sep + 1:-1]
        # the two segments are the window cut in two, in order or swapped
        assert first + second == list(range(100, 160)) or second + first == list(range(100, 160))
        assert e["token_type_ids"].tolist() == [0] * (sep + 1) + [1] * (len(ids) - sep - 1)


def test_task_batches_are_masked_and_differ_by_seed(micro_config):
    task = build_task(load_config(micro_config))
    a, b = next(task.batches(8, seed=1)), next(task.batches(8, seed=2))
    assert a["input_ids"].shape == (8, 64)
    assert set(a) == {"input_ids", "token_type_ids", "attention_mask", "sentence_order_label", "labels"}
    masked = (a["labels"] != -100).float().mean().item()
    assert 0.05 < masked < 0.3  # ~15% of tokens are prediction targets
    assert not torch.equal(a["input_ids"], b["input_ids"])  # each peer its own order
    again = next(task.batches(8, seed=1))
    assert torch.equal(a["input_ids"], again["input_ids"])  # and reproducible
    loss = task.loss(a)
    assert torch.isfinite(loss) and 4 < loss.item() < 12  # ~ln(1000) MLM + ln(2) SOP at init


def test_local_text_files_dataset(tmp_path, tokenizer):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    (corpus / "b.md").write_text("pack my box with five dozen liquor jugs. " * 200)
    (corpus / "ignored.bin").write_bytes(b"\x00\x01")
    assert [p.name for p in local_text_files(str(corpus))] == ["a.txt", "b.md"]
    window = next(token_windows(str(corpus), tokenizer, 32, seed=0))
    text = tokenizer.decode(window)
    assert "fox" in text or "jugs" in text or "dozen" in text or "lazy" in text
    with pytest.raises(UserError, match="does not exist"):
        local_text_files(str(tmp_path / "nope"))
    with pytest.raises(UserError, match="holds no .txt or .md files; point --dataset at them"):
        (tmp_path / "empty").mkdir()
        local_text_files(str(tmp_path / "empty"))


def test_hugging_face_dataset_path_on_local_files(tmp_path, tokenizer):
    """The hf: path is the one real runs use (streaming load_dataset); here it reads a local dataset folder."""
    data = tmp_path / "hfdata"
    data.mkdir()
    (data / "train.txt").write_text("\n".join(f"line {i} says the sky is blue and the grass is green." for i in range(300)))
    windows = token_windows(f"hf:{data}", tokenizer, 24, seed=0)
    first = [next(windows) for _ in range(5)]
    assert all(w.shape == (24,) for w in first)
    assert "sky" in tokenizer.decode(torch.cat(first))
    with pytest.raises(UserError, match="cannot load dataset"):
        next(token_windows(f"hf:{tmp_path / 'missing'}", tokenizer, 24, seed=0))


def test_hugging_face_dataset_without_text_is_an_error_not_a_hang(tmp_path, tokenizer):
    import json

    no_text = tmp_path / "no_text"
    no_text.mkdir()
    (no_text / "train.jsonl").write_text("".join(json.dumps({"body": f"row {i}"}) + "\n" for i in range(20)))
    with pytest.raises(UserError, match="has no 'text' column \\(columns: body\\)"):
        next(token_windows(f"hf:{no_text}", tokenizer, 24, seed=0))
    empty = tmp_path / "empty_text"
    empty.mkdir()
    (empty / "train.jsonl").write_text("".join(json.dumps({"text": ""}) + "\n" for _ in range(20)))
    with pytest.raises(UserError, match="has no text in its 'text' column"):
        next(token_windows(f"hf:{empty}", tokenizer, 24, seed=0))  # before: a loop over the empty rows forever


def test_tokenizer_from_json_and_folder(tmp_path, tokenizer):
    from_json = load_tokenizer(str(embedded_tokenizer_file(VOCAB)), VOCAB)
    assert from_json("hello world")["input_ids"] == tokenizer("hello world")["input_ids"]
    tokenizer.save_pretrained(tmp_path / "tok")
    from_folder = load_tokenizer(str(tmp_path / "tok"), VOCAB)
    assert from_folder.mask_token == "[MASK]"
    assert "token_type_ids" in from_folder("a", "b")
    with pytest.raises(UserError, match="cannot load tokenizer"):
        load_tokenizer(str(tmp_path / "no-such-folder"), VOCAB)
