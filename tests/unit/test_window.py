"""Micro-batches checked and summed on the device, read once per window (collab.train.window): the sum holds exactly
the good micro-batches, the guard counts exactly the bad ones, fp16's loss scale moves on the device, and nothing
is read back before the window closes."""

from __future__ import annotations

import contextlib

import pytest
import torch

from collab.train.guard import RELOAD_AFTER, BatchGuard
from collab.train.precision import GROW_AFTER, INITIAL_SCALE, Precision
from collab.train.window import MOST, WINDOW_SECONDS, GradientWindow

HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu")


@contextlib.contextmanager
def no_host_reads():
    """What makes a host wait for a GPU: any read of a tensor's value into Python. Each one raises here."""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def refuse(name):
        def read(*args, **kwargs):
            raise AssertionError(f"Tensor.{name} read a value back to the host")
        return read

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, refuse(name))
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _loss(model, x):
    return model(x).pow(2).mean()


def _gradient(model, x) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    _loss(model, x).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def test_the_window_sums_exactly_the_good_micro_batches_and_the_guard_counts_exactly_the_bad_ones():
    model = _model()
    xs = [torch.randn(8, 4) for _ in range(6)]
    xs[1] = xs[1].clone()
    xs[1][0, 0] = float("nan")  # its loss is NaN
    blow_up = {"now": False}
    model[0].weight.register_hook(lambda g: g * float("inf") if blow_up["now"] else g)  # 3: finite loss, inf grads
    good = [0, 2, 4, 5]
    expected = [sum(parts) for parts in zip(*(_gradient(model, xs[i]) for i in good))]

    precision = Precision(device=torch.device("cpu"), precision="fp32")
    precision.attach(model)
    window = GradientWindow(model.parameters(), precision)
    window.limit = 6
    with no_host_reads():
        for i, x in enumerate(xs):
            blow_up["now"] = i == 3
            window.add(_loss(model, x))
    assert window.full()
    for param, want in zip(model.parameters(), expected):
        torch.testing.assert_close(param.grad, want)  # not a trace of micro-batches 1 and 3
    outcomes = window.close()
    assert [o.good for o in outcomes] == [True, False, True, False, True, True]
    assert not outcomes[1].loss_finite and outcomes[3].loss_finite and not outcomes[3].gradients_finite
    assert outcomes[0].loss == pytest.approx(float(_loss(model, xs[0]).detach()))
    guard = BatchGuard()
    assert [guard.count(o.loss_finite, o.gradients_finite) for o in outcomes] == [o.good for o in outcomes]
    assert guard.dropped == {"loss not finite": 1, "gradients not finite": 1} and guard.in_a_row == 0
    assert window.size == 0  # closed: the next micro-batch opens a new one


def test_many_bad_micro_batches_in_a_row_mean_the_replica_is_broken():
    guard = BatchGuard()
    for _ in range(RELOAD_AFTER - 1):
        guard.count(False, False)
    assert not guard.replica_is_broken() and guard.dropped == {"loss not finite": RELOAD_AFTER - 1}
    guard.count(True, False)
    assert guard.replica_is_broken()
    guard.count(True, True)
    assert not guard.replica_is_broken()


def test_fp16_scaling_on_the_device_hands_over_the_true_gradient_and_backs_off_on_overflow():
    model = _model()
    x = torch.randn(8, 4)
    expected = _gradient(model, x)
    precision = Precision(device=torch.device("cpu"), precision="fp16")  # the scaling needs no GPU
    precision.attach(model)
    window = GradientWindow(model.parameters(), precision)
    window.limit = 2
    seen = {}

    def look(g):
        seen.setdefault("scaled", g.abs().max())
        return g

    model[2].weight.register_hook(look)
    with no_host_reads():
        window.add(_loss(model, x))
    assert float(seen["scaled"]) > 1000 * float(expected[2].abs().max())  # the backward pass saw the scale
    for param, want in zip(model.parameters(), expected):
        torch.testing.assert_close(param.grad, want)

    overflow = model[0].weight.register_hook(lambda g: g * 1e38)  # finite loss, gradients beyond fp16's range x scale
    with no_host_reads():
        window.add(_loss(model, x))
    overflow.remove()
    outcomes = window.close()
    assert [(o.loss_finite, o.gradients_finite) for o in outcomes] == [(True, True), (True, False)]
    assert precision.scale == INITIAL_SCALE / 2
    for param, want in zip(model.parameters(), expected):  # the overflowed micro-batch left the sum as it was
        torch.testing.assert_close(param.grad, want)

    window.add(_loss(model, x) * float("nan"))  # a bad batch, not an overflow: the scale stays
    window.close()
    assert precision.scale == INITIAL_SCALE / 2
    for _ in range(GROW_AFTER):  # a long clean run earns the scale back
        model.zero_grad(set_to_none=True)
        window.add(_loss(model, x))
        window.close()
    assert precision.scale == INITIAL_SCALE


def test_the_window_grows_with_the_pace_and_shrinks_before_the_epoch_ends():
    model = _model()
    precision = Precision(device=torch.device("cpu"), precision="fp32")
    precision.attach(model)
    window = GradientWindow(model.parameters(), precision)
    assert window.limit == 1  # the pace is not known yet
    window.resize(seconds=0.01, micro_batches=1, seconds_to_epoch_end=60.0)
    assert window.limit == min(MOST, int(WINDOW_SECONDS / 0.01))  # micro-batches of 10 ms
    window.resize(seconds=0.01, micro_batches=1, seconds_to_epoch_end=0.05)
    assert window.limit == 2  # half of the 50 ms left: this peer's samples reach the swarm before its epoch ends
    window.resize(seconds=0.01, micro_batches=1, seconds_to_epoch_end=-3.0)  # overdue: every micro-batch counts
    assert window.limit == 1
    single = GradientWindow(model.parameters(), precision, most=1)  # a mode that steps on every micro-batch
    single.resize(seconds=0.001, micro_batches=1, seconds_to_epoch_end=60.0)
    assert single.limit == 1
