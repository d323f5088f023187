"""What each compression choice and averaging mode costs in learning: 3 real collab peers against one process.

For each row and each seed: 3 `collab join` peers (collab.peers.launcher, 127.0.0.1) train ALBERT-tiny (or, with
--task causal-lm, the Llama-style causal-lm-tiny) on the embedded corpus; one process trains the same model (same seed, so the same initial weights), optimizer and
schedule with plain gradient accumulation to the same batch. The swarm's peers keep their identities (so their
data order) across rows: rows differ only in the codec or mode. Rows: sync codecs (fp16, uniform8bit, powersgd,
dgc, ...; CODEC+AGGREGATION for another aggregation, e.g. fp16+adasum against fp16+mean; ROW@OVERLAP for another
averaging.overlap than --overlap, e.g. fp16@optimizer against fp16 with the same peers and seeds), --steps collaborative
steps of --batch samples; diloco-h<H> (averaging.mode diloco, pseudo-gradients
in --local-codec, fp16 by default, an outer step every H micro-batches per peer), and gossip-<rule>
(averaging.mode gossip with that interpolation, parameters exchanged in --local-codec every --gossip-k local
steps on average), on the same number of samples. A gossip row's held-out loss is the mean over the three replicas (no replica is "the" model); its spread
column is the largest distance of a replica from their mean, relative to the mean's norm.

Columns: row; held-out loss of the final model (EVAL_BATCHES micro-batches no run trains on: the one yardstick
for every mode) and its ratio (L0 - L) / (L0 - L of the single process); kB sent and received per sample
trained, all peers together; the training loss over the last 5 steps and its progress ratio (for sync rows; one
L0 for both runs: the mean of their first-step losses); bytes per peer per step as its all-reduce counted them;
x fewer bytes than fp32, over the run and over its last rounds (dgc's sparsity warms up); wall time per run.
Goals: issue 12: fp16 >= 0.98; 8-bit >= 0.97 at >= 4x; powersgd (rank 4) >= 0.95 at >= 10x; dgc >= 0.95 at
>= 100x after warm-up. Issue 13: diloco-h50 >= 40x fewer bytes per sample than fp16 at >= 0.9 of its progress;
gossip: replicas within 1% of the norm at the end, >= 0.85 of sync's progress.

    python3 benchmarks/fidelity.py [--codecs fp16,uniform8bit,powersgd,powersgd-r8,dgc,diloco-h10,gossip-loss]
                                   [--seeds 0,1,2] [--steps 60] [--batch 48] [--seq-length 128]
                                   [--overlap none] [--inner-lr 1e-3] [--inner-warmup 10] [--gossip-k 10]
                                   [--task albert|causal-lm]
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

from collab.averaging.traffic import RECENT_ROUNDS  # noqa: E402
from collab.peers.launcher import LocalSwarm  # noqa: E402
from collab.peers.report import aligned  # noqa: E402
from tests.conftest import peer_env, read_summary  # noqa: E402

PEERS, LAST = 3, 5
TASK_CONFIGS = {"albert": "albert-tiny.yaml", "causal-lm": "causal-lm-tiny.yaml"}


def task_config(args) -> dict:
    return yaml.safe_load((ROOT / "configs" / TASK_CONFIGS[getattr(args, "task", "albert")]).read_text())
EVAL_BATCHES = 24


def diloco_h(row: str) -> Optional[int]:
    """H, the inner steps per peer per outer step, of a row named diloco-h<H>; None for a sync codec."""
    return int(row.removeprefix("diloco-h")) if row.startswith("diloco-h") else None


def gossip_rule(row: str) -> Optional[str]:
    """The interpolation of a row named gossip-<rule>; None for any other row."""
    return row.removeprefix("gossip-") if row.startswith("gossip-") else None


def local_steps(row: str) -> bool:
    """Rows whose peers step on their own (diloco, gossip): their loss curve is not the swarm model's."""
    return diloco_h(row) is not None or gossip_rule(row) is not None


def run_config(args, row: str, seed: int) -> dict:
    config = task_config(args)
    config["task"]["data"]["seq_length"] = args.seq_length
    config["training"].update(target_batch_size=args.batch, seed=seed, total_steps=max(args.steps * 2, 100))
    # a round as soon as all 3 are in it; parameters averaged rarely: the gradients' codec is what is measured
    row, _, overlap = row.partition("@")  # fp16@none: a sync row with another averaging.overlap than --overlap
    codec, _, aggregation = row.partition("+")  # fp16+adasum: a sync codec with another aggregation
    codec, _, rank = codec.partition("-r")  # powersgd-r8: PowerSGD at rank 8 (the config's rank otherwise)
    if rank:
        config["averaging"]["powersgd_rank"] = int(rank)
    config["averaging"].update(compression=codec, group_size=PEERS, average_state_every=10**6,
                               dgc_warmup_epochs=args.dgc_warmup, overlap=overlap or args.overlap)
    if aggregation:
        config["averaging"]["aggregation"] = aggregation
    h = diloco_h(row)
    if h is not None:  # an outer step every H micro-batches per peer; the pseudo-gradients travel in fp16
        micro = config["training"]["micro_batch_size"]
        config["training"]["target_batch_size"] = h * PEERS * micro
        config["averaging"].update(mode="diloco", compression=args.local_codec)
        config["averaging"]["diloco"] = {"inner_lr": args.inner_lr, "inner_warmup_steps": args.inner_warmup}
    rule = gossip_rule(row)
    if rule is not None:  # an epoch is still --batch samples of the swarm's: --steps epochs, the same samples
        config["averaging"].update(mode="gossip", compression=args.local_codec)
        config["averaging"]["gossip"] = {"interpolation": rule, "mean_local_steps": args.gossip_k,
                                         "lr": args.inner_lr, "warmup_steps": args.inner_warmup}
    return config


def steps_for(args, row: str) -> int:
    """Collaborative (outer) steps that train the same samples as --steps sync steps of --batch."""
    h = diloco_h(row)
    if h is None:
        return args.steps
    micro = task_config(args)["training"]["micro_batch_size"]
    return max(1, round(args.steps * args.batch / (h * PEERS * micro)))


def eval_loss(args, seed: int, model_dir: Optional[Path] = None, task=None) -> float:
    """The model's mean loss on EVAL_BATCHES held-out micro-batches (a data order no run trains on, the same
    masks every time): one yardstick for every mode, whatever its own loss curve counts."""
    import torch

    from collab.config import RunConfig
    from collab.tasks import build_task

    if task is None:
        task = build_task(RunConfig.model_validate(run_config(args, "fp16", seed)))
        if model_dir is not None:
            task.load_pretrained(model_dir)
    task.model.eval()
    batches = task.batches(8, seed=999_999)
    with torch.no_grad():
        value = statistics.mean(task.loss(next(batches)).item() for _ in range(EVAL_BATCHES))
    task.model.train()
    return value


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
    return losses, eval_loss(args, seed, task=task)


def swarm(args, row: str, seed: int, identities: Path, workdir: Path, config: Optional[dict] = None,
          steps: Optional[int] = None, evaluate: bool = True) -> dict:
    """One row's run on 3 peers. `config`, `steps`: instead of the row's; `evaluate`: the held-out loss of
    ALBERT's final model (benchmarks/batch_scaling.py runs other tasks too)."""
    workdir.mkdir(parents=True)
    for i in range(PEERS):  # the same peers (so the same data order) in every row of this seed
        shutil.copy(identities / f"peer{i}.identity", workdir / f"peer{i}.identity")
    config_file = workdir / "config.yaml"
    config_file.write_text(yaml.safe_dump(config if config is not None else run_config(args, row, seed)))
    config = config_file
    started, steps = time.monotonic(), steps if steps is not None else steps_for(args, row)
    checkpoints = {i: ["--checkpoint-dir", str(workdir / f"ckpt{i}")] for i in range(PEERS)}
    with LocalSwarm(PEERS, f"fidelity-{uuid.uuid4().hex[:6]}", workdir,
                    ["--config", str(config), "--max-epochs", str(steps)], env=peer_env(),
                    per_peer_args=checkpoints) as peers:
        peers.start()
        if not peers.wait(timeout=args.timeout):
            raise SystemExit(f"{row} seed {seed}: the peers did not reach step {steps} in {args.timeout} s")
        summaries = [read_summary(p) for p in peers.peers]
    finals = [s["checkpoint"] for s in summaries if s["checkpoint"]]
    if not finals:
        raise SystemExit(f"{row} seed {seed}: no peer saved its final model")
    by_step: dict[int, list[float]] = {}
    for s in summaries:
        for step, loss in s["loss_by_epoch"].items():
            by_step.setdefault(int(step), []).append(loss)
    losses = [statistics.mean(by_step[k]) for k in sorted(by_step)]
    moved = sum(s["allreduce_bytes_sent"] + s["allreduce_bytes_received"] for s in summaries)
    spread, evals = None, [eval_loss(args, seed, Path(finals[0])) if evaluate else float("nan")]
    if gossip_rule(row) is not None:  # gossip's bytes are its exchanges; every replica is a model of the run
        moved = sum(s["gossip"]["bytes_sent"] + s["gossip"]["bytes_received"] for s in summaries)
        spread = replica_spread([Path(f) for f in finals])
        evals = [evals[0], *(eval_loss(args, seed, Path(f)) for f in finals[1:])]
    rounds = sum(s["rounds_joined"] + s["rounds_failed"] for s in summaries)
    return dict(losses=losses, summaries=summaries, bytes_per_step=moved / max(rounds, 1),
                fewer=sum(s["allreduce_fp32_bytes"] for s in summaries) / moved if moved else float("nan"),
                # the last rounds alone (after dgc's warm-up): each peer's own recent rate, averaged
                fewer_recent=statistics.mean(s["allreduce_recent_fewer_than_fp32"] or float("nan") for s in summaries),
                failed=sum(s["rounds_failed"] for s in summaries), wall=time.monotonic() - started,
                samples_per_step=sum(s["samples_contributed"] for s in summaries) / steps,
                # what each peer sent and received, per sample the swarm trained: comparable across modes
                bytes_per_sample=moved / max(1, sum(s["samples_contributed"] for s in summaries)),
                eval=statistics.mean(evals), spread=spread)


def replica_spread(checkpoints: list[Path]) -> float:
    """The largest distance of a replica from the replicas' mean, relative to the mean's norm."""
    from safetensors.torch import load_file

    replicas = [load_file(path / "model.safetensors") for path in checkpoints]
    names = [n for n, t in replicas[0].items() if t.is_floating_point()]
    mean = {n: sum(r[n].double() for r in replicas) / len(replicas) for n in names}
    norm = sum(float(t.pow(2).sum()) for t in mean.values()) ** 0.5
    return max(sum(float((r[n].double() - mean[n]).pow(2).sum()) for n in names) ** 0.5 for r in replicas) / norm


def progress(losses: list[float], first: Optional[float] = None) -> tuple[float, float]:
    """(L0 - L_N, L_N): L_N over the last steps. `first`: L0 to use instead of this run's own first step."""
    last = statistics.mean(losses[-LAST:])
    return (losses[0] if first is None else first) - last, last


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", default="fp16,uniform8bit,powersgd,dgc",
                        help="rows: sync codecs, diloco-h<H> (DiLoCo, H inner steps per peer per outer step), gossip-<rule> "
                             "(constant, clock, loss, evolutionary)")
    parser.add_argument("--inner-lr", type=float, default=1e-3, help="diloco rows: the inner AdamW's learning rate")
    parser.add_argument("--inner-warmup", type=int, default=10, help="diloco rows: inner warm-up, micro-batches")
    parser.add_argument("--local-codec", default="fp16",
                        help="diloco and gossip rows: the codec of their pseudo-gradients or parameters")
    parser.add_argument("--gossip-k", type=float, default=10.0,
                        help="gossip rows: mean local steps between a peer's merges (the lr and warm-up: --inner-*)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=48, help="samples per collaborative step (all 3 peers)")
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--dgc-warmup", type=int, default=4, help="dgc's warm-up, in steps")
    parser.add_argument("--overlap", default="none", choices=["none", "optimizer", "full"],
                        help="averaging.overlap of the swarm's peers (none: the default; optimizer: the LAMB step in "
                             "the background, which makes one micro-batch per peer per step stale)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--task", default="albert", choices=sorted(TASK_CONFIGS),
                        help="which tiny model the rows train (causal-lm: the Llama-style decoder)")
    args = parser.parse_args()
    codecs, seeds = args.codecs.split(","), [int(s) for s in args.seeds.split(",")]
    from collab.records.identity import load_or_create_identity

    work = Path(tempfile.mkdtemp(prefix="collab-fidelity-"))
    single, single_losses, single_eval, initial_eval = {}, {}, {}, {}
    for seed in seeds:
        (work / f"ids{seed}").mkdir()
        for i in range(PEERS):
            load_or_create_identity(work / f"ids{seed}" / f"peer{i}.identity")
        initial_eval[seed] = eval_loss(args, seed)
        single_losses[seed], single_eval[seed] = single_process(args, seed)
        single[seed] = progress(single_losses[seed])
        print(f"single process, seed {seed}: L0 - L{args.steps} = {single[seed][0]:.3f}, "
              f"last {LAST} steps {single[seed][1]:.3f}; held-out loss {initial_eval[seed]:.3f} -> "
              f"{single_eval[seed]:.3f}", flush=True)
    rows = []
    for codec in codecs:
        results = []
        for seed in seeds:
            result = swarm(args, codec, seed, work / f"ids{seed}", work / f"{codec}-{seed}")
            # both runs start from the same weights: one L0 for both, the mean of their two estimates of it
            first = (result["losses"][0] + single_losses[seed][0]) / 2
            gain, last = progress(result["losses"], first)
            result.update(ratio=gain / progress(single_losses[seed], first)[0], last=last,
                          eval_ratio=(initial_eval[seed] - result["eval"]) / (initial_eval[seed] - single_eval[seed]))
            results.append(result)
            print(f"{codec}, seed {seed}: held-out loss {result['eval']:.3f} (ratio {result['eval_ratio']:.3f}), "
                  f"{result['bytes_per_sample'] / 1e3:.1f} kB/sample; "
                  f"progress ratio {result['ratio']:.3f}, last {LAST} steps {last:.3f}, "
                  f"{result['bytes_per_step'] / 1e6:.2f} MB/peer/step ({result['fewer']:.1f}x fewer than fp32, "
                  f"{result['fewer_recent']:.1f}x over the last rounds), "
                  f"{result['failed']} rounds failed, {result['samples_per_step']:.0f} samples/step, "
                  + (f"replicas within {result['spread']:.2%}, " if result["spread"] is not None else "") +
                  f"{result['wall']:.0f} s", flush=True)
        ratios, evals = [r["ratio"] for r in results], [r["eval_ratio"] for r in results]
        rows.append((codec, f"{statistics.mean(r['eval'] for r in results):.3f}",
                     f"{statistics.mean(evals):.3f} +- {statistics.pstdev(evals):.3f}",
                     f"{statistics.mean(r['bytes_per_sample'] for r in results) / 1e3:.1f}",
                     # diloco's and gossip's own loss curves are of replicas between merges: not comparable
                     *((f"{statistics.mean(r['last'] for r in results):.3f}",
                        f"{statistics.mean(ratios):.3f} +- {statistics.pstdev(ratios):.3f}")
                       if not local_steps(codec) else ("-", "-")),
                     # all-reduce rounds' columns: a gossip row has none (its bytes are in kB/sample)
                     *((f"{statistics.mean(r['bytes_per_step'] for r in results) / 1e6:.2f}",
                        f"{statistics.mean(r['fewer'] for r in results):.1f}x",
                        f"{statistics.mean(r['fewer_recent'] for r in results):.1f}x")
                       if gossip_rule(codec) is None else ("-", "-", "-")),
                     f"{statistics.mean(r['spread'] for r in results):.2%}" if gossip_rule(codec) else "-",
                     f"{statistics.mean(r['wall'] for r in results):.0f} s"))
    header = ("row", "held-out loss", "held-out ratio", "kB/sample", f"train loss (last {LAST})", "progress ratio",
              "MB/peer/step", "vs fp32",
              f"vs fp32, last {RECENT_ROUNDS} rounds", "replica spread", "wall/run")
    print(f"\n{args.task}: 3 peers, {args.steps * args.batch} samples per run ({args.steps} sync steps of {args.batch}; "
          f"diloco and gossip rows the same samples, in {args.local_codec}), seq {args.seq_length}, "
          f"overlap {args.overlap}, "
          f"seeds {args.seeds}; "
          f"single process L0 - L{args.steps}: " + ", ".join(f"{single[s][0]:.3f}" for s in seeds))
    print("\n".join(aligned([header, *rows])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
