"""Multi-crop's typed config (`task.crops` of a SwAV run config), next to the augmentation it configures
(collab.data.images). Imports no torch: reading and checking a config costs no second of imports."""

from __future__ import annotations

from pydantic import Field, model_validator

from collab.sections import Section

Scale = tuple[float, float]


class MultiCropConfig(Section):
    """SwAV's multi-crop: a few large views and several small ones of each image."""

    num_global: int = Field(2, ge=1, description="large crops; codes are computed on these")
    global_size: int = Field(224, ge=8)
    global_scale: Scale = Field((0.14, 1.0), description="area fraction of the image a large crop covers")
    num_local: int = Field(6, ge=0, description="small crops; they only predict the large crops' codes")
    local_size: int = Field(96, ge=8)
    local_scale: Scale = Field((0.05, 0.14))
    flip_probability: float = Field(0.5, ge=0, le=1, description="horizontal flips; 0 where mirroring matters")
    color_jitter: float = Field(1.0, ge=0, le=2.5, description="colour distortion strength (SimCLR's s)")
    blur_probability: float = Field(0.5, ge=0, le=1)

    @model_validator(mode="after")
    def _valid_views(self):
        for name in ("global_scale", "local_scale"):
            low, high = getattr(self, name)
            if not 0 < low <= high <= 1:
                raise ValueError(f"{name} ({low}, {high}) must satisfy 0 < low <= high <= 1; fix task.crops.{name}")
        if self.num_global + self.num_local < 2:
            raise ValueError("swapped prediction needs at least 2 crops; raise task.crops.num_global or num_local")
        return self
