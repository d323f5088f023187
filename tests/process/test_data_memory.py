"""A peer's memory does not grow with the corpus: reading windows of 16x more shards (16M against 256M tokens) costs a
reading process the same resident memory, within 50 MB (issue 34 allows 100 MB between 100 MB and 5 GB of text;
benchmarks/data.py measures that). Each reading runs in a process of its own, so its peak RSS is its own."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from collab.data.shards import ShardWriter, write_shard_list

READER = """
import resource, sys, itertools
from collab.data.feed import ShardFeed
feed = ShardFeed.from_folder(sys.argv[1], start=0.5)
windows = sum(1 for _ in itertools.islice(feed.windows(512), 20000))
print(windows, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def _shards(folder, tokens: int) -> None:
    writer = ShardWriter(folder, 8000, 1 << 24)
    rng = np.random.default_rng(0)
    infos = []
    for _ in range(tokens // (1 << 24)):  # a shard at a time: this test's own memory stays small too
        infos += writer.add(rng.integers(0, 8000, size=1 << 24, dtype=np.uint16), starts_document=True)
    write_shard_list(folder, infos)


def _peak_rss_mb(folder) -> float:
    child = subprocess.run([sys.executable, "-c", READER, str(folder)], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    windows, rss = child.stdout.split()
    assert int(windows) == 20000
    return float(rss)


def test_reading_a_corpus_16_times_larger_takes_no_more_memory(tmp_path):
    sizes = {"small": 1 << 24, "large": 1 << 28}  # tokens: 32 MB and 512 MB of shards
    rss = {}
    for name, tokens in sizes.items():
        (tmp_path / name).mkdir()
        _shards(tmp_path / name, tokens)
        rss[name] = _peak_rss_mb(tmp_path / name)
    print(json.dumps(rss))
    assert rss["large"] - rss["small"] < 50, rss
