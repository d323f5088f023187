"""What a trainer peer reports about its run: the exit summary (`--summary-json`, read by `collab simulate` and the
tests), written atomically at every epoch and at exit, and the per-epoch loss it is built from."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from collab.modes.gossip_rules import sketch
from collab.records.metrics import AveragingLog


@dataclass
class Summary:
    peer_id: str = ""
    start_epoch: int = 0
    final_epoch: int = 0
    samples_contributed: int = 0
    train_seconds: float = 0.0  # time in the training loop (excludes start-up and shutdown)
    compute_seconds: float = 0.0  # of that, computing micro-batches (data, forward, backward); the rest is waiting
    rounds_joined: int = 0
    rounds_failed: int = 0
    rounds_failed_by_reason: dict[str, int] = field(default_factory=dict)  # collab.modes.round_failures.round_failure
    rounds_replayed: int = 0  # of those, missed rounds applied from a peer that made them (collab.averaging.round_replay)
    # its state-averaging rounds: ok, given up (cancelled: no group in time, sat out, left), failed; "peers": their
    # groups' sizes summed
    state_rounds: dict[str, int] = field(default_factory=dict)
    group_sizes: list[int] = field(default_factory=list)
    groups: list[dict] = field(default_factory=list)  # each gradient round: {"epoch": e, "peers": [peer ids]}
    loss_by_epoch: dict[int, float] = field(default_factory=dict)
    # samples_contributed when each epoch closed: the swarm's samples through epoch e are the peers' sum (a target
    # is a floor; the micro-batches in flight when it is reached count too)
    samples_by_epoch: dict[int, int] = field(default_factory=dict)
    # training.target_batch_size auto / lr_scaling adascale (collab.adaptive.batch_plan): per epoch [target, gain,
    # scale-invariant progress, learning rate] as this peer used them, and the plans it issued (the organizer)
    plan_by_epoch: dict[int, list] = field(default_factory=dict)
    plans_issued: int = 0
    plans_read_late: int = 0  # plans read after their first epoch began here (collab.train.plan_keeper)
    loaded_state_from_peers: bool = False
    catch_up: str = ""  # what the catch-up at the start did, and why (a late peer that trained from its own replica)
    swarm_epoch_at_join: int = 0  # the swarm's epoch when this peer came in (0: nothing to catch up on yet)
    checkpoint: Optional[str] = None
    nonfinite_parameters: list[str] = field(default_factory=list)  # names of tensors holding NaN or inf
    batches_dropped: dict[str, int] = field(default_factory=dict)  # micro-batches not sent (collab.train.guard), by why
    peers_found_back: int = 0  # lost peers that answered again (collab.swarm.rejoin: a network split healed)
    reloads: int = 0  # times the replica was reloaded from the swarm after many dropped micro-batches
    rejected: dict[str, dict[str, int]] = field(default_factory=dict)  # peer -> what this peer refused from it
    # its gradient rounds' bytes, as its all-reduce counted them, and the same rounds uncompressed
    # (collab.averaging.traffic)
    allreduce_bytes_sent: int = 0
    allreduce_bytes_received: int = 0
    allreduce_fp32_bytes: float = 0.0
    # the same over the last rounds only (collab.averaging.traffic.RECENT_ROUNDS): what a codec costs once warmed up
    allreduce_recent_mb_per_round: Optional[float] = None
    allreduce_recent_fewer_than_fp32: Optional[float] = None
    # those rounds' seconds in all: finding the group (matchmaking) and the all-reduce, and how many rounds
    round_seconds: dict = field(default_factory=dict)
    # at exit, whose replica this is: "swarm" (its last step was the swarm's), "downloaded" (its last step was
    # its own, and it downloaded the swarm's state before leaving) or "own step" (it could not: no checkpoint)
    final_replica: str = ""
    mode: str = "sync"  # averaging.mode
    # a run with token shards (collab.train.data_feed): its place in them, what it fetched and from whom
    data: dict = field(default_factory=dict)
    # diloco: each outer step as this peer saw it (outer step -> norm, weight, probe, applied; collab.modes.diloco)
    outer_steps: dict[int, dict] = field(default_factory=dict)
    # gossip: exchanges asked, answered, failed and refused, the recent merges, this replica's norm and sketch
    gossip: dict = field(default_factory=dict)
    # the gradient noise scale's smoothed |G|^2 and tr(Sigma) from this peer's rounds (collab.adaptive.noise_scale)
    noise_scale: dict = field(default_factory=dict)
    # and each round's inputs to it, the last NOISE_INPUTS_KEPT: [epoch, |g_i|^2, B_i, |g|^2, B] (what to check an
    # estimate against, round by round, on a task whose B_noise is known)
    noise_inputs: list = field(default_factory=list)
    device: str = ""  # where and in what precision this peer computed (collab.train.precision)
    # its first micro-batch: seconds, graphs compiled, later recompiles, why it fell back to eager (collab.train.compiling)
    compile: dict = field(default_factory=dict)
    # where its batches were made (workers: 0 in the training thread), the worker's own rate, the seconds training
    # waited for them, and the warning, if the pipeline bounded this peer (collab.train.pipeline)
    pipeline: dict = field(default_factory=dict)
    # one peer for several devices (collab.train.local_group): the devices, and the micro-batches each computed
    local_group: dict = field(default_factory=dict)
    # what its DHT node sent the swarm: requests and bytes, per RPC, over `seconds` (collab.swarm.dht_traffic)
    dht: dict = field(default_factory=dict)
    # its tracker's reads of the run's progress: how many, and how many found no record at all while others trained
    # (failed reads, which the last read stood in for: collab.modes.tracker.FOUND_NOTHING_KEPT)
    progress_reads: dict = field(default_factory=dict)
    # micro-batches skipped by fp16 loss scaling (not dropped: collab.train.guard never saw them)
    fp16_overflows: int = 0
    # a count sketch of its parameters as each epoch began, the last REPLICA_SKETCHES_KEPT epochs: the distance
    # between two peers' sketches of one epoch estimates how far apart their replicas were (collab simulate's
    # replicas' spread; collab.modes.gossip_rules.sketch)
    replica_sketches: dict[int, list[float]] = field(default_factory=dict)
    exit_reason: str = "running"  # until the peer leaves: a killed peer's last summary says so


REPLICA_SKETCHES_KEPT = 16
REPLICA_SKETCH_SIZE = 64  # estimates a distance within ~sqrt(2/64) = 18%; equal replicas give equal sketches


def sketch_replica(summary: Summary, epoch: int, model) -> None:
    """Keep a sketch of the replica this epoch starts from (the step that ended the last one applied)."""
    summary.replica_sketches[epoch] = sketch([p for p in model.parameters()], seed=0, size=REPLICA_SKETCH_SIZE)
    for old in sorted(summary.replica_sketches)[:-REPLICA_SKETCHES_KEPT]:
        del summary.replica_sketches[old]


def write_summary(summary: Summary, path: Optional[Path]) -> None:
    """Atomically: a peer killed while writing leaves the previous summary, never half of one."""
    if path is None:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(summary), indent=1))
    tmp.replace(path)


def nonfinite_parameters(model) -> list[str]:
    return [name for name, param in model.named_parameters() if not bool(param.detach().isfinite().all())]


class EpochLoss:
    """Mean local loss over the micro-batches of each epoch."""

    def __init__(self):
        self.total, self.count, self.last_mean = 0.0, 0, None

    def add(self, loss: float) -> None:
        self.total += loss
        self.count += 1

    def close(self) -> Optional[float]:
        if self.count:
            self.last_mean = self.total / self.count
        self.total, self.count = 0.0, 0
        return self.last_mean


def harvest(summary: Summary, opt, model, log: AveragingLog) -> None:
    """What the optimizer, its averagers and the model say now, into the summary (at each epoch and at exit):
    rounds, refusals, bytes, non-finite parameters and the mode's own report."""
    log.copy_to(summary)
    summary.rounds_replayed = getattr(opt, "rounds_replayed", 0)
    outcomes = getattr(getattr(opt, "state_averager", None), "state_round_outcomes", None)
    summary.state_rounds = outcomes() if outcomes is not None else {}
    summary.rejected = {peer: dict(reasons) for peer, reasons in opt.rejections.drain().items()}
    opt.traffic.copy_to(summary)
    summary.nonfinite_parameters = nonfinite_parameters(model)
    report = opt.mode_report()
    summary.outer_steps, summary.gossip = report.outer_steps, report.gossip
    summary.noise_scale, summary.noise_inputs = report.noise, report.noise_inputs
    tracker = getattr(opt, "tracker", None)  # (a mode without collab's progress tracker reads nothing of its own)
    if tracker is not None:
        summary.progress_reads = {"read": tracker.reads, "found_nothing": tracker.found_nothing}
