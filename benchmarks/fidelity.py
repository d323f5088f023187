"""What each compression choice costs in learning: 3 real collab peers against one process, same everything else.

For each codec and each seed: 3 `collab join` peers (peers.launcher, 127.0.0.1) train ALBERT-tiny on the
embedded corpus for --steps collaborative steps; one process trains the same model (same seed, so the same
initial weights), optimizer and schedule with plain gradient accumulation to the same batch. The swarm's peers
keep their identities (so their data order) across codecs: rows differ only in the codec.

Columns: codec; mean loss over the last 5 steps; progress ratio (L0 - L_N) / (L0 - L_N of the single process), with
one L0 for both (they start from the same weights: the mean of the two runs' first-step losses), mean and spread
over the seeds; bytes per peer per step as its all-reduce counted them; x fewer bytes than fp32, over the whole run
and over its last rounds (dgc's sparsity warms up); wall time per run. Goals (issue 12): fp16 >= 0.98; 8-bit >=
0.97 at >= 4x; powersgd (rank 4) >= 0.95 at >= 10x; dgc >= 0.95 at >= 100x after warm-up.

    python3 benchmarks/fidelity.py [--codecs fp16,uniform8bit,powersgd,dgc] [--seeds 0,1,2] [--steps 60]
                                   [--batch 48] [--seq-length 128] [--overlap optimizer]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from collab.traffic import RECENT_ROUNDS  # noqa: E402
from peers.launcher import LocalSwarm  # noqa: E402
from peers.report import aligned  # noqa: E402
from tests.conftest import peer_env, read_summary  # noqa: E402

PEERS, LAST = 3, 5


def run_config(args, codec: str, seed: int) -> dict:
    config = yaml.safe_load((ROOT / "configs" / "albert-tiny.yaml").read_text())
    config["task"]["data"]["seq_length"] = args.seq_length
    config["training"].update(target_batch_size=args.batch, seed=seed, total_steps=max(args.steps * 2, 100))
    # a round as soon as all 3 are in it; parameters averaged rarely: the gradients' codec is what is measured
    config["averaging"].update(compression=codec, group_size=PEERS, average_state_every=10**6,
                               dgc_warmup_epochs=args.dgc_warmup, overlap=args.overlap)
    return config


def single_process(args, seed: int) -> list[float]:
    """Loss per step of one process: the swarm's batch by gradient accumulation, same seed, optimizer, schedule."""
    from collab.config import RunConfig
    from collab.tasks import build_task

    config = RunConfig.model_validate(run_config(args, "fp16", seed))
    task = build_task(config)
    optimizer = task.optimizer_factory()(task.parameter_groups())
    scheduler = task.scheduler_factory()(optimizer)
    micro = config.training.micro_batch_size
    accumulate = args.batch // micro
    batches = task.batches(micro, seed=10_000 + seed)
    losses = []
    for _ in range(args.steps):
        total = 0.0
        for _ in range(accumulate):
            loss = task.loss(next(batches))
            (loss / accumulate).backward()
            total += loss.item()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(total / accumulate)
    return losses


def swarm(args, codec: str, seed: int, identities: Path, workdir: Path) -> dict:
    workdir.mkdir(parents=True)
    for i in range(PEERS):  # the same peers (so the same data order) in every row of this seed
        shutil.copy(identities / f"peer{i}.identity", workdir / f"peer{i}.identity")
    config = workdir / "config.yaml"
    config.write_text(yaml.safe_dump(run_config(args, codec, seed)))
    started = time.monotonic()
    with LocalSwarm(PEERS, f"fidelity-{uuid.uuid4().hex[:6]}", workdir,
                    ["--config", str(config), "--max-epochs", str(args.steps)], env=peer_env()) as peers:
        peers.start()
        if not peers.wait(timeout=args.timeout):
            raise SystemExit(f"{codec} seed {seed}: the peers did not reach step {args.steps} in {args.timeout} s")
        summaries = [read_summary(p) for p in peers.peers]
    by_step: dict[int, list[float]] = {}
    for s in summaries:
        for step, loss in s["loss_by_epoch"].items():
            by_step.setdefault(int(step), []).append(loss)
    losses = [statistics.mean(by_step[k]) for k in sorted(by_step)]
    moved = sum(s["allreduce_bytes_sent"] + s["allreduce_bytes_received"] for s in summaries)
    rounds = sum(s["rounds_joined"] + s["rounds_failed"] for s in summaries)
    return dict(losses=losses, bytes_per_step=moved / max(rounds, 1),
                fewer=sum(s["allreduce_fp32_bytes"] for s in summaries) / moved if moved else float("nan"),
                # the last rounds alone (after dgc's warm-up): each peer's own recent rate, averaged
                fewer_recent=statistics.mean(s["allreduce_recent_fewer_than_fp32"] or float("nan") for s in summaries),
                failed=sum(s["rounds_failed"] for s in summaries), wall=time.monotonic() - started,
                samples_per_step=sum(s["samples_contributed"] for s in summaries) / args.steps)


def progress(losses: list[float], first: Optional[float] = None) -> tuple[float, float]:
    """(L0 - L_N, L_N): L_N over the last steps. `first`: L0 to use instead of this run's own first step."""
    last = statistics.mean(losses[-LAST:])
    return (losses[0] if first is None else first) - last, last


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", default="fp16,uniform8bit,powersgd,dgc")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=48, help="samples per collaborative step (all 3 peers)")
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--dgc-warmup", type=int, default=4, help="dgc's warm-up, in steps")
    parser.add_argument("--overlap", default="optimizer", choices=["none", "optimizer", "full"],
                        help="averaging.overlap of the swarm's peers (optimizer: the default, one step in the background)")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    codecs, seeds = args.codecs.split(","), [int(s) for s in args.seeds.split(",")]
    from hivemind.p2p import P2P

    work = Path(tempfile.mkdtemp(prefix="collab-fidelity-"))
    single, single_losses = {}, {}
    for seed in seeds:
        (work / f"ids{seed}").mkdir()
        for i in range(PEERS):
            P2P.generate_identity(str(work / f"ids{seed}" / f"peer{i}.identity"))
        single_losses[seed] = single_process(args, seed)
        single[seed] = progress(single_losses[seed])
        print(f"single process, seed {seed}: L0 - L{args.steps} = {single[seed][0]:.3f}, "
              f"last {LAST} steps {single[seed][1]:.3f}", flush=True)
    rows = []
    for codec in codecs:
        results = []
        for seed in seeds:
            result = swarm(args, codec, seed, work / f"ids{seed}", work / f"{codec}-{seed}")
            # both runs start from the same weights: one L0 for both, the mean of their two estimates of it
            first = (result["losses"][0] + single_losses[seed][0]) / 2
            gain, last = progress(result["losses"], first)
            result.update(ratio=gain / progress(single_losses[seed], first)[0], last=last)
            results.append(result)
            print(f"{codec}, seed {seed}: progress ratio {result['ratio']:.3f}, last {LAST} steps {last:.3f}, "
                  f"{result['bytes_per_step'] / 1e6:.2f} MB/peer/step ({result['fewer']:.1f}x fewer than fp32, "
                  f"{result['fewer_recent']:.1f}x over the last rounds), "
                  f"{result['failed']} rounds failed, {result['samples_per_step']:.0f} samples/step, "
                  f"{result['wall']:.0f} s", flush=True)
        ratios = [r["ratio"] for r in results]
        rows.append((codec, f"{statistics.mean(r['last'] for r in results):.3f}",
                     f"{statistics.mean(ratios):.3f} +- {statistics.pstdev(ratios):.3f}",
                     f"{statistics.mean(r['bytes_per_step'] for r in results) / 1e6:.2f}",
                     f"{statistics.mean(r['fewer'] for r in results):.1f}x",
                     f"{statistics.mean(r['fewer_recent'] for r in results):.1f}x",
                     f"{statistics.mean(r['wall'] for r in results):.0f} s"))
    header = ("codec", f"loss (last {LAST})", "progress ratio", "MB/peer/step", "vs fp32",
              f"vs fp32, last {RECENT_ROUNDS} rounds", "wall/run")
    print(f"\n3 peers x {args.steps} steps of {args.batch} samples (seq {args.seq_length}, overlap {args.overlap}), "
          f"seeds {args.seeds}; "
          f"single process L0 - L{args.steps}: " + ", ".join(f"{single[s][0]:.3f}" for s in seeds))
    print("\n".join(aligned([header, *rows])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
