"""Honest peers' learning under attack, with mean against centered_clip, on this machine.

For each attack (tests/swarm/attacker_peer.py) and each aggregation, --honest ALBERT-micro peers and one attacker
(two for nan+sign-flip) train on 127.0.0.1 to --epochs; a clean run (no attacker, --honest + 1 honest peers) is
the reference. For each run it prints the honest peers' mean loss at epoch 0 and at the last epoch, the loss
decrease against the clean run's with the same aggregation (goal with centered_clip: >= 0.95), their gradient
rounds ok and failed, and the contributions they refused.

    python3 benchmarks/robustness.py [--honest 4] [--epochs 6] [--attacks sign-flip,nan,weight,garbage-reducer]
                                     [--aggregations mean,centered_clip] [--repeats 1] [--target-batch-size N]

With --repeats N each cell is run N times: the table shows the median and, in brackets, the range of the ratio.

Both attackers of tests/swarm/test_robust_averaging.py::test_nan_and_sign_flip_attackers_are_excluded_and_clipped
together (4 honest peers, one NaN sender and one sign-flipper x1000, the test's target batch of 384), with
centered_clip against a clean run:

    python3 benchmarks/robustness.py --attacks nan+sign-flip --aggregations centered_clip --epochs 5 \
        --target-batch-size 384

The cost side (a centered_clip round's time against mean's) is benchmarks/allreduce.py's symmetric case:
    sudo python3 benchmarks/allreduce.py --only symmetric --methods hivemind-fp16,collab-centered-clip
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from collab.peers.launcher import LocalSwarm  # noqa: E402
from tests.conftest import peer_env, read_summary, write_config  # noqa: E402

# each attack: the attacker peers' arguments, one list per attacker
ATTACKS = {"clean": [], "sign-flip": [["--sign-flip", "1000"]], "nan": [["--nan"]], "weight": [["--weight", "1e9"]],
           "garbage-reducer": [["--garbage-reducer"]], "nan+sign-flip": [["--nan"], ["--sign-flip", "1000"]]}
ATTACKER = [sys.executable, str(ROOT / "tests" / "swarm" / "attacker_peer.py")]


def run(workdir: Path, config: Path, honest: int, epochs: int, attackers: list[list[str]]) -> list[dict]:
    """The honest peers' summaries; a clean run (no attackers) has one more honest peer in their place."""
    n = honest + max(1, len(attackers))
    programs = {honest + i: [*ATTACKER, *attack] for i, attack in enumerate(attackers)} or None
    with LocalSwarm(n, f"bench-{workdir.name}", workdir, ["--config", str(config), "--max-epochs", str(epochs),
                                                          "--wait-peers", str(n)],
                    env=peer_env(), per_peer_program=programs) as swarm:
        swarm.start()
        for peer in swarm.peers[:honest]:
            peer.wait(timeout=600)
        return [read_summary(p) for p in swarm.peers[:honest]]


def loss_at(summaries: list[dict], epoch: str) -> float:
    values = [s["loss_by_epoch"][epoch] for s in summaries if epoch in s["loss_by_epoch"]]
    return statistics.mean(values) if values else float("nan")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--honest", type=int, default=4)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--attacks", default="sign-flip,nan,weight,garbage-reducer")
    p.add_argument("--aggregations", default="mean,centered_clip")
    p.add_argument("--repeats", type=int, default=1, help="runs per cell (attack x aggregation)")
    p.add_argument("--target-batch-size", type=int, default=None,
                   help="training.target_batch_size (default: the micro config's, 1024)")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="collab-robustness-") as tmp:
        for aggregation in args.aggregations.split(","):
            changes = {"averaging.aggregation": aggregation}
            if args.target_batch_size:
                changes["training.target_batch_size"] = args.target_batch_size
            config = write_config(Path(tmp), changes, name=f"{aggregation}.yaml")
            clean_drops = []
            for attack in ["clean", *args.attacks.split(",")]:
                firsts, lasts, drops, ok, failed, reasons = [], [], [], 0, 0, Counter()
                for repeat in range(args.repeats):
                    workdir = Path(tmp) / f"{aggregation}-{attack}-{repeat}"
                    summaries = run(workdir, config, args.honest, args.epochs, ATTACKS[attack])
                    firsts.append(loss_at(summaries, "0"))
                    lasts.append(loss_at(summaries, str(args.epochs - 1)))
                    drops.append(firsts[-1] - lasts[-1])
                    ok += sum(s["rounds_joined"] for s in summaries)
                    failed += sum(s["rounds_failed"] for s in summaries)
                    for s in summaries:
                        for by_reason in s["rejected"].values():
                            reasons.update(by_reason)
                if attack == "clean":
                    clean_drops = drops
                clean = statistics.median(clean_drops)
                ratios = [d / clean if clean else float("nan") for d in drops]
                rows.append((attack, aggregation, statistics.median(firsts), statistics.median(lasts),
                             statistics.median(ratios), min(ratios), max(ratios), ok, failed, sum(reasons.values()),
                             reasons))
                print(f"  {aggregation:13s} {attack:16s} done", flush=True)
    runs = f", {args.repeats} runs per cell (medians; ratio range in brackets)" if args.repeats > 1 else ""
    print(f"\n{args.honest} honest peers + the attackers (nan+sign-flip: 2, others: 1), ALBERT-micro, "
          f"{args.epochs} epochs; loss: the honest peers' mean{runs}")
    print(f"{'attack':16s} {'aggregation':13s} {'loss e0':>8s} {'loss eN':>8s} {'drop/clean':>18s} "
          f"{'rounds ok':>9s} {'failed':>6s} {'refused':>7s}")
    for attack, aggregation, first, last, ratio, low, high, ok, failed, refused, _ in rows:
        spread = f" [{low:.2f}, {high:.2f}]" if args.repeats > 1 else ""
        print(f"{attack:16s} {aggregation:13s} {first:8.3f} {last:8.3f} {ratio:>6.2f}{spread:>12s} {ok:9d} {failed:6d} "
              f"{refused:7d}")
    print("\nwhat the honest peers refused, and why:")
    for attack, aggregation, *_, reasons in rows:
        print(f"  {attack} / {aggregation}: " + ("; ".join(f"{why} x{n}" for why, n in reasons.most_common(4)) or "-"))


if __name__ == "__main__":
    main()
