"""Token shards (collab.data.shards) and the order peers read them in (collab.data.order): no process, no socket."""

from __future__ import annotations

import numpy as np
import pytest

from collab.data.order import WindowOrder, start_for_peer
from collab.data.shards import Shard, ShardInfo, ShardWriter, file_sha256, open_shards, token_dtype
from collab.errors import UserError


def _documents(count: int, vocab: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(1, 40))) for _ in range(count)]


def _write(folder, documents, vocab: int, shard_tokens: int) -> list[ShardInfo]:
    writer = ShardWriter(folder, vocab, shard_tokens)
    infos = [info for doc in documents for info in writer.add(doc)]
    last = writer.finish()
    return infos + ([last] if last else [])


def test_shards_hold_the_documents_exactly_in_fixed_sizes_with_their_boundaries(tmp_path):
    documents = _documents(200, vocab=30_000)
    infos = _write(tmp_path, documents, 30_000, shard_tokens=256)
    total = sum(len(d) for d in documents)
    assert [i.tokens for i in infos] == [256] * (total // 256) + ([total % 256] if total % 256 else [])
    shards = open_shards(tmp_path, infos)
    assert all(s.tokens.dtype == np.uint16 for s in shards)
    assert np.array_equal(np.concatenate([s.tokens for s in shards]), np.concatenate(documents))
    # every document's start, as a global offset, where it is recorded
    starts = np.concatenate([s.doc_starts.astype(np.int64) + 256 * i for i, s in enumerate(shards)])
    assert np.array_equal(starts, np.cumsum([0] + [len(d) for d in documents[:-1]]))
    assert all(info.sha256 == file_sha256(tmp_path / info.name) for info in infos)


def test_a_vocabulary_over_65536_ids_takes_four_bytes_a_token_and_foreign_ids_are_refused(tmp_path):
    assert token_dtype(65_536) == np.uint16 and token_dtype(65_537) == np.uint32
    infos = _write(tmp_path, [np.array([0, 70_000, 5])], 70_001, shard_tokens=8)
    assert Shard(tmp_path / infos[0].name).tokens.tolist() == [0, 70_000, 5]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ShardWriter(tmp_path / "other", 100, 8).add(np.array([3, 100]))


def test_a_truncated_or_foreign_shard_is_refused_in_one_line(tmp_path):
    infos = _write(tmp_path, _documents(20, vocab=1000), 1000, shard_tokens=64)
    path = tmp_path / infos[0].name
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(UserError, match=r"truncated or corrupt.*prepare the data again"):
        open_shards(tmp_path, infos)
    path.write_bytes(b"not a shard at all, but long enough to hold a header of sixty-four bytes....")
    with pytest.raises(UserError, match="not a collab token shard"):
        open_shards(tmp_path, infos)
    (tmp_path / infos[1].name).unlink()
    with pytest.raises(UserError, match=f"shard {infos[1].name} is missing"):
        open_shards(tmp_path, infos[1:])


def _order(start: float, seed: int = 7) -> WindowOrder:
    return WindowOrder([1000, 1000, 999, 300, 10, 1000, 1000, 1000], length=100, seed=seed, start=start)


def test_a_pass_reads_every_window_once_and_the_order_is_reproducible_and_resumable():
    order = _order(start_for_peer(7, "QmPeerA"))
    assert order.per_pass == 10 + 10 + 9 + 3 + 0 + 10 + 10 + 10  # the 10-token shard holds no window
    windows = [w for w, _ in zip(order.iterate(), range(2 * order.per_pass))]
    first = {(w.shard, w.start) for w in windows[:order.per_pass]}
    assert len(first) == order.per_pass and all(w.start % 100 == 0 for w in windows)
    again = _order(start_for_peer(7, "QmPeerA"))
    assert [w for w, _ in zip(again.iterate(), range(2 * order.per_pass))] == windows  # anyone can reproduce it
    for position in (0, 1, 9, 37, order.per_pass, order.per_pass + 23):  # a restart resumes where it was
        assert next(order.iterate(position)) == windows[position]
    # the next pass visits the shards in another order, and another seed reads another order
    assert [w.shard for w in windows[:order.per_pass]] != [w.shard for w in windows[order.per_pass:]]
    assert order.shard_sequence(0) != _order(order.start, seed=8).shard_sequence(0)
    assert order.shards_ahead(0, 3) == list(dict.fromkeys(w.shard for w in windows))[:3]


def _overlap(orders: list[WindowOrder], each: int) -> float:
    """The fraction of windows read that another peer also read, each peer reading `each` windows."""
    seen: dict = {}
    for order in orders:
        for w, _ in zip(order.iterate(), range(each)):
            seen[(w.shard, w.start)] = seen.get((w.shard, w.start), 0) + 1
    return 1 - len(seen) / (each * len(orders))


def test_eight_peers_reading_an_eighth_of_a_pass_each_overlap_little():
    shard_tokens = [4096] * 64
    orders = [WindowOrder(shard_tokens, 128, seed=1, start=start_for_peer(1, f"peer-{i}")) for i in range(8)]
    each = orders[0].per_pass // 8
    hashed = _overlap(orders, each)
    spread = _overlap([WindowOrder(shard_tokens, 128, seed=1, start=i / 8) for i in range(8)], each)
    print(f"\noverlap of 8 peers reading 1/8 of a pass each: {hashed:.3f} with starts hashed from their ids, "
          f"{spread:.3f} with starts spread evenly")
    assert spread == 0.0  # evenly spread starts read disjoint shards
    assert hashed < 0.45  # random starts: about 1 - (1 - (1 - 1/8) ** 8) = 0.34 expected


def _tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "[EOS]"] + [f"w{i}" for i in range(300)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    return path


def _corpus(folder, paragraphs: int = 400):
    import json

    rng = np.random.default_rng(1)
    text = lambda: " ".join(f"w{i}" for i in rng.integers(0, 300, size=int(rng.integers(3, 30))))  # noqa: E731
    folder.mkdir()
    (folder / "a.txt").write_text("\n\n".join(text() for _ in range(paragraphs)) + "\n")
    (folder / "b.jsonl").write_text("".join(json.dumps({"text": text(), "id": i}) + "\n" for i in range(paragraphs)))
    return folder


def test_a_corpus_is_prepared_from_text_and_json_lines_and_an_interrupted_preparation_resumes(tmp_path, monkeypatch):
    import collab.data.prepare as prepare

    tokenizer, corpus = _tokenizer(tmp_path / "tokenizer.json"), _corpus(tmp_path / "corpus")
    whole = prepare.prepare_corpus(str(corpus), tokenizer, tmp_path / "whole", shard_tokens=500, separator=1)
    shards = open_shards(tmp_path / "whole", whole.shards)
    tokens = np.concatenate([s.tokens for s in shards])
    assert whole.total_tokens == len(tokens) > 4000 and (tokens == 0).sum() == 0  # no unknown word
    assert (tokens == 1).sum() == 800  # one end-of-text per document: 400 paragraphs and 400 lines
    assert sum(len(s.doc_starts) for s in shards) == 800

    monkeypatch.setattr(prepare, "BATCH_DOCUMENTS", 64)
    calls = []

    def interrupt(read, tokens):
        calls.append(read)
        if len(calls) == 7:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare.prepare_corpus(str(corpus), tokenizer, tmp_path / "resumed", shard_tokens=500, separator=1,
                               progress=interrupt)
    done_before = len(list((tmp_path / "resumed").glob("*.shard")))
    assert 0 < done_before < len(whole.shards)
    resumed = prepare.prepare_corpus(str(corpus), tokenizer, tmp_path / "resumed", shard_tokens=500, separator=1)
    assert resumed.shards == whole.shards  # the same files, byte for byte (their sha256)
    assert resumed.bytes_read < whole.bytes_read  # and what was done was not done again


def test_a_dataset_without_text_gets_one_line(tmp_path):
    from collab.data.prepare import prepare_corpus

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("\n\n  \n")
    with pytest.raises(UserError, match="holds no text"):
        prepare_corpus(str(tmp_path / "empty"), _tokenizer(tmp_path / "t.json"), tmp_path / "out", 100)
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(b"\x89PNG")
    with pytest.raises(UserError, match="holds no .txt, .md, .jsonl or .parquet files"):
        prepare_corpus(str(tmp_path / "images"), tmp_path / "t.json", tmp_path / "out", 100)


def test_a_tokenizer_that_does_not_cover_the_data_gets_one_line(tmp_path):
    from collab.data.prepare import prepare_corpus

    (tmp_path / "greek.txt").write_text("\n\n".join("άλφα βήτα γάμμα w1 δέλτα" for _ in range(50)))
    with pytest.raises(UserError, match=r"reads 80% of dataset .* as \[UNK\].*set task.tokenizer"):
        prepare_corpus(str(tmp_path / "greek.txt"), _tokenizer(tmp_path / "t.json"), tmp_path / "out", 100)
    assert not list((tmp_path / "out").glob("*.shard"))  # nothing half-written: judged before the first shard


def test_peers_that_join_one_by_one_take_the_largest_gap_and_then_read_disjoint_shards():
    from collab.data.order import start_in_largest_gap

    assert start_in_largest_gap([], 0.3) == 0.3
    assert start_in_largest_gap([0.9], 0.3) == pytest.approx(0.4)  # opposite the only other peer
    assert start_in_largest_gap([0.1, 0.2, float("nan"), 7.0, "x"], 0.0) == pytest.approx(0.65)  # junk ignored
    starts: list[float] = []
    for i in range(8):
        starts.append(start_in_largest_gap(starts, start_for_peer(1, f"peer-{i}")))
    orders = [WindowOrder([4096] * 64, 128, seed=1, start=start) for start in starts]
    each = orders[0].per_pass // 8
    overlap = _overlap(orders, each)
    print(f"\noverlap of 8 peers joining one by one, each taking the largest gap: {overlap:.3f}")
    assert overlap < 0.15, (starts, overlap)


def test_peers_that_joined_at_once_spread_out_on_a_second_look_without_colliding_again():
    from collab.data.order import spread_twins, start_in_largest_gap

    shard_tokens, peers = [4096] * 64, [f"peer-{i}" for i in range(8)]
    # peer 0 is alone; the other seven join at the same moment, each seeing only peer 0: one point for all seven
    first = start_for_peer(1, peers[0])
    chosen = {peers[0]: first, **{p: start_in_largest_gap([first], start_for_peer(1, p)) for p in peers[1:]}}
    assert len(set(chosen.values())) == 2
    each = WindowOrder(shard_tokens, 128, seed=1, start=0.0).per_pass // 8
    before = _overlap([WindowOrder(shard_tokens, 128, seed=1, start=s) for s in chosen.values()], each)
    # each then sees all eight claims: the twin with the smallest id keeps the point, the others take gaps in turn
    after = {p: spread_twins(p, chosen) for p in peers}
    assert after[peers[0]] == first and after[min(peers[1:])] == chosen[min(peers[1:])]
    overlap = _overlap([WindowOrder(shard_tokens, 128, seed=1, start=s) for s in after.values()], each)
    print(f"\noverlap of 8 peers, 7 joining at once: {before:.3f} at the largest gap, {overlap:.3f} after the "
          "second look")
    assert before > 0.6 and overlap < 0.15, (after, overlap)
    # a second look that finds no twin moves nobody (peers that joined one by one stay where they were)
    for p in peers:
        assert spread_twins(p, after) == after[p]
    # another peer's claim is untrusted: junk is ignored, and a peer with no start of its own is a bug
    assert spread_twins("a", {"a": 0.5, "b": float("nan"), "c": 7.0, "d": "x"}) == 0.5
    with pytest.raises(ValueError, match="no start of its own"):
        spread_twins("a", {"b": 0.5})


def test_a_pool_of_tokenizing_processes_writes_the_same_shards(tmp_path, monkeypatch):
    """A large corpus is tokenized by a process per core (spawned, each with its own tokenizer); the shards are the
    ones a single process writes, byte for byte."""
    import collab.data.prepare as prepare

    tokenizer, corpus = _tokenizer(tmp_path / "tokenizer.json"), _corpus(tmp_path / "corpus")
    alone = prepare.prepare_corpus(str(corpus), tokenizer, tmp_path / "alone", shard_tokens=500, separator=1)
    monkeypatch.setattr(prepare, "POOL_FROM_BYTES", 0)
    monkeypatch.setattr(prepare, "BATCH_DOCUMENTS", 64)
    monkeypatch.setattr(prepare.os, "cpu_count", lambda: 2)
    assert prepare._workers(str(corpus)) == 2
    pooled = prepare.prepare_corpus(str(corpus), tokenizer, tmp_path / "pooled", shard_tokens=500, separator=1)
    assert pooled.shards == alone.shards


def test_a_joiner_reads_the_others_signed_claims_and_counts_each_bad_one_against_its_signer():
    from types import SimpleNamespace

    from hivemind.utils.crypto import RSAPrivateKey

    from collab.records.identity import peer_id_of
    from collab.train.data_feed import BAD_CLAIM, published_starts

    keys = [RSAPrivateKey() for _ in range(3)]
    ids = [peer_id_of(k.get_public_key()) for k in keys]
    subkeys = [b"[owner:" + k.get_public_key().to_bytes() + b"]" for k in keys]
    claims = {subkeys[0]: 0.25, subkeys[1]: 7.0, subkeys[2]: 0.75, b"no owner": 0.5}

    class DHT:  # what a read of the run's keys returns: no records yet, and the claims
        def get(self, key, latest=False):
            if not key.endswith("_data_starts"):
                return None
            return SimpleNamespace(value={s: SimpleNamespace(value=v) for s, v in claims.items()})

    refused = []
    starts = published_starts(DHT(), "run", but=ids[2], refused=lambda peer, why: refused.append((peer, why)))
    assert starts == {ids[0]: 0.25}  # peer 2 is the reader itself; peer 1's claim is junk; one is unsigned
    assert sorted(refused) == sorted([(ids[1], BAD_CLAIM), ("unsigned", BAD_CLAIM)])
