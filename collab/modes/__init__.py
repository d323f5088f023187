"""averaging.mode: how one peer's training meets the swarm's. One module per mode, one interface for all, so the
trainer's loop (collab.train.trainer) is the same whichever the run's manifest fixes.

| mode   | module              | what is averaged, and when                                                   |
|--------|---------------------|------------------------------------------------------------------------------|
| sync   | collab.modes.sync   | gradients, once per target batch; every peer takes the same optimizer step  |
| diloco | collab.modes.diloco | pseudo-gradients (outer minus local parameters) after a target batch of     |
|        |                     | local AdamW steps; every replica takes the same Nesterov outer step         |
| gossip | collab.modes.gossip | parameters, pairwise with a random peer after a Poisson-drawn number of     |
|        |                     | local steps (its merge rules: collab.modes.gossip_rules); no global step    |

Each mode is a hivemind.Optimizer on one base (collab.modes.base.SwarmOptimizer: the swarm's epoch, whether the replica
is the swarm's, state downloads, members-only rules and leaving are shared; diloco builds on sync) and each module says what it changes in the optimizer
collab.train.make_optimizer builds: `optimizer_options(ModeContext) -> dict` of hivemind.Optimizer keywords.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

MODES = ("sync", "diloco", "gossip")


@dataclass(frozen=True)
class ModeContext:
    """What a mode's options are built from: the run's config and task, and the robust-averaging pieces the
    optimizer shares with its averagers (rejections and traffic are logged per peer, whatever the mode)."""
    config: Any  # collab.config.RunConfig
    task: Any  # collab.tasks.Task
    rule: Any  # collab.averaging.aggregation.Aggregation: the gradient rounds' reduction
    gate: Any = None  # collab.run.gate.MemberGate in a private run
    rejections: Any = None  # collab.records.rejections.RejectionLog
    traffic: Any = None  # collab.averaging.traffic.TrafficLog
    averager_opts: dict = field(default_factory=dict)  # bandwidth, request timeout, group size
    plan: Any = None  # collab.train.plan_keeper's plan (sync only: target and lr gain per epoch)


@dataclass
class ModeReport:
    """What a mode says about its own rounds, for the exit summary and the metrics record (every mode answers; a
    field a mode has nothing for stays empty)."""
    noise: dict = field(default_factory=dict)  # the noise scale's record fields (collab.adaptive.noise_scale)
    noise_inputs: list = field(default_factory=list)  # each measured round's inputs to it, the last ones
    outer_steps: dict = field(default_factory=dict)  # diloco: each outer step as this peer saw it
    inner_steps: Optional[int] = None  # diloco: this outer step's local steps so far
    pseudo_gradient_norm: Optional[float] = None  # diloco: the last averaged pseudo-gradient's norm
    gossip: dict = field(default_factory=dict)  # gossip: exchanges, merges, this replica's norm and sketch


class AveragingMode(Protocol):
    """What the trainer's loop uses of a mode's optimizer, every mode alike."""
    local_epoch: int  # this replica's epoch (the swarm's, once in sync)
    tracker: Any  # hivemind's progress tracker: the swarm's epoch and samples
    state_averager: Any  # parameters and optimizer state, served to peers behind
    rejections: Any  # contributions refused, and why (collab.records.rejections)
    traffic: Any  # bytes sent and received per round (collab.averaging.traffic)
    load_state_timeout: float
    own_step: Any  # the last step taken on this peer's own gradients, if any (collab.modes.replica_sync.OwnStep)
    plan_keeper: Any  # the run's batch plan it follows (collab.train.plan_keeper), or None
    # step(batch_size=n * micro-batch) may bring n micro-batches' gradients summed in .grad (collab.train.window);
    # False where each micro-batch is a step of its own
    sums_micro_batches: bool

    def leave_at(self, epoch: Optional[int]) -> None: ...  # --max-epochs: no round starts for a later epoch
    def start_together(self, peers: int, timeout: float) -> None: ...  # --wait-peers: the first step waits for them
    def holding_for_the_others(self) -> bool: ...  # start_together: compute nothing more until they are counted
    def read_progress_soon(self) -> None: ...  # the first round's plan: this peer's view of who trains, at once
    def count_only_members(self, allows) -> None: ...  # a private run: others' progress records are ignored
    def mode_report(self) -> ModeReport: ...
    def step(self, *args, **kwargs) -> Any: ...  # after a window of micro-batches (collab.train.window)
    def zero_grad(self, set_to_none: bool = True) -> None: ...
    def observe_loss(self, loss: float) -> None: ...  # gossip's loss rule, the noise guard
    def in_sync(self) -> bool: ...
    def load_state_from_peers(self, deadline: Optional[float] = None, **kwargs) -> bool: ...
    def has_pending_updates(self) -> bool: ...
    def apply_revocations(self, revocations) -> None: ...
    def settle_before_leaving(self, timeout: float) -> str: ...
    def abort_rounds(self) -> None: ...
    def shutdown(self) -> None: ...


def optimizer_options(mode: str, context: ModeContext) -> dict:
    """The hivemind.Optimizer keywords averaging.mode `mode` sets (its module's optimizer_options), with
    `optimizer_class` the mode's optimizer."""
    if mode not in MODES:  # config validation names the field first; this guards direct callers
        raise ValueError(f"averaging.mode {mode!r} is not one of {', '.join(MODES)}")
    return importlib.import_module(f"collab.modes.{mode}").optimizer_options(context)


__all__ = ["MODES", "ModeContext", "ModeReport", "AveragingMode", "optimizer_options"]
