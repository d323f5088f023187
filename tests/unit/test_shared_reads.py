"""A peer's readers of the progress key share one stream of reads (collab.records.shared_reads): the rules, on a
walk that the test controls (a fake DHTNode.get) and a fake clock. The real DHT: tests/process/test_shared_reads.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hivemind.utils import get_dht_time

from collab.records.shared_reads import (FULL_READ_EVERY, PEERS_PER_READ, READ_EVERY_MOST, READ_REPLICAS,
                                        NearestReads, SharedReads, share_for)

KEY = "run_progress"


def found(peers: int, tag: str = ""):
    """What a read of the key returns: its value a dictionary of `peers` subkeys."""
    return SimpleNamespace(value={f"peer{i}{tag}": i for i in range(peers)}, expiration_time=0)


class Walks:
    """A DHTNode.get whose walks end when the test says, each with what the test gives it."""

    def __init__(self):
        self.started: list[asyncio.Future] = []
        self.keys: list[str] = []

    async def get(self, key, latest=False):
        assert latest
        self.keys.append(key)
        walk = asyncio.get_running_loop().create_future()
        self.started.append(walk)
        return await walk


def test_the_period_a_read_is_shared_for_grows_with_the_swarm_up_to_a_bound():
    assert [share_for(n) for n in (0, 1, PEERS_PER_READ, 12, 32, 64, 1000)] == \
        [0.5, 0.5, 0.5, 0.75, 2.0, READ_EVERY_MOST, READ_EVERY_MOST]
    assert share_for(64, min_refresh=4.0) == 4.0  # a run that reads rarely already: not more often


def test_readers_join_a_walk_under_way_and_take_a_recent_one_until_its_period_is_over():
    async def scenario():
        now = [100.0]
        shared, walks = SharedReads([KEY], clock=lambda: now[0]), Walks()
        first = asyncio.ensure_future(shared.read(KEY, walks.get))  # hivemind's tracker
        await settle()
        others = [asyncio.ensure_future(shared.recent(KEY, walks.get)) for _ in range(3)]  # collab's readers
        await settle()
        assert len(walks.started) == 1, "readers that came during a walk walked again"
        walks.started[0].set_result(found(12))
        assert all(len(r.value) == 12 for r in await asyncio.gather(first, *others))
        assert shared.counts() == dict(walked=1, served=0, joined=3)

        now[0] += share_for(12) - 0.01  # 12 records: shared for 0.75 s
        assert len((await shared.recent(KEY, walks.get)).value) == 12
        assert len(walks.started) == 1 and shared.counts()["served"] == 1

        now[0] += 0.02  # the period is over: a fresh walk
        later = asyncio.ensure_future(shared.recent(KEY, walks.get))
        await settle()
        assert len(walks.started) == 2
        walks.started[1].set_result(found(13))
        assert len((await later).value) == 13

        # a fresh read (the tracker's) always walks, and the others then take what it found
        now[0] += 0.1
        fresh = asyncio.ensure_future(shared.read(KEY, walks.get))
        await settle()
        assert len(walks.started) == 3
        walks.started[2].set_result(found(14))
        await fresh
        assert len((await shared.recent(KEY, walks.get)).value) == 14 and len(walks.started) == 3
        assert shared.counts() == dict(walked=3, served=2, joined=3)

    asyncio.run(scenario())


def test_a_failed_walk_is_not_kept_and_a_slow_one_does_not_replace_a_newer():
    async def scenario():
        now = [0.0]
        shared, walks = SharedReads([KEY], clock=lambda: now[0]), Walks()
        failing = asyncio.ensure_future(shared.recent(KEY, walks.get))
        await settle()
        walks.started[0].set_exception(TimeoutError("no node answered"))
        with pytest.raises(TimeoutError):
            await failing
        assert KEY not in shared.last and not shared.under_way

        # a walk whose caller gave up (hivemind's tracker cancels its read at shutdown) is still kept for the others
        gave_up = asyncio.ensure_future(shared.read(KEY, walks.get))
        await settle()
        gave_up.cancel()
        walks.started[1].set_result(found(5))
        await settle()
        assert len(shared.last[KEY][1].value) == 5

        # two walks under way at once cannot happen through `read`; a slow walk that began earlier than the kept one
        # (its result arriving late) does not replace it
        shared.last[KEY] = (10.0, found(7, "new"))
        shared._walked(KEY, 9.0, _done(found(6, "old")))
        assert len(shared.last[KEY][1].value) == 7

    asyncio.run(scenario())


def test_two_shared_keys_are_shared_and_counted_apart():
    """The progress key and the metrics key (collab.swarm.node): a read of one never answers a read of the other,
    and each key's counts are its own (a report's progress-read figures stay the progress key's)."""
    metrics = "run_metrics"

    async def scenario():
        shared, walks = SharedReads([KEY, metrics], clock=lambda: 0.0), Walks()
        reads = [asyncio.ensure_future(shared.recent(key, walks.get)) for key in (KEY, metrics, metrics)]
        await settle()
        assert walks.keys == [KEY, metrics]  # one walk each; the second metrics read joined its key's walk
        walks.started[0].set_result(found(3, "p"))
        walks.started[1].set_result(found(2, "m"))
        progress, first, second = await asyncio.gather(*reads)
        assert set(progress.value) == {"peer0p", "peer1p", "peer2p"} and first is second
        assert set((await shared.recent(metrics, walks.get)).value) == {"peer0m", "peer1m"}  # served, no walk
        assert len(walks.started) == 2
        assert shared.counts(KEY) == dict(walked=1, served=0, joined=0)
        assert shared.counts(metrics) == dict(walked=1, served=1, joined=1)
        assert shared.counts() == dict(walked=2, served=1, joined=1)

    asyncio.run(scenario())


def test_other_keys_are_read_as_before():
    async def scenario():
        shared, walks = SharedReads([KEY], clock=lambda: 0.0), Walks()
        reads = [asyncio.ensure_future(shared.recent("run_grad_averager.0b", walks.get)) for _ in range(2)]
        await settle()
        assert len(walks.started) == 2  # each its own walk, nothing kept
        for walk in walks.started:
            walk.set_result(found(1))
        await asyncio.gather(*reads)
        assert not shared.last and shared.counts() == dict(walked=0, served=0, joined=0)

    asyncio.run(scenario())


class Nodes:
    """The DHT node's side of NearestReads, faked: its walk (get), the walk that finds the key's nearest nodes, and
    a read from given nodes, each answering as the test sets."""

    def __init__(self, records: int):
        self.records = records
        self.nearest = {b"n1": "peer1", b"n2": "peer2"}
        self.answering = set(self.nearest)
        self.calls: list[str] = []

    async def get(self, key, latest=False):
        assert latest and key == KEY
        self.calls.append("walk")
        return found(self.records)

    async def find_nearest(self, _node, key, k):
        assert k == READ_REPLICAS and key == KEY
        self.calls.append("find nearest")
        if self.nearest is None:
            raise TimeoutError("the walk found no one")
        return self.nearest

    async def read_from(self, _node, key, nodes):
        self.calls.append(f"read {len(nodes)}")
        answered = len(set(nodes) & self.answering)
        return (found(self.records) if answered and self.records else None), answered


def test_reads_ask_the_nearest_nodes_found_by_the_last_walk_and_walk_again_when_one_fails_or_time_is_up():
    async def scenario():
        now = [0.0]
        nodes = Nodes(records=12)
        reads = NearestReads([KEY], None, nodes.get, clock=lambda: now[0], read_from=nodes.read_from,
                             find_nearest=nodes.find_nearest)
        assert len((await reads(KEY)).value) == 12
        assert sorted(nodes.calls) == ["find nearest", "walk"]  # the first read walks, and finds the nearest
        nodes.calls.clear()
        for _ in range(3):
            now[0] += 1.0
            assert len((await reads(KEY)).value) == 12
        assert nodes.calls == ["read 2"] * 3  # two nodes asked, no walk

        nodes.answering = {b"n1"}  # one of the nearest left: the read walks, and finds the nearest anew
        nodes.calls.clear()
        assert len((await reads(KEY)).value) == 12
        assert nodes.calls[0] == "read 2" and sorted(nodes.calls[1:]) == ["find nearest", "walk"]
        nodes.answering = set(nodes.nearest)

        nodes.calls.clear()
        now[0] += FULL_READ_EVERY  # the nearest were found too long ago: a full walk
        await reads(KEY)
        assert sorted(nodes.calls) == ["find nearest", "walk"]

        nodes.answering, nodes.records = set(nodes.nearest), 0  # they answer, holding nothing: walk
        nodes.calls.clear()
        await reads(KEY)
        assert nodes.calls[0] == "read 2" and "walk" in nodes.calls

        nodes.nearest, nodes.records = None, 12  # the walk for the nearest failed: the read still answers...
        now[0] += FULL_READ_EVERY
        assert len((await reads(KEY)).value) == 12
        nodes.calls.clear()
        await reads(KEY)  # ...and the next one walks again
        assert "walk" in nodes.calls
        assert reads.counts() == dict(from_nearest=3, full_walks=6, fell_back=2, unanswered=1, held_nothing=1,
                                      records_from_nearest=36, records_missed=0)

        async def broken(*_):
            raise ValueError("a reply that does not parse")
        nodes.nearest = {b"n1": "peer1", b"n2": "peer2"}
        await reads(KEY)  # (a walk: the nearest found again)
        reads.read_from = broken
        nodes.calls.clear()
        assert len((await reads(KEY)).value) == 12 and "walk" in nodes.calls  # a read that broke: a walk instead
        assert [reads.counts()[name] for name in ("fell_back", "unanswered", "full_walks")] == [3, 2, 8]

        nodes.calls.clear()  # another key (a group key, read by matchmaking) is walked as hivemind walks it
        reads.get = lambda key, latest: asyncio.sleep(0, result=found(1))
        assert len((await reads("run_grad_averager.0b")).value) == 1 and not nodes.calls
        assert reads.counts()["full_walks"] == 8

    asyncio.run(scenario())


def test_a_read_from_the_nearest_counts_the_live_records_the_last_walk_found_and_it_did_not():
    def records(**expires_in):
        now = get_dht_time()
        return SimpleNamespace(value={name: SimpleNamespace(value=1, expiration_time=now + t)
                                      for name, t in expires_in.items()}, expiration_time=now + 60)

    async def scenario():
        walked = records(a=60, b=60, c=-1)  # c's record had expired: no node need hold it
        nearest = records(a=60)

        async def get(key, latest):
            return walked

        async def find_nearest(_node, key, k):
            return {b"n1": "peer1"}

        async def read_from(_node, key, nodes):
            return nearest, 1

        reads = NearestReads([KEY], None, get, clock=lambda: 0.0, read_from=read_from, find_nearest=find_nearest)
        await reads(KEY)  # a walk
        assert await reads(KEY) is nearest
        # b missed; c had expired
        assert (reads.counts()["records_from_nearest"], reads.counts()["records_missed"]) == (1, 1)

    asyncio.run(scenario())


async def settle() -> None:
    """Let the tasks just made run as far as they can (a read's task, then its walk's)."""
    for _ in range(5):
        await asyncio.sleep(0)


def _done(result) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(result)
    return future


def test_a_peers_report_gives_the_share_of_reads_from_the_nearest_and_what_they_found_and_missed():
    from collab.peers.report import _reads_made  # (peers/ installs as collab.peers)

    incarnations = [dict(walked=4, served=1, joined=0, from_nearest=3, full_walks=1, fell_back=0,
                         records_from_nearest=30, records_missed=1),
                    dict(walked=4, served=0, joined=0, from_nearest=1, full_walks=3, fell_back=1,
                         records_from_nearest=10, records_missed=0)]
    assert _reads_made(incarnations) == dict(progress_reads_from_nearest=0.5, records_per_nearest_read=10.0,
                                             records_missed_per_nearest_read=0.25)
    assert set(_reads_made([]).values()) == {None}  # a peer that made no read: nothing to show, not zero
