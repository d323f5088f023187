"""A real collab peer with one fault injected, for tests: `python tests/faulty_peer.py FAULT join ARGS...`.

The product's code path has no test switches; a test that needs a broken peer starts this wrapper
instead of `python -m collab` (peers.launcher's `per_peer_program`), and it patches collab before
running the ordinary CLI.

Faults:
  --starve-at-epoch E --stall S   at the end of epoch E the peer behaves as one starved of CPU: it takes
                                  no part in that epoch's gradient round (no pre-scheduled matchmaking),
                                  stalls S seconds while the others average without it, and then its own
                                  round cannot start, so hivemind falls back to a step on its own
                                  gradients. The cause of the CI failure in which one peer left at
                                  --max-epochs one update away from the others.
"""

from __future__ import annotations

import argparse
import sys
import time


def starve_at_epoch(epoch: int, stall: float) -> None:
    from hivemind.averaging.partition import AllreduceException

    from collab.optim import CollabOptimizer

    schedule = CollabOptimizer._maybe_schedule_gradient_averaging
    begin = CollabOptimizer._begin_averaging_gradients

    def no_matchmaking(self):
        if self.local_epoch != epoch:
            schedule(self)

    def starved(self, grad_scaler):
        if self.local_epoch != epoch:
            return begin(self, grad_scaler)
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            self.scheduled_grads.cancel()
        self.scheduled_grads = None
        print(f"[fault] starving for {stall:.0f} s at the end of epoch {epoch}", flush=True)
        time.sleep(stall)

        def cannot_start(*args, **kwargs):
            raise AllreduceException("[fault] this peer was starved: its gradient round could not start")

        self.grad_averager.step = cannot_start
        try:
            return begin(self, grad_scaler)
        finally:
            del self.grad_averager.step

    CollabOptimizer._maybe_schedule_gradient_averaging = no_matchmaking
    CollabOptimizer._begin_averaging_gradients = starved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--starve-at-epoch", type=int, required=True)
    parser.add_argument("--stall", type=float, default=15.0)
    args, rest = parser.parse_known_args()
    starve_at_epoch(args.starve_at_epoch, args.stall)

    from collab.cli import main as collab_main

    return collab_main(rest)


if __name__ == "__main__":
    sys.exit(main())
