"""The gradient noise scale, measured by the swarm (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training"), and AdaScale's gain (Johnson et al. 2020).

Every gradient round gives a peer two gradients of the same parameters: its own, the mean over the B_i samples it
accumulated, and the swarm's average over the B samples of its group. For a batch of b samples the expected
squared norm of the mean gradient is |G|^2 + tr(Sigma) / b (G: the true gradient, Sigma: the per-sample
covariance), whether or not one batch is part of the other. Two batch sizes give the two unknowns, unbiased
(appendix A):

    |G|^2    ~ (B |g|^2 - B_i |g_i|^2) / (B - B_i)
    tr(Sigma) ~ (|g_i|^2 - |g|^2) / (1 / B_i - 1 / B)

Each estimate is very noisy; their ratio is more so. As in AdaptDL's gradient_noise_scale.py the two are smoothed
separately with bias-corrected moving averages (each round's two divided by its |g|^2 first, so that a round
counts on its own scale as the gradients shrink), and B_noise = tr(Sigma) / |G|^2 is their ratio: the batch size
at which the gradient's noise and its signal are equal. Training at targets well below B_noise wastes steps, well
above it wastes samples.

The norms are what each peer's averager measured on the tensors it really all-reduced (collab.averaging.robust_rounds);
B, the group's samples, is the sum of the weights its reducer combined (after the robust caps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

SMOOTHING = 0.98  # each round's estimate moves the averages by 2%: a window of ~50 rounds (at 0.9, 3 peers' estimates of a
# known B_noise of 41 ranged 19-92; at 0.98, 32-66, and their pooled one 39-45)
WINDOW = round(1 / (1 - SMOOTHING))  # rounds the smoothed estimates mostly stand for
NOISE_INPUTS_KEPT = 400  # rounds whose raw inputs a peer's summary keeps


def two_batch_estimate(small_sq: float, small_batch: float, big_sq: float, big_batch: float
                       ) -> Optional[tuple[float, float]]:
    """(|G|^2, tr(Sigma)) from the squared norms of two mean gradients of `small_batch` < `big_batch` samples;
    None when the batches do not differ (a group of one) or a number is not finite."""
    values = (small_sq, small_batch, big_sq, big_batch)
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        return None
    if not 0 < small_batch < big_batch or small_sq < 0 or big_sq < 0:
        return None
    signal = (big_batch * big_sq - small_batch * small_sq) / (big_batch - small_batch)
    noise = (small_sq - big_sq) / (1.0 / small_batch - 1.0 / big_batch)
    return signal, noise


@dataclass
class NoiseScale:
    """Bias-corrected moving averages of |G|^2 and tr(Sigma), per unit of each round's |g|^2, and their ratio."""

    smoothing: float = SMOOTHING
    signal_avg: float = 0.0
    noise_avg: float = 0.0
    weight_avg: float = 0.0
    updates: int = 0
    last_group_samples: Optional[float] = None

    def update(self, own_sq: float, own_samples: float, average_sq: float, group_samples: float) -> bool:
        """One round's norms; False (nothing changed) for a round that measures nothing."""
        estimate = two_batch_estimate(own_sq, own_samples, average_sq, group_samples)
        if estimate is None:
            return False
        signal, noise = estimate
        # Each round counts on its own scale: both estimates divided by its |g|^2 (the averaged gradient's squared
        # norm, the most precise number a round has; E|g|^2 = |G|^2 (1 + B_noise / B)). A run's gradients shrink as
        # it trains, and raw, the smoothed averages were its early rounds' larger numbers for many windows after:
        # on linreg a 4x-target row's loss fell 10x, its first rounds (replicas not yet in sync) were off, and its
        # pooled B_noise read 1500-5000 to the end against a truth of 20001; replayed from the same recorded
        # rounds with the division, 16900-19400. signal_avg and noise_avg are therefore per unit of |g|^2.
        if not average_sq > 0:
            return False
        signal, noise = signal / average_sq, noise / average_sq
        # Rounds count by the inverse of their estimates' variance, which both ends of B_i/B blow up:
        # - both estimators divide by 1 - B_i/B: a peer that brought most of the group's samples measures little
        #   (its gradient nearly is the average) and its noise is amplified (a peer can bring most of a round's
        #   samples, and unweighted, one such round moves a pooled estimate far off);
        # - a peer that brought few samples has a squared norm that is itself noisy: per-sample gradients' squared
        #   norms are heavy-tailed, so |g_i|^2 strays from its mean by ~sqrt(2 / B_i) of tr(Sigma) / B_i, and both
        #   estimates carry that. One round in which a peer brought a few samples of hundreds can give a |G|^2
        #   far below zero, and with the weight (1 - B_i/B)^2 alone (near 1 for such a peer, more than an equal
        #   share's) a few such rounds keep the smoothed |G|^2 negative for long.
        # Their variance goes as 1 / (B_i (B - B_i)^2), hence the weight (B_i/B) (1 - B_i/B)^2: largest for a third
        # of the group's samples, as small for 2% as for 75%.
        share = own_samples / group_samples
        weight = share * (1 - share) ** 2
        self.signal_avg = self.smoothing * self.signal_avg + (1 - self.smoothing) * weight * signal
        self.noise_avg = self.smoothing * self.noise_avg + (1 - self.smoothing) * weight * noise
        self.weight_avg = self.smoothing * self.weight_avg + (1 - self.smoothing) * weight
        self.updates += 1
        self.last_group_samples = group_samples
        return True

    def _corrected(self, value: float) -> float:
        # the weighted average so far: the moving average of the weights is also the bias correction
        return value / self.weight_avg

    @property
    def signal(self) -> Optional[float]:
        """|G|^2 per unit of the rounds' |g|^2, smoothed (None before the first round that measured it)."""
        return self._corrected(self.signal_avg) if self.updates else None

    @property
    def noise(self) -> Optional[float]:
        """tr(Sigma) per unit of the rounds' |g|^2, smoothed: over `signal`, B_noise."""
        return self._corrected(self.noise_avg) if self.updates else None

    @property
    def b_noise(self) -> Optional[float]:
        """tr(Sigma) / |G|^2, in samples; None until both are measured and positive (early on, noise can
        swamp the signal estimate and leave it negative: the ratio then means nothing yet)."""
        signal, noise = self.signal, self.noise
        if signal is None or not signal > 0 or not noise > 0:
            return None
        return noise / signal


def adascale_gain(noise: float, signal: float, scale: float) -> float:
    """AdaScale's gain r = (var + sqr) / (var / S + sqr) for a batch S times the base batch, where var is the
    per-base-batch gradient variance and sqr the squared true gradient: 1 at S = 1, S when noise dominates,
    1 when the signal does. Between 1 and S for any non-negative inputs."""
    if not scale >= 1:
        raise ValueError(f"AdaScale's scale is the target batch over the base batch, at least 1 (got {scale})")
    noise, signal = max(0.0, noise), max(0.0, signal)
    if noise + signal == 0:
        return 1.0
    return (noise + signal) / (noise / scale + signal)


def noise_fields(noise: NoiseScale) -> dict:
    """The estimate as a metrics record carries it (noise_signal, noise_trace, noise_rounds), or nothing while there
    is none or it is out of the record's bounds."""
    if noise.signal is None or not all(math.isfinite(v) and abs(v) <= 1e12 for v in (noise.signal, noise.noise)):
        return {}
    return dict(noise_signal=float(noise.signal), noise_trace=float(noise.noise), noise_rounds=noise.updates)
