"""Building the collaborative optimizer from a run config: hivemind.Optimizer's many arguments, set once here
(collab.modes holds what each averaging mode does, and what it changes here; this is how it is configured)."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from functools import partial
from typing import Optional

from hivemind.compression import NoCompression
from hivemind.utils.logging import get_logger

from collab.averaging.aggregation import Aggregation
from collab.averaging.compression import wire_codec
from collab.averaging.dgc import DGCSettings, sparsified
from collab.averaging.grad_averager import CollabDGCAverager, CollabGradientAverager, CollabPowerSGDAverager
from collab.averaging.robust_rounds import quiet_rejections
from collab.averaging.traffic import TrafficLog
from collab.config import RunConfig, join_request_timeout, round_timeout_caution
from collab.modes import ModeContext, optimizer_options
from collab.modes.base import SwarmOptimizer
from collab.records.metrics import AveragingLog
from collab.records.rejections import RejectionLog
from collab.run.gate import MemberGate
from collab.tasks import Task
from collab.train.plan_keeper import scheduled_by_plan

def build_optimizer(config: RunConfig, task: Task, dht, run_id: str, averaging_log: AveragingLog,
                    client_mode: bool = False, stop: Optional[threading.Event] = None,
                    gate: Optional[MemberGate] = None, plan=None) -> SwarmOptimizer:
    """`gate`: in a private run, the members check every averager applies (collab.run.gate); `plan`: the run's
    batch plan (collab.train.plan_keeper) when its target or learning rate follows the noise scale (sync mode only)."""
    avg = config.averaging
    compression = wire_codec(avg.compression)
    # the manifest says mean or centered_clip; "auto" only reaches here from a config that skipped it
    method = avg.aggregation if avg.aggregation in ("mean", "adasum") else "centered_clip"
    rule = Aggregation(method=method, tau=avg.clip_tau, iterations=avg.clip_iterations,
                       max_weight_ratio=avg.max_weight_ratio)
    # adasum adds gradients; parameters (state rounds) are averaged, robustly
    state_rule = replace(rule, method="centered_clip") if method == "adasum" else rule
    rejections, traffic = RejectionLog(), TrafficLog()
    quiet_rejections()  # a refused round is reported once by collab, not with hivemind's traceback
    caution = round_timeout_caution(avg)
    if caution is not None:
        get_logger(__name__).warning(caution)
    averager_opts = dict(bandwidth=avg.bandwidth, request_timeout=join_request_timeout(avg.matchmaking_time),
                         target_group_size=avg.group_size)
    scheduler = task.scheduler_factory()
    if plan is not None:
        scheduler = scheduled_by_plan(scheduler, plan)
    mode = optimizer_options(avg.mode, ModeContext(config=config, task=task, rule=rule, gate=gate,
                                                   rejections=rejections, traffic=traffic,
                                                   averager_opts=averager_opts, plan=plan))
    return mode.pop("optimizer_class")(**{**dict(
        averaging_log=averaging_log,
        stop=stop,
        gate=gate,
        rule=state_rule,  # the state averager's (the gradient averager's is in its factory)
        rejections=rejections,
        traffic=traffic,
        dht=dht,
        run_id=run_id,
        target_batch_size=config.training.target_batch_size,
        batch_size_per_step=config.training.micro_batch_size,
        params=_parameter_groups(config, task),
        optimizer=task.optimizer_factory(),
        scheduler=scheduler,
        matchmaking_time=avg.matchmaking_time,
        averaging_timeout=avg.averaging_timeout,
        next_chunk_timeout=avg.next_chunk_timeout,
        load_state_timeout=avg.load_state_timeout,
        offload_optimizer=True,
        # accumulate micro-batches in the model's own .grad (the trainer's window sums them there: collab.train.window),
        # no copy into a second buffer per window; the delayed all-reduce of overlap=full needs a separate buffer
        reuse_grad_buffers=avg.overlap != "full",
        delay_optimizer_step=avg.overlap in ("optimizer", "full"),
        delay_grad_averaging=avg.overlap == "full",
        average_state_every=avg.average_state_every,
        client_mode=client_mode,
        grad_compression=compression,
        # parameters travel exactly: state averaging exists to make replicas identical, and fp16 would
        # leave them 2^-11 apart (LayerNorm weights ~1.0); it runs only every `average_state_every` epochs.
        # Likewise a joining peer starts from the swarm's exact parameters.
        state_averaging_compression=NoCompression(),
        load_state_compression=NoCompression(),
        grad_averager_factory=_gradient_averager(config, gate=gate, rule=rule, findings=rejections.queue,
                                                 traffic=traffic.queue,
                                                 micro_batch_size=config.training.micro_batch_size,
                                                 **averager_opts),
        averager_opts=averager_opts,
        tracker_opts=dict(min_refresh_period=0.5, default_refresh_period=2.0),
        shutdown_timeout=2,
        # hivemind's per-round messages ("Averaged gradients with 3 peers") when its log level is INFO or lower
        verbose=logging.getLogger("hivemind").getEffectiveLevel() <= logging.INFO,
    ), **mode})


def _gradient_averager(config: RunConfig, **options):
    """hivemind calls this with the parameters and its own keywords (dht, prefix, compression, ...)."""
    avg = config.averaging
    if avg.compression == "dgc":
        settings = DGCSettings(sparsity=avg.dgc_sparsity, warmup_epochs=avg.dgc_warmup_epochs,
                               momentum=avg.dgc_momentum, clip_norm=config.training.max_grad_norm)
        return partial(CollabDGCAverager, settings=settings, seed=config.training.seed, **options)
    if avg.compression == "powersgd":
        def powersgd(parameters, **kwargs):
            return CollabPowerSGDAverager(parameters, config.averaging.powersgd_rank, seed=config.training.seed,
                                          **options, **kwargs)
        return powersgd
    # a replayed round is applied at the step (collab.modes.sync); under overlap=full the round ends a step later
    return partial(CollabGradientAverager, replays=avg.overlap != "full", **options)


def _parameter_groups(config: RunConfig, task: Task) -> list[dict]:
    """The task's groups; under dgc each is split, and the optimizer's momentum is off for the matrices DGC sends
    (their momentum is DGC's velocity: collab.averaging.dgc)."""
    groups = task.parameter_groups()
    if config.averaging.compression != "dgc":
        return groups
    split = []
    for group in groups:
        matrices = [p for p in group["params"] if sparsified(p)]
        vectors = [p for p in group["params"] if not sparsified(p)]
        if matrices:
            split.append({**group, "params": matrices, **task.without_momentum()})
        if vectors:
            split.append({**group, "params": vectors})
    return split
