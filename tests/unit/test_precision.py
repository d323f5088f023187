"""Where and in what precision a peer computes (collab.train.precision): the choices and their errors (fp16's loss
scaling is tested with the window that runs it: test_window)."""

from __future__ import annotations

import torch

from collab.config import load_config
from collab.train.precision import Precision


def test_bf16_autocast_trains_the_task_on_a_cpu(micro_config):
    from collab.tasks import build_task

    config = load_config(micro_config, {"training.precision": "bf16", "training.device": "cpu"})
    precision = Precision.from_config(config.training)
    task = build_task(config)
    precision.attach(task.model)
    with precision.autocast():
        loss = task.loss(precision.to_device(next(task.batches(2, seed=1))))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)  # the loss is reduced in fp32 under autocast
    precision.backward(loss)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in task.model.parameters() if p.requires_grad)
    assert precision.describe() == "bf16 on cpu (CPU)"

