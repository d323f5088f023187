"""One peer for all of a machine's GPUs (training.devices, --gpus): a helper process per extra device, in lockstep
with the trainer's windows (collab.train.window), and one hivemind peer toward the swarm.

The trainer's process is rank 0: it keeps the DHT, the optimizer and the data. At each window it deals every
helper its share of the peer's micro-batches (from the peer's one stream, so the order and the place in the
shards stay the peer's), sends the parameters if they changed, computes its own share, and then sums the
helpers' window gradients into its own .grad (torch.distributed: NCCL between GPUs, gloo between CPU processes).
The optimizer sees one peer's window of all the devices' good micro-batches, and counts all their samples.
A helper's checks run on its own device, as rank 0's do; what it found comes back with the sum.
"""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from collab.errors import UserError
from collab.train.window import Outcome

# how long a rank waits for the others in a collective: a helper imports torch and builds the model before it joins,
# and compiles with its first window; rank 0 stops the helpers as soon as its training loop ends
TIMEOUT = timedelta(minutes=30)
GO, STOP = 1, 0


def resolve_devices(devices) -> list[str]:
    """training.devices as device names, every GPU named checked to be there (before anything starts)."""
    if devices == "all":
        count = torch.cuda.device_count()
        if count == 0:
            raise UserError("--gpus all: torch sees no GPU (torch " + torch.__version__ + "); install a CUDA build of "
                            "torch, or leave --gpus out")
        return [f"cuda:{i}" for i in range(count)]
    for name in devices:
        if name.startswith("cuda:") and int(name[5:]) >= torch.cuda.device_count():
            raise UserError(f"--gpus names {name}, but torch sees {torch.cuda.device_count()} GPU(s); pass indices "
                            "below that, or --gpus all")
    return list(devices)


class LocalGroup:
    """Rank 0's side: the helper processes, and the collectives of each window."""

    def __init__(self, config, devices: list[str]):
        self.devices, self.size = devices, len(devices)
        self.backend = "nccl" if devices[0].startswith("cuda") else "gloo"
        self.micro_batches = [0] * self.size  # each rank's micro-batches computed, rank 0's included
        self._open = False
        context = torch.multiprocessing.get_context("spawn")  # the trainer may hold CUDA: never fork it
        address = f"tcp://127.0.0.1:{_free_port()}"
        self.helpers = [context.Process(target=_helper, args=(config.model_dump(mode="json"), device, rank,
                                                                self.size, address),
                                        name=f"collab-rank{rank}", daemon=True)
                        for rank, device in enumerate(devices) if rank > 0]
        for helper in self.helpers:
            helper.start()
        if self.backend == "nccl":
            torch.cuda.set_device(torch.device(devices[0]))
        self._join(address)

    def _join(self, address: str) -> None:
        """Form the group, or say which helper died before it joined (its own error is on the peer's stderr)."""
        failed: list[BaseException] = []

        def init() -> None:
            try:
                dist.init_process_group(self.backend, init_method=address, rank=0, world_size=self.size,
                                        timeout=TIMEOUT)
            except BaseException as e:  # noqa: BLE001 - reported below, in the trainer's thread
                failed.append(e)

        joining = threading.Thread(target=init, name="local-group-join", daemon=True)
        joining.start()
        while joining.is_alive():
            dead = [(device, helper.exitcode) for device, helper in zip(self.devices[1:], self.helpers)
                    if not helper.is_alive()]
            if dead:
                device, code = dead[0]
                raise UserError(f"the process for {device} exited (code {code}) before it joined this peer (its "
                                "error is above); fix that, or pass --gpus without it")
            joining.join(0.5)
        if failed:
            raise UserError(f"the processes for {', '.join(self.devices)} could not form one peer: {failed[0]}; "
                            "pass --gpus with fewer devices, or leave it out")

    @property
    def others(self) -> int:
        return self.size - 1

    def open_window(self, parameters: list[torch.nn.Parameter], dealt: list[list[dict]]) -> None:
        """Start a window: the parameters, and each helper's micro-batches. The parameters go every window: hivemind
        changes them inside a step (a delayed optimizer step lands in a later one) and in state downloads, and a
        helper a window behind would compute gradients on stale weights (a model's fp32 weights a window: 48 MB for
        ALBERT-base, a few ms over PCIe or NVLink)."""
        dist.broadcast(self._tensor([GO, len(dealt[0])]), src=0)
        dist.broadcast(_flat(p.detach() for p in parameters), src=0)
        dist.scatter_object_list([None], [None, *dealt], src=0)
        self._open = True

    def close_window(self, parameters: list[torch.nn.Parameter]) -> list[Outcome]:
        """End a window: the helpers' window gradients summed into rank 0's .grad; what their checks found."""
        for p in parameters:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = _flat(p.grad for p in parameters)
        dist.reduce(flat, dst=0, op=dist.ReduceOp.SUM)
        _unflat(flat, [p.grad for p in parameters])
        found = [None] * self.size
        dist.gather_object(None, found, dst=0)
        self._open = False
        outcomes = []
        for rank, rows in enumerate(found[1:], start=1):
            self.micro_batches[rank] += len(rows)
            outcomes += [Outcome(*row) for row in rows]
        return outcomes

    def close(self, parameters: list[torch.nn.Parameter]) -> None:
        """Stop the helpers (finishing a window they are in: they wait for its sum)."""
        if dist.is_initialized():
            try:
                if self._open:
                    self.close_window(parameters)
                dist.broadcast(self._tensor([STOP, 0]), src=0)
            except Exception as e:  # noqa: BLE001 - a helper that died: the others are ended below all the same
                print(f"while stopping this peer's other devices: {type(e).__name__}: {e}", flush=True)
            dist.destroy_process_group()
        for helper in self.helpers:
            helper.join(timeout=10)
            if helper.is_alive():
                helper.terminate()

    def report(self) -> dict:
        return {"devices": self.devices, "micro_batches_by_rank": list(self.micro_batches)}

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.devices[0] if self.backend == "nccl" else "cpu")


def _helper(config: dict, device: str, rank: int, size: int, address: str) -> None:
    """A helper rank: the model on its own device, computing the windows rank 0 deals it."""
    from collab.config import RunConfig
    from collab.tasks import build_task
    from collab.train.precision import Precision
    from collab.train.window import GradientWindow

    run_config = RunConfig.model_validate(config)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    else:
        torch.set_num_threads(1)  # (the CPU test: two ranks on the cores rank 0 also uses)
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=size, timeout=TIMEOUT)
    precision = Precision.from_config(run_config.training, device=device)
    task = build_task(run_config)
    precision.attach(task.model)
    precision.compile_model(task.model)
    parameters = [p for p in task.model.parameters() if p.requires_grad]
    window = GradientWindow(parameters, precision)
    control = torch.zeros(2, dtype=torch.int64, device=device if backend == "nccl" else "cpu")
    try:
        while True:
            dist.broadcast(control, src=0)
            go, count = control.tolist()
            if go == STOP:
                return
            flat = _flat(p.detach() for p in parameters)
            dist.broadcast(flat, src=0)
            with torch.no_grad():
                _unflat(flat, [p.data for p in parameters])
            dealt = [None]
            dist.scatter_object_list(dealt, None, src=0)
            window.limit = count
            for batch in dealt[0]:
                with precision.autocast():
                    loss = task.loss(precision.to_device(batch))
                window.add(loss)
            found = window.close()
            for p in parameters:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            dist.reduce(_flat(p.grad for p in parameters), dst=0, op=dist.ReduceOp.SUM)
            for p in parameters:
                p.grad = None  # this window's sum went to rank 0
            dist.gather_object([(o.loss, o.loss_finite, o.gradients_finite) for o in found], None, dst=0)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflat(flat: torch.Tensor, into: list[torch.Tensor]) -> None:
    offset = 0
    for t in into:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
