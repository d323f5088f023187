"""Micro-batches without a host-device sync each: their checks stay on the device, and the trainer reads them, and
hands the optimizer the good micro-batches' summed gradients, once per window of several.

A GPU runs ahead of the Python that feeds it. Reading anything back (a loss, "is this gradient finite?") makes the
host wait until the GPU has drained its queue, and the next micro-batch's kernels start only when the host has
launched them again: one bubble per read. The trainer used to read three per micro-batch (the loss, its
finiteness, the gradients' finiteness). Here each micro-batch's backward pass writes fresh gradients; one fused
kernel divides them by fp16's loss scale and flags any that is not finite (collab.train.precision); a bad
micro-batch's gradients are zeroed on the device (masked, whatever the flag says, so nothing waits for it) before
they are added to the window's sum in .grad. Its loss and flags go to a small device table the trainer reads
when the window closes: the guard (collab.train.guard) then counts exactly the micro-batches it counted when it
read each one, none of a bad one's gradients ever reach the sum, and the good ones are handed to the optimizer
together (collab.averaging.grad_averager.SummedMicroBatches counts them as that many micro-batches).

The window is short: WINDOW_SECONDS of compute, and at most half the time the progress tracker expects until the
swarm's epoch ends, so this peer's progress reaches the swarm in time. Modes that step on every micro-batch
(diloco's inner steps, gossip's local steps) close it after each one, and so does a peer on a CPU, which has no
queue of kernels to keep fed.

The cost: while one micro-batch's gradients are summed in, the model holds them beside the window's sum (one
more gradient-sized buffer than accumulating in .grad directly, which could not leave a bad micro-batch out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from collab.train.precision import Precision

WINDOW_SECONDS = 0.2  # of compute between two reads
MOST = 16  # micro-batches in a window, at most


@dataclass(frozen=True)
class Outcome:
    """One micro-batch of a closed window, as its device checks found it."""
    loss: float
    loss_finite: bool
    gradients_finite: bool

    @property
    def good(self) -> bool:
        return self.loss_finite and self.gradients_finite


class GradientWindow:
    def __init__(self, parameters, precision: Precision, most: int = MOST):
        self.parameters = [p for p in parameters if p.requires_grad]
        self.precision, self.most = precision, most
        # per micro-batch: loss, loss finite (1/0), gradients not finite (1/0)
        self._table = torch.zeros(most, 3, device=precision.device)
        self.size = 0  # micro-batches in the open window
        self.limit = 1  # close the window at this many; grows once the pace is known (resize)
        self._seconds_per_micro_batch: Optional[float] = None

    def add(self, loss: torch.Tensor) -> None:
        """Backward this micro-batch's loss, check it on the device, and add its gradients to the window's sum
        (zeros if it is bad). Reads nothing back."""
        held = [p.grad for p in self.parameters]  # the sum so far: the micro-batch's own gradients come fresh
        for p in self.parameters:
            p.grad = None
        value = loss.detach()
        loss_finite = torch.isfinite(value)
        self.precision.backward(loss)
        fresh = [p.grad for p in self.parameters]
        computed = [g for g in fresh if g is not None]
        not_finite = self.precision.unscale_and_check(computed, loss_finite)
        bad = ~loss_finite | (not_finite[0] > 0)
        for g in computed:
            g.masked_fill_(bad, 0.0)
        into, added = [], []
        for p, h, g in zip(self.parameters, held, fresh):
            if g is None or h is None:  # untouched by this micro-batch, or its first gradient: no copy either way
                p.grad = h if g is None else g
            else:
                into.append(h)
                added.append(g)
                p.grad = h
        if into:
            torch._foreach_add_(into, added)
        row = self._table[self.size]
        row[0] = value.float()
        row[1] = loss_finite
        row[2] = not_finite[0]
        self.size += 1

    def full(self) -> bool:
        return self.size >= self.limit

    def close(self) -> list[Outcome]:
        """The window's micro-batches, in order: the one host read of the window (it waits for their kernels)."""
        rows = self._table[:self.size].tolist()
        self.size = 0
        return [Outcome(loss=row[0], loss_finite=row[1] > 0, gradients_finite=row[2] == 0) for row in rows]

    def resize(self, seconds: float, micro_batches: int, seconds_to_epoch_end: Optional[float]) -> None:
        """After a window of `micro_batches` took `seconds` (compute and read): the next one's size."""
        if micro_batches <= 0:
            return
        pace = seconds / micro_batches
        self._seconds_per_micro_batch = pace if self._seconds_per_micro_batch is None else (
            0.7 * self._seconds_per_micro_batch + 0.3 * pace)
        budget = WINDOW_SECONDS
        if seconds_to_epoch_end is not None:
            budget = min(budget, max(0.0, seconds_to_epoch_end) / 2)
        self.limit = max(1, min(self.most, int(budget / max(self._seconds_per_micro_batch, 1e-6))))
