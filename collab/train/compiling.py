"""A peer's first micro-batch: a throw-away forward and backward that also compiles the model when the peer does
(training.compile, collab.train.precision).

The first step of a process is several times slower (allocator, data pipeline, CUDA kernels), and with compiling
tens of seconds on a GPU: a peer that announced itself before it would look stalled to the swarm, and the time
would count against its samples/s. A compile that fails leaves the peer training eager, with one warning line:
a volunteer's odd toolchain must not cost the swarm a peer. The graphs compiled then, and any compiled later
(a recompile: a shape that changed), are counted for the peer's summary.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from collab.data.feed import FeedStopped


@dataclass
class CompileReport:
    seconds: float = 0.0  # the first micro-batch, compiling included
    graphs: int = 0  # graphs compiled by the first micro-batch
    recompiles: int = 0  # graphs compiled after it (fixed shapes: none expected)
    fell_back: Optional[str] = None  # why this peer trains eager although it was to compile
    compiled: bool = False  # whether the model that trains is the compiled one

    def as_dict(self) -> dict:
        """For the summary, with the graphs compiled since the warm-up counted now."""
        if self.compiled:
            self.recompiles = max(0, compiled_graphs() - self._after_warm_up)
        return asdict(self)


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters  # dynamo's own bookkeeping: the one count of graphs it compiled

    return int(counters["stats"]["unique_graphs"])


def warm_up(task, precision, batches) -> CompileReport:
    """One throw-away micro-batch; compiles the model if the peer compiles (or falls back to eager)."""
    report, started, before = CompileReport(), time.monotonic(), compiled_graphs()
    if precision.compile:
        print("Compiling the model (the first micro-batch; tens of seconds on a GPU)...", flush=True)
    batch = precision.to_device(next(batches))
    try:
        _step(task, precision, batch)
    except FeedStopped:
        raise
    except Exception as e:  # noqa: BLE001 - whatever failed while compiling, the peer can still train eager
        if not precision.compile:
            raise
        root = e  # dynamo wraps the backend's own error (BackendCompilerFailed.inner_exception): that one says why
        while (getattr(root, "inner_exception", None) or root.__cause__) is not None:
            root = getattr(root, "inner_exception", None) or root.__cause__
        first = str(root).strip().splitlines()[0] if str(root).strip() else ""
        report.fell_back = f"{type(root).__name__}: {first}"[:300]
        precision.compile = False
        task.model._compiled_call_impl = None  # what nn.Module.compile set: the module runs its forward again
        task.model.zero_grad(set_to_none=True)
        print(f"torch.compile failed ({report.fell_back}); this peer trains without it (pass --compile off to skip "
              "the attempt)", flush=True)
        _step(task, precision, batch)
    report.seconds = time.monotonic() - started
    report._after_warm_up = compiled_graphs()
    report.graphs, report.compiled = report._after_warm_up - before, precision.compile
    if precision.compile:
        print(f"Compiled the model in {report.seconds:.0f} s ({report.graphs} graphs)", flush=True)
    return report


def _step(task, precision, batch) -> None:
    with precision.autocast():
        loss = task.loss(batch)
    precision.backward(loss)
    task.model.zero_grad(set_to_none=True)
    if precision.device.type == "cuda":
        torch.cuda.synchronize(precision.device)  # the compile and the kernels' first launch are in the time
