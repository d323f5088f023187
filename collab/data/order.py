"""Which windows of the run's shards a peer reads, and in what order: a pure function of the run's data seed, the
peer's starting point and its position (how many windows it has read), so anyone can reproduce what a peer trained
on, and a restarted peer resumes where it was.

A pass over the corpus visits every shard once, in an order that is the same for every peer (a permutation drawn
from the seed and the pass number). Each peer enters that ring of shards at its own `start` (a fraction of the ring)
and reads onward; within a shard it reads the shard's windows in its own permuted order. Peers that start at
different points read different shards until one catches up with the next: spreading the starts spreads the
work. A window is `length` consecutive tokens at a multiple of `length` in its shard (packed: documents are
separated inside the token stream, not by padding).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np


def start_for_peer(seed: int, peer_id: str) -> float:
    """A peer's default starting point on the ring of shards, in [0, 1): a hash of the run's seed and its id."""
    digest = hashlib.sha256(f"collab-data:{seed}:{peer_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64


def _rng(*key) -> np.random.Generator:
    digest = hashlib.sha256(":".join(map(str, ("collab-data", *key))).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:16], "big"))


@dataclass(frozen=True)
class Window:
    position: int  # how many windows this peer had read before this one
    shard: int  # index into the manifest's list of shards
    start: int  # token offset in that shard


class WindowOrder:
    """The windows one peer reads: `shard_tokens` (each shard's token count, in manifest order), `length` tokens per
    window, the run's `seed`, and the peer's `start` on the ring (start_for_peer, or a point the swarm assigned)."""

    def __init__(self, shard_tokens: list[int], length: int, seed: int, start: float):
        if length < 1:
            raise ValueError(f"a window must hold at least one token, got length {length}")
        if not 0.0 <= start < 1.0:
            raise ValueError(f"start must be in [0, 1), got {start}")
        self.length, self.seed, self.start = length, seed, start
        self.windows = [tokens // length for tokens in shard_tokens]
        self.usable = [i for i, count in enumerate(self.windows) if count > 0]
        self.per_pass = sum(self.windows)
        if self.per_pass == 0:
            raise ValueError(f"no shard holds a whole window of {length} tokens")
        self._entry = int(start * len(self.usable))

    def shard_sequence(self, pass_index: int) -> list[int]:
        """The shards this peer visits in pass `pass_index`, in order."""
        ring = [self.usable[i] for i in _rng(self.seed, "pass", pass_index).permutation(len(self.usable))]
        return ring[self._entry:] + ring[:self._entry]

    def window_starts(self, pass_index: int, shard: int) -> np.ndarray:
        """Token offsets of the windows of `shard`, in the order this peer reads them in pass `pass_index`."""
        rng = _rng(self.seed, "windows", pass_index, shard, self.start)
        return rng.permutation(self.windows[shard]).astype(np.int64) * self.length

    def locate(self, position: int) -> tuple[int, int, int]:
        """(pass, index in that pass's shard sequence, index of the window within the shard) of window `position`."""
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        pass_index, rest = divmod(position, self.per_pass)
        for k, shard in enumerate(self.shard_sequence(pass_index)):
            if rest < self.windows[shard]:
                return pass_index, k, rest
            rest -= self.windows[shard]
        raise AssertionError("unreachable: the windows of a pass add up to per_pass")

    def iterate(self, position: int = 0) -> Iterator[Window]:
        """Every window from `position` on, forever (pass after pass)."""
        pass_index, k, w = self.locate(position)
        while True:
            sequence = self.shard_sequence(pass_index)
            for shard in sequence[k:]:
                for start in self.window_starts(pass_index, shard)[w:]:
                    yield Window(position, shard, int(start))
                    position += 1
                w = 0
            pass_index, k = pass_index + 1, 0

    def shards_ahead(self, position: int, count: int) -> list[int]:
        """The next `count` distinct shards this peer will read from `position` on (what to fetch ahead of use)."""
        ahead: list[int] = []
        pass_index, k, _ = self.locate(position)
        while len(ahead) < min(count, len(self.usable)):
            for shard in self.shard_sequence(pass_index)[k:]:
                if shard not in ahead:
                    ahead.append(shard)
                if len(ahead) == count:
                    break
            pass_index, k = pass_index + 1, 0
        return ahead


def start_in_largest_gap(taken: list[float], fallback: float) -> float:
    """A joining peer's start on the ring of shards: the middle of the largest gap between the starts other peers
    published (each in [0, 1)), so concurrent peers read different shards; `fallback` (start_for_peer) when none
    is known. Starts that are not a number in [0, 1) (another peer's record is untrusted) are ignored."""
    points = sorted({s for s in taken if isinstance(s, float) and 0.0 <= s < 1.0})
    if not points:
        return fallback
    gaps = [((points[(i + 1) % len(points)] - p) % 1.0 or 1.0, p) for i, p in enumerate(points)]
    width, left = max(gaps)
    return (left + width / 2) % 1.0


def _ring_distance(a: float, b: float) -> float:
    d = abs(a - b) % 1.0
    return min(d, 1.0 - d)


def spread_twins(mine: str, starts: dict[str, float]) -> float:
    """Peer `mine`'s start after a second look at everyone's (`starts`: peer id -> start, its own included).

    Peers that joined at once saw the same starts, so start_in_largest_gap gave them the same point. Once each has
    published its own, every one of them sees the twins: those closer to it than a quarter of a fair share of the
    ring (1 / peers). The twin with the smallest id keeps the point; the others, in id order, each take the largest
    gap left by the rest and the twins before it. Every twin computes the same placement from the same view, so
    they do not collide again. Not a number in [0, 1) (another peer's claim is untrusted): ignored."""
    points = {peer: s for peer, s in starts.items() if isinstance(s, float) and 0.0 <= s < 1.0}
    own = points.get(mine)
    if own is None:
        raise ValueError(f"peer {mine!r} has no start of its own among {len(points)}")
    near = 0.25 / len(points)
    twins = sorted(peer for peer, s in points.items() if _ring_distance(s, own) < near)
    if twins[0] == mine:
        return own
    taken = [s for peer, s in points.items() if peer not in twins] + [points[twins[0]]]
    for peer in twins[1:]:
        start = start_in_largest_gap(taken, own)
        if peer == mine:
            return start
        taken.append(start)
    raise AssertionError("unreachable: `mine` is one of its own twins")
