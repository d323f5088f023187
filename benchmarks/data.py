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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000,5000", help="corpus sizes in MB of text, comma-separated")
    parser.add_argument("--windows", type=int, default=20000)
    parser.add_argument("--shard-tokens", type=int, default=1 << 24)
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
