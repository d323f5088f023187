"""A trainer peer, top to bottom: build the task, join the swarm, catch up, train, leave cleanly."""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from collab.config import RunConfig
from collab.dashboard.collector import Collector
from collab.dashboard.server import BackgroundDashboard
from collab.modes import AveragingMode
from collab.process.lifecycle import StopOnSignal
from collab.records.identity import load_or_create_identity
from collab.records.metrics import AveragingLog, PeerMetricsRecord, loss_for_record, publish, rate_for_record
from collab.run.gate import MemberGate
from collab.run.sharer import RunSharer, SharedRun
from collab.swarm.node import PeerConfig, Swarm
from collab.swarm.state import read_run_state
from collab.tasks import build_task
from collab.train.checkpoint import load_model_weights, restore_training_state, save_checkpoint
from collab.train.guard import RELOAD_AFTER, BatchGuard
from collab.train.make_optimizer import build_optimizer
from collab.train.plan_keeper import plan_fields, plan_in_force, start_plan_keeper
from collab.train.precision import Precision
from collab.train.progress import ProgressDisplay, Snapshot

PUBLISH_EVERY = 10.0  # seconds; also at every epoch
METRICS_RECORD_LIFETIME = 300.0  # seconds a peer's metrics record lives in the DHT unless republished


@dataclass
class JoinOptions:
    max_epochs: Optional[int] = None
    summary_path: Optional[Path] = None  # a JSON summary written at exit (used by `collab simulate`)
    live_display: Optional[bool] = None  # None: a live bar only on a terminal
    wait_peers: int = 1  # do not start training until this many peers are in the run
    wait_peers_timeout: float = 180.0
    dashboard_port: Optional[int] = None  # serve the dashboard from this peer's own DHT node


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
    # at exit, whose replica this is: "swarm" (its last step was the swarm's), "downloaded" (its last step was
    # its own, and it downloaded the swarm's state before leaving) or "own step" (it could not: no checkpoint)
    final_replica: str = ""
    mode: str = "sync"  # averaging.mode
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
    # micro-batches skipped by fp16 loss scaling (not dropped: collab.train.guard never saw them)
    fp16_overflows: int = 0
    exit_reason: str = "running"  # until the peer leaves: a killed peer's last summary says so


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


def run(config: RunConfig, peer: PeerConfig, options: JoinOptions, stop: threading.Event,
        shared: Optional[SharedRun] = None, swarm: Optional[Swarm] = None) -> Summary:
    """Train until --max-epochs or a signal. `shared`: the run's manifest and files, which this peer passes on;
    `swarm`: this peer's DHT node if it is already up (a volunteer's, started to fetch the manifest)."""
    # hivemind advances a downloaded schedule before the first optimizer step; that is intended
    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
    summary = Summary(mode=config.averaging.mode)
    if stop.is_set():  # asked to leave while still starting up (e.g. importing torch): nothing joined, nothing lost
        return _write_exit_summary(summary, options, "stopped by signal")
    precision = Precision.from_config(config.training)  # a missing GPU fails here, before anything starts
    task = build_task(config)
    ckpt_dir = config.checkpoint.dir
    resume = load_model_weights(ckpt_dir, task) if ckpt_dir else None  # before the optimizer copies the weights

    # the data source is opened before joining: a bad --dataset fails here, before any process starts.
    # Each peer draws its own data order: the seed comes from its signing key, i.e. from who it is.
    identity = swarm.identity if swarm is not None else load_or_create_identity(peer.identity)
    seed = int.from_bytes(hashlib.sha256(identity.key.to_bytes()).digest()[:4], "little")
    batches = task.batches(config.training.micro_batch_size, seed)
    # the DHT's process is forked before this one initialises CUDA (as in hivemind's own examples): a fork of a
    # CUDA process must never touch the GPU, and nothing then depends on the DHT's code never doing so
    swarm = swarm if swarm is not None else Swarm(peer, identity)
    try:
        precision.attach(task.model)
        summary.device = precision.describe()
        # one throw-away forward/backward: the first step of a process is several times slower (allocator, data
        # pipeline, CUDA kernels), and a peer that announced itself before it would look stalled to the swarm
        with precision.autocast():
            warm_up = task.loss(precision.to_device(next(batches)))
        precision.backward(warm_up)
        task.model.zero_grad(set_to_none=True)
    except BaseException:  # out of GPU memory, a signal: the DHT process started above must not outlive us
        swarm.shutdown()
        raise

    if stop.is_set():
        swarm.shutdown()
        return _write_exit_summary(summary, options, "stopped by signal")
    display = ProgressDisplay(live=options.live_display)
    summary.peer_id = swarm.peer_id
    log = AveragingLog()
    opt = dashboard = sharer = keeper = None
    try:
        def leave(_why: str) -> None:  # this peer's invite was revoked or expired: leave as on a signal
            stop.set()
            if opt is not None:
                opt.abort_rounds()

        sharer = RunSharer(swarm, shared, on_lost=leave).start() if shared is not None else None
        if options.dashboard_port is not None:
            dashboard = _start_dashboard(swarm, options.dashboard_port)
            print(f"Dashboard: {dashboard.url}", flush=True)
        if not peer.initial_peers:
            line = swarm.join_command(shared.fingerprint if shared is not None else None)
            if shared is not None and shared.private is not None:
                line += (" --token-file INVITE\nThis run is private: each volunteer sends you their peer id ('collab "
                         "id'), you run 'collab invite --run DIR --peer ID' and send back the invite it prints")
            print(f"Started a new swarm. Others join with:\n{line}", flush=True)
        # the run's target and learning-rate gain for each epoch, when they follow the noise scale
        keeper = start_plan_keeper(config, swarm, shared, lambda: opt.local_epoch if opt is not None else 0)
        opt = _build_optimizer(config, task, swarm, log, stop, shared, keeper)
        opt.leave_at_epoch = options.max_epochs
        if sharer is not None and sharer.watch is not None:  # a private run: non-members' progress is not counted
            opt.tracker.members = shared.private.access.allows
            sharer.watch.on_revoked.append(opt.apply_revocations)
        StopOnSignal.reinstall()  # starting hivemind's averagers made this process ignore Ctrl-C
        StopOnSignal.on_stop(opt.abort_rounds)
        StopOnSignal.before_force_exit(lambda reason: _write_exit_summary(summary, options, f"forced exit: {reason}"))
        if resume is not None:
            restore_training_state(opt, resume)
            print(f"Resumed from checkpoint at epoch {opt.local_epoch}", flush=True)
        if peer.initial_peers:
            summary.loaded_state_from_peers, summary.catch_up = _catch_up(opt, display, stop)
            summary.swarm_epoch_at_join = opt.tracker.global_epoch

        _publish(swarm, opt, config, summary, log, None)  # announces this peer (and lets --wait-peers count it)
        if options.wait_peers > 1:
            _wait_for_peers(swarm, options, display, stop)
        summary.start_epoch = opt.local_epoch
        # hivemind's rate estimate (an EMA of seconds per sample) counts its first interval from the optimizer's
        # creation: the state download and --wait-peers made a peer look 50x slower than it is for its first ~40
        # micro-batches, on the dashboard and in its signed record, where the others' weight caps read it
        opt.tracker.performance_ema.reset_timer()
        micro = config.training.micro_batch_size
        epoch_loss, last_epoch, last_publish = EpochLoss(), opt.local_epoch, float("-inf")
        guard = BatchGuard(task.model.parameters())
        checkpoint_due = False
        loop_started = time.monotonic()
        with display:
            while not stop.is_set():
                if options.max_epochs is not None and opt.local_epoch >= options.max_epochs:
                    summary.exit_reason = f"reached epoch {options.max_epochs}"
                    break
                task.set_step(opt.local_epoch)
                computing = time.monotonic()
                with precision.autocast():
                    loss = task.loss(precision.to_device(next(batches)))
                loss_ok = guard.loss_ok(loss)
                if loss_ok:
                    precision.backward(loss)
                summary.compute_seconds += time.monotonic() - computing
                if loss_ok and not precision.unscale():  # fp16 overflowed: a smaller loss scale, the next batch
                    summary.fp16_overflows = precision.overflows
                    continue
                if loss_ok:
                    if guard.gradients_ok():
                        opt.step()
                        opt.zero_grad()
                        epoch_loss.add(loss.item())
                        opt.observe_loss(loss.item())
                        summary.samples_contributed += micro
                    else:
                        opt.drop_micro_batch()
                if guard.in_a_row:  # a dropped micro-batch: never sent, never counted toward the target
                    summary.batches_dropped = dict(guard.dropped)
                    if guard.replica_is_broken():
                        _reload_broken_replica(opt, guard, summary, display)
                    continue

                new_epoch = opt.local_epoch != last_epoch
                if new_epoch:
                    mean = epoch_loss.close()
                    if mean is not None:
                        summary.loss_by_epoch[last_epoch] = mean
                    summary.samples_by_epoch[last_epoch] = summary.samples_contributed
                    last_epoch = opt.local_epoch
                    checkpoint_due = checkpoint_due or bool(ckpt_dir and opt.local_epoch % config.checkpoint.every_epochs == 0)
                # a replica one update off the swarm waits for its re-sync, and is saved as soon as that comes (with
                # the epoch it re-synced at), not at the end of the next epoch
                if checkpoint_due and opt.in_sync():
                    _checkpoint(opt, task, config, summary)
                    checkpoint_due = False
                if new_epoch:
                    if keeper is not None:  # what this peer used for the epoch it now starts (peers must agree)
                        summary.plan_by_epoch[opt.local_epoch] = plan_in_force(keeper, opt)
                    summary.final_epoch = opt.local_epoch
                    summary.train_seconds = time.monotonic() - loop_started
                    log.copy_to(summary)
                    summary.rejected = {peer: dict(reasons) for peer, reasons in opt.rejections.drain().items()}
                    opt.traffic.copy_to(summary)
                    summary.nonfinite_parameters = nonfinite_parameters(task.model)
                    summary.outer_steps = dict(getattr(opt, "outer_steps", {}))
                    summary.gossip = getattr(opt, "report", dict)()
                    summary.noise_scale = _noise_fields(opt)
                    summary.noise_inputs = list(getattr(opt, "noise_inputs", ()))
                    write_summary(summary, options.summary_path)
                if new_epoch or time.monotonic() - last_publish > PUBLISH_EVERY:
                    summary.peers_found_back = swarm.rejoin()
                    _publish(swarm, opt, config, summary, log, epoch_loss.last_mean)
                    last_publish = time.monotonic()
                    if sharer is not None:
                        sharer.refresh()
                display.update(_snapshot(opt, summary, epoch_loss.last_mean, log))
        if stop.is_set():
            lost = shared.private.lost if shared is not None and shared.private is not None else None
            summary.exit_reason = "stopped by signal" if lost is None else "no longer a member of the private run"
        summary.train_seconds = time.monotonic() - loop_started
    finally:
        if opt is not None:
            if summary.exit_reason.startswith("reached epoch"):
                summary.final_replica = _settle(opt, config)
            opt.shutdown()  # waits for a delayed optimizer step, says goodbye to the tracker
            summary.final_epoch = opt.local_epoch
            summary.final_replica = summary.final_replica or ("swarm" if opt.in_sync() else "own step")
            log.copy_to(summary)
            summary.rejected = {peer: dict(reasons) for peer, reasons in opt.rejections.drain().items()}
            opt.traffic.copy_to(summary)
            summary.nonfinite_parameters = nonfinite_parameters(task.model)
            summary.gossip = getattr(opt, "report", dict)()
            # a peer stopped by a signal mid-update has no consistent state to save: the swarm has it; nor has
            # a peer whose last step was its own: that model is nobody else's
            saved_already = summary.checkpoint is not None and summary.checkpoint.endswith(f"-{summary.final_epoch:06d}")
            if (ckpt_dir and summary.final_epoch > summary.start_epoch and not saved_already
                    and not opt.has_pending_updates() and summary.final_replica != "own step"):
                _checkpoint(opt, task, config, summary)
        if dashboard is not None:
            dashboard.stop()
        if keeper is not None:
            keeper.stop()
            summary.plans_issued, summary.plans_read_late = keeper.issued, keeper.late
        if sharer is not None:
            sharer.stop()
        swarm.shutdown()
        if summary.exit_reason == "running":
            summary.exit_reason = "failed"  # an exception is on its way up
        write_summary(summary, options.summary_path)
    return summary


def _reload_broken_replica(opt: AveragingMode, guard: BatchGuard, summary: Summary, display: ProgressDisplay) -> None:
    """Micro-batch after micro-batch gave NaN or inf: the replica itself is broken (its weights, or a corrupted
    checkpoint it resumed from). The swarm's state replaces it; alone, there is nothing to reload from."""
    why = ", ".join(f"{n} {reason}" for reason, n in guard.dropped.items())
    display.message(f"{RELOAD_AFTER} micro-batches in a row were dropped ({why} so far): this replica is broken; "
                    "reloading the swarm's state")
    summary.reloads += 1
    guard.in_a_row = 0
    if not opt.load_state_from_peers(deadline=time.monotonic() + opt.load_state_timeout):
        display.message("No peer gave its state: training on with this replica")


def leave_before_start(options: JoinOptions) -> Summary:
    """A signal came before this peer joined: its summary says so (a report reads no error into it)."""
    return _write_exit_summary(Summary(), options, "stopped by signal")


def _write_exit_summary(summary: Summary, options: JoinOptions, reason: str) -> Summary:
    summary.exit_reason = reason
    write_summary(summary, options.summary_path)
    return summary


def _settle(opt: AveragingMode, config: RunConfig) -> str:
    """Leaving at --max-epochs: the final replica is the swarm's, or it is said loudly that it is not."""
    try:
        outcome = opt.settle_before_leaving(timeout=config.averaging.load_state_timeout)
    except Exception as e:  # a DHT or averager failing now must not cost the exit summary, nor claim a sync
        print(f"while re-syncing before leaving: {type(e).__name__}: {e}", flush=True)
        return "swarm" if opt.own_step is None else "own step"
    if outcome == "downloaded":
        print(f"The last step (to epoch {opt.local_epoch}) was this peer's own: its gradient round failed. "
              "Downloaded the swarm's state before leaving.", flush=True)
    elif outcome == "own step":
        print(f"The last step (to epoch {opt.local_epoch}) was this peer's own: its gradient round failed and no "
              "peer could give the swarm's state. This replica is not the swarm's: no checkpoint written for it.",
              flush=True)
    return outcome


def _build_optimizer(config, task, swarm: Swarm, log: AveragingLog, stop: threading.Event,
                     shared: Optional[SharedRun], keeper=None) -> AveragingMode:
    private = shared.private if shared is not None else None
    gate = MemberGate(swarm.peer.run_id, private.access.organizer_key) if private is not None else None
    return build_optimizer(config, task, swarm.dht, swarm.peer.run_id, log, client_mode=swarm.peer.client_mode,
                           stop=stop, gate=gate, plan=keeper)


def _start_dashboard(swarm: Swarm, port: int):
    collector = Collector(swarm.peer.run_id, dht=swarm.dht)  # reads through this peer's node: no second DHT
    return BackgroundDashboard(collector, port=port).start()


def _wait_for_peers(swarm: Swarm, options: JoinOptions, display: ProgressDisplay, stop: threading.Event) -> None:
    """Hold step 0 until the expected peers have published, so a simulated swarm starts together."""
    display.message(f"Waiting for {options.wait_peers} peers to join...")
    deadline = time.monotonic() + options.wait_peers_timeout
    while not stop.is_set() and time.monotonic() < deadline:
        present = sum(p.online for p in read_run_state(swarm.dht, swarm.peer.run_id).peers)
        if present >= options.wait_peers:
            return
        stop.wait(0.25)
    if not stop.is_set():
        display.message(f"Only {present} of {options.wait_peers} peers after {options.wait_peers_timeout:.0f} s; "
                        "training anyway")


def _catch_up(opt: AveragingMode, display: ProgressDisplay, stop: threading.Event,
              wait: float = 30.0) -> tuple[bool, str]:
    """A late peer first downloads the swarm's parameters and optimizer state, then trains at its epoch. Says
    whether it loaded a state, and what happened (kept in the summary: a late peer that trained from its own
    replica says why)."""
    started = time.monotonic()
    while not opt.tracker.fetched_global_progress_this_epoch.is_set() and time.monotonic() < started + wait:
        if stop.wait(0.1):
            return False, "stopped"
    seen = "" if opt.tracker.fetched_global_progress_this_epoch.is_set() else f" (no progress read in {wait:.0f} s)"
    if opt.tracker.global_epoch <= opt.local_epoch:
        return False, f"the swarm was at epoch {opt.tracker.global_epoch}, this peer at {opt.local_epoch}{seen}"
    display.message(f"Swarm is at epoch {opt.tracker.global_epoch}, this peer at {opt.local_epoch}: "
                    "loading state from peers...")
    asking = time.monotonic()
    # under churn the first donors tried may be dead peers whose records linger: keep asking a while
    if not opt.load_state_from_peers(deadline=asking + 5 * opt.load_state_timeout) or stop.is_set():
        display.message("No peer gave its state yet: training from this replica, and trying again at the next step")
        return False, (f"no peer gave its state in {time.monotonic() - asking:.0f} s (the swarm at epoch "
                       f"{opt.tracker.global_epoch}, {opt.tracker.global_progress.num_peers} peers)")
    display.message(f"Caught up: now at epoch {opt.local_epoch}")
    return True, f"loaded the swarm's state at epoch {opt.local_epoch} in {time.monotonic() - started:.0f} s"


def _checkpoint(opt, task, config: RunConfig, summary: Summary) -> None:
    opt.state_averager.step(wait_for_delayed_updates=True)  # never save a half-applied step
    path = save_checkpoint(config.checkpoint.dir, opt.local_epoch, task, opt, config.checkpoint.keep)
    summary.checkpoint = str(path)


def _publish(swarm: Swarm, opt, config: RunConfig, summary: Summary, log: AveragingLog, loss) -> None:
    record = PeerMetricsRecord(
        peer_id=swarm.peer_id,
        role="trainer",
        epoch=opt.local_epoch,
        loss=loss_for_record(loss),
        samples_per_second=rate_for_record(opt.tracker.performance_ema.samples_per_second),
        samples_contributed=summary.samples_contributed,
        target_batch_size=config.training.target_batch_size,
        client_mode=swarm.peer.client_mode,
        bandwidth_mbps=config.averaging.bandwidth,
        rounds_joined=log.joined,
        rounds_failed=log.failed,
        last_group_size=log.last_group_size,
        time=time.time(),
        batches_dropped=sum(summary.batches_dropped.values()),
        rejected=opt.rejections.for_record(),
        **dict(zip(("mb_per_round", "fewer_bytes_than_fp32"), opt.traffic.per_round())),
        mode=config.averaging.mode,
        inner_steps=getattr(opt, "inner_steps", None),
        pseudo_gradient_norm=getattr(opt, "last_pseudo_gradient_norm", None),
        **_gossip_fields(opt),
        **_noise_fields(opt),
        **plan_fields(getattr(opt, "plan_keeper", None), opt.local_epoch, config.training),
    )
    publish(swarm.dht, swarm.peer.run_id, swarm.public_key, record, METRICS_RECORD_LIFETIME)


def _noise_fields(opt) -> dict:
    noise = getattr(opt, "noise_scale", None)
    if noise is None or noise.signal is None or not all(math.isfinite(v) and abs(v) <= 1e12
                                                         for v in (noise.signal, noise.noise)):
        return {}
    return dict(noise_signal=float(noise.signal), noise_trace=float(noise.noise), noise_rounds=noise.updates)


def _gossip_fields(opt) -> dict:
    if not hasattr(opt, "report"):
        return {}
    report = opt.report()
    return dict(merges_per_minute=report["merges_per_minute"], merge_update_norm=report["last_update_norm"],
                param_norm=report["param_norm"], param_sketch=report["sketch"])


def _snapshot(opt, summary: Summary, loss, log: AveragingLog) -> Snapshot:
    progress = opt.tracker.global_progress
    return Snapshot(
        epoch=opt.local_epoch,
        swarm_samples=progress.samples_accumulated,
        target_batch_size=progress.target_batch_size,
        num_peers=max(progress.num_peers, 1),
        local_samples_per_second=float(opt.tracker.performance_ema.samples_per_second),
        loss=loss,
        samples_contributed=summary.samples_contributed,
        rounds_joined=log.joined,
    )
