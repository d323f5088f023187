"""Bytes on the wire, per averaging round, as this peer's all-reduce really sent and received them.

Every message of a round passes through the runner: the parts this peer sends to each reducer and the
averages they send back, and, as a reducer, the parts it receives and the averages it returns. Their protobuf
sizes are counted (the payload libp2p carries, without its own framing), with the number of values they held.
A round's fp32 equivalent is what the same values cost uncompressed, scaled for a codec that sends fewer values
than the gradient holds (PowerSGD's factors): 4 bytes x values moved x gradient size / values all-reduced.

The averager runs in its own process: a finished round goes to the trainer on a multiprocessing queue
(TrafficLog), which sums the runs of one round (PowerSGD has two) and keeps the recent rounds.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from hivemind.proto import averaging_pb2

from collab.hivemind_hooks.allreduce import RunnerHooks

RECENT_ROUNDS = 16


def _values(message: averaging_pb2.AveragingData) -> int:
    if not message.HasField("tensor_part"):
        return 0
    count = 1
    for dim in message.tensor_part.size:
        count *= dim
    return count


class CountingRunner(RunnerHooks):
    """hivemind's all-reduce runner, counting what it sends and receives in both roles."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.bytes_sent = self.bytes_received = self.values_moved = 0

    def _count(self, message: averaging_pb2.AveragingData, sent: bool) -> averaging_pb2.AveragingData:
        size = message.ByteSize()
        if sent:
            self.bytes_sent += size
        else:
            self.bytes_received += size
        self.values_moved += _values(message)
        return message

    async def _counted(self, stream: AsyncIterator, sent: bool) -> AsyncIterator:
        async for message in stream:
            yield self._count(message, sent)

    async def parts_for_peer(self, peer_index: int):
        async for message in super().parts_for_peer(peer_index):
            yield self._count(message, sent=True)

    def replies_from(self, stream, peer_index: int):
        return self._counted(super().replies_from(stream, peer_index), sent=False)

    async def reduce_stream(self, stream, sender_index: int):
        async for message in super().reduce_stream(self._counted(stream, sent=False), sender_index):
            yield self._count(message, sent=True)


@dataclass
class RoundTraffic:
    bytes_sent: int = 0
    bytes_received: int = 0
    fp32_bytes: float = 0.0  # the same round uncompressed (see the module's docstring)
    # seconds: the search that found the round's group (hivemind's matchmaking), and its all-reduce (both runs of
    # PowerSGD's round); counted where the averager's process ran an all-reduce
    matchmaking_seconds: float = 0.0
    allreduce_seconds: float = 0.0
    # collab.adaptive.noise_scale's inputs, from a gradient round this peer accepted: its own gradient's squared norm
    # and samples, the average's and the samples it stands for (None where this peer reduced no part: client mode)
    norms: Optional[tuple[float, float, float, Optional[float]]] = None

    @property
    def ratio(self) -> Optional[float]:
        """How many times fewer bytes than fp32 this round moved (None for a round that moved nothing)."""
        moved = self.bytes_sent + self.bytes_received
        return self.fp32_bytes / moved if moved else None


class TrafficLog:
    """Rounds' traffic, put by the averager's process and summed per round by the trainer."""

    def __init__(self, context: Optional[mp.context.BaseContext] = None):
        self.queue = (context or mp.get_context()).Queue()
        self.total = RoundTraffic()
        self.recent: list[RoundTraffic] = []
        self.rounds = 0  # rounds that moved bytes
        self._lock = threading.Lock()

    @staticmethod
    def put(traffic_queue, runner: CountingRunner, values_all_reduced: int, gradient_values: int,
            seconds: tuple[float, float] = (0.0, 0.0)) -> None:
        """From the averager's process, after each run of a round (whatever its outcome); `seconds`: its group's
        matchmaking and this run's all-reduce."""
        if traffic_queue is None or values_all_reduced <= 0:
            return
        fp32 = 4.0 * runner.values_moved * gradient_values / values_all_reduced
        try:
            traffic_queue.put_nowait((runner.bytes_sent, runner.bytes_received, fp32, *map(float, seconds)))
        except (OSError, ValueError, queue.Full):  # closed at shutdown: nothing to count any more
            pass

    @staticmethod
    def put_norms(traffic_queue, own_sq: float, own_samples, average_sq: float, group_samples) -> None:
        """From the averager's process, after a gradient round it accepted."""
        if traffic_queue is None or not own_samples:
            return
        try:
            traffic_queue.put_nowait(("norms", float(own_sq), float(own_samples), float(average_sq),
                                      None if group_samples is None else float(group_samples)))
        except (OSError, ValueError, queue.Full):
            pass

    def end_round(self, wait: float = 0.0, norms_wait: float = 0.0) -> Optional[RoundTraffic]:
        """Sum what the round's runs put (called by the trainer once the round is over); None if nothing moved.
        `wait`: how long the first report may take to arrive (a queue's put reaches the other end a bit later);
        `norms_wait`: how long the round's norms may take after it (they are put once the round is applied)."""
        this = RoundTraffic()
        while True:
            if this.norms is None and norms_wait > 0 and this.bytes_sent + this.bytes_received > 0:
                wait, norms_wait = norms_wait, 0.0
            try:
                sent, received, fp32, *rest = self.queue.get(timeout=wait) if wait > 0 else self.queue.get_nowait()
                wait = 0.0
            except queue.Empty:
                break
            except (OSError, ValueError, EOFError):
                break
            if sent == "norms":
                this.norms = (received, fp32, *rest)
                continue
            this.bytes_sent += int(sent)
            this.bytes_received += int(received)
            this.fp32_bytes += float(fp32)
            if len(rest) == 2:
                this.matchmaking_seconds = max(this.matchmaking_seconds, float(rest[0]))
                this.allreduce_seconds += float(rest[1])
        if not this.bytes_sent and not this.bytes_received:
            return None
        with self._lock:
            self.total.bytes_sent += this.bytes_sent
            self.total.bytes_received += this.bytes_received
            self.total.fp32_bytes += this.fp32_bytes
            self.total.matchmaking_seconds += this.matchmaking_seconds
            self.total.allreduce_seconds += this.allreduce_seconds
            self.rounds += 1
            self.recent = [*self.recent, this][-RECENT_ROUNDS:]
        return this

    def copy_to(self, summary) -> None:
        """Into a trainer Summary: the totals of every round so far, and the recent rounds' rate."""
        with self._lock:
            summary.allreduce_bytes_sent, summary.allreduce_bytes_received = self.total.bytes_sent, self.total.bytes_received
            summary.allreduce_fp32_bytes = self.total.fp32_bytes
            summary.round_seconds = {"rounds": self.rounds, "matchmaking": round(self.total.matchmaking_seconds, 3),
                                     "allreduce": round(self.total.allreduce_seconds, 3)}
        summary.allreduce_recent_mb_per_round, summary.allreduce_recent_fewer_than_fp32 = self.per_round()

    def per_round(self) -> tuple[Optional[float], Optional[float]]:
        """(MB moved per round, sent plus received, over the recent rounds; x fewer bytes than fp32)."""
        with self._lock:
            rounds = list(self.recent)
        if not rounds:
            return None, None
        moved = sum(r.bytes_sent + r.bytes_received for r in rounds)
        return moved / len(rounds) / 1e6, (sum(r.fp32_bytes for r in rounds) / moved if moved else None)
