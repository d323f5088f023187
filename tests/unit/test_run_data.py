"""`collab init --dataset`: the run's corpus as token shards in its folder, listed (with their sha256) in the signed
manifest; an interrupted init resumes. No process, no socket."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from collab.config import load_config
from collab.data.shards import file_sha256, open_shards
from collab.errors import UserError
from collab.run.folder import DATA, MANIFEST, create_run_folder, load_run_folder
from collab.run.manifest import verify


def _corpus(folder, paragraphs: int = 300):
    rng = np.random.default_rng(2)
    words = ["average", "gradient", "peer", "swarm", "model", "round", "batch", "token", "shard", "epoch"]
    folder.mkdir()
    (folder / "notes.txt").write_text("\n\n".join(" ".join(rng.choice(words, size=12)) for _ in range(paragraphs)))
    (folder / "more.jsonl").write_text("".join(json.dumps({"text": " ".join(rng.choice(words, size=8))}) + "\n"
                                               for _ in range(paragraphs)))
    return folder


def test_init_with_a_dataset_writes_shards_the_signed_manifest_lists(tmp_path, micro_config):
    corpus = _corpus(tmp_path / "corpus")
    run = create_run_folder("data-run", micro_config, load_config(micro_config), tmp_path / "run", private=False,
                            dataset=str(corpus), shard_tokens=1000)
    data = verify((tmp_path / "run" / MANIFEST).read_bytes(), "data-run", run.fingerprint).data
    assert data is not None and data.shard_tokens == 1000 and len(data.shards) >= 3
    assert all(file_sha256(tmp_path / "run" / DATA / s.name) == s.sha256 for s in data.shards)
    shards = open_shards(tmp_path / "run" / DATA, data.shards)
    assert sum(len(s) for s in shards) == data.total_tokens and max(int(s.tokens.max()) for s in shards) < 8000
    assert load_run_folder(tmp_path / "run").manifest.data == data  # and the folder loads as any run's


def test_an_interrupted_init_resumes_and_writes_the_same_shards(tmp_path, micro_config, monkeypatch):
    import collab.data.prepare as prepare

    corpus, config = _corpus(tmp_path / "corpus"), load_config(micro_config)
    monkeypatch.setattr(prepare, "BATCH_DOCUMENTS", 50)
    calls = []

    def interrupt(read, tokens):
        calls.append(read)
        if len(calls) == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        create_run_folder("data-run", micro_config, config, tmp_path / "run", False, dataset=str(corpus),
                          shard_tokens=1000, progress=interrupt)
    assert not (tmp_path / "run" / MANIFEST).exists() and list((tmp_path / "run" / DATA).glob("*.shard"))
    key = (tmp_path / "run" / "organizer.key").read_bytes()
    resumed = create_run_folder("data-run", micro_config, config, tmp_path / "run", False, dataset=str(corpus),
                                shard_tokens=1000)
    assert (tmp_path / "run" / "organizer.key").read_bytes() == key  # the run keeps its identity
    clean = create_run_folder("data-run", micro_config, config, tmp_path / "clean", False, dataset=str(corpus),
                              shard_tokens=1000)
    assert resumed.manifest.data == clean.manifest.data
    with pytest.raises(UserError, match="already exists and is not empty"):  # a finished run is not made again
        create_run_folder("data-run", micro_config, config, tmp_path / "run", False, dataset=str(corpus))


def test_a_dataset_for_a_task_without_text_gets_one_line(tmp_path):
    from collab.config import shipped_config

    with pytest.raises(UserError, match="reads no text: --dataset prepares a text task's corpus"):
        create_run_folder("swav-run", shipped_config("swav-tiny"), load_config(shipped_config("swav-tiny")),
                          tmp_path / "run", False, dataset=str(_corpus(tmp_path / "corpus")))


def test_the_organizers_peer_trains_on_the_runs_shards_in_its_own_order(tmp_path, micro_config):
    from collab.data.text import token_windows
    from collab.run.joining import as_organizer
    from collab.tasks import build_task

    corpus = _corpus(tmp_path / "corpus")
    create_run_folder("data-run", micro_config, load_config(micro_config), tmp_path / "run", False,
                      dataset=str(corpus), shard_tokens=1000)
    config, _ = as_organizer(tmp_path / "run", {}, None, "QmOrganizer")
    assert config.task.data.dataset == f"shards:{tmp_path / 'run' / DATA}"
    task = build_task(config)
    stream = np.concatenate([s.tokens for s in open_shards(tmp_path / "run" / DATA, load_run_folder(
        tmp_path / "run").manifest.data.shards)]).astype(np.int64)
    windows = token_windows(config.task.data.dataset, task.tokenizer, 50, seed=1)
    for _ in range(30):  # each window is 50 consecutive tokens of the shards
        window = next(windows).numpy()
        at = [i for i in range(0, len(stream) - 49) if np.array_equal(stream[i:i + 50], window)]
        assert at, window
    other = token_windows(config.task.data.dataset, task.tokenizer, 50, seed=2)  # another peer, another order
    assert [next(other).tolist() for _ in range(5)] != [w.tolist() for w, _ in zip(
        token_windows(config.task.data.dataset, task.tokenizer, 50, seed=1), range(5))]
    batch = next(task.batches(4, seed=1))  # and the task's batches come from them
    assert batch["input_ids"].shape[0] == 4 and float(task.loss(batch)) > 0
    with pytest.raises(UserError, match="trains on the token shards its manifest lists: leave --dataset"):
        as_organizer(tmp_path / "run", {"task": {"data": {"dataset": str(corpus)}}}, None, "QmOrganizer")
    with pytest.raises(UserError, match="holds no shards.json: it is not a folder of token shards"):
        next(token_windows(f"shards:{corpus}", task.tokenizer, 50, seed=1))


def test_a_volunteers_own_copy_is_used_only_if_every_shard_matches_and_the_cache_must_hold_what_it_reads(tmp_path,
                                                                                                      micro_config):
    from collab.run.joining import volunteer_shards

    run = create_run_folder("data-run", micro_config, load_config(micro_config), tmp_path / "run", private=False,
                            dataset=str(_corpus(tmp_path / "corpus")), shard_tokens=1000)
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "run" / DATA, copy)
    shards = volunteer_shards(run.manifest, {"task": {"data": {"dataset": str(copy)}}}, 20.0)
    assert shards.folder == copy and shards.cache is None and shards.held() == list(range(len(run.manifest.data.shards)))
    last = run.manifest.data.shards[-1].name
    blob = bytearray((copy / last).read_bytes())
    blob[70] ^= 1  # one token changed
    (copy / last).write_bytes(bytes(blob))
    with pytest.raises(UserError, match=rf"--dataset {copy} is not a copy of run 'data-run''s token shards \({last}: "
                                        r"its sha256 is not the manifest's\); leave --dataset out"):
        volunteer_shards(run.manifest, {"task": {"data": {"dataset": str(copy)}}}, 20.0)
    cached = volunteer_shards(run.manifest, {"task": {"data": {"dataset": "embedded"}}}, 20.0)  # the default: none
    assert cached.cache is not None and cached.held() == []
    with pytest.raises(UserError, match=r"--data-cache-gb 1e-06 cannot hold the 5 shards a peer reads and fetches "
                                        r"ahead \(up to 0\.0121 MB each\); pass --data-cache-gb 6e-05 or more"):
        volunteer_shards(run.manifest, {}, 1e-6)
