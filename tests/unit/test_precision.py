"""Where and in what precision a peer computes (collab.train.precision): fp16's loss scaling, the choices' errors."""

from __future__ import annotations

import torch

from collab.config import load_config
from collab.train.precision import GROW_AFTER, INITIAL_SCALE, Precision


def _scaled(model: torch.nn.Module) -> Precision:
    precision = Precision(device=torch.device("cpu"), precision="fp16")  # the scaling needs no GPU
    precision.attach(model)
    return precision


def test_fp16_scaling_hands_the_optimizer_the_true_gradient_and_backs_off_on_overflow():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x = torch.randn(8, 4)
    model(x).pow(2).mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    precision = _scaled(model)
    precision.backward(model(x).pow(2).mean())
    assert model.weight.grad.abs().max() > 1000 * expected[0].abs().max()  # the backward pass saw the scale
    assert precision.unscale()
    for param, want in zip(model.parameters(), expected):
        torch.testing.assert_close(param.grad, want)

    precision.backward(model(x).pow(2).mean() * float("inf"))  # an overflow: skipped, not sent
    assert not precision.unscale()
    assert precision.scale == INITIAL_SCALE / 2 and precision.overflows == 1
    assert all(p.grad is None for p in model.parameters())

    for _ in range(GROW_AFTER):  # a long clean run earns the scale back
        precision.backward(model(x).pow(2).mean())
        assert precision.unscale()
        model.zero_grad(set_to_none=True)
    assert precision.scale == INITIAL_SCALE


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
    assert precision.unscale()  # nothing to unscale in bf16
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in task.model.parameters() if p.requires_grad)
    assert precision.describe() == "bf16 on cpu (CPU)"

