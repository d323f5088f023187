"""Deep Gradient Compression (Lin et al., ICLR 2018): send 0.1% of each gradient matrix, keep the rest for later.

All four of its techniques and its warm-up, applied to what a peer sends into each gradient round (collab's
"iteration" is one collaborative step: the peer's gradient accumulated toward it, averaged over its samples):

- momentum correction: the velocity is accumulated, not the raw gradient (u <- m*u + g; v <- v + u), and the
  top-k of v is sent; what is not sent stays in v, so every gradient is sent eventually (error feedback);
- momentum factor masking: u and v are zeroed where values were sent, so stale momentum does not push a
  coordinate long after its update went out;
- local gradient clipping, before accumulation: at `clip_norm * sqrt(N)` for N peers. DGC clips each of N
  summed gradients at thr * N^-1/2 so their sum keeps to thr; collab averages (divides the sum by N), so the
  same reasoning gives thr * N^1/2 per peer for an average that keeps to thr;
- warm-up: the density (1 - sparsity) falls exponentially over the first `warmup_epochs` collaborative steps,
  final_density ** ((epoch + 1) / (warmup_epochs + 1)): with 4 steps and 99.9%, the paper's 75%, 93.75%,
  98.4%, 99.6%, then 99.9%.

Only tensors of two or more dimensions are sparsified, as in the paper: vectors (biases, norms) are a small
share of the bytes and go whole. Their momentum stays with the optimizer; a sparsified tensor's momentum is
DGC's own (its velocity), so the optimizer must not apply it a second time: the task turns its optimizer's
momentum off for those tensors (Task.without_momentum: LAMB's first-moment beta, LARS's momentum). LAMB keeps
its second moment and its trust ratio for them: the update it makes is then an Adam-normalised step along DGC's
sparse, momentum-corrected average - the composition collab chose over plain momentum SGD (the paper's),
which would change the run's optimizer and its tuned learning rate.

Selecting the top 0.1% by a full sort of every tensor at every step would cost more than the round saves on a
CPU: the threshold is estimated from a random sample (as DGC's reference code does) and checked; when the
estimate selects too many or too few (over 1.5x or under 0.5x of k), it falls back to an exact top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

SAMPLE_AT_LEAST = 100_000  # tensors smaller than this are selected exactly: sampling would not save anything
SAMPLE_FRACTION = 0.01


@dataclass(frozen=True)
class DGCSettings:
    sparsity: float = 0.999
    warmup_epochs: int = 4
    momentum: float = 0.9
    clip_norm: float = 1.0

    def density(self, epoch: int) -> float:
        final = 1.0 - self.sparsity
        if self.warmup_epochs <= 0:
            return final
        return final ** min(1.0, (epoch + 1) / (self.warmup_epochs + 1))


def sparsified(tensor: torch.Tensor) -> bool:
    return tensor.dim() > 1


def top_mask(values: torch.Tensor, density: float, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """A boolean mask of about the `density` share of `values` largest in magnitude (at least one)."""
    flat = values.detach().abs().flatten()
    k = max(1, math.ceil(density * flat.numel()))
    if k >= flat.numel():
        return torch.ones_like(values, dtype=torch.bool)
    if flat.numel() >= SAMPLE_AT_LEAST:
        sample = flat[torch.randint(flat.numel(), (max(1000, int(SAMPLE_FRACTION * flat.numel())),),
                                    generator=generator)]
        kept = max(1, math.ceil(density * sample.numel()))
        threshold = torch.topk(sample, kept, sorted=False).values.min()
        mask = flat >= threshold
        if 0.5 * k <= int(mask.sum()) <= 1.5 * k:
            return mask.view_as(values)
    threshold = torch.topk(flat, k, sorted=False).values.min()
    return (flat >= threshold).view_as(values)


class DGCMemory:
    """A peer's velocity (u) and not-yet-sent accumulation (v) for each sparsified tensor, and the selection."""

    def __init__(self, shapes: Sequence[torch.Tensor], settings: DGCSettings, seed: int = 0):
        self.settings = settings
        self.u = [torch.zeros_like(t) if sparsified(t) else None for t in shapes]
        self.v = [torch.zeros_like(t) if sparsified(t) else None for t in shapes]
        self.generator = torch.Generator().manual_seed(seed)
        self.sent_values = self.total_values = 0  # of the sparsified tensors, last step

    @torch.no_grad()
    def compress_(self, grads: Sequence[torch.Tensor], epoch: int, peers: int) -> None:
        """Turn this step's gradients, in place, into what this peer sends: sparse for matrices, whole for vectors."""
        threshold = self.settings.clip_norm * math.sqrt(max(1, peers))
        norm = torch.sqrt(sum(g.float().pow(2).sum() for g in grads))
        if math.isfinite(float(norm)) and float(norm) > threshold:  # (a non-finite step never gets here: guard)
            for g in grads:
                g.mul_(threshold / float(norm))
        density = self.settings.density(epoch)
        self.sent_values = self.total_values = 0
        for g, u, v in zip(grads, self.u, self.v):
            if u is None:
                continue
            u.mul_(self.settings.momentum).add_(g)
            v.add_(u)
            mask = top_mask(v, density, self.generator)
            g.copy_(torch.where(mask, v, torch.zeros_like(v)))
            v.masked_fill_(mask, 0.0)
            u.masked_fill_(mask, 0.0)
            self.sent_values += int(mask.sum())
            self.total_values += v.numel()
