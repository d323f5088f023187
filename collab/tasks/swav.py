"""SwAV self-supervised pretraining of a ResNet (Caron et al., "Unsupervised Learning of Visual
Features by Contrasting Cluster Assignments", NeurIPS 2020), as a collab task.

Each image gives several augmented crops. Every crop is embedded (ResNet -> projection head ->
L2-normalised) and scored against K learnable prototypes. For each large crop, Sinkhorn-Knopp
turns the scores of the batch into soft cluster assignments ("codes") that use all prototypes
equally; every other crop of the same image must predict those codes (swapped prediction).
A queue of recent embeddings fills the batch out when it is small next to K. Prototypes are
frozen for the first steps, and LARS with warm-up and a cosine schedule trains everything.

Steps here are collaborative steps (epochs of the swarm), SwAV's iterations. The backbone is
transformers' ResNetModel built from its config (no hub download) and is exported with
save_pretrained, so `ResNetModel.from_pretrained(checkpoint)` loads the pretrained features.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from pytorch_optimizer import LARS
from torch import nn
from transformers import ResNetConfig, ResNetModel, get_cosine_with_min_lr_schedule_with_warmup

from collab.data.images import MultiCrop, image_stream
from collab.tasks import Batch, OptimizerFactory, SchedulerFactory, Task
from collab.tasks.swav_config import SwavModelConfig, SwavTaskConfig

HEAD_FILE = "swav_head.pt"  # projection head and prototypes, beside the backbone's HF files


@torch.no_grad()
def sinkhorn_knopp(scores: torch.Tensor, epsilon: float, iterations: int) -> torch.Tensor:
    """Soft assignments [B, K] of B samples to K prototypes: each row sums to 1 and, as the
    iterations converge, each prototype receives B/K of the mass (the equipartition constraint
    that keeps SwAV from collapsing onto one cluster).

    SwAV's distributed version all-reduces the row and column sums over the GPUs of one batch;
    here each peer balances its own micro-batch (plus its queue), as the peers hold no common batch.
    """
    # SwAV's loop in the log domain: the same normalisations, but a small epsilon cannot underflow
    # whole rows of exp(scores / epsilon) to zero and then divide by them
    log_q = scores.float().t() / epsilon  # K x B
    num_prototypes, batch = log_q.shape
    log_q = log_q - torch.logsumexp(log_q.flatten(), dim=0)
    for _ in range(iterations):
        log_q = log_q - torch.logsumexp(log_q, dim=1, keepdim=True) - math.log(num_prototypes)  # prototypes: 1/K
        log_q = log_q - torch.logsumexp(log_q, dim=0, keepdim=True) - math.log(batch)  # samples: 1/B each
    return (log_q + math.log(batch)).exp().t()


class SwavModel(nn.Module):
    def __init__(self, config: SwavModelConfig):
        super().__init__()
        self.backbone = ResNetModel(ResNetConfig(
            embedding_size=config.embedding_size, hidden_sizes=list(config.hidden_sizes), depths=list(config.depths),
            layer_type=config.layer_type))
        self.projection = nn.Sequential(
            nn.Linear(config.hidden_sizes[-1], config.projection_hidden_size),
            nn.BatchNorm1d(config.projection_hidden_size),
            nn.ReLU(inplace=True),
            nn.Linear(config.projection_hidden_size, config.projection_size),
        )
        self.prototypes = nn.Linear(config.projection_size, config.num_prototypes, bias=False)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """The backbone's pooled features [B, C]: what a downstream task (or a linear probe) uses."""
        return self.backbone(pixel_values=images).pooler_output.flatten(1)

    def normalized_prototypes(self) -> torch.Tensor:
        # SwAV rescales the prototype rows to unit length in place before each step. Here hivemind's
        # offloaded optimizer owns the parameters and copies them over the model's after every step
        # (from a background thread with overlap), so an in-place rescale would be overwritten or race;
        # normalising inside the forward scores with the same unit vectors, and LARS's update, which
        # scales with the weight's norm, makes the stored scale irrelevant.
        return F.normalize(self.prototypes.weight, dim=1)

    def forward(self, crops_by_size: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Crops [N, B, 3, s, s] per size -> embeddings [sum N * B, D] and prototype scores [sum N * B, K],
        crop-major. Crops of one size go through the backbone as one batch, as in SwAV."""
        features = torch.cat([self.features(crops.flatten(0, 1)) for crops in crops_by_size if len(crops)])
        embeddings = F.normalize(self.projection(features), dim=1)
        return embeddings, embeddings @ self.normalized_prototypes().t()


class SwavTask(Task):
    batches_apart_from_model = False  # its augmentations hold tensors of their own (collab.data.images)

    def __init__(self, config: SwavTaskConfig, training):
        self.config, self.training = config, training
        # the same seed on every peer: all start from identical weights, so averaged gradients apply cleanly
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(training.seed)
            self.model = SwavModel(config.model)
        self.multicrop = MultiCrop(config.crops)
        self.step = 0
        self.queue: Optional[torch.Tensor] = None  # [num_global, queue_length, D], newest first
        self.queued = 0
        # zero the prototypes' gradient while frozen, rather than skip them: with reuse_grad_buffers the
        # .grad tensors are hivemind's accumulators, so every peer then sends exact zeros for them, and
        # LARS's only remaining move (weight decay) shrinks the rows without turning them
        self.model.prototypes.weight.register_hook(lambda grad: torch.zeros_like(grad) if self._frozen() else grad)

    def _frozen(self) -> bool:
        return self.step < self.config.loss.freeze_prototypes_steps

    def set_step(self, step: int) -> None:
        self.step = step
        loss = self.config.loss
        if self.queue is None and loss.queue_length > 0 and step >= loss.queue_start_step:
            self.queue = torch.zeros(self.config.crops.num_global, loss.queue_length, self.config.model.projection_size)

    def batches(self, micro_batch_size: int, seed: int, feed=None) -> Iterator[Batch]:  # no text: no shards
        return self.multicrop_batches(image_stream(self.config.data.dataset, self.config.data.image_size, seed),
                                      micro_batch_size, seed)

    def multicrop_batches(self, images: Iterator[torch.Tensor], micro_batch_size: int, seed: int) -> Iterator[Batch]:
        for index in range(2**62):
            batch = torch.stack([next(images) for _ in range(micro_batch_size)])
            yield self.multicrop(batch, seed=hash((seed, index)) & 0x7FFF_FFFF)

    def loss(self, batch: Batch) -> torch.Tensor:
        global_crops, local_crops = batch["global_crops"], batch["local_crops"]
        num_global, batch_size = global_crops.shape[:2]
        num_crops = num_global + len(local_crops)
        embeddings, scores = self.model([global_crops, local_crops])
        log_predictions = F.log_softmax(scores / self.config.loss.temperature, dim=1).split(batch_size)
        total = scores.new_zeros(())
        for crop in range(num_global):
            codes = self._codes(crop, scores[crop * batch_size:(crop + 1) * batch_size].detach())
            swapped = [-(codes * log_predictions[v]).sum(dim=1).mean() for v in range(num_crops) if v != crop]
            total = total + torch.stack(swapped).mean()
        self._enqueue(embeddings.detach(), batch_size)
        return total / num_global

    @torch.no_grad()
    def _codes(self, crop: int, scores: torch.Tensor) -> torch.Tensor:
        """Sinkhorn codes of this batch's crop, computed together with the queue once it is full."""
        batch_size = len(scores)
        if self.queue is not None and self.queued >= self.queue.shape[1]:
            queued_scores = self.queue[crop] @ self.model.normalized_prototypes().t()
            scores = torch.cat([queued_scores, scores])
        codes = sinkhorn_knopp(scores, self.config.loss.epsilon, self.config.loss.sinkhorn_iterations)
        return codes[-batch_size:]

    def _enqueue(self, embeddings: torch.Tensor, batch_size: int) -> None:
        if self.queue is None:
            return
        length = self.queue.shape[1]
        for crop in range(self.queue.shape[0]):
            newest = embeddings[crop * batch_size:(crop + 1) * batch_size]
            self.queue[crop] = torch.cat([newest, self.queue[crop]])[:length]
        self.queued = min(self.queued + batch_size, length)

    def parameter_groups(self) -> list[dict]:
        # one group: pytorch-optimizer's LARS already leaves 1-D tensors (biases, BatchNorm) out of
        # weight decay and trust-ratio scaling, the usual LARS recipe
        return [{"params": list(self.model.parameters()), "weight_decay": self.training.weight_decay}]

    def optimizer_factory(self) -> OptimizerFactory:
        lr, lars = self.training.learning_rate, self.config.lars
        return lambda groups: LARS(groups, lr=lr, momentum=lars.momentum, trust_coefficient=lars.trust_coefficient)

    def without_momentum(self) -> dict:
        return {"momentum": 0.0}

    def scheduler_factory(self) -> SchedulerFactory:
        warmup, total, ratio = self.training.warmup_steps, self.training.total_steps, self.config.lars.final_lr_ratio
        return lambda opt: get_cosine_with_min_lr_schedule_with_warmup(
            opt, num_warmup_steps=warmup, num_training_steps=total, min_lr_rate=ratio)

    def save_pretrained(self, directory: Path) -> None:
        self.model.backbone.save_pretrained(directory)
        head = {"projection": self.model.projection.state_dict(), "prototypes": self.model.prototypes.state_dict()}
        torch.save(head, Path(directory) / HEAD_FILE)

    def load_pretrained(self, directory: Path) -> None:
        backbone = ResNetModel.from_pretrained(directory)
        self.model.backbone.load_state_dict(backbone.state_dict())
        head = torch.load(Path(directory) / HEAD_FILE, weights_only=True)
        self.model.projection.load_state_dict(head["projection"])
        self.model.prototypes.load_state_dict(head["prototypes"])
