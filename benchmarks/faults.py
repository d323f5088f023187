"""A frozen peer and a split swarm, for the full 60 s: the long versions of tests/swarm/test_faults.py's scenarios.

tests/swarm/test_faults.py runs them short: a 15 s freeze (with a 5 s chunk, 12 s averaging and 10 s state download
timeout) and a 40 s split, both from epoch 1, the split run stopped at the first epoch 3-5 after the heal that all
four checkpointed. Here both faults last 60 s with the split's timeouts (10 s, 15 s, 20 s), from epoch 2, and the
split run goes on to 5 epochs past the heal.

    sudo python3 benchmarks/faults.py [--seconds 60] [--only freeze|split]

freeze: 3 ALBERT-tiny peers on 127.0.0.1; one whole session gets SIGSTOP mid-round, then SIGCONT.
split: 4 peers in network namespaces (root); peers 0, 1 and 2, 3 lose each other, then the network heals.
The config is the micro one with a 10 s chunk, 15 s averaging and 20 s state download timeout and a target batch of
512 (~6 s epochs on 2 cores).

Prints one table: what the run did during the fault, and how long recovery took, against the goals (the
frozen peer back at the swarm's epoch and averaging; all replicas one model 3 epochs after the heal).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.lab.faults import freeze_scenario, split_scenario  # noqa: E402
from collab.peers.netns import namespaces_unavailable_reason  # noqa: E402
from tests.conftest import peer_env, write_config  # noqa: E402
from tests.swarm.test_swarm_training import PARAM_TOLERANCE  # noqa: E402

FAST = {"training.target_batch_size": 512, "averaging.next_chunk_timeout": 10.0,
        "averaging.averaging_timeout": 15.0, "averaging.load_state_timeout": 20.0}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0, help="how long each fault lasts")
    p.add_argument("--only", choices=["freeze", "split"])
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.only in (None, "freeze"):
            r = freeze_scenario(work / "freeze", f"bench-freeze-{uuid.uuid4().hex[:6]}",
                                write_config(work, FAST, "freeze.yaml"), args.seconds, env=peer_env())
            rows.append(("freeze", f"others +{r.others_epochs_while_frozen} epochs",
                         f"caught up in {r.seconds_to_catch_up:.0f} s (epoch {r.at_freeze['final_epoch']} -> "
                         f"{r.after['final_epoch']})", r.others_epochs_while_frozen >= 2))
        if args.only in (None, "split"):
            reason = namespaces_unavailable_reason()
            if reason is not None:
                rows.append(("split", "-", f"not run: {reason}", False))
            else:
                config = write_config(work, {**FAST, "checkpoint.every_epochs": 1, "checkpoint.keep": 200}, "split.yaml")
                r = split_scenario(work / "split", f"bench-split-{uuid.uuid4().hex[:6]}", config, args.seconds,
                                   env=peer_env())
                during = f"epochs {r.split_at} -> {r.healed_at}, halves {r.apart:.2e} apart"
                after = f"epoch {r.first_common_epoch}: max difference {r.difference_after:.2e}, " \
                        f"peers found back {r.found_back}"
                rows.append(("split", during, after, r.difference_after < PARAM_TOLERANCE))
    print(f"fault for {args.seconds:.0f} s")
    print(f"{'fault':<8}{'during the fault':<60}{'after':<70}{'goal'}")
    for name, during, after, met in rows:
        print(f"{name:<8}{during:<60}{after:<70}{'met' if met else 'NOT met'}")


if __name__ == "__main__":
    main()
