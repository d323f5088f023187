"""What does collab cost a peer? One collab peer training alone against a plain PyTorch loop.

Both train the same model (the config's AlbertForPreTraining) on the same data pipeline with the
same micro-batch, the same LAMB optimizer and the same number of micro-batches per optimizer step
(target_batch_size / micro_batch_size, plain gradient accumulation) — what a user would otherwise
run on one machine. collab runs as a real `collab join` process (DHT, averagers and p2pd included)
and reports samples/s over its training loop; the plain loop runs in this process afterwards.

    python3 benchmarks/overhead.py [--config albert-tiny] [--epochs 6] [--threads 2]
    python3 benchmarks/overhead.py --config albert-base --device cuda --micro-batch-size 32   # bf16, compiled
    python3 benchmarks/overhead.py --compile on      # both compiled (torch.compile; its time is not counted)

On a GPU the defaults are what a strong user writes: bf16 autocast (the GPU's if it has it, else fp16 with loss
scaling), SDPA attention (transformers' default), torch.compile; on a CPU, fp32 and eager.

On a GPU both sides compute in the same autocast precision; the plain loop uses torch's GradScaler for fp16
(what a user would write), collab its own per-micro-batch loss scaling (collab.train.precision).

MFU (model FLOPs utilisation) = samples/s x the FLOPs of one sample's forward and backward (counted by torch's
FlopCounterMode on the model itself, attention included) / the GPU's dense peak in that precision. On a CPU it is
not printed: its peak depends on the cores and vector units the run got.

Goals: CPU ratio >= 0.95; GPU (compiled bf16 on both sides, what a strong user writes) ratio >= 0.9.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def collab_alone(args, env: dict) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "summary.json"
        subprocess.run([sys.executable, "-m", "collab", "join", "--run-id", f"bench-{os.getpid()}",
                        "--config", args.config, "--max-epochs", str(args.epochs),
                        "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--device", args.device, "--precision", args.precision,
                        "--micro-batch-size", str(args.micro_batch_size), "--compile", args.compile,
                        "--summary-json", str(summary), "--no-live"],
                       check=True, env=env, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL, timeout=3600)
        s = json.loads(summary.read_text())
    return s["samples_contributed"] / s["train_seconds"]


def plain_loop(args, config, samples: int) -> float:
    import contextlib

    import torch

    from collab.tasks import build_task

    task = build_task(config)
    device = torch.device(args.device)
    task.model.to(device)
    if args.compile == "on":  # what a strong user writes: the model compiled, the warm-up step below compiles it
        task.model.compile(dynamic=False)
    micro, target = args.micro_batch_size, config.training.target_batch_size
    optimizer = task.optimizer_factory()(task.parameter_groups())
    scheduler = task.scheduler_factory()(optimizer)
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.precision)

    def loss_of(batch):
        batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        with torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext():
            return task.loss(batch)

    if device.type == "cuda":  # a strong user's loader: torch's DataLoader with a worker, pinned, as collab's
        from collab.train.pipeline import BatchPipeline

        batches = BatchPipeline(config, micro, seed=0, pin=True)
    else:
        batches = task.batches(micro, seed=0)
    scaler.scale(loss_of(next(batches))).backward()  # the same warm-up step collab takes before it starts counting
    optimizer.zero_grad()
    accumulation = target // micro
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    done, started = 0, time.monotonic()
    while done < samples:
        for _ in range(accumulation):
            scaler.scale(loss_of(next(batches)) / accumulation).backward()
            done += micro
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad()
    sync()
    return done / (time.monotonic() - started)


# dense tensor-core peaks (FLOP/s) in bf16/fp16, and fp32 through TF32, from the vendors' datasheets (SXM parts)
PEAKS = {"H200": (989e12, 495e12), "H100": (989e12, 495e12), "A100": (312e12, 156e12), "L4": (121e12, 60e12),
         "A10": (125e12, 62e12), "T4": (65e12, 8e12)}


def flops_per_sample(config, device: str) -> float:
    """One sample's forward and backward, as torch counts them (matmuls and attention)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from collab.tasks import build_task

    task = build_task(config)
    task.model.to(device)
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in next(task.batches(1, seed=0)).items()}
    with FlopCounterMode(display=False) as counter:
        task.loss(batch).backward()
    return float(counter.get_total_flops())


def peak_flops(args) -> float | None:
    import torch

    if args.device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    for part, (half, tf32) in PEAKS.items():
        if part in name:
            return half if args.precision in ("bf16", "fp16") else tf32
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="albert-tiny")
    parser.add_argument("--epochs", type=int, default=6, help="collaborative steps collab trains for")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--precision", default="auto", choices=("auto", "fp32", "fp16", "bf16"),
                        help="auto: bf16 on a GPU that has it, else fp16; fp32 on a CPU")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="default: the config's")
    parser.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                        help="torch.compile the model, in collab (--compile) and in the plain loop alike (auto: on a "
                             "GPU)")
    args = parser.parse_args()
    if args.compile == "auto":
        args.compile = "on" if args.device == "cuda" else "off"
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), HIVEMIND_LOGLEVEL="ERROR")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    if args.precision == "auto":
        args.precision = "fp32" if args.device != "cuda" else ("bf16" if torch.cuda.is_bf16_supported() else "fp16")

    from collab.config import load_config

    config = load_config(args.config)
    args.micro_batch_size = args.micro_batch_size or config.training.micro_batch_size
    collab_sps = collab_alone(args, env)
    plain_sps = plain_loop(args, config, args.epochs * config.training.target_batch_size)
    flops, peak = flops_per_sample(config, args.device), peak_flops(args)

    def mfu(sps: float) -> str:
        return f"{sps * flops / peak:.3f}" if peak else "-"

    rows = [("plain PyTorch loop (grad accumulation + LAMB)", plain_sps, "1.00"),
            ("collab join, alone (hivemind.Optimizer, DHT, p2pd)", collab_sps, f"{collab_sps / plain_sps:.2f}")]
    print(f"config {args.config}: micro-batch {args.micro_batch_size}, target {config.training.target_batch_size}, "
          f"{args.epochs} steps, {args.precision} on {args.device}, {args.threads} threads, compile {args.compile}; "
          f"{flops / 1e9:.1f} GFLOP a sample")
    print(f"{'':52} {'samples/s':>10} {'ratio':>6} {'MFU':>6}")
    for name, sps, ratio in rows:
        print(f"{name:52} {sps:>10.2f} {ratio:>6} {mfu(sps):>6}")
    goal = 0.9 if args.device == "cuda" else 0.95
    print(f"goal: ratio >= {goal} -> {'met' if collab_sps / plain_sps >= goal else 'NOT met'}")


if __name__ == "__main__":
    main()
