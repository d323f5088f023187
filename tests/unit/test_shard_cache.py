"""A peer's disk cache of token shards (collab.data.shard_cache): checked, bounded, damage noticed. No process."""

from __future__ import annotations

import os

import numpy as np
import pytest

from collab.data.shard_cache import ShardCache, ShardRefused
from collab.data.shards import ShardWriter


def _shards(folder, count: int = 4, tokens: int = 1000):
    writer = ShardWriter(folder, 5000, tokens)
    rng = np.random.default_rng(0)
    infos = writer.add(rng.integers(0, 5000, size=count * tokens))
    return infos, {i.name: (folder / i.name).read_bytes() for i in infos}


def test_a_shard_is_kept_only_if_it_is_the_manifests_and_a_damaged_one_is_dropped(tmp_path):
    infos, data = _shards(tmp_path / "source")
    cache = ShardCache(tmp_path / "cache", infos)
    first = infos[0].name
    assert not cache.holds(first)
    with pytest.raises(ShardRefused, match="does not match the manifest's sha256"):
        cache.put(first, data[infos[1].name])  # another shard's bytes under this name
    with pytest.raises(ShardRefused, match="not a shard of this run"):
        cache.put("99999.shard", data[first])
    assert not cache.holds(first) and not list((tmp_path / "cache").glob("*.shard"))
    cache.put(first, data[first])
    assert cache.holds(first) and cache.held() == [first]
    path = tmp_path / "cache" / first
    path.write_bytes(path.read_bytes()[:-10])  # truncated after it was kept
    assert not cache.holds(first) and not path.exists()  # dropped: it is fetched again


def test_the_cache_keeps_within_its_budget_dropping_the_least_recently_used(tmp_path):
    infos, data = _shards(tmp_path / "source")
    size = len(data[infos[0].name])
    cache = ShardCache(tmp_path / "cache", infos, budget_bytes=2 * size)
    cache.put(infos[0].name, data[infos[0].name])
    cache.put(infos[1].name, data[infos[1].name])
    past = os.path.getmtime(tmp_path / "cache" / infos[1].name) - 100
    os.utime(tmp_path / "cache" / infos[0].name, (past - 10, past - 10))
    os.utime(tmp_path / "cache" / infos[1].name, (past, past))
    cache.used(infos[0].name)  # read just now: shard 1 is now the least recently used
    cache.put(infos[2].name, data[infos[2].name])
    assert cache.held() == [infos[0].name, infos[2].name]
    cache.put(infos[3].name, data[infos[3].name], keep=[infos[2].name])  # about to be read: kept
    assert cache.held() == [infos[2].name, infos[3].name]
    assert sum(p.stat().st_size for p in (tmp_path / "cache").glob("*.shard")) <= 2 * size
