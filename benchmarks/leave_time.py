"""How fast does a peer leave when asked? SIGTERM a training peer at random moments, many times.

A volunteer who presses Ctrl-C (or `docker stop`, which sends SIGTERM) is promised that the peer is
gone within 10 s, p2pd included, and that it leaves gracefully: it says goodbye to the swarm and
writes its summary. The hard part is a signal that lands inside an averaging round, which hivemind
will not interrupt. Here 3 real `collab join` peers train on 127.0.0.1; every few seconds one of
the two non-bootstrap peers gets SIGTERM, its exit is timed, and it is restarted with its identity.
The target batch is small (32 samples) so that an epoch is mostly matchmaking and all-reduce, and
most signals land inside a round; with the config's own 128 they mostly land in computation.

    python3 benchmarks/leave_time.py [--config albert-tiny] [--target-batch-size 32] [--trials 12]

Prints the share of graceful exits (exit 0) and the time to leave against the 10 s promise.
Goal: every exit graceful; worst time / 10 s <= 0.5.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMISE_SECONDS = 10.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="albert-tiny", help="shipped config name or YAML path")
    parser.add_argument("--target-batch-size", type=int, default=32)
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from collab.peers.launcher import LocalSwarm

    rng = random.Random(args.seed)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    times, outcomes = [], []
    with tempfile.TemporaryDirectory() as tmp, \
            LocalSwarm(3, f"leave-{uuid.uuid4().hex[:6]}", Path(tmp),
                       ["--config", args.config, "--target-batch-size", str(args.target_batch_size)], env=env) as swarm:
        swarm.start()
        time.sleep(20)  # past start-up: the first rounds are under way
        for trial in range(args.trials):
            time.sleep(rng.uniform(3, 12))  # lands anywhere in an epoch: computing, matchmaking, all-reduce
            peer = swarm.peers[1 + trial % 2]
            started = time.monotonic()
            peer.signal(signal.SIGTERM)
            code = peer.wait(timeout=30)
            took = time.monotonic() - started
            reason = json.loads(peer.summary_path.read_text()).get("exit_reason", "?")
            times.append(took)
            outcomes.append((code, reason))
            print(f"trial {trial + 1:2d}: peer {peer.index} exit {code} ({reason}) after {took:.1f} s", flush=True)
            swarm.start_peer(peer.index)

    graceful = sum(1 for code, _ in outcomes if code == 0)
    worst = max(times)
    print()
    print("| metric | value | against | ratio |")
    print("|---|---|---|---|")
    print(f"| graceful exits | {graceful} of {len(outcomes)} | all | {graceful / len(outcomes):.2f} |")
    print(f"| median time to leave | {statistics.median(times):.1f} s | {PROMISE_SECONDS:.0f} s promise | "
          f"{statistics.median(times) / PROMISE_SECONDS:.2f} |")
    print(f"| worst time to leave | {worst:.1f} s | {PROMISE_SECONDS:.0f} s promise | {worst / PROMISE_SECONDS:.2f} |")


if __name__ == "__main__":
    main()
