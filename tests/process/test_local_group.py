"""One peer for several devices (collab.train.local_group), on the CPU: two processes over gloo. The machine's
summed gradient is exactly what one process computes on both ranks' micro-batches, a helper's bad micro-batch is
left out and reported, and the helper follows rank 0's parameters."""

from __future__ import annotations

import itertools

import psutil
import torch

from collab.config import RunConfig
from collab.tasks import build_task
from collab.train.local_group import LocalGroup
from collab.train.precision import Precision
from collab.train.window import GradientWindow
from tests.conftest import MICRO_CONFIG

K = 3  # micro-batches per rank and window


def _one_process_gradient(task, batches: list[dict]) -> list[torch.Tensor]:
    task.model.zero_grad(set_to_none=True)
    for batch in batches:
        task.loss(batch).backward()
    grads = [p.grad.clone() for p in task.model.parameters() if p.requires_grad]
    task.model.zero_grad(set_to_none=True)
    return grads


def test_two_ranks_sum_exactly_what_one_process_computes_on_both_ranks_micro_batches():
    # linreg: no dropout, so the helper's forward passes are exactly the reference's
    config = RunConfig.model_validate({**MICRO_CONFIG, "task": {"name": "linreg", "dim": 16},
                                       "training": {**MICRO_CONFIG["training"], "device": "cpu"}})
    task, reference = build_task(config), build_task(config)
    precision = Precision.from_config(config.training, device="cpu")
    precision.attach(task.model)
    window = GradientWindow(task.model.parameters(), precision)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    group = LocalGroup(config, ["cpu", "cpu"])
    try:
        stream = task.batches(4, seed=5)
        for round_ in range(2):
            dealt = [list(itertools.islice(stream, K))]
            own = list(itertools.islice(stream, K))
            if round_ == 1:
                with torch.no_grad():  # rank 0's parameters moved (a step): the helper must compute on the new ones
                    for p in task.model.parameters():
                        p.mul_(0.99)
                    reference.model.load_state_dict(task.model.state_dict())
            group.open_window(window.parameters, dealt)
            window.limit = K
            for batch in own:
                window.add(task.loss(batch))
            found = window.close() + group.close_window(window.parameters)
            assert [o.good for o in found] == [True] * (2 * K)
            expected = _one_process_gradient(reference, dealt[0] + own)
            for param, want in zip(window.parameters, expected):
                torch.testing.assert_close(param.grad, want, rtol=1e-4, atol=1e-6)
            task.model.zero_grad(set_to_none=True)
        assert group.micro_batches == [0, 2 * K]  # (rank 0's own are the trainer's to count)

        # a micro-batch whose loss is NaN on the helper: left out of the sum, and reported
        dealt = [list(itertools.islice(stream, K))]
        dealt[0][0] = {**dealt[0][0], "y": torch.full_like(dealt[0][0]["y"], float("nan"))}
        own = list(itertools.islice(stream, K))
        group.open_window(window.parameters, dealt)
        for batch in own:
            window.add(task.loss(batch))
        found = window.close() + group.close_window(window.parameters)
        assert [o.good for o in found] == [True] * K + [False] + [True] * (K - 1)
        assert not found[K].loss_finite
        expected = _one_process_gradient(reference, dealt[0][1:] + own)
        for param, want in zip(window.parameters, expected):
            torch.testing.assert_close(param.grad, want, rtol=1e-4, atol=1e-6)
    finally:
        group.close(window.parameters)
    assert not {p.pid for p in psutil.Process().children(recursive=True)
                if "resource_tracker" not in " ".join(p.cmdline())} - before  # the helper is gone
