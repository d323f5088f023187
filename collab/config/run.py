"""The run config's sections: training, averaging (collab.config.averaging), checkpoints and the task (each task's
section beside it, collab/tasks/*_config.py), assembled and checked across sections in RunConfig."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator, model_validator

from collab.config.averaging import AveragingConfig
from collab.sections import Section
from collab.tasks.albert_config import AlbertTaskConfig
from collab.tasks.causal_lm_config import CausalLmTaskConfig
from collab.tasks.linreg_config import LinregTaskConfig
from collab.tasks.swav_config import SwavTaskConfig


class AutoTargetConfig(Section):
    """training.target_batch_size: auto (collab.adaptive.batch_plan): the target follows the swarm's measured noise
    scale."""
    enabled: bool = Field(False, description="set by target_batch_size: auto")
    min: int = Field(64, gt=0, le=10**9, description="the smallest target the run may take")
    max: int = Field(8192, gt=0, le=10**9, description="the largest target the run may take")
    start: Optional[int] = Field(None, gt=0, le=10**9, description="the target until the noise scale is measured "
                                 "(default: min)")
    every_epochs: int = Field(5, ge=1, le=10**6, description="epochs between two changes of the target (each at "
                              "most 2x)")


class TrainingConfig(Section):
    micro_batch_size: Union[int, Literal["auto"]] = Field(
        8, description="samples per local forward/backward; auto: the largest that fits this peer's GPU, found at "
        "start (8 on a CPU)")
    target_batch_size: int = Field(256, gt=0, description="samples the whole swarm accumulates per optimizer step "
                                   "('auto': it follows the measured gradient noise scale, within auto_target)")
    auto_target: AutoTargetConfig = Field(default_factory=AutoTargetConfig)
    lr_scaling: Literal["none", "adascale"] = Field(
        "none", description="adascale: the learning rate times AdaScale's gain for the target (from the measured "
        "noise scale), and the schedule in scale-invariant steps of base_batch_size")
    base_batch_size: Optional[int] = Field(None, gt=0, le=10**9, description="the batch the learning rate and "
                                           "schedule were tuned at (AdaScale's and goodput's baseline; default: "
                                           "the starting target)")
    learning_rate: float = Field(1.76e-3, gt=0)
    warmup_steps: int = Field(50, ge=0, description="linear warm-up, in collaborative steps (epochs)")
    total_steps: int = Field(10_000, gt=0, description="length of the linear decay, in collaborative steps")
    weight_decay: float = Field(0.01, ge=0)
    max_grad_norm: float = Field(1.0, gt=0, description="LAMB's gradient clipping")
    seed: int = Field(0, ge=0, description="model initialisation seed, shared by all peers")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where this peer computes (auto: its GPU "
                                                   "if torch sees one); each peer's own choice")
    precision: Literal["auto", "fp32", "fp16", "bf16"] = Field(
        "auto", description="forward and backward passes' precision (autocast; fp16 with loss scaling); auto: "
        "bf16 on a GPU that has it, else fp16; fp32 on a CPU. The optimizer and the averaged gradients stay fp32")
    compile: Literal["auto", "on", "off"] = Field(
        "auto", description="torch.compile the model (the first micro-batch compiles it; a failure falls back to "
        "eager with one warning); auto: on a GPU only (on a CPU it made the peer no faster). Each peer's own choice")
    data_workers: Union[Literal["auto"], int] = Field(
        "auto", description="worker processes that make batches ahead of training (0: in the training thread); "
        "auto: 1 on a GPU, 0 on a CPU (whose cores are the model's). Each peer's own choice")

    devices: Union[Literal["all"], list[str]] = Field(
        default_factory=list, description="one peer for several devices (--gpus): a process per device, gradients "
        "summed inside the machine, one peer toward the swarm; 'all' (every GPU torch sees) or names such as "
        "cuda:0, cuda:1 (cpu, cpu: two processes on the CPU, for tests). Empty: one process on training.device. "
        "Each peer's own choice")

    @field_validator("devices", mode="before")
    @classmethod
    def _devices(cls, value):
        if isinstance(value, str):
            value = "all" if value == "all" else [part.strip() for part in value.split(",") if part.strip()]
        names = [] if value == "all" else [f"cuda:{v}" if str(v).isdigit() else str(v) for v in value or []]
        if any(not re.match(r"^(cpu|cuda:\d+)$", name) for name in names):
            raise ValueError("expected 'all' or device names such as cuda:0, cuda:1 (or GPU indices 0,1), "
                             f"got {value!r}")
        if len({name.split(":")[0] for name in names}) > 1:
            raise ValueError(f"mixes the CPU and GPUs ({', '.join(names)}); name GPUs only, or the CPU only")
        return value if value == "all" else names

    @field_validator("data_workers", mode="before")
    @classmethod
    def _data_workers(cls, value):
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 1):
            return value
        raise ValueError(f"must be 0, 1 or 'auto', got {value!r} (one worker process per GPU; more are not "
                         "supported)")

    @model_validator(mode="before")
    @classmethod
    def _auto_target(cls, data: Any) -> Any:
        # target_batch_size: auto is stored as the starting target and auto_target.enabled (the manifest's form)
        if isinstance(data, dict) and data.get("target_batch_size") == "auto":
            auto = dict(data.get("auto_target") or {})
            auto["enabled"] = True
            start = auto.get("start") if auto.get("start") is not None else auto.get("min", AutoTargetConfig().min)
            data = {**data, "auto_target": auto, "target_batch_size": start}
        return data

    @property
    def base_batch(self) -> int:
        return self.base_batch_size or self.target_batch_size

    @field_validator("micro_batch_size", mode="before")  # before the union's own check: one message, not two
    @classmethod
    def _samples_or_auto(cls, value):
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            return value
        raise ValueError(f"must be a whole number of samples > 0 or 'auto', got {value!r}")

    @model_validator(mode="after")
    def _target_holds_a_micro_batch(self):
        auto = self.auto_target
        if auto.enabled and not auto.min <= self.target_batch_size <= auto.max:
            raise ValueError(f"auto_target: min ({auto.min}) <= start ({self.target_batch_size}) <= max ({auto.max}) "
                             "must hold; fix the bounds or auto_target.start")
        micro = self.micro_batch_size if self.micro_batch_size != "auto" else 1  # auto never exceeds the target
        if auto.enabled and auto.min < micro:
            raise ValueError(f"auto_target.min ({auto.min}) is smaller than micro_batch_size ({self.micro_batch_size})"
                             "; raise auto_target.min")
        lowest = auto.min if auto.enabled else self.target_batch_size
        if self.lr_scaling == "adascale" and self.base_batch > lowest:
            raise ValueError(f"base_batch_size ({self.base_batch}) is above the smallest target ({lowest}); AdaScale "
                             "scales the learning rate up from the base batch: lower base_batch_size")
        if self.target_batch_size < micro:
            raise ValueError(
                f"target_batch_size ({self.target_batch_size}) is smaller than micro_batch_size "
                f"({self.micro_batch_size}); raise training.target_batch_size or lower training.micro_batch_size"
            )
        return self


class CheckpointConfig(Section):
    dir: Optional[Path] = None
    every_epochs: int = Field(10, gt=0)
    keep: int = Field(2, ge=1, description="how many checkpoints to keep")


# task.name -> that task's config section; `name` may be left out for the default task, albert
TASK_CONFIGS: dict[str, type[BaseModel]] = {"albert": AlbertTaskConfig, "causal-lm": CausalLmTaskConfig,
                                             "swav": SwavTaskConfig, "linreg": LinregTaskConfig}


def task_name(value: Any) -> Any:
    return value.get("name", "albert") if isinstance(value, dict) else getattr(value, "name", None)


TaskConfig = Annotated[
    Union[tuple(Annotated[model, Tag(name)] for name, model in TASK_CONFIGS.items())],
    Discriminator(task_name),
]


class RunConfig(Section):
    task: TaskConfig = Field(default_factory=AlbertTaskConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    averaging: AveragingConfig = Field(default_factory=AveragingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

    @model_validator(mode="after")
    def _noise_scale_is_measured(self):
        # both follow the noise scale, measured on whole gradients of the sync mode's weighted mean
        training, avg = self.training, self.averaging
        wants = ("training.target_batch_size auto" if training.auto_target.enabled else
                 "training.lr_scaling adascale" if training.lr_scaling == "adascale" else None)
        if wants is None:
            return self
        if avg.mode != "sync":
            raise ValueError(f"{wants} follows the gradient noise scale, measured in sync mode only; use a fixed "
                             f"target and lr_scaling none with averaging.mode {avg.mode}")
        if avg.compression in ("dgc", "powersgd") or avg.aggregation == "adasum":
            what = f"averaging.compression {avg.compression}" if avg.aggregation != "adasum" else "adasum"
            raise ValueError(f"{wants} needs the gradient noise scale, which {what} rounds do not measure (no whole "
                             "gradients, or no weighted mean); use fp16 or none and mean or centered_clip")
        return self
