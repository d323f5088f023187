"""A trainer peer, top to bottom: build the task, join the swarm, catch up, train, leave cleanly."""

from __future__ import annotations

import hashlib
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hivemind.utils import get_dht_time

from collab.config import RunConfig
from collab.data.feed import FeedStopped
from collab.modes import AveragingMode
from collab.process.lifecycle import StopOnSignal
from collab.records.identity import load_or_create_identity
from collab.records.metrics import AveragingLog
from collab.run.gate import MemberGate
from collab.run.sharer import SharedRun
from collab.swarm.dht_traffic import READ_TIMEOUT, ask_for_counts, counts_answered
from collab.swarm.node import PeerConfig, Swarm
from collab.tasks import Task, build_task
from collab.train.catch_up import catch_up, settle, wait_for_peers
from collab.train.checkpoint import load_model_weights, restore_training_state, save_checkpoint
from collab.train.compiling import warm_up
from collab.train.cpu_threads import one_thread_team
from collab.train.data_feed import PLACE_KEY, PeerData
from collab.train.micro_batch import with_micro_batch
from collab.train.guard import BatchGuard
from collab.train.announce import publish_metrics
from collab.train.local_group import LocalGroup, resolve_devices
from collab.train.make_optimizer import build_optimizer
from collab.train.plan_keeper import plan_in_force
from collab.train.pipeline import BatchPipeline, bound_warning, peer_batches
from collab.train.precision import Precision
from collab.train.progress import ProgressDisplay, Snapshot
from collab.train.services import PeerServices
from collab.train.summary import EpochLoss, Summary, harvest, sketch_replica, write_summary
from collab.train.window import GradientWindow

PUBLISH_EVERY = 10.0  # seconds; also at every epoch
HOLD_POLL = 0.25  # seconds between looks at the others' progress while a --wait-peers start holds
# seconds of a signalled leave's grace kept for what follows the exit figures: the DHT's and the helpers' shutdown,
# the summary (~1 s measured beside a CPU hog, 4 peers leaving at once on 2 cores)
AFTER_THE_FIGURES = 2.5


@dataclass
class JoinOptions:
    max_epochs: Optional[int] = None
    summary_path: Optional[Path] = None  # a JSON summary written at exit (used by `collab simulate`)
    live_display: Optional[bool] = None  # None: a live bar only on a terminal
    wait_peers: int = 1  # do not start training until this many peers are in the run
    wait_peers_timeout: float = 180.0
    dashboard_port: Optional[int] = None  # serve the dashboard from this peer's own DHT node


def run(config: RunConfig, peer: PeerConfig, options: JoinOptions, stop: threading.Event,
        shared: Optional[SharedRun] = None, swarm: Optional[Swarm] = None) -> Summary:
    """Train until --max-epochs or a signal. `shared`: the run's manifest and files, which this peer passes on;
    `swarm`: this peer's DHT node if it is already up (a volunteer's, started to fetch the manifest)."""
    # hivemind advances a downloaded schedule before the first optimizer step; that is intended
    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
    summary = Summary(mode=config.averaging.mode)
    if stop.is_set():  # asked to leave while still starting up (e.g. importing torch): nothing joined, nothing lost
        return _write_exit_summary(summary, options, "stopped by signal")
    devices = resolve_devices(config.training.devices)  # a missing GPU fails here, before anything starts
    if devices:  # rank 0 (this process) computes on the first
        kind = "cuda" if devices[0].startswith("cuda") else "cpu"
        config = config.model_copy(update={"training": config.training.model_copy(update={"device": kind})})
    precision = Precision.from_config(config.training, device=devices[0] if devices else None)
    task = build_task(config)
    # read before the optimizer copies the weights
    resume = load_model_weights(config.checkpoint.dir, task) if config.checkpoint.dir else None
    # the data source is opened before joining: a bad --dataset fails here, before any process starts.
    # Each peer draws its own data order: the seed comes from its signing key, i.e. from who it is.
    identity = swarm.identity if swarm is not None else load_or_create_identity(peer.identity)
    seed = int.from_bytes(hashlib.sha256(identity.key.to_bytes()).digest()[:4], "little")
    # a run with token shards: this peer reads them through a feed, which fetches what it lacks from the swarm
    data = PeerData(shared, stop) if shared is not None and shared.shards is not None else None
    feed = data.feed if data is not None else None
    # the DHT's process is forked before this one initialises CUDA (as in hivemind's own examples): a fork of a
    # CUDA process must never touch the GPU, and nothing then depends on the DHT's code never doing so
    services = PeerServices(swarm if swarm is not None else Swarm(peer, identity))
    first_step = pipeline = group = None
    try:
        with services:
            services.start_data(data, resume)  # its place in the shards is set before the warm-up reads from them
            precision.attach(task.model)
            summary.device = precision.describe()
            batches = None
            try:
                config = with_micro_batch(config, task, precision, seed, feed)  # auto: the largest that fits
                batches = pipeline = peer_batches(config, task, precision, seed, data)
                precision.compile_model(task.model)  # for the micro-batch's shape
                first_step = warm_up(task, precision, batches)  # and compiles the model, if this peer does
                summary.device = precision.describe()
            except FeedStopped:  # asked to leave while the first shard was on its way
                pass
            if stop.is_set():
                summary.exit_reason = "stopped by signal"
                return summary
            if len(devices) > 1:
                print(f"Starting a process for each of {', '.join(devices[1:])} (one peer for {len(devices)} devices)",
                      flush=True)
                group = LocalGroup(config, devices)
            loop = TrainingLoop(config, options, stop, task, precision, batches, services, summary, group)
            loop.start(peer, shared, resume)
            loop.train()
            if group is not None:  # at once: the helpers wait in a collective while this peer leaves the swarm
                group.close(loop.window.parameters)
            if stop.is_set():
                lost = shared.private.lost if shared is not None and shared.private is not None else None
                summary.exit_reason = "stopped by signal" if lost is None else "no longer a member of the private run"
    except BaseException as e:
        if summary.exit_reason != "running" and not summary.exit_reason.startswith("forced exit"):
            # the loop had ended (its reason is set) and leaving failed: the summary must not read as a clean exit
            summary.exit_reason = f"failed while leaving ({summary.exit_reason}): {type(e).__name__}: {e}"
        raise
    finally:
        if services.keeper is not None:
            summary.plans_issued, summary.plans_read_late = services.keeper.issued, services.keeper.late
        if group is not None:
            group.close([p for p in task.model.parameters() if p.requires_grad])  # (again: it does nothing twice)
            summary.local_group = group.report()
        if isinstance(pipeline, BatchPipeline):
            pipeline.close()
            summary.pipeline.update(pipeline.report())
        elif pipeline is not None:
            summary.pipeline["workers"] = 0
        if data is not None:
            summary.data = data.report()
        if first_step is not None:
            summary.compile = first_step.as_dict()
        if summary.exit_reason == "running":
            summary.exit_reason = "failed"  # an exception is on its way up
        write_summary(summary, options.summary_path)
    return summary


class TrainingLoop:
    """One peer's training: compute a micro-batch, step, end an epoch, publish. It owns the loop's own state; the
    services it trains beside (DHT node, sharer, dashboard, plan keeper, optimizer) are PeerServices'."""

    def __init__(self, config: RunConfig, options: JoinOptions, stop: threading.Event, task: Task,
                 precision: Precision, batches, services: PeerServices, summary: Summary,
                 group: Optional[LocalGroup] = None):
        self.config, self.options, self.stop, self.task = config, options, stop, task
        self.precision, self.batches, self.services, self.summary = precision, batches, services, summary
        self.swarm = services.swarm
        self.display = ProgressDisplay(live=options.live_display)
        self.log = AveragingLog()
        self.guard = BatchGuard()
        self.window = GradientWindow(task.model.parameters(), precision)
        self.group = group  # this peer's other devices (collab.train.local_group), or None
        self._window_opened = 0.0
        self.batch_seconds = 0.0  # waiting for the next batch (made in this thread, or by a data worker)
        self.epoch_loss = EpochLoss()
        self.opt: Optional[AveragingMode] = None
        summary.peer_id = self.swarm.peer_id

    def start(self, peer: PeerConfig, shared: Optional[SharedRun], resume) -> None:
        """Start the services in order, then catch up with the swarm and announce this peer."""
        services, options, summary = self.services, self.options, self.summary

        def leave(_why: str) -> None:  # this peer's invite was revoked or expired: leave as on a signal
            self.stop.set()
            if services.opt is not None:
                services.opt.abort_rounds()

        services.start_sharer(shared, on_lost=leave)
        services.start_probe()
        services.start_dashboard(options.dashboard_port)
        if services.dashboard is not None:
            print(f"Dashboard: {services.dashboard.url}", flush=True)
        if not peer.initial_peers:
            line = self.swarm.join_command(shared.fingerprint if shared is not None else None)
            if shared is not None and shared.private is not None:
                line += (" --token-file INVITE\nThis run is private: each volunteer sends you their peer id ('collab "
                         "id'), you run 'collab invite --run DIR --peer ID' and send back the invite it prints")
            print(f"Started a new swarm. Others join with:\n{line}", flush=True)
        services.start_plan_keeper(self.config, shared)
        self.opt = opt = services.start_optimizer(lambda: self._build_optimizer(shared), self._leave)
        opt.leave_at(options.max_epochs)
        # diloco and gossip step on each micro-batch; sync sums a window of them on a GPU. A CPU has no queue of
        # kernels to keep fed (a read waits for nothing): there a window of one reports progress as it comes
        if not opt.sums_micro_batches or self.precision.device.type == "cpu":
            self.window.most = 1
        if self.precision.device.type == "cpu":
            one_thread_team(opt.state_averager)  # hivemind's step pool would stop libgomp's spinning (cpu_threads)
        if services.sharer is not None and services.sharer.watch is not None:  # a private run: members only
            opt.count_only_members(shared.private.access.allows)
            services.sharer.watch.on_revoked.append(opt.apply_revocations)
        StopOnSignal.reinstall()  # starting hivemind's averagers made this process ignore Ctrl-C
        StopOnSignal.on_stop(opt.abort_rounds)
        StopOnSignal.before_force_exit(lambda reason: _write_exit_summary(summary, options, f"forced exit: {reason}"))
        if resume is not None:
            restore_training_state(opt, resume)
            print(f"Resumed from checkpoint at epoch {opt.local_epoch}", flush=True)
        if peer.initial_peers:
            summary.loaded_state_from_peers, summary.catch_up = catch_up(opt, self.display, self.stop)
            summary.swarm_epoch_at_join = opt.tracker.global_epoch
        self._publish()  # announces this peer (and lets --wait-peers count it)
        if options.wait_peers > 1:
            present = wait_for_peers(self.swarm, options.wait_peers, options.wait_peers_timeout, self.display,
                                     self.stop, announce=self._publish)
            # the first step waits for the peers that came (a run of 64 where 4 never came waited 180 s more for them)
            opt.start_together(present, options.wait_peers_timeout)  # (it reads them when all are in)
        else:
            opt.read_progress_soon()  # the swarm's records, for this peer's first round
        summary.start_epoch = opt.local_epoch
        # hivemind's rate estimate (an EMA of seconds per sample) counts its first interval from the optimizer's
        # creation: the state download and --wait-peers made a peer look 50x slower than it is for its first ~40
        # micro-batches, on the dashboard and in its signed record, where the others' weight caps read it
        opt.tracker.performance_ema.reset_timer()

    def train(self) -> None:
        opt, summary, max_epochs = self.opt, self.summary, self.options.max_epochs
        last_epoch, last_publish, checkpoint_due = opt.local_epoch, float("-inf"), False
        started = time.monotonic()
        # --wait-peers in the sync mode: after its first window the peer waits for the others' progress records
        holding = self.options.wait_peers > 1 and self.config.averaging.mode == "sync"
        try:
            with self.display:
                while not self.stop.is_set():
                    if max_epochs is not None and opt.local_epoch >= max_epochs:
                        summary.exit_reason = f"reached epoch {max_epochs}"
                        break
                    self.task.set_step(opt.local_epoch)
                    if holding and opt.holding_for_the_others():
                        self.stop.wait(HOLD_POLL)
                        continue
                    if not self._micro_batch():
                        continue  # nothing to count: fp16 overflowed, or the micro-batch was dropped
                    new_epoch = opt.local_epoch != last_epoch
                    if new_epoch:
                        self._close_epoch(last_epoch)
                        last_epoch = opt.local_epoch
                        every = self.config.checkpoint.every_epochs
                        checkpoint_due = checkpoint_due or bool(self.config.checkpoint.dir and last_epoch % every == 0)
                    # a replica one update off the swarm waits for its re-sync, and is saved as soon as that comes
                    # (with the epoch it re-synced at), not at the end of the next epoch
                    if checkpoint_due and opt.in_sync():
                        self._checkpoint()
                        checkpoint_due = False
                    if new_epoch:
                        summary.train_seconds = time.monotonic() - started
                        self._check_the_pipeline(summary.train_seconds)
                        self._report_epoch()
                    if new_epoch or time.monotonic() - last_publish > PUBLISH_EVERY:
                        summary.peers_found_back = self.swarm.rejoin()
                        self._publish()
                        last_publish = time.monotonic()
                        if self.services.sharer is not None:
                            self.services.sharer.refresh()
                    self.display.update(self._snapshot())
        finally:
            summary.train_seconds = time.monotonic() - started

    def _micro_batch(self) -> bool:
        """Compute one micro-batch; at the end of a window, hand its good micro-batches to the optimizer. False if
        nothing was counted: the window is still open, or all of it was dropped or overflowed."""
        computing = time.monotonic()
        if self.window.size == 0:
            self._window_opened = computing
            if self.group is not None:  # each other device's share of the window, from this peer's one stream
                try:
                    dealt = [[next(self.batches) for _ in range(self.window.limit)] for _ in range(self.group.others)]
                except FeedStopped:
                    return False
                self.group.open_window(self.window.parameters, dealt)
        with self.precision.autocast():
            try:
                batch = next(self.batches)
            except FeedStopped:  # asked to leave while a shard was on its way: the loop ends on the stop event
                return False
            self.batch_seconds += time.monotonic() - computing
            loss = self.task.loss(self.precision.to_device(batch))
        self.window.add(loss)  # checked and summed on the device: nothing read back yet
        self.summary.compute_seconds += time.monotonic() - computing
        return self._close_window() if self.window.full() else False

    def _close_window(self) -> bool:
        """Read the window's checks (the one host-device sync of the window) and count its micro-batches; the good
        ones' gradients, already summed in .grad, go to the optimizer as one step of that many micro-batches."""
        opt, guard, summary, window = self.opt, self.guard, self.summary, self.window
        reading = time.monotonic()
        outcomes = window.close()
        own = len(outcomes)
        if self.group is not None:  # the other devices' window sums, added into this one's .grad
            self.group.micro_batches[0] += own
            outcomes += self.group.close_window(window.parameters)
        summary.compute_seconds += time.monotonic() - reading  # the device's work, which the read waited for
        good, broken = [], False
        for outcome in outcomes:
            if self.precision.scaling and outcome.loss_finite and not outcome.gradients_finite:
                self.precision.overflows += 1  # fp16 overflowed: the scale came down on the device already
            elif guard.count(outcome.loss_finite, outcome.gradients_finite):
                good.append(outcome.loss)
            broken = broken or guard.replica_is_broken()
        micro = self.config.training.micro_batch_size
        if good:
            opt.step(batch_size=len(good) * micro)
            summary.samples_contributed += len(good) * micro
        opt.zero_grad()
        for loss in good:
            self.epoch_loss.add(loss)
            opt.observe_loss(loss)
        summary.fp16_overflows = self.precision.overflows
        summary.batches_dropped = dict(guard.dropped)
        if broken:
            guard.reload_replica(opt, summary, self.display)
        eta = opt.tracker.estimated_next_update_time - get_dht_time()
        window.resize(time.monotonic() - self._window_opened, own, eta)
        return bool(good)

    def _check_the_pipeline(self, trained: float) -> None:
        """Say once when the data pipeline is what bounds this peer, and how to fix it."""
        pipeline = self.batches if isinstance(self.batches, BatchPipeline) else None
        self.summary.pipeline["waited_seconds"] = round(self.batch_seconds, 1)
        if self.summary.pipeline.get("bound"):
            return
        warning = bound_warning(self.batch_seconds, trained, pipeline.rate() if pipeline else None, pipeline is None)
        if warning is not None:
            self.summary.pipeline["bound"] = warning
            self.display.message(warning)

    def _close_epoch(self, epoch: int) -> None:
        mean = self.epoch_loss.close()
        if mean is not None:
            self.summary.loss_by_epoch[epoch] = mean
        self.summary.samples_by_epoch[epoch] = self.summary.samples_contributed

    def _report_epoch(self) -> None:
        opt, summary = self.opt, self.summary
        if self.services.keeper is not None:  # what this peer used for the epoch it now starts (peers must agree)
            summary.plan_by_epoch[opt.local_epoch] = plan_in_force(self.services.keeper, opt)
        summary.final_epoch = opt.local_epoch
        harvest(summary, opt, self.task.model, self.log)
        # for the simulator's replicas' spread; with overlap the step may still be running, so no sketch of a
        # replica half-updated
        if self.options.summary_path is not None and self.config.averaging.overlap == "none":
            sketch_replica(summary, opt.local_epoch, self.task.model)
        write_summary(summary, self.options.summary_path)

    def _leave(self, opt: AveragingMode) -> None:
        """How the optimizer stops (PeerServices calls it): at --max-epochs, first make sure the replica is the
        swarm's; then shut the averagers down, and save what is worth saving."""
        summary, config = self.summary, self.config
        if summary.exit_reason.startswith("reached epoch"):
            summary.final_replica = settle(opt, config)
            if summary.final_replica == "downloaded" and self.options.summary_path is not None \
                    and config.averaging.overlap == "none":
                sketch_replica(summary, opt.local_epoch, self.task.model)  # the replica it leaves with: the swarm's
        # the DHT's figures, read once, at exit (each read is a request to the DHT's process): asked now, answered
        # while the averagers shut down. Asked after, a DHT process starved of CPU (24 peers on 2 cores) made a
        # leaving peer wait up to READ_TIMEOUT more, past the leave's grace
        asked = ask_for_counts(opt.dht, self.swarm.peer.run_id, last_epoch=opt.local_epoch)
        opt.shutdown()  # waits for a delayed optimizer step, says goodbye to the tracker
        summary.final_epoch = opt.local_epoch
        summary.final_replica = summary.final_replica or ("swarm" if opt.in_sync() else "own step")
        harvest(summary, opt, self.task.model, self.log)
        # a peer stopped by a signal mid-update has no consistent state to save: the swarm has it; nor has
        # a peer whose last step was its own: that model is nobody else's
        saved_already = summary.checkpoint is not None and summary.checkpoint.endswith(f"-{summary.final_epoch:06d}")
        if (config.checkpoint.dir and summary.final_epoch > summary.start_epoch and not saved_already
                and not opt.has_pending_updates() and summary.final_replica != "own step"):
            self._checkpoint()
        # the figures last, after what is worth keeping: of 173 forced exits in two days here (most of them 24-32
        # peers leaving at once on 2 cores), 57 were waiting for them, and the checkpoint came after. On a signal,
        # only while the grace leaves time for the rest (the DHT's shutdown: ~1 s): the DHT's process, busy with
        # the others' goodbyes, took the whole READ_TIMEOUT (5 s) to answer, and the leave overran its 7 s (a peer
        # of the churn test, in CI)
        summary.dht = counts_answered(asked, timeout=StopOnSignal.budget(READ_TIMEOUT, keep=AFTER_THE_FIGURES)) or {}

    def _build_optimizer(self, shared: Optional[SharedRun]) -> AveragingMode:
        private = shared.private if shared is not None else None
        swarm = self.swarm
        gate = MemberGate(swarm.peer.run_id, private.access.organizer_key) if private is not None else None
        return build_optimizer(self.config, self.task, swarm.dht, swarm.peer.run_id, self.log,
                               client_mode=swarm.peer.client_mode, stop=self.stop, gate=gate, plan=self.services.keeper)

    def _checkpoint(self) -> None:
        opt, config = self.opt, self.config
        opt.state_averager.step(wait_for_delayed_updates=True)  # never save a half-applied step
        data = self.services.data
        extra = {PLACE_KEY: data.now()} if data is not None else {}  # a restart resumes the data where it was
        path = save_checkpoint(config.checkpoint.dir, opt.local_epoch, self.task, opt, config.checkpoint.keep, extra)
        self.summary.checkpoint = str(path)

    def _publish(self) -> None:
        data = self.services.data
        if data is not None:
            data.settle(self.opt.rejections)
        publish_metrics(self.opt, self.config, self.swarm, self.summary, self.log, self.epoch_loss.last_mean, data)

    def _snapshot(self) -> Snapshot:
        opt = self.opt
        progress = opt.tracker.global_progress
        return Snapshot(
            epoch=opt.local_epoch,
            swarm_samples=progress.samples_accumulated,
            target_batch_size=progress.target_batch_size,
            num_peers=max(progress.num_peers, 1),
            local_samples_per_second=float(opt.tracker.performance_ema.samples_per_second),
            loss=self.epoch_loss.last_mean,
            samples_contributed=self.summary.samples_contributed,
            rounds_joined=self.log.joined,
        )


def leave_before_start(options: JoinOptions) -> Summary:
    """A signal came before this peer joined: its summary says so (a report reads no error into it)."""
    return _write_exit_summary(Summary(), options, "stopped by signal")


def _write_exit_summary(summary: Summary, options: JoinOptions, reason: str) -> Summary:
    summary.exit_reason = reason
    write_summary(summary, options.summary_path)
    return summary
