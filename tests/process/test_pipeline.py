"""Batches made ahead in a worker process (collab.train.pipeline): the same batches, in the same order, as the
training thread makes for the same seed; with the run's token shards too, where the peer's place counts the windows
it trained on (not the ones the worker read ahead); and a pipeline that bounds the peer is said, with the fix."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import torch

from collab.config import RunConfig, load_config
from collab.data.feed import ShardFeed
from collab.data.shards import ShardWriter, write_shard_list
from collab.tasks import build_task
from collab.train.pipeline import BOUND_AFTER, BatchPipeline, bound_warning
from tests.conftest import MICRO_CONFIG

TAKEN = 12


def _same(expected: list[dict], got: list[dict]) -> None:
    assert len(got) == len(expected)
    for want, batch in zip(expected, got):
        assert batch.keys() == want.keys()
        for key in want:
            assert torch.equal(batch[key], want[key]), key


def _workers_alive(before: set[int]) -> set[int]:
    """Processes started since `before`, less multiprocessing's resource tracker (it lives as long as this process)."""
    return {p.pid for p in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())} - before


def test_a_worker_makes_the_same_batches_in_the_same_order_as_the_training_thread():
    config = RunConfig.model_validate(MICRO_CONFIG)
    expected = list(itertools.islice(build_task(config).batches(4, seed=1234), TAKEN))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    pipeline = BatchPipeline(config, 4, seed=1234)
    try:
        _same(expected, list(itertools.islice(pipeline, TAKEN)))
        assert pipeline.batches_taken == TAKEN and pipeline.rate() > 0
        assert pipeline.report()["workers"] == 1
    finally:
        pipeline.close()
    assert not _workers_alive(before)  # closed: its worker is gone


def test_with_token_shards_the_worker_reads_the_feed_in_order_and_the_place_counts_what_was_trained_on(tmp_path):
    config = load_config("causal-lm-tiny", {"task.model.num_hidden_layers": 1})
    length = config.task.data.seq_length
    writer = ShardWriter(tmp_path, 1000, 4 * length)
    write_shard_list(tmp_path, writer.add(np.random.default_rng(0).integers(0, 1000, size=40 * length)))
    in_thread = ShardFeed.from_folder(tmp_path, start=0.4, position=3)
    expected = list(itertools.islice(build_task(config).batches(2, seed=7, feed=in_thread), TAKEN))
    assert in_thread.position == 3 + 2 * TAKEN

    feed = ShardFeed.from_folder(tmp_path, start=0.4, position=3)
    pipeline = BatchPipeline(config, 2, seed=7, feed=feed)
    try:
        _same(expected, list(itertools.islice(pipeline, TAKEN)))
        assert pipeline.position == 3 + 2 * TAKEN  # what training took; the feed itself has read ahead
        assert feed.position > pipeline.position
    finally:
        pipeline.close()
        feed.close()


def test_a_process_that_closed_a_pipeline_with_windows_still_queued_exits(tmp_path):
    """The windows sent ahead to a worker that is gone must not hold the peer's exit (a queue's feeder thread
    blocked on a full pipe made a process that had closed its pipeline hang at exit)."""
    script = tmp_path / "close_and_exit.py"
    script.write_text(f"""
import itertools, sys
import numpy as np
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from collab.config import load_config
from collab.data.feed import ShardFeed
from collab.data.shards import ShardWriter, write_shard_list
from collab.train.pipeline import BatchPipeline

if __name__ == "__main__":
    config = load_config("causal-lm-tiny", {{"task.model.num_hidden_layers": 1}})
    length = config.task.data.seq_length
    writer = ShardWriter({str(tmp_path)!r}, 1000, 64 * length)
    write_shard_list({str(tmp_path)!r}, writer.add(np.random.default_rng(0).integers(0, 1000, size=640 * length)))
    feed = ShardFeed.from_folder({str(tmp_path)!r}, start=0.0)
    pipeline = BatchPipeline(config, 2, seed=7, feed=feed)
    list(itertools.islice(pipeline, 2))
    pipeline.close()
    feed.close()
    print("closed", flush=True)
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "closed" in done.stdout, done.stderr[-2000:]


def test_a_pipeline_that_bounds_the_peer_is_said_once_with_the_fix():
    assert bound_warning(waited=5.0, trained=BOUND_AFTER + 10, rate=900.0, in_thread=False) is None  # 12%: fine
    assert bound_warning(waited=20.0, trained=BOUND_AFTER - 1, rate=900.0, in_thread=False) is None  # too soon
    in_thread = bound_warning(waited=20.0, trained=60.0, rate=None, in_thread=True)
    assert "33% of its time making batches" in in_thread and "--data-workers 1" in in_thread
    assert "training.data_workers: 1" in in_thread  # collab simulate has no such flag: its peers read the config
    worker = bound_warning(waited=20.0, trained=60.0, rate=900.0, in_thread=False)
    assert "its worker makes 900 samples/s" in worker and "33%" in worker
