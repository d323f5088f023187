"""Where a peer computes and in what precision: its own business (a volunteer's GPU, another's CPU), never the
run's. The averaged gradients and the optimizer stay fp32 on the CPU (hivemind's offloaded optimizer): only the
forward and backward passes run in the chosen precision.

fp16 needs loss scaling (its gradients underflow below 6e-8). hivemind's GradScaler is built around torch's
and the optimizer's own step; collab checks and drops micro-batches itself (collab.train.window), so the scaling is
done here, per micro-batch, and on the device (no host read per micro-batch): the loss is multiplied by the scale,
the micro-batch's gradients divided by it and checked in one fused kernel (torch's own GradScaler kernels), and an
overflow halves the scale and skips the micro-batch (it is not a bad batch: the guard never counts it, and it
never counts toward reloading the replica).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from collab.errors import UserError

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
INITIAL_SCALE = 2.0 ** 16
GROW_AFTER = 1000  # clean micro-batches in a row before the scale doubles (as torch's GradScaler: 2000 steps)
MIN_SCALE = 1.0


def choose_device(device: str) -> torch.device:
    """training.device: "auto" is the GPU when there is one."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("training.device is 'cuda' but torch sees no GPU (torch " + torch.__version__ + "); set "
                        "--device cpu, or install a CUDA build of torch")
    return torch.device(device)


def uses_precision(training) -> str:
    """training.precision with "auto" decided: bf16 on a GPU that has it (no loss scaling: fp32's range), fp16 on an
    older one, fp32 on a CPU."""
    if training.precision != "auto":
        return training.precision
    device = choose_device(training.device)
    if device.type != "cuda":
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def uses_compile(training, device: torch.device) -> bool:
    """training.compile with "auto" decided: on a GPU only. On a CPU a compiled model made collab's peer no faster
    (benchmarks/overhead.py, 2 cores, ALBERT-tiny, 2026-11-28: 25.4-34.0 samples/s compiled against 26.7-33.2 eager,
    medians 28.5 and 29.3), after a 30 s compile at every start, though the plain loop gained about 15% from it;
    `--compile on` still compiles there (docs/benchmarks.md)."""
    if training.compile != "auto":
        return training.compile == "on"
    return device.type == "cuda"


def uses_data_workers(training, device: torch.device) -> int:
    """training.data_workers with "auto" decided: a worker process on a GPU (the training thread then only launches
    kernels), none on a CPU (a worker would take cores from the model it feeds)."""
    if training.data_workers != "auto":
        return training.data_workers
    return 1 if device.type == "cuda" else 0


@dataclass
class Precision:
    device: torch.device
    precision: str  # fp32 | fp16 | bf16
    overflows: int = 0  # fp16 micro-batches skipped because their gradients overflowed (counted by the trainer)
    compile: bool = False  # torch.compile the model (training.compile decided)
    _scale: Optional[torch.Tensor] = None  # fp16's loss scale, on the device (as torch's GradScaler keeps it)
    _clean_in_a_row: Optional[torch.Tensor] = None  # int32, on the device

    @classmethod
    def from_config(cls, training, device: Optional[str] = None) -> "Precision":
        """`device`: one of training.devices (collab.train.local_group), else training.device decides."""
        device = torch.device(device) if device is not None else choose_device(training.device)
        precision = uses_precision(training)
        if precision == "fp16" and device.type != "cuda":
            raise UserError(f"training.precision fp16 needs a GPU (this peer computes on {device.type}); use "
                            "--precision bf16 or fp32 on a CPU")
        return cls(device=device, precision=precision, compile=uses_compile(training, device))

    def attach(self, model: torch.nn.Module) -> None:
        model.to(self.device)
        self._scale = torch.full((), INITIAL_SCALE if self.scaling else 1.0, device=self.device)
        self._clean_in_a_row = torch.zeros((), dtype=torch.int32, device=self.device)

    def compile_model(self, model: torch.nn.Module) -> None:
        """Once the micro-batch size is known (its shape is what compiles)."""
        if self.compile:
            # in place: the module keeps its parameters (the ones hivemind averages) and its state_dict's names;
            # nothing compiles until the first forward pass (the trainer's warm-up: collab.train.compiling)
            model.compile(dynamic=False)

    def to_device(self, batch: dict) -> dict:
        if self.device.type == "cpu":
            return batch
        return {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}

    def autocast(self):
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[self.precision])

    @property
    def scaling(self) -> bool:
        return self.precision == "fp16"

    @property
    def scale(self) -> float:
        return float(self._scale)  # a host read: for reports and tests, never per micro-batch

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self._scale if self.scaling else loss).backward()

    def unscale_and_check(self, grads: list[torch.Tensor], loss_finite: torch.Tensor) -> torch.Tensor:
        """After backward: the micro-batch's gradients divided by the scale, in place. Returns a device flag (1.0 if
        any gradient is not finite); under fp16 an overflow of a finite loss halves the scale, and GROW_AFTER clean
        micro-batches in a row double it. Nothing is read on the host."""
        found = torch.zeros(1, device=self.device)
        inverse = torch.reciprocal(self._scale)
        for group in _by_device_and_dtype(grads):  # torch's kernel takes one device and dtype at a time
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inverse)
        if self.scaling:  # a non-finite loss is a bad batch, not an overflow: it leaves the scale as it is
            torch._amp_update_scale_(self._scale, self._clean_in_a_row, found * loss_finite, 2.0, 0.5, GROW_AFTER)
            self._scale.clamp_(min=MIN_SCALE)
        return found

    def describe(self) -> str:
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "CPU"
        return f"{self.precision}{', compiled' if self.compile else ''} on {self.device.type} ({name})"


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())
