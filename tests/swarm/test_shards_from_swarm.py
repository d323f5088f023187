"""The run's token shards come from the swarm: a volunteer with nothing but the join line fetches them from the
organizer's peer, and a later one from that volunteer once the organizer's peer is gone (real DHT, p2pd, averaging).
The run trains the causal LM (the quick start's ALBERT runs read the embedded corpus's shards in every swarm test)."""

from __future__ import annotations

import re
import shutil

from collab.data.corpus import embedded_corpus_path
from collab.data.shards import Shard, file_sha256
from collab.peers.launcher import LocalSwarm
from collab.run.folder import load_run_folder
from tests.conftest import MICRO_LM, fork_server, peer_env, read_summary, run_cli, swarm_config, wait_for


def test_volunteers_train_on_shards_fetched_from_the_organizer_then_from_each_other(tmp_path, run_id,
                                                                                    no_leftover_processes):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shutil.copyfile(embedded_corpus_path(), corpus / "docs.txt")
    folder = tmp_path / "run"
    config = swarm_config(tmp_path, 2, {"training.target_batch_size": 512, "task": MICRO_LM})
    init = run_cli("init", run_id, "--config", str(config),
                   "--dir", str(folder), "--dataset", str(corpus), "--shard-tokens", "131072", timeout=180)
    assert init.returncode == 0, init.stderr
    run = load_run_folder(folder)
    shards = run.manifest.data.shards
    # four shards: the first volunteer fetches them all ahead (collab.data.feed.AHEAD), so it can serve every one
    assert len(shards) == 4, len(shards)
    caches = {i: tmp_path / f"cache{i}" for i in (1, 2)}
    for cache in caches.values():  # each volunteer is another machine: its own cache, empty
        cache.mkdir()

    with LocalSwarm(3, run_id, tmp_path / "peers", ["--no-live"], env=peer_env(), forks=fork_server(),
                    per_peer_args={0: ["--run", str(folder), "--max-epochs", "2"],
                                   1: ["--run-key", run.fingerprint], 2: ["--run-key", run.fingerprint]},
                    per_peer_env={i: {"COLLAB_CACHE_DIR": str(cache)} for i, cache in caches.items()}) as swarm:
        swarm.start(count=2, wait_peers=2)
        wait_for(lambda: swarm.peers[0].popen.poll() is not None, timeout=240,
                 what="the organizer's peer to reach epoch 2 and leave")
        assert swarm.peers[0].popen.returncode == 0, swarm.peers[0].log_text()[-3000:]
        swarm.start_peer(2, ["--wait-peers", "2"])  # joins through the first volunteer only
        # two gradient rounds of the second volunteer (with the first: nobody else is left), then both leave
        wait_for(lambda: re.search(r"averaging rounds [2-9]", swarm.peers[2].log_text()), timeout=240,
                 what="the second volunteer's second averaging round")
        swarm.stop()
        logs = "\n".join(f"--- peer {p.index}\n{p.log_text()[-2500:]}" for p in swarm.peers)
        organizer, first, second = (read_summary(p) for p in swarm.peers)
    assert [p.popen.returncode for p in swarm.peers] == [0, 0, 0], logs

    assert organizer["data"]["shards_fetched"] == 0 and organizer["data"]["bytes_from"] == {}
    # the first volunteer had nothing but the join line: every shard it read came from the organizer's peer
    assert first["data"]["shards_fetched"] >= 1 and set(first["data"]["bytes_from"]) == {organizer["peer_id"]}, first
    # the second came when the organizer's peer was gone: from the first volunteer, which serves its verified copies
    assert second["data"]["shards_fetched"] >= 1 and set(second["data"]["bytes_from"]) == {first["peer_id"]}, second
    assert second["data"]["refused_from"] == {} and first["data"]["refused_from"] == {}
    # it entered the ring of shards in the largest gap the others left (their records said where they were)
    assert second["data"]["came_from"] == "largest gap", second["data"]
    starts = sorted(s["data"]["start"] for s in (organizer, first, second))
    assert min(b - a for a, b in zip(starts, starts[1:])) > 0.1, starts
    # and trained with the first volunteer on them
    assert second["rounds_joined"] >= 2 and max(second["group_sizes"]) == 2, second
    for summary in (first, second):
        assert summary["data"]["position"] > 0
    # what each cache holds is the manifest's bytes
    listed = {s.name: s for s in shards}
    for cache in caches.values():
        held = list(cache.glob("shards/*/*.shard"))
        assert held, list(cache.rglob("*"))
        for path in held:
            assert file_sha256(path) == listed[path.name].sha256 and len(Shard(path)) == listed[path.name].tokens
