"""A real collab peer that attacks the run, for tests and benchmarks: `python tests/swarm/attacker_peer.py ATTACK join ARGS`.

Like tests/swarm/faulty_peer.py, it patches collab from outside before running the ordinary CLI: the product has no
test switch. Each attack acts where a hostile peer can, after the honest peer's own guards (collab.train.guard):

  --sign-flip SCALE   every gradient it sends is its own times -SCALE
  --nan               every gradient it sends is NaN
  --weight W          it claims averaging weight W (as if it had accumulated W samples)
  --garbage-reducer   the part it reduces for the group comes back as noise x 1000
  --poison-state      it claims the highest state-sharing priority and serves its state x 1000
  --gossip-scale S    (averaging.mode gossip) the parameters it sends peers are its own times S (nan: all NaN);
                      it merges what it receives honestly
"""

from __future__ import annotations

import argparse
import sys


def poison_sent_gradients(transform) -> None:
    import torch

    from collab.averaging.grad_averager import CollabGradientAverager

    load = CollabGradientAverager.load_accumulators_into_averager_

    @torch.no_grad()
    def poisoned(self):
        load(self)
        with self.get_tensors() as averaged:
            for tensor in averaged:
                tensor.copy_(transform(tensor))

    CollabGradientAverager.load_accumulators_into_averager_ = poisoned


def claim_weight(weight: float) -> None:
    from collab.averaging.grad_averager import CollabGradientAverager

    step = CollabGradientAverager.step

    def heavy(self, *args, **kwargs):
        kwargs["weight"] = weight
        return step(self, *args, **kwargs)

    CollabGradientAverager.step = heavy


def reduce_garbage() -> None:
    import torch

    from collab.averaging.aggregation import RobustPartReducer

    def garbage(self, received):
        return 1000 * torch.randn(self.part_shapes[self.current_part_index])

    RobustPartReducer.combine = garbage


def serve_poisoned_state() -> None:
    """Claims the highest state-sharing priority (hivemind picks donors by it) and serves its state x 1000."""
    from hivemind.averaging import DecentralizedAverager

    from collab.averaging.replica import RecordingStateAverager

    current = RecordingStateAverager.get_current_state

    def poisoned(self):
        metadata, tensors, infos = current(self)
        return metadata, [t * 1000 for t in tensors], infos

    RecordingStateAverager.get_current_state = poisoned
    declared = DecentralizedAverager.state_sharing_priority
    RecordingStateAverager.state_sharing_priority = property(declared.fget, lambda self, _: declared.fset(self, 1e9))


def send_scaled_parameters(scale: float) -> None:
    """Its snapshot, the parameters peers receive from it, is its own times `scale`; its own replica is not.
    Copied and scaled under one hold of the snapshot's lock: between two, the averager process serving an
    exchange could read the honest copy (a CI run's honest peers merged some)."""
    import time

    import torch

    from collab.modes.gossip import GossipOptimizer

    @torch.no_grad()
    def scaled(self):
        with self.gossip.get_tensors() as snapshot:
            for slot, param in zip(snapshot, self.params):
                slot.copy_(param.detach())
                slot.fill_(float("nan")) if scale != scale else slot.mul_(scale)
        self.gossip.clock.value = self.clock
        self._snapshot_at = time.monotonic()

    GossipOptimizer._refresh_snapshot = scaled
    init = GossipOptimizer.__init__

    def init_scaled(self, *args, **kwargs):  # from the start: its first snapshot is made before any step
        init(self, *args, **kwargs)
        self._refresh_snapshot()

    GossipOptimizer.__init__ = init_scaled


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    attack = parser.add_mutually_exclusive_group(required=True)
    attack.add_argument("--sign-flip", type=float)
    attack.add_argument("--nan", action="store_true")
    attack.add_argument("--weight", type=float)
    attack.add_argument("--garbage-reducer", action="store_true")
    attack.add_argument("--poison-state", action="store_true")
    attack.add_argument("--gossip-scale", type=float)
    args, rest = parser.parse_known_args()
    if args.sign_flip is not None:
        poison_sent_gradients(lambda t: -args.sign_flip * t)
    elif args.nan:
        poison_sent_gradients(lambda t: t.fill_(float("nan")))
    elif args.weight is not None:
        claim_weight(args.weight)
    elif args.garbage_reducer:
        reduce_garbage()
    elif args.gossip_scale is not None:
        send_scaled_parameters(args.gossip_scale)
    else:
        serve_poisoned_state()
    print(f"[attack] {' '.join(sys.argv[1:3])}", flush=True)

    from collab.cli import main as collab_main

    return collab_main(rest)


if __name__ == "__main__":
    sys.exit(main())
