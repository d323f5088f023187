"""averaging.mode gossip: no global batch. Each peer trains its replica on its own (AdamW, one step per
micro-batch); after K local steps, K ~ Poisson(averaging.gossip.mean_local_steps) (seed 000), it picks a random
peer and the two swap parameters in one exchange over hivemind's P2P. Each side then merges from its own view:
theta <- (1 - a) * theta + a * theta_peer, a from averaging.gossip.interpolation (collab.modes.gossip_rules). The chosen
peer never stops training: the parameters it received are merged at its next step (dpwa's Rx/Tx threads).

The exchange (collab.modes.gossip_exchange) is a bidirectional stream: the asking peer sends a `Hello` (its clock,
recent loss, the exchange's random split u) and its parameters; the answering peer replies with its own. Both sides check what they got
(collab.modes.gossip_rules.check_peer_model: shapes, finite, not far off) and the claims (clock, loss) before merging;
what they refuse is counted and attributed like a bad averaging part (collab.records.rejections), and a peer caught with
hard evidence is never picked again. In a private run only members may ask or be asked (MembersOnly). Client-mode
(NAT'd) peers ask but are never asked: nobody can dial them.

The epoch still counts the swarm's samples (every training.target_batch_size of them, as in the other modes), so
--max-epochs, checkpoints and the dashboard mean what they mean elsewhere; no step waits for it.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import queue
import random
import time
import uuid
from collections import deque
from dataclasses import replace
from functools import partial
from typing import Optional

import torch
from hivemind.utils.mpfuture import MPFuture

from collab.averaging.compression import wire_codec
from collab.modes import ModeContext, ModeReport
from collab.modes.diloco import adamw_with_warmup
from collab.modes.gossip_exchange import MAX_WAITING, Busy, GossipAverager
from collab.modes.gossip_rules import FlowControl, Side, check_peer_model, claims_ok, interpolation, local_steps, sketch
from collab.modes.base import SwarmOptimizer
from collab.records.untrusted import progress_records

SNAPSHOT_EVERY = 1.0  # seconds: how stale the parameters this peer serves may get
PARTNERS_EVERY = 10.0  # seconds between re-reads of who is online
RECENT = 64  # merges kept in the summary
SETTLE_QUIET = 5.0  # seconds without a merge that end a leaving peer's settling


class GossipOptimizer(SwarmOptimizer):
    """The trainer's loop calls step() after each micro-batch: a local AdamW step (hivemind's use_local_updates),
    the merges that came in or came back, and, every K steps, a new exchange."""

    def __init__(self, *, settings, compression, seed: int, max_grad_norm: float, **kwargs):
        super().__init__(**kwargs)
        self.settings, self.seed, self.max_grad_norm = settings, seed, max_grad_norm
        self.rng = random.Random()  # each peer its own draws: peers picked and K must not be the same everywhere
        self.params = [p for group in self.state_averager.optimizer.param_groups for p in group["params"]]
        self.inbox = mp.Queue()
        self.gossip = GossipAverager(
            [p.detach().to("cpu", torch.float32, copy=True) for p in self.params], dht=self.dht,
            prefix=f"{self.run_id}_gossip", client_mode=self.client_mode, compression=compression, inbox=self.inbox,
            findings=self.rejections.queue, gate=self.gate, timeout=settings.exchange_timeout, start=True)
        self.flow = FlowControl(self.rng)
        self.steps_to_merge = local_steps(settings.mean_local_steps, self.rng)
        self.clock, self.loss = 0, None
        self.asking: Optional[tuple[str, str, float, MPFuture]] = None  # peer, exchange id, u, its future
        self.counts = dict(asked=0, answered=0, failed=0, busy=0, refused=0, merges=0)
        self.merges: deque = deque(maxlen=RECENT)  # the recent merges, newest last
        self._merge_times: deque = deque(maxlen=1000)
        self._snapshot_at = self._partners_at = float("-inf")
        self._partners: list[str] = []
        self.last_update_norm: Optional[float] = None
        self.settled: Optional[dict] = None  # at --max-epochs: how long it merged without training, and why it ended

    # -- the trainer's interface
    def step(self, *args, **kwargs):
        torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        result = super().step(*args, **kwargs)  # the local step; a new epoch label when the swarm's samples say so
        self.clock += self.batch_size_per_step
        self._merge_arrivals()
        self._finish_asking()
        self.steps_to_merge -= 1
        if self.steps_to_merge <= 0 and self.asking is None:
            self._start_asking()
        elif time.monotonic() - self._snapshot_at > SNAPSHOT_EVERY:
            self._refresh_snapshot()
        return result

    def observe_loss(self, loss: float) -> None:
        if math.isfinite(loss):
            self.loss = loss if self.loss is None else 0.9 * self.loss + 0.1 * loss
            self.gossip.loss.value = self.loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.params:
            param.grad = None

    def should_download_state(self) -> bool:
        return False  # a replica behind takes the swarm's epoch label and merges its way in: no download per step

    def settle_before_leaving(self, timeout: float) -> str:
        """At --max-epochs: no more training, but merges with the peers still here for up to
        averaging.gossip.settle_seconds, so that the replicas saved at the end are close. (Without it the peers
        that stop first leave the last ones nobody to merge with, and those train on apart from them.) Both sides
        of an exchange land on the same point under every rule but constant != 0.5, so a few exchanges of idle
        replicas bring them together; it ends after two merges in a row found the other replica, settling too,
        within settle_distance, or after SETTLE_QUIET s without a merge."""
        started = time.monotonic()
        deadline = started + self.settings.settle_seconds
        first = merges = self.counts["merges"]
        close, last_merge = 0, started
        self.gossip.settling.value = True
        self._refresh_snapshot()
        while time.monotonic() < deadline and not self.stop.is_set() and close < 2:
            self._merge_arrivals()
            self._finish_asking()
            if self.asking is None:
                self._start_asking()  # at once: no local steps in between
            if self.counts["merges"] != merges:
                for merge in list(self.merges)[-(self.counts["merges"] - merges):]:
                    # close to a replica that still trains is no end: it moves on, and the two would end apart
                    near = merge["distance"] < self.settings.settle_distance and merge["settling"]
                    close = close + 1 if near else 0
                merges, last_merge = self.counts["merges"], time.monotonic()
                self._refresh_snapshot()  # what this peer answers with: the merged replica
            if time.monotonic() - last_merge > SETTLE_QUIET:
                break  # nobody merged with us for a while: the others left (their records outlive them)
            self.stop.wait(0.02)
        self.settled = dict(seconds=round(time.monotonic() - started, 2), merges=self.counts["merges"] - first,
                            ended="close" if close >= 2 else "quiet" if time.monotonic() < deadline else "time")
        return "swarm"

    def apply_revocations(self, revocations) -> None:
        super().apply_revocations(revocations)
        if self.gossip.is_alive():
            self.gossip._outer_pipe.send(("_apply_revocations", [revocations], {}))

    def shutdown(self) -> None:
        try:
            if self.asking is not None:
                self.asking[3].cancel()
        finally:
            self.gossip.shutdown()
            super().shutdown()

    # -- exchanges
    def _refresh_snapshot(self) -> None:
        with torch.no_grad(), self.gossip.get_tensors() as snapshot:
            for slot, param in zip(snapshot, self.params):
                slot.copy_(param.detach())
        self.gossip.clock.value = self.clock
        self._snapshot_at = time.monotonic()

    def _partners_now(self) -> list[str]:
        # more often while the tracker counts peers this list lacks (the first seconds of a run, a newcomer)
        missing = len(self._partners) + 1 < self.tracker.global_progress.num_peers
        if time.monotonic() - self._partners_at > (1.0 if missing else PARTNERS_EVERY):
            self._partners_at = time.monotonic()
            try:
                records = progress_records(self.dht, self.run_id)
            except Exception:  # a DHT hiccup: ask from the last list
                return self._partners
            me = self.dht.peer_id.to_base58()
            self._partners = [peer for peer, record in records.items() if peer != me and not record.client_mode]
        return self._partners

    def _start_asking(self) -> None:
        peer = self.flow.pick(self._partners_now())
        if peer is None:
            return  # alone for now: ask again at the next step
        self._refresh_snapshot()
        exchange, u = uuid.uuid4().hex, self.rng.random()
        self.asking = (peer, exchange, u, self.gossip.exchange(peer, exchange, u))
        self.counts["asked"] += 1

    def _finish_asking(self) -> None:
        if self.asking is None or not self.asking[3].done():
            return
        peer, exchange, u, future = self.asking
        self.asking = None
        self.steps_to_merge = local_steps(self.settings.mean_local_steps, self.rng)
        try:
            mine, hello, tensors = future.result()
        except Busy:
            self.counts["busy"] += 1
            return
        except BaseException:  # a timeout, a peer that left, one that refused us
            self.counts["failed"] += 1
            self.flow.failed(peer)
            return
        if self._merge(peer, mine, hello, tensors, asked=True):
            self.flow.succeeded(peer)

    def _merge_arrivals(self) -> None:
        for _ in range(MAX_WAITING):
            try:
                peer, mine, hello, tensors = self.inbox.get_nowait()
            except queue.Empty:
                return
            with self.gossip.waiting.get_lock():
                self.gossip.waiting.value -= 1
            self.counts["answered"] += 1
            self._merge(peer, mine, hello, tensors, asked=False)

    @torch.no_grad()
    def _merge(self, peer: str, mine: dict, hello: dict, tensors: list, asked: bool) -> bool:
        """`mine`: what this peer said of itself in the exchange; both sides weigh the same pair of claims (and the
        same draw u), so their factors agree - with clock, loss and evolutionary, they add up to one."""
        if not claims_ok(hello.get("clock"), hello.get("loss")):
            return self._refuse(peer, "implausible clock or loss", hard=False)
        why, distance = check_peer_model([p.detach() for p in self.params], tensors, self.settings.max_distance)
        if why is not None:
            # far off is no proof of bad faith (a replica that trained alone a long while drifts): asked less often,
            # not banned. Not finite or the wrong shapes is: never asked again
            return self._refuse(peer, why, hard=not why.startswith("parameters too far"))
        u = mine["u"]
        a = interpolation(self.settings.interpolation, Side(mine["clock"], mine["loss"]),
                          Side(hello["clock"], hello["loss"]), constant=self.settings.constant, u=u,
                          divergence_threshold=self.settings.divergence_threshold)
        norm = math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in self.params)) or 1.0
        for param, theirs in zip(self.params, tensors):
            param.lerp_(theirs.to(param.device, param.dtype), a)
        self.clock = round((1 - a) * self.clock + a * hello["clock"])  # the merged model's age
        self.last_update_norm = a * distance * norm
        self._merge_times.append(time.monotonic())
        self.counts["merges"] += 1
        self.merges.append(dict(exchange=hello["exchange"], peer=peer, asked=asked, a=a, u=u, distance=distance,
                                settling=bool(hello.get("settling")),
                                update_norm=self.last_update_norm, epoch=self.local_epoch))
        return True

    def _refuse(self, peer: str, why: str, hard: bool) -> bool:
        self.counts["refused"] += 1
        self.rejections.queue.put((peer, why, "gossip"))
        if hard:
            self.flow.ban(peer)
        else:
            self.flow.failed(peer)
        return False

    # -- what is shown
    def merges_per_minute(self) -> float:
        now = time.monotonic()
        return float(sum(1 for t in self._merge_times if now - t < 60.0))

    def mode_report(self) -> ModeReport:
        return replace(super().mode_report(), gossip=self.report())

    def report(self) -> dict:
        """For the summary and the metrics record: counts, the recent merges, and this replica's sketch."""
        params = [p.detach() for p in self.params]
        return dict(**self.counts, merges_per_minute=self.merges_per_minute(),
                    last_update_norm=self.last_update_norm, clock=self.clock,
                    bytes_sent=self.gossip.bytes_sent.value, bytes_received=self.gossip.bytes_received.value,
                    param_norm=math.sqrt(sum(float(p.double().pow(2).sum()) for p in params)),
                    sketch=sketch(params, self.seed), recent=list(self.merges), settled=self.settled)


def optimizer_options(context: ModeContext) -> dict:
    """What averaging.mode gossip changes (collab.train.make_optimizer): hivemind's local updates (an AdamW step per
    micro-batch, no gradient averager), no state rounds, and the pairwise exchanges beside them."""
    config = context.config
    settings, training = config.averaging.gossip, config.training
    lr = settings.lr if settings.lr is not None else training.learning_rate
    return dict(
        optimizer_class=GossipOptimizer,
        settings=settings,
        compression=wire_codec(config.averaging.compression),
        seed=training.seed,
        max_grad_norm=training.max_grad_norm,
        use_local_updates=True,
        optimizer=partial(adamw_with_warmup, lr=lr, warmup_steps=settings.warmup_steps),
        scheduler=None,
        offload_optimizer=False,
        reuse_grad_buffers=False,
        delay_optimizer_step=False,
        delay_grad_averaging=False,
        grad_averager_factory=None,
        average_state_every=10**9,  # the merges are the averaging
    )
