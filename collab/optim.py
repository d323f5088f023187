"""Building the collaborative optimizer: hivemind.Optimizer with collab's defaults and guards.

DeDLOC's recipe: gradients accumulate locally toward the swarm's target batch, are averaged in
one all-reduce per epoch, and every peer applies the same LAMB step. With `overlap`, the
all-reduce and the optimizer step run in a background thread while the next micro-batches are
computed (hivemind's delayed gradient averaging / delayed optimizer step, one step of staleness).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from typing import Optional
import torch
from hivemind import Optimizer
from hivemind.averaging.control import StepControl
from hivemind.compression import (
    CompressionBase,
    Float16Compression,
    NoCompression,
    Quantile8BitQuantization,
    Uniform8BitQuantization,
)
from hivemind.optim.grad_averager import GradientAverager
from hivemind.utils.logging import get_logger
from hivemind.utils.mpfuture import MPFuture

from collab.config import RunConfig
from collab.metrics import AveragingLog
from collab.tasks import Task

COMPRESSION: dict[str, type[CompressionBase]] = {
    "none": NoCompression,
    "fp16": Float16Compression,
    "uniform8bit": Uniform8BitQuantization,
    "quantile8bit": Quantile8BitQuantization,
}


LEAVE_LINGER_SECONDS = 3.0
logger = get_logger(__name__)


class LeavingMidStep(Exception):
    """Raised inside opt.step() when the peer was asked to leave while its epoch's round ran."""


class CollabOptimizer(Optimizer):
    """hivemind.Optimizer that records each gradient-averaging round and refuses non-finite averages.

    hivemind applies whatever the group returned; one faulty or malicious peer can send NaN/inf,
    which would poison every model in the group. Here such an average is discarded and the peer
    steps with its own gradients for that epoch (state averaging later pulls it back in line).
    """

    def __init__(self, *, averaging_log: AveragingLog, stop: Optional[threading.Event] = None, **kwargs):
        self.averaging_log = averaging_log
        self.stop = stop if stop is not None else threading.Event()
        self._state_rounds: list = []  # recent state-averaging controls; one may still run in the background
        self._stepped_apart = False  # this epoch's step used our own gradients while others were in the swarm
        super().__init__(**kwargs)

    def _update_global_epoch(self, grad_scaler) -> None:
        # hivemind hands this epoch's state-averaging control to a background step and forgets it
        if self.scheduled_state is not None:
            self._state_rounds = [c for c in self._state_rounds if not c.done()][-1:] + [self.scheduled_state]
        try:
            return super()._update_global_epoch(grad_scaler)
        except LeavingMidStep:
            return  # this epoch's step is abandoned: the peers who stay make it, and we keep our last state

    def abort_rounds(self) -> None:
        """On a signal: cancel averaging rounds in flight, so the training thread is not held inside
        opt.step() for up to averaging_timeout by a round that the peers who stay will finish anyway."""
        for control in (self.scheduled_grads, self.scheduled_state, *self._state_rounds):
            if control is not None and not control.done():
                control.cancel()
        # hivemind's background optimizer step also makes rounds of its own (when none was pre-scheduled)
        # and keeps them nowhere we can reach; the main thread then waits on that step. Every round is a
        # StepControl future registered by the process that made it, so cancel those too.
        for future_ref in list((MPFuture._active_futures or {}).values()):
            control = future_ref()
            if isinstance(control, StepControl) and not control.done():
                control.cancel()

    def _should_load_state_from_peers(self) -> bool:
        # after a step on our own gradients, download the swarm's state at the next step: exact, and the
        # gradients we would compute meanwhile would be for parameters nobody else has
        return self._stepped_apart or super()._should_load_state_from_peers()

    def load_state_from_peers(self, **kwargs) -> None:
        """hivemind's catch-up, with two changes: a peer asked to leave stops retrying (hivemind retries
        forever), and the gradient averager's "state" is not downloaded - those are another peer's
        accumulated gradients, which hivemind fetches (a model's size) and then throws away."""
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            self._tag_along_with_zero_weight(self.scheduled_grads)
            self.scheduled_grads = None
        self.state_averager.step(wait_for_delayed_updates=True)

        with self.tracker.pause_updates():
            while not self.stop.is_set():
                try:
                    self.state_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)
                    break
                except BaseException as e:  # a peer that left mid-download, a timeout: try the next one
                    if not self.stop.is_set():
                        logger.warning(f"Failed to load state from peers ({type(e).__name__}: {e}); retrying")
            if self.stop.is_set():
                return
            self._stepped_apart = False
            if self.tracker.global_epoch - 1 <= self.local_epoch < self.tracker.global_epoch:
                self.state_averager.local_epoch = self.tracker.global_epoch  # one epoch behind: that step is ours
            self.tracker.report_local_progress(local_epoch=self.local_epoch, samples_accumulated=0)
            if not self.client_mode:
                self.state_averager.state_sharing_priority = self.local_epoch
            if self.use_gradient_averaging:
                self.grad_averager.reset_accumulated_grads_()
                if not self.client_mode:
                    self.grad_averager.state_sharing_priority = self.local_epoch

    def _wait_for_round(self, control):
        """The round's result, waiting in short slices: a peer asked to leave must not sit out a whole
        averaging_timeout (up to minutes) inside an all-reduce before it can say goodbye."""
        deadline = time.monotonic() + self.averaging_timeout
        while True:
            try:
                return control.result(timeout=0.25)
            except FutureTimeout:
                if self.stop.is_set() or time.monotonic() > deadline:
                    raise

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control) -> None:
        averaged = False
        if maybe_step_control is not None:
            try:
                group = self._wait_for_round(maybe_step_control)
                if self._averaged_gradients_are_finite():
                    self._load_averaged_gradients_into_optimizer_()
                    self.averaging_log.success(len(group))
                    averaged = True
                else:
                    self.averaging_log.failure()
            except BaseException:  # timeouts, a peer that vanished mid-round: fall back to local gradients
                self.averaging_log.failure()
        if not averaged:
            if self.stop.is_set() and not self.delay_grad_averaging:
                # leaving: no step at all rather than one on local gradients. Loading them would also wait
                # for the averager process, which holds the gradient buffers until its all-reduce gives up.
                raise LeavingMidStep()
            self._load_local_gradients_into_optimizer()
            # this step moves us away from the swarm's parameters (and optimizer state), and state averaging
            # may not bring us back: a client whose round found no group can miss those rounds too
            self._stepped_apart = self.tracker.global_progress.num_peers > 1

    def _tag_along_with_zero_weight(self, control) -> None:
        # on the way out, hivemind would sit through a running round (up to averaging_timeout) with zero
        # weight; a leaving peer cancels instead, and the group finishes without it
        if self.stop.is_set():
            if not control.done():
                control.cancel()
            return
        super()._tag_along_with_zero_weight(control)

    def shutdown(self) -> None:
        if not self.stop.is_set():
            # leaving at --max-epochs: finish the delayed step, then go - but not at once. Our round may
            # be over while we still stream a client-mode (NAT'd or slow) groupmate its share: hivemind
            # sends those results only after the client's whole input, and closing p2pd now would leave
            # that peer with a partial average it is told was complete.
            if self.tracker.global_progress.num_peers > 1:
                self.stop.wait(LEAVE_LINGER_SECONDS)
            return super().shutdown()
        # leaving on a signal: say goodbye and go, without waiting up to averaging_timeout for a
        # background state-averaging round (the peers that stay finish it without us)
        self.tracker.shutdown(self.shutdown_timeout)
        for control in (self.scheduled_grads, self.scheduled_state):
            if control is not None and not control.done():
                control.cancel()
        self.state_averager.shutdown()
        if self.use_gradient_averaging:
            self.grad_averager.shutdown()

    def has_pending_updates(self) -> bool:
        return any(not update.done() for update in self.state_averager.pending_updates)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # with reuse_grad_buffers hivemind accumulates in .grad itself and clears it after each epoch
        if not self.grad_averager.reuse_grad_buffers:
            super().zero_grad(set_to_none)

    def _maybe_schedule_gradient_averaging(self) -> None:
        # hivemind pre-schedules matchmaking even for a peer that is alone, and the fruitless search keeps
        # the DHT and averager processes busy (a third of a core here). With one peer there is nobody to
        # match; when another appears, _begin_averaging_gradients still starts a round at the epoch's end.
        if self.tracker.global_progress.num_peers > 1:
            super()._maybe_schedule_gradient_averaging()

    def _maybe_schedule_state_averaging(self) -> None:
        if self.tracker.global_progress.num_peers > 1:
            super()._maybe_schedule_state_averaging()

    def _averaged_gradients_are_finite(self) -> bool:
        with torch.no_grad(), self.grad_averager.get_tensors() as tensors:
            return all(bool(torch.isfinite(t).all()) for t in tensors)


def build_optimizer(config: RunConfig, task: Task, dht, run_id: str, averaging_log: AveragingLog,
                    client_mode: bool = False, stop: Optional[threading.Event] = None) -> CollabOptimizer:
    avg = config.averaging
    compression = COMPRESSION[avg.compression]()
    # hivemind warns (and can deadlock in rare cases) when a matchmaking request may outlive matchmaking itself
    averager_opts = dict(bandwidth=avg.bandwidth, request_timeout=min(3.0, avg.matchmaking_time / 2))
    return CollabOptimizer(
        averaging_log=averaging_log,
        stop=stop,
        dht=dht,
        run_id=run_id,
        target_batch_size=config.training.target_batch_size,
        batch_size_per_step=config.training.micro_batch_size,
        params=task.parameter_groups(),
        optimizer=task.optimizer_factory(),
        scheduler=task.scheduler_factory(),
        matchmaking_time=avg.matchmaking_time,
        averaging_timeout=avg.averaging_timeout,
        next_chunk_timeout=avg.next_chunk_timeout,
        load_state_timeout=avg.load_state_timeout,
        offload_optimizer=True,
        # accumulate micro-batches in the model's own .grad: no copy and no zeroing per micro-batch
        # (2% of a CPU peer's time); the delayed all-reduce of overlap=full needs a separate buffer
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
        grad_averager_factory=partial(GradientAverager, **averager_opts),
        averager_opts=averager_opts,
        tracker_opts=dict(min_refresh_period=0.5, default_refresh_period=2.0),
        shutdown_timeout=2,
    )
