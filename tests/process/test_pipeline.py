"""Batches made ahead in a worker process (collab.train.pipeline): the same batches, in the same order, as the
training thread makes for the same seed; with the run's token shards too, where the peer's place counts the windows
it trained on (not the ones the worker read ahead); and a pipeline that bounds the peer is said, with the fix."""

from __future__ import annotations

import itertools

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


def test_a_pipeline_that_bounds_the_peer_is_said_once_with_the_fix():
    assert bound_warning(waited=5.0, trained=BOUND_AFTER + 10, rate=900.0, in_thread=False) is None  # 12%: fine
    assert bound_warning(waited=20.0, trained=BOUND_AFTER - 1, rate=900.0, in_thread=False) is None  # too soon
    in_thread = bound_warning(waited=20.0, trained=60.0, rate=None, in_thread=True)
    assert "33% of its time making batches" in in_thread and "--data-workers 1" in in_thread
    worker = bound_warning(waited=20.0, trained=60.0, rate=900.0, in_thread=False)
    assert "its worker makes 900 samples/s" in worker and "33%" in worker
