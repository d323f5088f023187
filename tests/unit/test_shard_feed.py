"""A peer's feed of windows from the run's shards (collab.data.feed): fetched ahead into a bounded cache, the same
windows whether the shards were local or fetched, resumed at a position, and a damaged cache file fetched again.
The fetcher here is a function over a folder; the swarm's (collab.run.shard_fetch) is tested with real peers."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest

from collab.data.feed import ShardFeed
from collab.data.shard_cache import ShardCache
from collab.data.shards import ShardWriter, write_shard_list
from collab.errors import UserError


def _source(folder, count: int = 6, tokens: int = 4096):
    writer = ShardWriter(folder, 5000, tokens)
    infos = writer.add(np.random.default_rng(0).integers(0, 5000, size=count * tokens))
    write_shard_list(folder, infos)
    return infos


class _Fetch:
    """Reads from the organizer's folder, and remembers what was asked."""

    def __init__(self, folder, fail_first: int = 0):
        self.folder, self.asked, self.fail_first = folder, [], fail_first
        self.lock = threading.Lock()

    def __call__(self, name: str) -> bytes:
        with self.lock:
            self.asked.append(name)
            if len(self.asked) <= self.fail_first:
                raise UserError("no peer of the run holds it yet")
        return (self.folder / name).read_bytes()


def _take(feed: ShardFeed, count: int, length: int = 100) -> list[list[int]]:
    return [w.tolist() for w in itertools.islice(feed.windows(length), count)]


def test_fetched_shards_give_the_same_windows_as_local_ones_within_the_cache_budget(tmp_path):
    infos = _source(tmp_path / "organizer")
    local = ShardFeed.from_folder(tmp_path / "organizer", start=0.3)
    expected = _take(local, 200)  # 40 windows a shard: five shards
    size = (tmp_path / "organizer" / infos[0].name).stat().st_size
    fetch = _Fetch(tmp_path / "organizer", fail_first=2)  # the swarm had nobody at first: it tries again
    cache = ShardCache(tmp_path / "cache", infos, budget_bytes=4 * size)
    feed = ShardFeed(tmp_path / "cache", infos, start=0.3, fetch=fetch, cache=cache, ahead=2)
    try:
        assert _take(feed, 200) == expected
    finally:
        feed.close()  # the prefetching thread is done: what was fetched and what the cache keeps hold still
    assert feed.position == 200 and feed.fetched >= 5 and feed.fetch_failures == 2
    # no shard fetched over and over: the ones about to be read are never evicted for the ones after them (one may
    # come twice: the last ones fetched ahead are the next pass's first, evicted since their first read)
    assert len(set(fetch.asked)) >= 5 and feed.fetched <= len(infos) + 1, fetch.asked
    held = list((tmp_path / "cache").glob("*.shard"))
    assert len(held) <= 4 and sum(p.stat().st_size for p in held) <= 4 * size


def test_a_feed_resumes_at_its_position_and_refetches_a_damaged_file(tmp_path):
    infos = _source(tmp_path / "organizer")
    whole = _take(ShardFeed.from_folder(tmp_path / "organizer", start=0.6), 120)
    cache = ShardCache(tmp_path / "cache", infos)
    fetch = _Fetch(tmp_path / "organizer")
    first = ShardFeed(tmp_path / "cache", infos, start=0.6, fetch=fetch, cache=cache, ahead=1)
    assert _take(first, 50) == whole[:50]
    first.close()
    for path in (tmp_path / "cache").glob("*.shard"):  # a crash of another tool: every file cut short
        path.write_bytes(path.read_bytes()[:-100])
    again = ShardFeed(tmp_path / "cache", infos, start=0.6, position=first.position, fetch=fetch, cache=cache)
    try:
        assert _take(again, 70) == whole[50:120]  # where it was, not from the start
        assert again.fetched >= 1
    finally:
        again.close()


def test_a_feed_that_nobody_serves_gives_up_in_one_line(tmp_path):
    infos = _source(tmp_path / "organizer", count=2)

    def nobody(name):
        raise UserError("no peer of the run holds shard " + name)

    feed = ShardFeed(tmp_path / "cache", infos, start=0.0, fetch=nobody, cache=ShardCache(tmp_path / "cache", infos),
                     patience=1.0)
    try:
        with pytest.raises(UserError, match=r"no peer of the run sent shard 0000\d.shard within 1 s \(last: no peer"):
            next(feed.windows(100))
    finally:
        feed.close()


def test_a_check_of_a_damaged_file_drops_only_that_file_not_the_whole_one_put_in_its_place(tmp_path, monkeypatch):
    # training read a damaged copy while the prefetching thread put a whole one in its place; the check then dropped
    # whatever was at the path - the whole one - and the shard was fetched a third time (a CI run)
    import collab.data.shard_cache as shard_cache

    infos = _source(tmp_path / "organizer", count=1)
    name, good = infos[0].name, (tmp_path / "organizer" / infos[0].name).read_bytes()
    cache = ShardCache(tmp_path / "cache", infos)
    (tmp_path / "cache" / name).write_bytes(good[:-100])
    real = shard_cache.Shard

    def read_then_replaced(path):
        try:
            return real(path)  # the damaged copy, read (and refused)
        finally:
            cache.put(name, good)  # meanwhile, the other thread's fetch lands

    monkeypatch.setattr(shard_cache, "Shard", read_then_replaced)
    assert not cache.holds(name)  # what it read was damaged
    monkeypatch.setattr(shard_cache, "Shard", real)
    assert cache.holds(name), "the whole shard put meanwhile was dropped"


def test_a_damaged_file_that_vanishes_while_it_is_checked_is_fetched_again_not_waited_on(tmp_path, monkeypatch):
    # training and the prefetching thread both check a damaged file, and each drops it: one found it, then could not
    # open it (in CI the thread died of that, and training waited for a shard nobody would fetch any more)
    import collab.data.shard_cache as shard_cache

    infos = _source(tmp_path / "organizer", count=2)
    cache = ShardCache(tmp_path / "cache", infos)
    for info in infos:  # damaged copies in the cache
        (tmp_path / "cache" / info.name).write_bytes((tmp_path / "organizer" / info.name).read_bytes()[:-100])
    real, vanished = shard_cache.Shard, set()

    def dropped_by_the_other_thread(path):
        if path.name not in vanished:
            vanished.add(path.name)
            path.unlink()
        return real(path)

    monkeypatch.setattr(shard_cache, "Shard", dropped_by_the_other_thread)
    expected = _take(ShardFeed.from_folder(tmp_path / "organizer", start=0.0), 60)
    feed = ShardFeed(tmp_path / "cache", infos, start=0.0, fetch=_Fetch(tmp_path / "organizer"), cache=cache,
                     patience=20.0)
    try:
        assert _take(feed, 60) == expected
        assert vanished == {info.name for info in infos} and feed.fetched == 2
    finally:
        feed.close()


class _Holders:
    """A DHT that lists nobody: the fetcher asks its known peers."""

    def get(self, key, latest=True):
        return None


def _fetcher_over(tmp_path, answers: dict):
    """A ShardFetcher of the swarm whose asks (peer -> a list of answers, each bytes or an exception) are scripted:
    what is tested is what it does with them."""
    import hashlib
    from collab.run.manifest import DataManifest
    from collab.run.shard_fetch import ShardFetcher

    infos = _source(tmp_path / "organizer", count=1)
    blob = (tmp_path / "organizer" / infos[0].name).read_bytes()
    data = DataManifest(shard_tokens=infos[0].tokens, total_tokens=infos[0].tokens, shards=[
        {"name": infos[0].name, "tokens": infos[0].tokens, "sha256": hashlib.sha256(blob).hexdigest()}])

    class Scripted(ShardFetcher):
        def _ask(self, peer, name, limit, timeout):
            answer = answers[peer].pop(0)
            if isinstance(answer, Exception):
                raise answer
            return blob if answer == "good" else answer

    return Scripted(_Holders(), "run", "me", data, known=list(answers)), infos[0].name, blob


def test_a_holder_whose_ask_failed_is_asked_once_more_and_a_failure_says_why(tmp_path, monkeypatch):
    # in CI the only holder's one ask failed (a busy machine) and the shard was given up on at once, with no reason
    import collab.run.shard_fetch as shard_fetch

    monkeypatch.setattr(shard_fetch, "RETRY_PAUSE", 0.01)
    fetcher, name, blob = _fetcher_over(tmp_path, {"peerA": [TimeoutError("no answer in 30 s"), "good"]})
    assert fetcher(name) == blob and fetcher.served == {"peerA": len(blob)} and fetcher.failed == {}

    fetcher, name, _ = _fetcher_over(tmp_path, {"peerA": [ConnectionResetError("stream reset")] * 2,
                                                "peerB": [b"", b""]})
    with pytest.raises(UserError, match=r"shard .* \(peerA\.\.\.: ConnectionResetError: stream reset; "
                                        r"peerB\.\.\.: it does not hold it\)"):
        fetcher(name)
    # a bad copy is not asked for again: refused once, banned
    fetcher, name, blob = _fetcher_over(tmp_path, {"peerA": [b"x" * len(blob), "good"]})
    with pytest.raises(UserError):
        fetcher(name)
    assert fetcher.refused == {"peerA": 1} and fetcher.served == {}
