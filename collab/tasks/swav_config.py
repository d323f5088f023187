"""The SwAV task's typed config (`task:` in a run config), multi-crop included. Kept apart from the
task and its augmentations, which import torch, transformers and kornia, so that reading and
checking a config (every CLI command, `--help`) costs no second of imports."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from collab.data.crops_config import MultiCropConfig
from collab.sections import Section


class SwavModelConfig(Section):
    # the ResNet: transformers' ResNetConfig fields (defaults: ResNet-50)
    embedding_size: int = Field(64, gt=0, description="channels of the stem convolution")
    hidden_sizes: list[int] = Field([256, 512, 1024, 2048], min_length=1)
    depths: list[int] = Field([3, 4, 6, 3], min_length=1)
    layer_type: Literal["basic", "bottleneck"] = "bottleneck"
    # SwAV's head: MLP projection, then prototypes
    projection_hidden_size: int = Field(2048, gt=0)
    projection_size: int = Field(128, gt=0)
    num_prototypes: int = Field(3000, ge=2)

    @model_validator(mode="after")
    def _one_depth_per_stage(self):
        if len(self.hidden_sizes) != len(self.depths):
            raise ValueError(f"hidden_sizes has {len(self.hidden_sizes)} stages but depths has {len(self.depths)}; "
                             "give task.model.depths one entry per stage")
        if min(self.hidden_sizes) < 1 or min(self.depths) < 1:
            raise ValueError("task.model.hidden_sizes and depths must be positive")
        return self


class SwavDataConfig(Section):
    dataset: str = Field("embedded", min_length=1, description="embedded | image files/folders | hf:NAME")
    image_size: int = Field(256, ge=8, description="images are resized and centre-cropped to this square first")


class SwavLossConfig(Section):
    temperature: float = Field(0.1, gt=0, description="softmax temperature of the predictions")
    epsilon: float = Field(0.05, gt=0, description="entropy regularisation of Sinkhorn-Knopp")
    sinkhorn_iterations: int = Field(3, ge=1)
    queue_length: int = Field(0, ge=0, description="past embeddings added to Sinkhorn's batch; 0: no queue")
    queue_start_step: int = Field(15, ge=0, description="start filling the queue at this collaborative step")
    freeze_prototypes_steps: int = Field(313, ge=0, description="prototypes get no updates before this step")


class LarsConfig(Section):
    momentum: float = Field(0.9, ge=0, lt=1)
    trust_coefficient: float = Field(1e-3, gt=0)
    final_lr_ratio: float = Field(1e-3, ge=0, le=1, description="the cosine ends at learning_rate x this")


class SwavTaskConfig(Section):
    name: Literal["swav"] = "swav"
    model: SwavModelConfig = Field(default_factory=SwavModelConfig)
    data: SwavDataConfig = Field(default_factory=SwavDataConfig)
    crops: MultiCropConfig = Field(default_factory=MultiCropConfig)
    loss: SwavLossConfig = Field(default_factory=SwavLossConfig)
    lars: LarsConfig = Field(default_factory=LarsConfig)
