"""Tasks: what a peer trains. Each task owns its model, data, loss, optimizer and export format.

The daemon (collab.train.trainer), the optimizer wrapper, metrics and checkpoints only speak to this
interface, so a new task (SwAV, ...) needs no second copy of the training loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional

if TYPE_CHECKING:  # the task configs live in this package, and reading a config must not import torch
    import torch

    from collab.data.feed import ShardFeed

Batch = dict[str, "torch.Tensor"]
OptimizerFactory = Callable[[list], "torch.optim.Optimizer"]
SchedulerFactory = Callable[["torch.optim.Optimizer"], "torch.optim.lr_scheduler.LRScheduler"]


class Task(ABC):
    """A model plus everything needed to train and export it."""

    model: torch.nn.Module
    # whether batches() uses nothing that building the task put on the default device: a data worker then builds it
    # with the model on the meta device (collab.train.pipeline: no memory, no initialisation)
    batches_apart_from_model: bool = True

    @abstractmethod
    def batches(self, micro_batch_size: int, seed: int, feed: Optional[ShardFeed] = None) -> Iterator[Batch]:
        """An endless stream of micro-batches, in an order that depends on `seed`; a text task reads the run's
        token shards through `feed` when the run has them (collab.data.feed), which then decides the order."""

    @abstractmethod
    def loss(self, batch: Batch) -> torch.Tensor:
        """Forward pass; returns the scalar loss to backpropagate."""

    @abstractmethod
    def parameter_groups(self) -> list[dict]:
        """The model's parameters as optimizer groups (e.g. no weight decay on norms and biases)."""

    @abstractmethod
    def optimizer_factory(self) -> OptimizerFactory:
        """Builds the local optimizer hivemind wraps (it must be a factory: hivemind offloads the params)."""

    @abstractmethod
    def without_momentum(self) -> dict:
        """Options of a parameter group that turn the optimizer's momentum off (for tensors DGC sends)."""

    @abstractmethod
    def scheduler_factory(self) -> SchedulerFactory:
        """Learning-rate schedule; it advances once per collaborative step (epoch)."""

    def set_step(self, step: int) -> None:
        """Called by the trainer before each micro-batch with the collaborative step (epoch) it counts
        toward, for tasks whose loss changes over training (SwAV's frozen prototypes and queue)."""

    @abstractmethod
    def save_pretrained(self, directory: Path) -> None:
        """Export the model in the standard Hugging Face layout (`from_pretrained` loads it)."""

    @abstractmethod
    def load_pretrained(self, directory: Path) -> None:
        """Load weights written by save_pretrained into self.model."""


def build_task(config) -> Task:
    """Build the task named in `config.task.name` (config: collab.config.RunConfig)."""
    return task_class(config.task.name)(config.task, config.training)


def task_class(name: str) -> type[Task]:
    # each task imports its own model code (transformers, kornia) only when it is the run's: a config is read and
    # checked by every command without them
    if name == "albert":
        from collab.tasks.albert import AlbertTask

        return AlbertTask
    if name == "causal-lm":
        from collab.tasks.causal_lm import CausalLmTask

        return CausalLmTask
    if name == "swav":
        from collab.tasks.swav import SwavTask

        return SwavTask
    if name == "linreg":
        from collab.tasks.linreg import LinregTask

        return LinregTask
    raise ValueError(f"unknown task {name!r}")  # unreachable: the config schema lists the tasks
