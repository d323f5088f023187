"""averaging.mode gossip: no global batch. Each peer trains its replica on its own (AdamW, one step per
micro-batch); after K local steps, K ~ Poisson(averaging.gossip.mean_local_steps) (seed 000), it picks a random
peer and the two swap parameters in one exchange over hivemind's P2P. Each side then merges from its own view:
theta <- (1 - a) * theta + a * theta_peer, a from averaging.gossip.interpolation (collab.modes.gossip_rules). The chosen
peer never stops training: the parameters it received are merged at its next step (dpwa's Rx/Tx threads).

The exchange is a bidirectional stream: the asking peer sends a `Hello` (its clock, recent loss, the exchange's
random split u) and its parameters; the answering peer replies with its own. Both sides check what they got
(collab.modes.gossip_rules.check_peer_model: shapes, finite, not far off) and the claims (clock, loss) before merging;
what they refuse is counted and attributed like a bad averaging part (collab.records.rejections), and a peer caught with
hard evidence is never picked again. In a private run only members may ask or be asked (MembersOnly). Client-mode
(NAT'd) peers ask but are never asked: nobody can dial them.

The epoch still counts the swarm's samples (every training.target_batch_size of them, as in the other modes), so
--max-epochs, checkpoints and the dashboard mean what they mean elsewhere; no step waits for it.
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import multiprocessing as mp
import queue
import random
import time
import uuid
from collections import deque
from dataclasses import replace
from functools import partial
from typing import AsyncIterator, Optional

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import CompressionInfo
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming
from pydantic import BaseModel, ConfigDict, Field

from collab.averaging.compression import decode_part, wire_codec
from collab.averaging.members_only import MembersOnly
from collab.averaging.tidy_leave import LeavesNoSocketFile, ReadsWholeRequests
from collab.modes import ModeContext, ModeReport
from collab.modes.diloco import adamw_with_warmup
from collab.modes.gossip_rules import FlowControl, Side, check_peer_model, claims_ok, interpolation, local_steps, sketch
from collab.modes.base import SwarmOptimizer
from collab.records.untrusted import progress_records

CHUNK_BYTES = 2**20
MAX_WAITING = 4  # received parameters not yet merged: a peer asked by everyone at once answers "busy" beyond this
SNAPSHOT_EVERY = 1.0  # seconds: how stale the parameters this peer serves may get
PARTNERS_EVERY = 10.0  # seconds between re-reads of who is online
RECENT = 64  # merges kept in the summary
SETTLE_QUIET = 5.0  # seconds without a merge that end a leaving peer's settling
BUSY, REFUSED = b"busy", b"refused"  # an answer's first message instead of a Hello


class Hello(BaseModel):
    """The first message of each side of an exchange (its metadata). Untrusted: bounded here and in claims_ok."""

    model_config = ConfigDict(extra="forbid")
    exchange: str = Field(max_length=64)
    clock: int = Field(ge=0, le=10**15)
    loss: Optional[float] = Field(None, ge=0, le=1e6)
    u: float = Field(ge=0, le=1)
    tensors: int = Field(ge=0, le=100_000)
    settling: bool = False  # it has stopped training (collab.modes.gossip's settle_before_leaving)


class Incomplete(Exception):
    """The other side's stream ended before all its parameters came: an exchange that failed, nothing refused."""


class Busy(Exception):
    """The asked peer has too many merges waiting: try another one next time (not a failure of the peer)."""


class GossipAverager(LeavesNoSocketFile, ReadsWholeRequests, MembersOnly, DecentralizedAverager):
    """Runs in its own process (as hivemind's averagers do): serves this peer's parameter snapshot to peers that
    ask, and asks peers for theirs. Its averaged tensors are the snapshot; received parameters go to the trainer
    on `inbox` (answered exchanges) or through the asking call's future."""

    def __init__(self, snapshot, *, compression, inbox, findings, gate=None, timeout: float, **kwargs):
        self.gate, self.compression, self.inbox, self.findings, self.timeout = gate, compression, inbox, findings, timeout
        self.expected = [tuple(t.shape) for t in snapshot]
        self.max_bytes = 8 * sum(t.numel() for t in snapshot) + 2**20  # fp32 plus framing, with room
        self.clock, self.loss = mp.Value(ctypes.c_longlong, 0), mp.Value(ctypes.c_double, math.nan)
        self.waiting = mp.Value(ctypes.c_int, 0)
        self.settling = mp.Value(ctypes.c_bool, False)
        self.bytes_sent, self.bytes_received = mp.Value(ctypes.c_double, 0.0), mp.Value(ctypes.c_double, 0.0)
        super().__init__(snapshot, allow_state_sharing=False, **kwargs)

    def _hello(self, exchange: str, u: float) -> Hello:
        loss = self.loss.value
        return Hello(exchange=exchange, clock=self.clock.value, loss=None if math.isnan(loss) else loss, u=u,
                     tensors=len(self.expected), settling=self.settling.value)

    def _messages(self, hello: Hello) -> list[averaging_pb2.DownloadData]:
        with self.get_tensors() as tensors:  # the trainer refreshes it under the same lock
            parts = [part for t in tensors
                     for part in split_for_streaming(self.compression.compress(t, CompressionInfo.from_tensor(t)), CHUNK_BYTES)]
        messages = [averaging_pb2.DownloadData(tensor_part=part) for part in parts]
        if messages:
            messages[0].metadata = hello.model_dump_json().encode()
        else:
            messages = [averaging_pb2.DownloadData(metadata=hello.model_dump_json().encode())]
        self.bytes_sent.value += sum(m.ByteSize() for m in messages)
        return messages

    async def _receive(self, stream: AsyncIterator[averaging_pb2.DownloadData]) -> tuple[Hello, list[torch.Tensor]]:
        """The other side's hello and parameters, within bounds (a peer may send anything)."""
        hello, tensors, parts, size = None, [], [], 0
        async for message in stream:
            size += message.ByteSize()
            if size > self.max_bytes:
                raise ValueError("sent more than parameters of these shapes can take")
            if hello is None:
                if message.metadata == BUSY:
                    raise Busy()
                if message.metadata == REFUSED:
                    raise ValueError("refused by the peer")
                hello = Hello.model_validate_json(message.metadata)
            if message.tensor_part.dtype and parts:
                tensors.append(decode_part(combine_from_streaming(parts)))
                parts = []
            if message.HasField("tensor_part"):
                parts.append(message.tensor_part)
            if len(tensors) > len(self.expected):
                raise ValueError("sent more tensors than the model has")
        if parts:
            tensors.append(decode_part(combine_from_streaming(parts)))
        if hello is None or len(tensors) < hello.tensors or len(tensors) < len(self.expected):
            raise Incomplete()  # the stream ended early: a peer that left, a broken link
        self.bytes_received.value += size
        return hello, tensors

    async def rpc_gossip(self, stream: AsyncIterator[averaging_pb2.DownloadData], context: P2PContext
                         ) -> AsyncIterator[averaging_pb2.DownloadData]:
        peer = context.remote_id.to_base58()
        if not await self._allows(context.remote_id, "a gossip exchange"):
            yield averaging_pb2.DownloadData(metadata=REFUSED)
            return
        if self.waiting.value >= MAX_WAITING:
            yield averaging_pb2.DownloadData(metadata=BUSY)
            return
        try:
            hello, tensors = await asyncio.wait_for(self._receive(stream), self.timeout)
        except Exception as e:
            if not isinstance(e, (Incomplete, asyncio.TimeoutError)):
                self.findings.put((peer, f"malformed gossip exchange ({type(e).__name__})", "gossip"))
            yield averaging_pb2.DownloadData(metadata=REFUSED)
            return
        mine = self._hello(hello.exchange, hello.u)
        for message in self._messages(mine):
            yield message
        with self.waiting.get_lock():
            self.waiting.value += 1
        self.inbox.put((peer, mine.model_dump(), hello.model_dump(), tensors))

    async def _exchange(self, peer: str, exchange: str, u: float, future: MPFuture) -> None:
        try:
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)

            mine = self._hello(exchange, u)

            async def ask():
                for message in self._messages(mine):
                    yield message

            async def run():
                return await self._receive(await stub.rpc_gossip(ask()))

            hello, tensors = await asyncio.wait_for(run(), self.timeout)
            future.set_result((mine.model_dump(), hello.model_dump(), tensors))
        except BaseException as e:
            if not future.done():
                future.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))

    def exchange(self, peer: str, exchange: str, u: float) -> MPFuture:
        future = MPFuture()
        self._outer_pipe.send(("_exchange", [peer, exchange, u, future], {}))
        return future


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
