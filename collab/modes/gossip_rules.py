"""averaging.mode gossip's arithmetic, apart from the wire (collab.modes.gossip): how far a merge moves, how many local
steps come before the next one, which peer is asked, whether another peer's parameters can be trusted, and the
sketch of a replica that lets a reader estimate how far apart the replicas are.

A merge is theta <- (1 - a) * theta + a * theta_peer. The factor a, from this peer's side (`Side`: its clock, the
samples it trained, and its recent loss):
- constant: the configured value (dpwa; the papers it follows derive one);
- clock: a = peer_clock / (clock + peer_clock) (dpwa): the older model weighs more;
- loss: a = loss / (loss + peer_loss): the lower-loss model weighs more. (dpwa's README writes it as clock's
  formula with losses, which would let the worse model weigh more; this is the intent it states.)
- evolutionary (seed 000's "random LERP"): u is drawn uniformly in [0, 1] once per exchange and sent along, so
  both sides use the same one; the better model (lower recent loss) moves by min(u, 1 - u), the worse one by
  max(u, 1 - u). The better moves less, and - as with clock and loss - both land on the same point
  (up to the steps each took meanwhile).
dpwa's divergence_threshold then applies to every rule: below that loss, a shrinks by loss / threshold.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

SKETCH_SIZE = 32
MIN_SCORE, MAX_SCORE = 1 / 16, 1.0


@dataclass(frozen=True)
class Side:
    clock: int  # samples this replica has trained (its own, plus what merges brought in: see GossipOptimizer)
    loss: Optional[float]  # its recent mean loss; None before it has one


def interpolation(rule: str, me: Side, peer: Side, *, constant: float = 0.5, u: float = 0.5,
                  divergence_threshold: float = 0.0) -> float:
    """The factor a of a merge, from `me`'s side. With no loss on one side, the loss rules fall back to 0.5."""
    if rule == "constant":
        a = constant
    elif rule == "clock":
        total = me.clock + peer.clock
        a = peer.clock / total if total > 0 else 0.5
    elif rule in ("loss", "evolutionary"):
        if me.loss is None or peer.loss is None:
            a = 0.5
        elif rule == "loss":
            total = me.loss + peer.loss
            a = me.loss / total if total > 0 else 0.5
        else:
            small, large = min(u, 1 - u), max(u, 1 - u)
            a = small if me.loss <= peer.loss else large
    else:
        raise ValueError(f"unknown interpolation rule {rule!r}")
    if divergence_threshold > 0 and me.loss is not None and me.loss < divergence_threshold:
        a *= me.loss / divergence_threshold
    return min(1.0, max(0.0, a))


def local_steps(mean: float, rng: random.Random) -> int:
    """K ~ Poisson(mean), at least 1 (Knuth's method for small means, a rounded normal for large ones)."""
    if mean > 60:
        return max(1, round(rng.gauss(mean, math.sqrt(mean))))
    limit, k, product = math.exp(-mean), 0, rng.random()
    while product > limit:
        k += 1
        product *= rng.random()
    return max(1, k)


class FlowControl:
    """dpwa's flow control: every peer starts with score 1; a timeout or failure halves it, a success doubles it
    (within [1/16, 1]); a peer is picked with probability proportional to its score. A peer whose parameters were
    refused on hard evidence (not finite, the wrong shapes, far off) is never picked again."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.scores: dict[str, float] = {}
        self.banned: set[str] = set()

    def pick(self, candidates: Sequence[str]) -> Optional[str]:
        allowed = [peer for peer in candidates if peer not in self.banned]
        if not allowed:
            return None
        weights = [self.scores.get(peer, MAX_SCORE) for peer in allowed]
        return self.rng.choices(allowed, weights=weights)[0]

    def succeeded(self, peer: str) -> None:
        self.scores[peer] = min(MAX_SCORE, self.scores.get(peer, MAX_SCORE) * 2)

    def failed(self, peer: str) -> None:
        self.scores[peer] = max(MIN_SCORE, self.scores.get(peer, MAX_SCORE) / 2)

    def ban(self, peer: str) -> None:
        self.banned.add(peer)


def check_peer_model(own: Sequence[torch.Tensor], theirs: Sequence[torch.Tensor], max_distance: float
                     ) -> tuple[Optional[str], float]:
    """(why the peer's parameters are refused or None, their distance from ours relative to our norm)."""
    if len(theirs) != len(own) or any(t.shape != o.shape for t, o in zip(theirs, own)):
        return "parameters of the wrong shapes", math.inf
    if not all(bool(torch.isfinite(t).all()) for t in theirs):
        return "parameters not finite", math.inf
    own = [o.detach().to("cpu", torch.float64) for o in own]
    norm = math.sqrt(sum(float(o.pow(2).sum()) for o in own)) or 1.0
    distance = math.sqrt(sum(float((t.double() - o).pow(2).sum()) for t, o in zip(theirs, own))) / norm
    if distance > max_distance:
        return f"parameters too far from this replica (>{max_distance:g} of its norm)", distance
    return None, distance


def claims_ok(clock, loss) -> bool:
    """A peer's own word about its replica, within what an honest one can say."""
    return (type(clock) is int and 0 <= clock <= 10**15
            and (loss is None or (type(loss) is float and math.isfinite(loss) and 0 <= loss <= 1e6)))


def sketch(tensors: Sequence[torch.Tensor], seed: int, size: int = SKETCH_SIZE) -> list[float]:
    """A count sketch of the concatenated tensors: each value goes, with a random sign, into one of `size` buckets
    (both drawn from `seed`, the same on every peer). Linear, and |sketch(x)|^2 estimates |x|^2, so the distance
    between two peers' sketches estimates the distance between their replicas (with ~sqrt(2 / size) relative
    error) without sending them."""
    generator = torch.Generator().manual_seed(seed)
    buckets = torch.zeros(size, dtype=torch.float64)
    for t in tensors:
        flat = t.detach().reshape(-1).to("cpu", torch.float64)
        for start in range(0, flat.numel(), 1 << 22):  # bounded scratch memory on a large model
            chunk = flat[start:start + (1 << 22)]
            index = torch.randint(size, (chunk.numel(),), generator=generator)
            signs = torch.randint(2, (chunk.numel(),), generator=generator).to(torch.float64) * 2 - 1
            buckets.index_add_(0, index, chunk * signs)
    return [float(b) for b in buckets]


def spread_from_mean(sketches: dict[str, Sequence[float]]) -> dict[str, float]:
    """Each peer's estimated distance to the replicas' mean, relative to the mean's norm (0.01: 1%)."""
    if len(sketches) < 2:
        return {peer: 0.0 for peer in sketches}
    size = len(next(iter(sketches.values())))
    mean = [sum(s[i] for s in sketches.values()) / len(sketches) for i in range(size)]
    norm = math.sqrt(sum(m * m for m in mean)) or 1.0
    return {peer: math.sqrt(sum((v - m) ** 2 for v, m in zip(s, mean))) / norm for peer, s in sketches.items()}
