"""How one part of an all-reduce is combined: the reducer that every non-client peer runs for its share.

hivemind's TensorPartReducer adds each sender's part into a running sum with whatever weight the sender
claims, so one NaN makes everyone's average NaN, one weight of 1e9 makes a sender's part the average, and
one part scaled by 1000 moves it a thousandfold. This reducer keeps the parts until every sender's has
arrived, then:
- leaves out the parts of senders banned here (collab.averaging.robust_rounds), and drops a part that is
  not finite, or whose weight is not a finite number >= 0 (the others' mean stays exact), and reports the sender;
- caps each weight at what the sender's own signed progress record makes plausible (`caps`, from
  collab.averaging.robust_rounds: a weight must be backed by a public claim that carries its name), or, for a sender
  without a record, at `max_weight_ratio` times the group's median weight (a peer's weight is the samples it
  accumulated; fast peers legitimately bring several times the median, not hundreds);
- combines what is left by the weighted mean or by CenteredClip (Karimireddy et al. 2021, as used in BTARD,
  Gorbunov et al. 2022): from the coordinate-wise median, iterate v <- v + sum_i w_i c_i (x_i - v) / sum_i w_i
  with c_i = min(1, tau / ||x_i - v||). tau is `tau` times the median distance of the parts from their
  median, so it follows the gradients' scale: honest parts, which lie at similar distances, are not clipped
  at all (the result is then exactly the mean), and one part far away moves the result by at most tau / n
  per iteration, however far it is. A part more than DROP_BEYOND radii away (scaled by sqrt(its weight / the
  median weight): a part from few samples is noisier) is left out altogether: clipped,
  it would still pull by tau / n at every round, in its own direction (one sign-flipping peer of 5 can hold
  the honest loss flat), and no honest part lies that far beyond the others' spread.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Callable, Collection, Optional, Sequence

import torch
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer

from collab.records.untrusted import LATE_PART

AGGREGATIONS = ("mean", "centered_clip", "adasum")
DROP_BEYOND = 5.0  # clip radii: a part further than this from the coordinate-wise median is not taken at all


@dataclass(frozen=True)
class Aggregation:
    """A run's aggregation rule (the manifest fixes it: every reducer of a run must combine alike)."""

    method: str = "centered_clip"
    tau: float = 2.0  # clip radius, in median distances of the parts from their median
    iterations: int = 5
    max_weight_ratio: float = 10.0  # a sender's weight is capped at this many times the group's median


def adasum(parts: torch.Tensor) -> torch.Tensor:
    """Adasum (Maleki et al. 2021) of `parts` (n x d), pairwise up a binary tree: for two gradients a and b,
    (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b - their sum when orthogonal, either one when identical, and in
    between what is new in each added once. In fp64: the dot products of long parts lose digits in fp32.
    Weights do not enter (as in Horovod's): each part counts once, whatever its samples."""
    level = list(parts.double())
    while len(level) > 1:
        merged = [_adasum_pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        level = merged + ([level[-1]] if len(level) % 2 else [])
    return level[0].to(parts.dtype)


def _adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    dot, a_sq, b_sq = float(a @ b), float(a @ a), float(b @ b)
    if a_sq == 0 or b_sq == 0:
        return a + b  # one of them is zero: nothing to share
    return (1 - dot / (2 * a_sq)) * a + (1 - dot / (2 * b_sq)) * b


def centered_clip(parts: torch.Tensor, weights: torch.Tensor, tau: float, iterations: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """CenteredClip of `parts` (n x d) with `weights` (n, summing to > 0). Returns (result, each part's last
    clip coefficient: 1.0 = taken whole, 0.0 = left out)."""
    center = parts.median(dim=0).values if len(parts) > 2 else parts.T @ weights / weights.sum()
    distances = (parts - center).norm(dim=1)
    radius = tau * distances.median()
    coefficients = torch.ones(len(parts))
    if not radius > 0:
        return parts.T @ weights / weights.sum(), coefficients  # the parts agree (or there are two): the mean
    # left out: a part far beyond the others in units of its own noise (a gradient of w samples strays ~1/sqrt(w):
    # an honest peer that brought few samples is farther, and is not an outlier for it). The median is kept.
    scaled = distances * (weights / weights.median()).sqrt()
    kept = (scaled <= DROP_BEYOND * tau * scaled.median()).float()
    weights = weights * kept
    for _ in range(iterations):
        diffs = parts - center
        coefficients = (radius / diffs.norm(dim=1).clamp_min(1e-30)).clamp(max=1.0) * kept
        step = diffs.T @ (weights * coefficients) / weights.sum()
        center = center + step
        if step.norm() <= 1e-6 * radius:
            break
    return center, coefficients


class RobustPartReducer(TensorPartReducer):
    """hivemind's reducer, but it keeps every sender's part and combines them when all are in (see above).
    `report(sender_index, reason)` is called once per sender and reason, when the reducer finishes."""

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, rule: Aggregation,
                 report: Optional[Callable[[int, str], None]] = None, excluded: Collection[int] = (),
                 report_clipping: bool = True, caps: Optional[dict[int, float]] = None, own: Optional[int] = None):
        # clipping is reported for gradients only: replicas in a state round are near-identical, so the clip
        # radius is tiny and a replica one own step away is "far" without anything wrong with its peer
        self.rule, self.report, self.excluded = rule, report, frozenset(excluded)
        self.caps = caps or {}  # sender index -> the most weight its signed progress makes plausible
        self.own = own  # this peer's sender index: its weight is what it counted, not a claim to bound
        self.report_clipping = report_clipping
        self.received: list[tuple[int, torch.Tensor, float]] = []
        self.findings: dict[int, set[str]] = {}
        self.group_weight: Optional[float] = None
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self):
        super().reset_accumulators()
        self.received = []
        self.accumulator = None  # no running sum: the parts are kept in `received`

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        # hivemind's own bookkeeping and waiting, with "keep the part" in place of "add it to the sum"
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        try:
            while part_index > self.current_part_index:
                await self._wait_for_previous_parts()
        except BaseException:
            # never handed over (its stream dropped meanwhile): the ban that follows counts only the parts that
            # came, or this part would wait for it forever (hivemind counts it as received before the wait)
            self.num_parts_received[sender_index] -= 1
            raise
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            self.received.append((sender_index, tensor_part, weight))
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        # every sender of the part awaits this one future: shielded, so that a sender's handler cancelled here (its
        # peer dropped as a round began) does not cancel the average for the others. Unshielded, as in hivemind,
        # every other sender's stream of the part failed at once, and this peer's own part never came
        return await asyncio.shield(current_part_future)

    async def _wait_for_previous_parts(self) -> None:
        await asyncio.wait({self.current_part_future, asyncio.create_task(self.finished.wait())},
                           return_when=asyncio.FIRST_COMPLETED)
        if self.finished.is_set():
            raise AllreduceException(f"attempted to aggregate part in a finalized {self.__class__.__name__}")

    def check_current_part_finished(self):
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            try:
                self.current_part_future.set_result(self.combine(self.received))
            except AllreduceException as e:
                self.current_part_future.set_exception(e)
            self.reset_accumulators()

    def combine(self, received: list[tuple[int, torch.Tensor, float]]) -> torch.Tensor:
        shape = self.part_shapes[self.current_part_index]
        senders, parts, weights = [], [], []
        for sender, part, weight in received:
            if sender in self.excluded:
                self._found(sender, "part left out (sender banned here)")
            elif not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight >= 0):
                self._found(sender, "weight not a finite number >= 0")
            elif part.shape != shape:
                self._found(sender, "part of the wrong shape")
            elif not bool(torch.isfinite(part).all()):
                self._found(sender, "part not finite")
            elif weight > 0:
                senders.append(sender)
                parts.append(part.float().flatten())
                weights.append(float(weight))
        if not parts:
            raise AllreduceException("no sender's part of this round could be used")
        w = torch.tensor(weights)
        median = float(w.median())
        for i, sender in enumerate(senders):
            if sender == self.own:  # this peer's own weight is what it counted, not a claim (and its record lags)
                continue
            signed = self.caps.get(sender)
            if signed is not None:
                # backed by its own signed progress (never doubted up to the group's median: records lag). A
                # weight so backed is not held to the median: in a group of peers that brought a micro-batch
                # or two, an honest peer with a whole epoch's samples is 60x the median
                if w[i] > max(signed, median):
                    self._found(sender, "weight above its signed progress")
                    w[i] = max(signed, median)
            elif w[i] > self.rule.max_weight_ratio * median:  # no record to back it: the group's median bounds it
                self._found(sender, "weight above the group's bound")
                w[i] = self.rule.max_weight_ratio * median
        stacked = torch.stack(parts)
        # the samples this average stands for (collab.adaptive.noise_scale's B): its variance is that of a mean of
        # (sum w)^2 / sum(w^2 / claimed) samples, which is sum w unless a weight was capped below its claim
        claimed = torch.tensor(weights)
        self.group_weight = float(w.sum() ** 2 / (w ** 2 / claimed).sum())
        if self.rule.method == "adasum":
            return adasum(stacked).reshape(shape)
        if self.rule.method == "centered_clip" and len(parts) > 2:
            result, coefficients = centered_clip(stacked, w, self.rule.tau, self.rule.iterations)
            # reported when left out only: a part clipped within DROP_BEYOND radii is an odd batch as much as an
            # attack, and a report counts toward a "suspect" flag
            for i in (coefficients == 0).nonzero().flatten().tolist() if self.report_clipping else ():
                self._found(senders[i], f"part dropped (over {DROP_BEYOND:g} clip radii from the others')")
        else:
            result = stacked.T @ w / w.sum()
        return result.reshape(shape)

    def _found(self, sender: int, reason: str) -> None:
        self.findings.setdefault(sender, set()).add(reason)

    def finalize(self):
        if not self.finished.is_set() and self.report is not None:
            # a sender whose parts did not all come while others' did: left out (hivemind's next_chunk_timeout).
            # Not when nobody's came: the round itself was called off, and no sender is to blame
            if self.num_parts and max(self.num_parts_received, default=0) == self.num_parts:
                for sender, count in enumerate(self.num_parts_received):
                    if count < self.num_parts and sender not in self.excluded:
                        self._found(sender, LATE_PART)
            for sender, reasons in self.findings.items():
                for reason in sorted(reasons):
                    self.report(sender, reason)
            self.findings = {}
        super().finalize()
