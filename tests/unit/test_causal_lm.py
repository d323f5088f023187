"""The causal-LM task (collab.tasks.causal_lm): a Llama-style decoder from its config, trained on packed sequences of
the run's shards whose documents end with the eos token; it learns. In process, no swarm."""

from __future__ import annotations

import itertools

import numpy as np
import torch
import yaml

from collab.config import load_config
from collab.data.shards import open_shards
from collab.run.folder import DATA, create_run_folder
from collab.run.joining import as_organizer
from collab.tasks import build_task
from tests.conftest import MICRO_CONFIG, MICRO_LM



def _config(tmp_path, **training):
    path = tmp_path / "lm.yaml"
    path.write_text(yaml.safe_dump({**MICRO_CONFIG, "task": MICRO_LM,
                                    "training": {**MICRO_CONFIG["training"], **training}}))
    return path


def test_shards_of_a_causal_lm_run_end_each_document_with_eos_and_batches_are_packed(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("\n\n".join(f"the peer {i} averaged its gradient with the swarm" for i in range(200)))
    path = _config(tmp_path)
    run = create_run_folder("lm-run", path, load_config(path), tmp_path / "run", private=False, dataset=str(corpus),
                            shard_tokens=1000)
    config, _ = as_organizer(tmp_path / "run", {}, None, "QmOrganizer")
    task = build_task(config)
    eos = task.tokenizer.eos_token_id
    assert run.manifest.data.separator == eos == task.model.config.eos_token_id
    shards = open_shards(tmp_path / "run" / DATA, run.manifest.data.shards)
    stream = np.concatenate([s.tokens for s in shards]).astype(np.int64)
    starts = np.concatenate([s.doc_starts.astype(np.int64) + sum(len(t) for t in shards[:i])
                             for i, s in enumerate(shards)])
    assert (stream == eos).sum() == 200 == len(starts)  # one eos after each document, none elsewhere
    assert all(stream[start - 1] == eos for start in starts[1:])
    batch = next(task.batches(4, seed=1))
    assert batch["input_ids"].shape == (4, 64) and (batch["input_ids"] != task.tokenizer.pad_token_id).all()
    assert torch.equal(batch["labels"], batch["input_ids"])  # the model shifts them: each token predicts the next


def test_the_causal_lm_learns_the_embedded_corpus(tmp_path):
    torch.manual_seed(0)
    path = _config(tmp_path, learning_rate=0.003)
    config = load_config(path)
    task = build_task(config)
    optimizer = task.optimizer_factory()(task.parameter_groups())
    batches = task.batches(8, seed=3)
    losses, counts = [], np.zeros(len(task.tokenizer))
    for batch in itertools.islice(batches, 300):
        counts += np.bincount(batch["input_ids"].flatten().numpy(), minlength=len(counts))
        loss = task.loss(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # the bar: the entropy of the tokens' frequencies (nats), what a model reaches that learned no context at all
    freq = counts[counts > 0] / counts.sum()
    unigram = float(-(freq * np.log(freq)).sum())
    held_out = [next(task.batches(8, seed=99 + i)) for i in range(4)]  # windows it never trained on
    with torch.no_grad():
        held = float(np.mean([task.loss(batch).item() for batch in held_out]))
    assert np.mean(losses[:5]) > 6.0  # it began at about ln(1000) = 6.9: uniform over the vocabulary
    assert held < unigram - 0.3, (held, unigram, np.mean(losses[-10:]))
