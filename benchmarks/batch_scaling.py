"""Bigger targets, AdaScale and an automatic target: loss against samples seen, 3 real collab peers per row.

Rows (ALBERT-tiny on the embedded corpus, the runner of benchmarks/fidelity.py, the same peers and data order in
every row): fixed-<T> (target T, the learning rate tuned at the base batch), fixed-<T>+adascale
(training.lr_scaling adascale over base batch --base: the learning rate times AdaScale's gain from the swarm's
measured noise scale, the schedule in scale-invariant steps), auto (target_batch_size auto from --base within
[--base, 16 --base], with AdaScale). Every fixed row trains 1.5x the reference's samples (so a slower row can
still reach its loss); auto runs as many epochs as the reference row, whatever its targets (only its columns at
the reference's loss compare).

Columns: the loss the row reached (mean of its last 5 epochs); samples to the reference's final loss (fixed-<base>'s
mean over its last 5 epochs: the first epoch whose trailing 5-epoch mean is at or below it), as a ratio of the
reference's own; wall time to that loss (the run's wall time at that epoch's share of its epochs) against the
reference's; the last target and gain; epochs. Goal (issue 14): fixed-<4 base>+adascale reaches the reference's
loss within 1.1x its samples; auto reaches it in less wall time than the best fixed row.

    python3 benchmarks/batch_scaling.py [--rows fixed-128,fixed-256,fixed-512,fixed-256+adascale,fixed-512+adascale,auto]
                                        [--base 128] [--reference-steps 40] [--seed 0] [--seq-length 64]
    python3 benchmarks/batch_scaling.py --task linreg --base 256 --reference-steps 180 --lr 0.01 \
        --rows fixed-512,fixed-1024,fixed-512+adascale,fixed-1024+adascale,auto [--dim 20000]

--task linreg runs the same rows on linear regression (collab.tasks.linreg, SGD) where B_noise is known and far
above the base batch; ALBERT-tiny's B_noise, early in training, is below it (measured: ~42 samples).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.fidelity import PEERS, run_config, swarm  # noqa: E402
from collab.peers.report import aligned  # noqa: E402

TRAIL = 5


def fidelity_args(args) -> SimpleNamespace:
    """What benchmarks/fidelity.py's runner reads: the reference row's batch and steps."""
    return SimpleNamespace(seq_length=args.seq_length, batch=args.base, steps=args.reference_steps, dgc_warmup=4,
                           overlap="none", local_codec="fp16", timeout=args.timeout)


# --task linreg: noiseless labels, so B_noise = tr(Sigma) / |G|^2 = dim + 1 = 20001 wherever w is, 78x the base batch
# of 256: the regime where a 4x target should cost little more than 1x the samples with AdaScale (at its gain for
# S = 4, 3.86, SGD's progress per sample at 4x is 0.98 of the base's). Without label noise the loss falls
# geometrically and each epoch's mean is exact to ~0.71 / sqrt(samples) of itself: rows resolve to a few percent.
LINREG = {"name": "linreg", "dim": 20000, "noise_sd": 0.0, "distance": 1.0}


def linreg_lr(args) -> float:
    """Half of SGD's fastest per-step rate on noiseless linreg at the base batch, 1 / (1 + B_noise / base): a rate
    tuned at the base batch, with a margin (the loss's expected factor per step is
    1 - 2 lr + lr^2 (1 + B_noise / B))."""
    return 0.5 / (1 + (args.dim + 1) / args.base)


def row_config(args, row: str) -> tuple[dict, int]:
    """The row's run config and its --max-epochs (enough epochs for --samples at its smallest target)."""
    config = run_config(fidelity_args(args), "fp16", args.seed)
    if args.task == "linreg":  # plain SGD at a rate that makes progress at the base batch; every part exact
        config["task"] = {**LINREG, "dim": args.dim}
        config["training"].update(micro_batch_size=16, learning_rate=args.lr or linreg_lr(args), warmup_steps=0)
        # no overlap: a micro-batch here takes ~2 ms, so with the step in the background a peer computed ~1000
        # samples during each round and every round held ~4.6x the base target (measured: 1176 per epoch at 256)
        # state rounds at the product's default (fidelity.py turns them off): at ~3000 samples/s a peer ran 15
        # epochs alone before its progress reached the others, and without a state round its replica stayed
        # apart for the whole run (its loss 2.3x the others'; the noise scale, measured on gradients taken at
        # different parameters, came out negative)
        config["averaging"].update(compression="none", aggregation="mean", overlap="none", average_state_every=5)
    elif args.lr:
        config["training"]["learning_rate"] = args.lr
    training = config["training"]
    samples = int(args.reference_steps * args.base * 1.5)
    training["total_steps"] = 4 * args.reference_steps  # linear decay: a schedule longer than every row's run
    name, _, scaling = row.partition("+")
    if name == "auto":
        training.update(target_batch_size="auto", base_batch_size=args.base, lr_scaling="adascale",
                        auto_target={"min": args.base, "max": 16 * args.base, "every_epochs": 3})
        return config, samples // args.base
    target = int(name.removeprefix("fixed-"))
    training["target_batch_size"] = target
    if scaling == "adascale":
        training.update(lr_scaling="adascale", base_batch_size=args.base)
    return config, max(1, samples // target)


def curve(result: dict, default_target: int) -> list[tuple[int, float]]:
    """(samples the swarm had trained when the epoch closed, the peers' mean loss over it) per epoch. The samples
    are the peers' own counts (a target is a floor: the micro-batches in flight when it is reached count too, a
    larger share of a small target); from the targets where a summary has none."""
    by_epoch: dict[int, list[float]] = {}
    targets: dict[int, int] = {}
    for s in result["summaries"]:
        for epoch, loss in s["loss_by_epoch"].items():
            by_epoch.setdefault(int(epoch), []).append(loss)
        for epoch, plan in s.get("plan_by_epoch", {}).items():
            targets[int(epoch)] = plan[0]
    counts = [{int(e): n for e, n in s.get("samples_by_epoch", {}).items()} for s in result["summaries"]]

    def counted(epoch: int) -> int:  # each peer's count at its last closed epoch up to this one
        return sum(max((n for e, n in c.items() if e <= epoch), default=0) for c in counts)

    points, seen = [], 0
    for epoch in sorted(by_epoch):
        seen += targets.get(epoch, default_target)
        points.append((counted(epoch) if all(counts) else seen, statistics.mean(by_epoch[epoch])))
    return points


def reached(points: list[tuple[int, float]], level: float, window: int) -> Optional[int]:
    """The index of the first epoch whose trailing mean, over the last epochs that hold at least `window` samples,
    is at or below `level`. A window of equal samples, not epochs: five epochs of a 4x target reach four times
    further back than five of the base, and would lag by as much on a falling curve."""
    for i in range(len(points)):
        j = i
        while j > 0 and points[i][0] - points[j - 1][0] < window:
            j -= 1
        if j == 0 and points[i][0] < window:
            continue
        if statistics.mean(loss for _, loss in points[j:i + 1]) <= level:
            return i
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="fixed-128,fixed-256,fixed-512,fixed-256+adascale,fixed-512+adascale,auto")
    parser.add_argument("--base", type=int, default=128, help="the reference target and the base batch")
    parser.add_argument("--reference-steps", type=int, default=40, help="epochs of the reference row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--task", default="albert", choices=("albert", "linreg"))
    parser.add_argument("--lr", type=float, default=None, help="the learning rate at the base batch (default: the "
                        "config's; linreg: half of SGD's fastest rate at the base batch)")
    parser.add_argument("--dim", type=int, default=LINREG["dim"], help="linreg's dimension: its B_noise is dim + 1")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    from collab.records.identity import load_or_create_identity

    work = Path(tempfile.mkdtemp(prefix="collab-batch-scaling-"))
    print(f"peers' logs and summaries (noise_inputs: each round's norms) under {work}", flush=True)
    (work / "ids").mkdir()
    for i in range(PEERS):
        load_or_create_identity(work / "ids" / f"peer{i}.identity")
    rows = [f"fixed-{args.base}", *(r for r in args.rows.split(",") if r != f"fixed-{args.base}")]
    results = {}
    for row in rows:
        config, epochs = row_config(args, row)
        result = swarm(fidelity_args(args), row, args.seed, work / "ids", work / row, config=config, steps=epochs,
                       evaluate=args.task == "albert")
        target = config["training"]["target_batch_size"]
        results[row] = (result, curve(result, target if isinstance(target, int) else args.base), epochs)
        points = results[row][1]
        print(f"{row}: {len(points)} epochs, loss {points[0][1]:.4g} -> {points[-1][1]:.4g}, "
              f"{result['wall']:.0f} s", flush=True)
    ref_result, ref_points, _ = results[rows[0]]
    ref_steps = min(args.reference_steps, len(ref_points))
    level = statistics.mean(loss for _, loss in ref_points[ref_steps - TRAIL:ref_steps])
    window = ref_points[ref_steps - 1][0] - ref_points[ref_steps - TRAIL - 1][0]  # the samples of the ref.'s last 5
    ref_at = reached(ref_points, level, window)
    ref_samples = ref_points[ref_at][0]
    ref_wall = ref_result["wall"] * (ref_at + 1) / len(ref_points)
    table = [("row", f"loss (last {TRAIL})", "samples to ref. loss", "vs ref.", "wall to ref. loss", "vs ref.",
              "last target", "last gain", "epochs")]
    for row in rows:
        result, points, _ = results[row]
        at = reached(points, level, window)
        plans = result["summaries"][0].get("plan_by_epoch", {})
        last_plan = plans[max(plans, key=int)] if plans else None
        wall = result["wall"] * (at + 1) / len(points) if at is not None else None
        table.append((row, f"{statistics.mean(loss for _, loss in points[-TRAIL:]):.4g}",
                      str(points[at][0]) if at is not None else "not reached",
                      f"{points[at][0] / ref_samples:.2f}x" if at is not None else "-",
                      f"{wall:.0f} s" if wall is not None else "-",
                      f"{wall / ref_wall:.2f}x" if wall is not None else "-",
                      str(last_plan[0]) if last_plan else str(row_config(args, row)[0]["training"]["target_batch_size"]),
                      f"{last_plan[1]:.2f}" if last_plan else "1", str(len(points))))
    what = (f"ALBERT-tiny seq {args.seq_length}" if args.task == "albert" else
            f"linreg dim {args.dim} (B_noise {args.dim + 1}), lr {args.lr or linreg_lr(args):.3g}")
    print(f"\n3 peers, {what}, seed {args.seed}; reference fixed-{args.base}: loss "
          f"{level:.4g} after {ref_samples} samples ({ref_steps} epochs)")
    print("\n".join(aligned(table)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
