"""A real collab peer with one fault injected, for tests: `python tests/swarm/faulty_peer.py FAULT join ARGS...`.

The product's code path has no test switches; a test that needs a broken peer starts this wrapper
instead of `python -m collab` (collab.peers.launcher's `per_peer_program`), and it patches collab before
running the ordinary CLI.

Faults:
  --starve-at-epoch E --stall S   at the end of epoch E the peer behaves as one starved of CPU: it takes
                                  no part in that epoch's gradient round (no pre-scheduled matchmaking),
                                  stalls S seconds while the others average without it, and then its own
                                  round cannot start, so hivemind falls back to a step on its own
                                  gradients. The cause of the CI failure in which one peer left at
                                  --max-epochs one update away from the others.
  --late-round-at-epoch E --stall S
                                  at the end of epoch E the peer waits (no pre-scheduled matchmaking,
                                  S seconds at most) until another peer's progress shows epoch E+1, and
                                  then starts its gradient round as usual: the others have averaged
                                  without it, so it joins their *next* round, one epoch behind - the
                                  lineage split of a peer that starts slowly, which left the NAT test's
                                  slow peers one epoch behind the swarm to the end. Its exact-epoch check
                                  after that round is missed, as a race made it in CI.
  --nan-every N                   every Nth loss the task computes in this process is NaN (a bad micro-batch
                                  such as an fp16 overflow in the forward pass or a corrupt sample makes);
                                  the peer must drop exactly those, on the device, and never send them.
"""

from __future__ import annotations

import argparse
import sys
import time


def stall_at_epoch(epoch: int, stall: float, round_fails: bool) -> None:
    from hivemind.averaging.partition import AllreduceException

    from collab.modes.sync import CollabOptimizer
    from collab.records.untrusted import progress_records

    schedule = CollabOptimizer.schedule_gradient_round
    begin = CollabOptimizer.begin_gradient_round

    fired = []  # once: a peer that comes back to epoch E (a download) trains normally

    def no_matchmaking(self):
        if self.local_epoch != epoch or fired:
            schedule(self)

    def starved(self, grad_scaler):
        if self.local_epoch != epoch or fired:
            return begin(self, grad_scaler)
        fired.append(True)
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            self.scheduled_grads.cancel()
        self.scheduled_grads = None
        if not round_fails:
            # the moment that splits lineages: the others' round for this epoch is over, their next one is not
            print(f"[fault] at the end of epoch {epoch}, waiting (up to {stall:.0f} s) for the others to leave it",
                  flush=True)
            deadline = time.monotonic() + stall
            while time.monotonic() < deadline and not any(
                    p.epoch > epoch for p in progress_records(self.dht, self.run_id).values()):
                time.sleep(0.2)
            return begin(self, grad_scaler)
        print(f"[fault] stalling for {stall:.0f} s at the end of epoch {epoch}", flush=True)
        time.sleep(stall)

        def cannot_start(*args, **kwargs):
            raise AllreduceException("[fault] this peer was starved: its gradient round could not start")

        self.grad_averager.step = cannot_start
        try:
            return begin(self, grad_scaler)
        finally:
            del self.grad_averager.step

    CollabOptimizer.schedule_gradient_round = no_matchmaking
    CollabOptimizer.begin_gradient_round = starved
    if not round_fails:
        _miss_the_exact_epoch_check_once(fired)


def _miss_the_exact_epoch_check_once(fired: list) -> None:
    """hivemind checks once per epoch, at its first progress fetch after the step, that this peer's epoch is
    exactly the swarm's; a fetch made before the others published their new epoch passes the check, and the
    split is never caught (as in the failing CI run). Make that race certain, once, after the late round."""
    from collab.hivemind_hooks.optimizer import OptimizerHooks

    update = OptimizerHooks.update_global_epoch  # hivemind's own end of an epoch, under every collab mode

    def update_then_miss_the_check(self, grad_scaler):
        update(self, grad_scaler)
        if fired and fired[-1] is True:
            fired.append("check missed")
            self._should_check_synchronization_on_update = False
            print("[fault] the exact-epoch check after the late round found the swarm not yet moved on", flush=True)

    OptimizerHooks.update_global_epoch = update_then_miss_the_check


def nan_every(every: int) -> None:
    from collab.tasks.albert import AlbertTask

    loss = AlbertTask.loss
    calls = [0]

    def sometimes_nan(self, batch):
        calls[0] += 1
        value = loss(self, batch)
        return value * float("nan") if calls[0] % every == 0 else value

    AlbertTask.loss = sometimes_nan


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    fault = parser.add_mutually_exclusive_group(required=True)
    fault.add_argument("--starve-at-epoch", type=int)
    fault.add_argument("--late-round-at-epoch", type=int)
    fault.add_argument("--nan-every", type=int)
    parser.add_argument("--stall", type=float, default=15.0)
    args, rest = parser.parse_known_args()
    if args.nan_every is not None:
        nan_every(args.nan_every)
    elif args.starve_at_epoch is not None:
        stall_at_epoch(args.starve_at_epoch, args.stall, round_fails=True)
    else:
        stall_at_epoch(args.late_round_at_epoch, args.stall, round_fails=False)

    from collab.cli import main as collab_main

    return collab_main(rest)


if __name__ == "__main__":
    sys.exit(main())
