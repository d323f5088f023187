"""The linreg task's typed config: a calibration task whose gradient noise scale is known exactly."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from collab.sections import Section


class LinregDataConfig(Section):
    dataset: Literal["synthetic"] = Field("synthetic", description="Gaussian inputs drawn by each peer itself")


class LinregTaskConfig(Section):
    """Linear regression y = x.w* + N(0, noise_sd^2), x ~ N(0, I_dim), started at |w - w*| = distance. At any w the
    gradient's signal is |G|^2 = |e|^2 and its noise tr(Sigma) = dim (|e|^2 + noise_sd^2) + |e|^2 (e = w - w*), so
    a swarm's measured B_noise (collab.adaptive.noise_scale) can be checked against the truth: with a learning rate too
    small to move w, B_noise stays at `true_noise_scale()`."""

    name: Literal["linreg"] = "linreg"
    dim: int = Field(20, ge=1, le=10**6, description="input dimension")
    noise_sd: float = Field(1.0, ge=0, le=1e3, description="the labels' Gaussian noise")
    distance: float = Field(1.0, gt=0, le=1e3, description="|w - w*| at the start")
    data: LinregDataConfig = Field(default_factory=LinregDataConfig)

    def true_noise_scale(self) -> float:
        """B_noise at the starting point."""
        e2 = self.distance ** 2
        return (self.dim * (e2 + self.noise_sd ** 2) + e2) / e2
