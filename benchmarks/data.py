"""The run's corpus as token shards (collab.data): how fast `collab init --dataset` tokenizes, how fast a peer reads
training windows from the shards, and whether a peer's memory grows with the corpus.

For each size (MB of generated English-like text), in a fresh process each so peak memory is that size's alone:
  1. write the corpus (paragraphs of words drawn from a 5,000-word Zipf vocabulary) to a temporary folder;
  2. tokenize it into shards with the embedded tokenizer (collab.data.prepare): MB/s of text;
  3. read `--windows` windows of 512 tokens through collab.data.text.shard_windows (memory-mapped shards, this
     peer's order) and turn each into a tensor: windows/s, against the bound of 10x the 1,009 samples/s that a
     compiled ALBERT-base reaches on an H100 at sequence 512;
  4. the peak resident memory of the reading process (ru_maxrss; the reading runs in a process of its own, as in a
     peer), against the bound: within 100 MB of the smallest corpus's.

    python3 benchmarks/data.py [--sizes 100,1000,5000] [--windows 20000] [--shard-tokens 16777216]

Prints one row per size and the ratios (read rate / bound, RSS growth / bound).

    python3 benchmarks/data.py --swarm [--epochs 12]

The shards served by the swarm instead: `collab init --dataset` on the embedded corpus (small shards), the organizer's
peer, then three volunteers with nothing but the join line, one after another, all on 127.0.0.1. Prints the bytes
each volunteer fetched from the organizer's peer and from the other volunteers: the organizer's share of what was
served, against 1.0 for volunteers that could only download from the organizer.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

READ_BOUND = 10 * 1009  # windows/s: ten times a compiled ALBERT-base's samples/s on an H100 (sequence 512)
RSS_BOUND_MB = 100.0  # a peer's memory may grow at most this much from the smallest corpus to the largest
WINDOW = 512


def _write_corpus(folder: Path, megabytes: float, seed: int = 0) -> Path:
    """Files of ~100 MB of paragraphs (40-200 words of a Zipf vocabulary); past the first 100 MB each file is a
    reshuffle of the first one's paragraphs (generating words is the slow part, and the shape is what counts)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = np.array(_vocabulary(5000))
    weights = 1.0 / np.arange(1, len(words) + 1)
    weights /= weights.sum()
    paragraphs, size = [], 0
    while size < min(100e6, megabytes * 1e6):
        paragraphs.append(" ".join(rng.choice(words, size=int(rng.integers(40, 200)), p=weights)))
        size += len(paragraphs[-1]) + 2
    folder.mkdir(parents=True, exist_ok=True)
    written, part = 0, 0
    while written < megabytes * 1e6:
        order = rng.permutation(len(paragraphs)) if part else range(len(paragraphs))
        with open(folder / f"part-{part:04d}.txt", "w") as f:
            for i in order:
                f.write(paragraphs[i] + "\n\n")
                written += len(paragraphs[i]) + 2
                if written >= megabytes * 1e6:
                    break
        part += 1
    return folder


def _vocabulary(n: int) -> list[str]:
    import itertools

    syllables = [a + b for a, b in itertools.product("bcdfghklmnprstvw", "aeiou")]
    return [syllables[k % 80] + syllables[(k // 80) % 80] + ("s" if k >= 6400 else "") for k in range(n)]


def _prepare(megabytes: float, folder: Path, shard_tokens: int) -> dict:
    from collab.data.prepare import prepare_corpus
    from collab.data.shards import write_shard_list
    from collab.data.tokenizer import embedded_tokenizer_file

    corpus = _write_corpus(folder / "corpus", megabytes)
    prepared = prepare_corpus(str(corpus), embedded_tokenizer_file(8000), folder / "shards", shard_tokens)
    write_shard_list(folder / "shards", prepared.shards)
    return {"tokens": prepared.total_tokens, "shards": len(prepared.shards),
            "tokenize_mb_s": prepared.megabytes_per_second}


def _read(folder: Path, windows: int) -> dict:
    """In a process of its own: what a peer's data reading costs, alone."""
    import torch

    from collab.data.text import shard_windows

    reader = shard_windows(folder / "shards", WINDOW, seed=1)
    started = time.perf_counter()
    for _ in range(windows):
        torch.as_tensor(next(reader))
    return {"windows_s": windows / (time.perf_counter() - started),
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _child(*args: str) -> dict:
    child = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    if child.returncode != 0:
        raise SystemExit(child.stderr[-2000:])
    return json.loads(child.stdout.strip().splitlines()[-1])


def _swarm(epochs: int, peers: int = 4) -> int:
    """Who served the shards: the organizer's peer, or the volunteers that hold verified copies."""
    import re
    import shutil
    import uuid

    from collab.data.corpus import embedded_corpus_path
    from collab.peers.launcher import LocalSwarm
    from collab.run.folder import load_run_folder
    from tests.conftest import peer_env, read_summary, run_cli, swarm_config

    run_id = f"data-bench-{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory(prefix="collab-data-swarm-") as tmp:
        tmp = Path(tmp)
        (tmp / "corpus").mkdir()
        shutil.copyfile(embedded_corpus_path(), tmp / "corpus" / "docs.txt")
        config = swarm_config(tmp, 2, {"training.target_batch_size": 256})  # rounds of 2 or more: nobody waits
        init = run_cli("init", run_id, "--config", str(config), "--dir", str(tmp / "run"), "--dataset",
                       str(tmp / "corpus"), "--shard-tokens", "16384", timeout=300)
        if init.returncode != 0:
            raise SystemExit(init.stderr)
        run = load_run_folder(tmp / "run")
        args = {0: ["--run", str(tmp / "run")], **{i: ["--run-key", run.fingerprint] for i in range(1, peers)}}
        caches = {i: {"COLLAB_CACHE_DIR": str(tmp / f"cache{i}")} for i in range(1, peers)}
        with LocalSwarm(peers, run_id, tmp / "peers", ["--no-live", "--max-epochs", str(epochs)], env=peer_env(),
                        per_peer_args=args, per_peer_env=caches) as swarm:
            swarm.start(count=2, wait_peers=2)
            for i in range(2, peers):  # one after another, as volunteers come: each when the last one trains
                deadline = time.monotonic() + 300
                while not re.search(r"^epoch \d+ .*loss \d", swarm.peers[i - 1].log_text(), re.M):
                    if time.monotonic() > deadline:
                        raise SystemExit(f"peer {i - 1} did not train:\n{swarm.peers[i - 1].log_text()[-2000:]}")
                    time.sleep(1)
                swarm.start_peer(i, ["--wait-peers", "2"])
            if not swarm.wait(timeout=1800):
                raise SystemExit("the swarm did not finish")
            summaries = [read_summary(p) for p in swarm.peers]
    organizer = summaries[0]["peer_id"]
    from_organizer = [name for s in summaries[1:] for name, who in s["data"]["shards_from"] if who == organizer]
    distinct = {name for s in summaries[1:] for name, _ in s["data"]["shards_from"]}
    rows, total_org, total_other = [], 0, 0
    for i, s in enumerate(summaries[1:], start=1):
        got = s["data"]["bytes_from"]
        mine = got.get(organizer, 0)
        others = sum(v for k, v in got.items() if k != organizer)
        total_org, total_other = total_org + mine, total_other + others
        rows.append(f"{i:>9} {s['data']['shards_fetched']:>8} {mine / 1e6:>16.2f} {others / 1e6:>18.2f}")
    print(f"{len(run.manifest.data.shards)} shards of {run.manifest.data.shard_tokens} tokens, {peers} peers, "
          f"{epochs} epochs")
    print(f"{'volunteer':>9} {'fetched':>8} {'MB from organizer':>16} {'MB from volunteers':>18}")
    print("\n".join(rows))
    share = total_org / max(1, total_org + total_other)
    print(f"organizer served {share:.2f} of the bytes (1.00 if volunteers could only download from it); "
          f"other peers {1 - share:.2f}")
    print(f"the volunteers fetched {len(distinct)} distinct shards; the organizer sent {len(from_organizer)} shard "
          f"copies: {len(from_organizer) / max(1, len(distinct)):.2f} per shard (at least 1.00: a shard nobody else "
          f"held yet; {sum(len(s['data']['shards_from']) for s in summaries[1:]) / max(1, len(distinct)):.2f} if "
          "every fetch went to the organizer)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000,5000", help="corpus sizes in MB of text, comma-separated")
    parser.add_argument("--windows", type=int, default=20000)
    parser.add_argument("--shard-tokens", type=int, default=1 << 24)
    parser.add_argument("--swarm", action="store_true", help="measure who serves the shards in a 4-peer swarm")
    parser.add_argument("--epochs", type=int, default=12, help="--swarm: epochs the swarm trains")
    parser.add_argument("--prepare", default=None, help=argparse.SUPPRESS)  # a child: SIZE:FOLDER
    parser.add_argument("--read", default=None, help=argparse.SUPPRESS)  # a child: FOLDER
    args = parser.parse_args()
    if args.prepare is not None:
        size, folder = args.prepare.split(":", 1)
        print(json.dumps(_prepare(float(size), Path(folder), args.shard_tokens)))
        return 0
    if args.read is not None:
        print(json.dumps(_read(Path(args.read), args.windows)))
        return 0
    if args.swarm:
        return _swarm(args.epochs)
    rows = []
    for size in (float(s) for s in args.sizes.split(",")):
        with tempfile.TemporaryDirectory(prefix="collab-data-bench-") as tmp:
            row = {"megabytes": size, **_child("--prepare", f"{size}:{tmp}", "--shard-tokens", str(args.shard_tokens))}
            rows.append({**row, **_child("--read", tmp, "--windows", str(args.windows))})
    base = rows[0]["rss_mb"]
    print(f"{'corpus MB':>10} {'tokens':>14} {'shards':>7} {'tokenize MB/s':>14} {'read windows/s':>15} "
          f"{'read/bound':>11} {'peak RSS MB':>12} {'RSS growth/bound':>17}")
    for r in rows:
        print(f"{r['megabytes']:>10.0f} {r['tokens']:>14,} {r['shards']:>7} {r['tokenize_mb_s']:>14.1f} "
              f"{r['windows_s']:>15,.0f} {r['windows_s'] / READ_BOUND:>11.2f} {r['rss_mb']:>12.0f} "
              f"{(r['rss_mb'] - base) / RSS_BOUND_MB:>17.2f}")
    print(f"bounds: reading >= {READ_BOUND:,} windows/s of {WINDOW} tokens (read/bound >= 1); peak RSS within "
          f"{RSS_BOUND_MB:.0f} MB of the smallest corpus's (RSS growth/bound <= 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
