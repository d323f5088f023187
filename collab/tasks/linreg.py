"""Linear regression on Gaussian data (collab.tasks.linreg_config): a task with a known gradient noise scale, to
check what the swarm measures (collab.adaptive.noise_scale) and to calibrate a run's tooling without a download."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load_file, save_file

from collab.tasks import Batch, OptimizerFactory, SchedulerFactory, Task
from collab.tasks.linreg_config import LinregTaskConfig

WEIGHTS_FILE = "model.safetensors"


class LinregTask(Task):
    def __init__(self, config: LinregTaskConfig, training):
        self.config, self.training = config, training
        # the same w* and start on every peer: both come from the run's seed
        generator = torch.Generator().manual_seed(training.seed)
        self.w_star = torch.randn(config.dim, generator=generator, device="cpu")  # (also where the model is not built)
        offset = torch.randn(config.dim, generator=generator, device="cpu")
        self.model = torch.nn.Linear(config.dim, 1, bias=False)
        with torch.no_grad():
            self.model.weight.copy_((self.w_star + config.distance * offset / offset.norm())[None])

    def batches(self, micro_batch_size: int, seed: int, feed=None) -> Iterator[Batch]:  # no text: no shards
        generator = torch.Generator().manual_seed(seed)
        while True:
            x = torch.randn(micro_batch_size, self.config.dim, generator=generator)
            noise = self.config.noise_sd * torch.randn(micro_batch_size, generator=generator)
            yield {"x": x, "y": x @ self.w_star + noise}

    def loss(self, batch: Batch) -> torch.Tensor:
        return 0.5 * (self.model(batch["x"]).squeeze(-1) - batch["y"]).pow(2).mean()

    def parameter_groups(self) -> list[dict]:
        return [{"params": list(self.model.parameters())}]

    def optimizer_factory(self) -> OptimizerFactory:
        lr = self.training.learning_rate
        return lambda groups: torch.optim.SGD(groups, lr=lr)

    def without_momentum(self) -> dict:
        return {"momentum": 0.0}

    def scheduler_factory(self) -> SchedulerFactory:
        return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    def save_pretrained(self, directory: Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        save_file({"weight": self.model.weight.detach().contiguous()}, str(Path(directory) / WEIGHTS_FILE))

    def load_pretrained(self, directory: Path) -> None:
        with torch.no_grad():
            self.model.weight.copy_(load_file(str(Path(directory) / WEIGHTS_FILE))["weight"])
