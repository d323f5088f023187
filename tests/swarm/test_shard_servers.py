"""Fetching a shard (collab.run.shard_fetch) between real DHT nodes and p2pd: a peer that serves a corrupt shard is
refused, counted, attributed and not asked again; the run's URL prefix (an HTTP server on 127.0.0.1) is asked first,
and a wrong file there falls back to the swarm."""

from __future__ import annotations

import functools
import http.server
import threading

import numpy as np
import pytest

from collab.data.shards import ShardWriter
from collab.run.manifest import DataManifest, ShardEntry
from collab.run.shard_fetch import REFUSED, RunShards, ShardFetcher, publish_holdings, read_holdings
from collab.run.sharing import RunFileServer
from collab.swarm.node import PeerConfig, Swarm
from tests.conftest import wait_for


@pytest.fixture()
def three_nodes(run_id, tmp_path, no_leftover_processes):
    nodes = []
    try:
        for name in ("good", "bad", "reader"):
            initial = [str(a) for a in nodes[0].dht.get_visible_maddrs()] if nodes else []
            nodes.append(Swarm(PeerConfig(run_id=run_id, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial,
                                          identity=tmp_path / f"{name}.key")))
        yield nodes
    finally:
        for node in reversed(nodes):
            node.shutdown()


def _run_data(folder) -> DataManifest:
    writer = ShardWriter(folder, 5000, 2000)
    infos = writer.add(np.random.default_rng(0).integers(0, 5000, size=6000))
    return DataManifest(shard_tokens=2000, total_tokens=6000,
                        shards=[ShardEntry(name=i.name, tokens=i.tokens, sha256=i.sha256) for i in infos])


class _Files(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_a_corrupt_shard_is_refused_and_its_server_banned_and_a_url_is_tried_first(three_nodes, run_id, tmp_path):
    good, bad, reader = three_nodes
    data = _run_data(tmp_path / "organizer")
    (tmp_path / "forged").mkdir()
    for entry in data.shards:  # same names, same size, other tokens: only the sha256 tells
        blob = bytearray((tmp_path / "organizer" / entry.name).read_bytes())
        blob[100] ^= 0xFF
        (tmp_path / "forged" / entry.name).write_bytes(bytes(blob))
    servers = [RunFileServer(good.dht, {}, shards=RunShards(data, tmp_path / "organizer").path_if_held).start(),
               RunFileServer(bad.dht, {}, shards=lambda name: tmp_path / "forged" / name).start()]
    httpd = None
    try:
        indices = list(range(len(data.shards)))
        publish_holdings(bad.dht, run_id, bad.public_key, indices)  # the bad one says it holds everything
        publish_holdings(good.dht, run_id, good.public_key, indices[1:])  # the good one, all but the first
        wait_for(lambda: len(read_holdings(reader.dht, run_id, len(indices)).get(1, [])) == 2, timeout=30,
                 what="both servers' holdings in the DHT")
        refusals = []
        fetcher = ShardFetcher(reader.dht, run_id, reader.peer_id, data, known=[good.peer_id],
                               on_refused=lambda peer, why: refusals.append((peer, why)))
        try:
            names = [s.name for s in data.shards]
            for name in names[1:] + names[:1]:  # shard 0 only the known peers are left to ask for
                blob = fetcher(name)
                assert blob == (tmp_path / "organizer" / name).read_bytes()
            assert fetcher.served == {good.peer_id: sum((tmp_path / "organizer" / n).stat().st_size for n in names)}
            # asked at most once: refused, counted, attributed to the server, which is then not asked again
            assert refusals == [(bad.peer_id, REFUSED)] and fetcher.refused == {bad.peer_id: 1}

            # the run's URL prefix: asked first, and a wrong file there is refused (the swarm sends the right one)
            folder = tmp_path / "www"
            folder.mkdir()
            (folder / names[0]).write_bytes((tmp_path / "organizer" / names[0]).read_bytes())
            (folder / names[1]).write_bytes((tmp_path / "forged" / names[1]).read_bytes())
            httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Files, directory=str(folder)))
            threading.Thread(target=httpd.serve_forever, daemon=True).start()
            fetcher.url = f"http://127.0.0.1:{httpd.server_address[1]}/"
            before = dict(fetcher.served)
            first = (tmp_path / "organizer" / names[0]).read_bytes()
            assert fetcher(names[0]) == first
            assert fetcher.served["url"] == len(first) and fetcher.served[good.peer_id] == before[good.peer_id]
            assert fetcher(names[1]) == (tmp_path / "organizer" / names[1]).read_bytes()
            assert fetcher.refused["url"] == 1 and fetcher.served[good.peer_id] > before[good.peer_id]
            assert fetcher(names[2]) == (tmp_path / "organizer" / names[2]).read_bytes()  # a 404: from the swarm
        finally:
            fetcher.close()
    finally:
        if httpd is not None:
            httpd.shutdown()
        for server in servers:
            server.stop()
