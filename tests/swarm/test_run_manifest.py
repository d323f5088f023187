"""A run made with `collab init`, joined by a volunteer with nothing but the join line (real DHT, p2pd, averaging)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

from transformers import AutoTokenizer

from collab.data.tokenizer import load_tokenizer
from collab.peers.launcher import LocalSwarm
from collab.run.folder import load_run_folder
from collab.train.checkpoint import list_checkpoints
from tests.conftest import MICRO_CONFIG, fork_server, peer_env, read_summary, run_cli, swarm_config, write_config



def _volunteers_own_tokenizer(cache, monkeypatch):
    """What the volunteer's machine would have trained: the embedded corpus of another standard library."""
    from collab.data.corpus import embedded_corpus_path
    from collab.data.tokenizer import embedded_tokenizer_file

    session_corpus = embedded_corpus_path()  # the session's cache: built once, before any test
    ours = session_corpus.read_text().split("\n\n")
    monkeypatch.setenv("COLLAB_CACHE_DIR", str(cache))
    # written where embedded_corpus_path() finds it, so that it does not build the full corpus in this cache first
    # (11 s of walking the standard library, only to be overwritten)
    cache.mkdir(parents=True, exist_ok=True)
    (cache / session_corpus.name).write_text("\n\n".join(ours[len(ours) // 3:]))  # a third of the docstrings differ
    assert embedded_corpus_path() == cache / session_corpus.name
    path = embedded_tokenizer_file(MICRO_CONFIG["task"]["data"]["vocab_size"])
    monkeypatch.undo()
    return path


def test_a_volunteer_with_only_the_join_line_trains_the_runs_model(tmp_path, micro_config, run_id, monkeypatch,
                                                                   no_leftover_processes):
    folder = tmp_path / "run"
    # half the micro config's target batch: nothing here measures learning, and each epoch is half as long
    init = run_cli("init", run_id, "--config", str(swarm_config(tmp_path, 2, {"training.target_batch_size": 512})),
                   "--dir", str(folder), timeout=120)
    assert init.returncode == 0, init.stderr
    key = load_run_folder(folder).fingerprint
    other_cache = tmp_path / "volunteer-cache"
    own_tokenizer = _volunteers_own_tokenizer(other_cache, monkeypatch)
    assert json.loads(own_tokenizer.read_text())["model"]["vocab"] != \
        json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"], "the corpora did not differ"

    checkpoints = {i: tmp_path / f"ckpt{i}" for i in range(2)}
    with LocalSwarm(2, run_id, tmp_path / "peers", ["--max-epochs", "3"], env=peer_env(), forks=fork_server(),
                    per_peer_args={0: ["--run", str(folder), "--checkpoint-dir", str(checkpoints[0])],
                                   # and it compiles its model (training.compile), the organizer's peer does not
                                   1: ["--run-key", key, "--checkpoint-dir", str(checkpoints[1]), "--compile", "on"]},
                    per_peer_env={1: {"COLLAB_CACHE_DIR": str(other_cache)}}) as swarm:
        # the organizer alone first, waiting for its volunteer: the refused joins below then share the 2 cores
        # with nobody's training (beside two training peers, CI took 106 s here, and once a starved volunteer
        # joined so late that the organizer had trained two epochs alone)
        swarm.start(count=1, wait_peers=2)
        line = re.search(r"^collab join .*$", swarm.peers[0].log_text(), re.M).group(0)
        assert line.endswith(f"--run-key {key}") and "--config" not in line, line

        # while the run is live: a peer whose config contradicts the manifest, or with another key, is refused
        bad = write_config(tmp_path, {"training.target_batch_size": 4096}, "bad.yaml")
        joining = ["join", "--run-id", run_id, "--initial-peers", swarm.initial_peer,
                   "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
        with ThreadPoolExecutor(2) as pool:  # at once: each is a few s of imports
            refused = pool.submit(run_cli, *joining, "--run-key", key, "--config", str(bad), timeout=120)
            impostor = pool.submit(run_cli, *joining, "--run-key", "0" * 32, timeout=120)
            refused, impostor = refused.result(), impostor.result()
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
        assert (f"training.target_batch_size is 4096 in --config {bad} or --target-batch-size, but the run's "
                "manifest says 512") in refused.stderr.strip().splitlines()[-1]
        assert impostor.returncode == 2, impostor.stderr
        assert f"signed by key {key}, not --run-key {'0' * 32}" in impostor.stderr.strip().splitlines()[-1]
        swarm.start_peer(1, ["--wait-peers", "2"])

        assert swarm.wait(timeout=300), "\n".join(p.log_text()[-2000:] for p in swarm.peers)
        organizer, volunteer = (read_summary(p) for p in swarm.peers)

    for summary in (organizer, volunteer):
        assert summary["final_epoch"] == 3 and summary["rounds_joined"] >= 2, summary
        assert max(summary["group_sizes"]) == 2, summary  # they averaged together
    # a compiled peer and an eager one: the compiled one compiled once, trained on, nothing recompiled
    assert volunteer["compile"]["compiled"] and volunteer["compile"]["recompiles"] == 0, volunteer["compile"]
    assert not organizer["compile"]["compiled"] and "compiled" in volunteer["device"]
    # the volunteer trained with the run's tokenizer, fetched from the organizer, not its own
    fetched = AutoTokenizer.from_pretrained(list_checkpoints(checkpoints[1])[-1])
    run_tokenizer = AutoTokenizer.from_pretrained(list_checkpoints(checkpoints[0])[-1])
    assert fetched.get_vocab() == run_tokenizer.get_vocab()
    text = "the dictionary maps each key to the value it holds, unless the iterator is exhausted"
    assert fetched(text)["input_ids"] == run_tokenizer(text)["input_ids"]
    # which it would not have matched with the tokenizer its own machine builds
    assert load_tokenizer(str(own_tokenizer), 1000)(text)["input_ids"] != run_tokenizer(text)["input_ids"]
