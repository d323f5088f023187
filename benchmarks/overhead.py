"""What does collab cost a peer? One collab peer training alone against a plain PyTorch loop.

Both train the same model (the config's AlbertForPreTraining) on the same data pipeline with the
same micro-batch, the same LAMB optimizer and the same number of micro-batches per optimizer step
(target_batch_size / micro_batch_size, plain gradient accumulation) — what a user would otherwise
run on one machine. collab runs as a real `collab join` process (DHT, averagers and p2pd included)
and reports samples/s over its training loop; the plain loop runs in this process afterwards.

    python3 benchmarks/overhead.py [--config albert-tiny] [--epochs 6] [--threads 2]

Goal: ratio >= 0.95.
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


def collab_alone(config: str, epochs: int, env: dict) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "summary.json"
        subprocess.run([sys.executable, "-m", "collab", "join", "--run-id", f"bench-{os.getpid()}",
                        "--config", config, "--max-epochs", str(epochs), "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                        "--summary-json", str(summary), "--no-live"],
                       check=True, env=env, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL, timeout=3600)
        s = json.loads(summary.read_text())
    return s["samples_contributed"] / s["train_seconds"]


def plain_loop(config_name: str, samples: int) -> float:
    import torch

    from collab.config import load_config
    from collab.tasks import build_task

    config = load_config(config_name)
    task = build_task(config)
    micro, target = config.training.micro_batch_size, config.training.target_batch_size
    optimizer = task.optimizer_factory()(task.parameter_groups())
    scheduler = task.scheduler_factory()(optimizer)
    batches = task.batches(micro, seed=0)
    task.loss(next(batches)).backward()  # the same warm-up step collab takes before it starts counting
    optimizer.zero_grad()
    accumulation = target // micro
    done, started = 0, time.monotonic()
    while done < samples:
        for _ in range(accumulation):
            (task.loss(next(batches)) / accumulation).backward()
            done += micro
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return done / (time.monotonic() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="albert-tiny")
    parser.add_argument("--epochs", type=int, default=6, help="collaborative steps collab trains for")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), HIVEMIND_LOGLEVEL="ERROR")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)

    from collab.config import load_config

    config = load_config(args.config)
    collab_sps = collab_alone(args.config, args.epochs, env)
    plain_sps = plain_loop(args.config, args.epochs * config.training.target_batch_size)
    rows = [("plain PyTorch loop (grad accumulation + LAMB)", f"{plain_sps:.2f}", "1.00"),
            ("collab join, alone (hivemind.Optimizer, DHT, p2pd)", f"{collab_sps:.2f}", f"{collab_sps / plain_sps:.2f}")]
    print(f"config {args.config}: micro-batch {config.training.micro_batch_size}, target "
          f"{config.training.target_batch_size}, {args.epochs} steps, {args.threads} threads")
    print(f"{'':52} {'samples/s':>10} {'ratio':>6}")
    for name, sps, ratio in rows:
        print(f"{name:52} {sps:>10} {ratio:>6}")
    print(f"goal: ratio >= 0.95 -> {'met' if collab_sps / plain_sps >= 0.95 else 'NOT met'}")


if __name__ == "__main__":
    main()
