"""A compiled model (training.compile, collab.train.compiling): it trains as the eager one does, keeps the parameters
hivemind averages, and a compile that fails leaves the peer training eager with one line. On the CPU; a process
test, as inductor runs the machine's C++ compiler."""

from __future__ import annotations

import itertools

import torch

from collab.config import RunConfig
from collab.train.compiling import warm_up
from collab.train.precision import Precision
from collab.tasks import build_task
from tests.conftest import MICRO_CONFIG

STEPS = 12


def _train(task, batches) -> list[float]:
    optimizer = task.optimizer_factory()(task.parameter_groups())
    losses = []
    for batch in itertools.islice(batches, STEPS):
        loss = task.loss(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_compiled_model_trains_as_the_eager_one_on_the_same_parameters(capsys):
    config = RunConfig.model_validate({**MICRO_CONFIG, "training": {**MICRO_CONFIG["training"], "compile": "on"}})
    eager, compiled = build_task(config), build_task(config)
    precision = Precision.from_config(config.training)
    auto = config.training.model_copy(update={"compile": "auto"})
    assert precision.compile and not Precision.from_config(auto).compile  # auto compiles on a GPU only
    assert not Precision.from_config(config.training.model_copy(update={"compile": "off"})).compile
    parameters = list(compiled.model.parameters())
    names = list(compiled.model.state_dict())
    precision.attach(compiled.model)
    precision.compile_model(compiled.model)
    report = warm_up(compiled, precision, compiled.batches(8, seed=2))
    assert report.compiled and report.fell_back is None and report.graphs >= 1, report
    assert "Compiled the model in" in capsys.readouterr().out
    # the module hivemind averages is the one that trains: the same parameter tensors, the same state_dict names
    assert list(compiled.model.parameters()) == parameters and list(compiled.model.state_dict()) == names
    losses = _train(compiled, compiled.batches(8, seed=1))
    assert losses[-1] < losses[0] - 0.1, losses
    assert report.as_dict()["recompiles"] == 0  # the shapes never change: nothing compiled after the warm-up

    # the same loss and gradients as the eager model's with the same weights, on the same batch (dropout off:
    # ALBERT's sentence-order head has some, and the compiled graph draws its random numbers otherwise)
    eager.model.load_state_dict(compiled.model.state_dict())
    batch = next(eager.batches(8, seed=3))
    grads = []
    for task in (eager, compiled):
        task.model.eval()
        loss = task.loss(batch)
        loss.backward()
        grads.append((loss.item(), torch.cat([p.grad.flatten() for p in task.model.parameters()])))
    (want, want_grad), (got, got_grad) = grads
    assert abs(want - got) < 1e-4 and torch.allclose(want_grad, got_grad, rtol=1e-3, atol=1e-5), (want, got)


def test_a_compile_that_fails_leaves_the_peer_training_eager_with_one_line(capsys):
    config = RunConfig.model_validate(MICRO_CONFIG)  # compile off: the broken backend below is set by hand
    task = build_task(config)
    precision = Precision.from_config(config.training)
    precision.attach(task.model)

    def broken_backend(graph, example_inputs):
        raise RuntimeError("no C++ compiler on this machine")

    task.model.compile(backend=broken_backend)  # what a volunteer's odd toolchain does to torch.compile
    precision.compile = True
    report = warm_up(task, precision, task.batches(8, seed=1))
    assert not report.compiled and not precision.compile and "no C++ compiler on this machine" in report.fell_back
    lines = [line for line in capsys.readouterr().out.splitlines() if "torch.compile failed" in line]
    assert len(lines) == 1 and "pass --compile off to skip the attempt" in lines[0], lines
    assert _train(task, task.batches(8, seed=1))[-1] < 8.0  # and it trains, eager
    assert torch.isfinite(next(task.model.parameters())).all()
