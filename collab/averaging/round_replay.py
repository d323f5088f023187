"""A gradient round a peer missed, replayed from a peer that made it: catching up without a full download.

A peer that reaches an epoch's end after the others have averaged it (it was starved of CPU, stalled, or its
download of the swarm's state landed just as the swarm's round began) finds nobody left to average with
(collab.modes.round_failures.NobodyLeftToJoin). Before, it stepped on its own gradients and then downloaded the
whole state (parameters and the optimizer's statistics: three times the model for LAMB or Adam), and a peer whose
download takes an epoch missed the next round the same way. The others' step to the next epoch was their round's average
applied to the parameters and optimizer state this peer still holds (it was in sync at this epoch), so that average
alone, one model's worth, makes the same step here: the replica is the swarm's again with no download.

Each plain gradient averager keeps a copy of the last average it applied (one model's worth of shared memory) with
the epoch it ended, and serves it to whoever asks (`rpc_download_round`; in a private run, members only). The peer
that missed the round asks peers whose records show the next epoch, checks what it gets (the shapes, finite, a norm
at most NORM_RATIO times the gradients it computed itself) and applies it as the round's average. A peer that is out
of sync, or finds no peer to give it, steps on its own gradients and re-syncs as before. PowerSGD and DGC keep
per-peer error feedback that a replayed average would leave wrong: they re-sync by download, as before. A peer among
the few of a split round answers with the members of its group instead (`note_few`; collab.averaging.split_rounds):
the askers learn when no group won the round, and stop waiting for it. A donor sends the members of the group that
made its round too: a peer that replays it takes that group as the one it stepped with, so it plans the next round's
leader from the same set as the many (collab.averaging.planned_leader.on_the_swarms_step; from its own few's group it
had planned another, and the round split again). A peer that a live reducer left out of its group's round asks its
groupmates the same way (collab.averaging.left_out), and the round it gets must agree with the parts it did get.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.logging import get_logger
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from collab.averaging.left_out import disagreement
from collab.averaging.state_download import DIAL_TIMEOUT  # a stream to one peer opens as a state download's does

NORM_RATIO = 10.0  # a replayed average may be at most this many times the norm of this peer's own gradients
ASK_AT_MOST = 3  # peers asked before the replay is given up (then: own step and a download, as before)
STOP_LOOK = 0.25  # seconds between two looks, while a round is fetched, at whether this peer is leaving
logger = get_logger(__name__)


@dataclass
class RoundAnswers:
    """What the peers asked for a round answered: the round, from the first that had it; and the groups that the
    few of that round among them claimed (untrusted: collab.averaging.split_rounds checks them)."""

    round: Optional[tuple[str, list]] = None  # (donor base58, tensors)
    group: object = None  # the members of the group that made that round, as its donor says (untrusted)
    fews: list = field(default_factory=list)  # (donor base58, the members it claims for its group)
    refused: list = field(default_factory=list)  # (donor base58, why): rounds that disagreed with this peer's parts


class ServedRounds:
    """A GradientAverager mixin: keeps the last average the trainer applied and serves it (`rpc_download_round`).
    `prepare_served_round` must run before hivemind's constructor starts the averager's process."""

    serves_rounds = True

    def prepare_served_round(self, parameters, replays: bool = True) -> None:
        """`replays`: whether the trainer replays rounds it missed or was left out of (not under overlap=full,
        whose rounds end a step later)."""
        self.replays_rounds = replays
        self._served = [torch.zeros_like(p, device="cpu").share_memory_() for p in parameters]
        self._served_epoch = mp.Value("i", -1, lock=False)  # -1: nothing (being) kept
        self._few_note = None  # (the averager's process) (epoch, members) of the last round this peer was a few of
        self._served_group = None  # (the averager's process) (epoch, members) of the group that made the round kept
        self._partial = None  # (the averager's process) (epoch, tensors, got) of a round this peer was left out of

    # -- in the trainer's process -------------------------------------------------------------------------

    @torch.no_grad()
    def keep_round(self, epoch: int, group=()) -> None:
        """The averaged buffers hold the round that ended `epoch`, about to be applied: keep a copy to serve, with
        `group` (base58), the members of the group that made it."""
        self._served_epoch.value = -1  # a reader mid-copy sees the epoch change and sends nothing
        with self.get_tensors() as averaged:
            for kept, tensor in zip(self._served, averaged):
                kept.copy_(tensor)
        self._served_epoch.value = epoch
        if group:
            self._outer_pipe.send(("_note_served_group", [], dict(epoch=epoch, members=sorted(group))))

    def adopt_step_group(self, epoch: int, group) -> None:
        """This peer's step of `epoch` was the round of `group` (base58), replayed: plan the next round from it."""
        self._outer_pipe.send(("_adopt_step_group", [], dict(epoch=epoch, members=sorted(group))))

    def note_few(self, epoch: int, members: list[str]) -> None:
        """This peer's round of `epoch` gathered only a few of the peers (`members`, base58): say so to its askers."""
        self._outer_pipe.send(("_note_few", [], dict(epoch=epoch, members=list(members))))

    def fetch_round(self, epoch: int, donors: list[str], timeout: float,
                    stop: Optional[threading.Event] = None) -> Optional[RoundAnswers]:
        """The round that ended `epoch`, from the first of `donors` (base58) that has it, and what the few among them
        said of their groups; None at once when `stop` is set (a leaving peer: at the end of a 32-peer run the donors,
        leaving too, took up to a dial timeout each, and 5 peers overran their leave's grace)."""
        future = MPFuture()
        self._outer_pipe.send(("_fetch_round", [], dict(epoch=epoch, donors=donors[:ASK_AT_MOST], timeout=timeout,
                                                         future=future)))
        deadline = time.monotonic() + (timeout + DIAL_TIMEOUT) * ASK_AT_MOST + 5
        while stop is None or not stop.is_set():
            try:
                return future.result(timeout=max(0.0, min(STOP_LOOK, deadline - time.monotonic())))
            except FutureTimeout:
                if time.monotonic() >= deadline:
                    raise
        return None

    @torch.no_grad()
    def load_replayed_(self, tensors: list[torch.Tensor]) -> None:
        with self.get_tensors() as averaged:
            for buffer, tensor in zip(averaged, tensors):
                buffer.copy_(tensor)

    # -- in the averager's process ------------------------------------------------------------------------

    async def rpc_download_round(self, _request: averaging_pb2.DownloadRequest, context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if getattr(self, "gate", None) is not None and not await self._allows(context.remote_id, "a round's average"):
            return
        epoch, few = self._served_epoch.value, self._few_note
        tensors = [t.clone() for t in self._served] if epoch >= 0 else []
        if epoch >= 0 and self._served_epoch.value != epoch:  # the trainer kept a newer round meanwhile
            return
        if epoch < 0 and few is None:
            return
        group = self._served_group[1] if self._served_group is not None and self._served_group[0] == epoch else None
        metadata = self.serializer.dumps(dict(epoch=epoch, few=dict(epoch=few[0], members=few[1]) if few else None,
                                              group=group))
        if not tensors:  # nothing kept: only the note of the few
            yield averaging_pb2.DownloadData(metadata=metadata)
        for tensor in tensors:
            for part in split_for_streaming(serialize_torch_tensor(tensor, runtime_pb2.CompressionType.NONE)):
                yield averaging_pb2.DownloadData(tensor_part=part, metadata=metadata or b"")
                metadata = None

    def keep_partial_round(self, epoch: int, tensors: list, got: list) -> None:
        """(the averager's process) What this peer got of `epoch`'s round before a reducer left it out: a replayed
        round must agree with it where `got` (collab.averaging.left_out.disagreement); None: nothing kept."""
        self._partial = (epoch, tensors, got) if epoch is not None else None

    async def _note_few(self, epoch: int, members: list[str]) -> None:
        self._few_note = (epoch, members)

    async def _note_served_group(self, epoch: int, members: list[str]) -> None:
        self._served_group = (epoch, members)

    async def _adopt_step_group(self, epoch: int, members: list[str]) -> None:
        # (collab.averaging.round_plans: the group of the round before an epoch's names who may lead it)
        self._last_group, self._averaged_epoch = frozenset(members), epoch

    async def _fetch_round(self, epoch: int, donors: list[str], timeout: float, future: MPFuture) -> None:
        answers = RoundAnswers()
        partial = self._partial if self._partial is not None and self._partial[0] == epoch else None
        try:
            for donor in filter(self._may_give_a_round, donors):
                try:
                    got, few = await self._ask_for_round(PeerID.from_base58(donor), timeout, epoch)
                except Exception as e:  # a donor that left, or does not answer: ask the next
                    logger.debug(f"No round from {donor}: {type(e).__name__}: {e}")
                    continue
                if isinstance(few, dict) and few.get("epoch") == epoch:
                    answers.fews.append((donor, few.get("members")))
                if got is not None and got[0] == epoch:
                    why = disagreement(got[1], partial[1], partial[2]) if partial is not None else None
                    if why is not None:
                        answers.refused.append((donor, why))
                        continue
                    answers.round, answers.group = (donor, got[1]), got[2]
                    return
        finally:
            if not future.done():
                future.set_result(answers)

    def _may_give_a_round(self, donor: str) -> bool:
        """Not a peer outside a private run's members, nor one this averager has banned (caught poisoning a round)."""
        gate = getattr(self, "gate", None)
        if gate is not None and gate.access.verdict(donor) != "member":
            return False
        banned = getattr(self, "banned", None)
        try:
            return banned is None or not banned(PeerID.from_base58(donor))
        except Exception:  # not a peer id
            return False

    async def _ask_for_round(self, peer: PeerID, timeout: float, epoch: int
                             ) -> tuple[Optional[tuple[int, list, object]], object]:
        """((epoch, tensors, its group) of the round `peer` kept, when it is `epoch`'s; or None), and its note of the
        few."""
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await asyncio.wait_for(stub.rpc_download_round(averaging_pb2.DownloadRequest()), DIAL_TIMEOUT)
        metadata, parts, tensors, received, few = None, [], [], 0, None
        most = 2 * sum(t.numel() * t.element_size() for t in self._served) + 2**20  # the model's bytes, and slack
        async for message in aiter_with_timeout(stream, timeout=timeout):
            received += len(message.tensor_part.buffer) + len(message.metadata)
            if received > most or len(tensors) > len(self._served):
                return None, few  # more than this model holds: not a round of this run (nor read to its end)
            if message.metadata:
                metadata = self.serializer.loads(message.metadata)
                few = metadata.get("few") if isinstance(metadata, dict) else None
                if not isinstance(metadata, dict) or metadata.get("epoch") != epoch:
                    return None, few  # another round (the donor is not there yet, or past it): not read to its end
            if message.tensor_part.dtype and parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
            parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        if not isinstance(metadata, dict) or type(metadata.get("epoch")) is not int:
            return None, few
        return (metadata["epoch"], tensors, metadata.get("group")), few


def what_is_wrong(tensors: list, like: list[torch.Tensor], own: Optional[list[torch.Tensor]]) -> Optional[str]:
    """Why a replayed round's average may not be applied (None: it may). `like`: this peer's averaged buffers; `own`:
    the gradients this peer computed for the round, when it still has them."""
    if len(tensors) != len(like) or any(not isinstance(t, torch.Tensor) or t.shape != o.shape
                                        for t, o in zip(tensors, like)):
        return "an average of the wrong shape"
    if not all(bool(torch.isfinite(t).all()) for t in tensors):
        return "an average that is not finite"
    norm = float(torch.stack([t.float().norm() for t in tensors]).norm())
    if norm == 0.0:
        return "an average of zeros"
    if own:
        own_norm = float(torch.stack([t.float().norm() for t in own]).norm())
        if own_norm > 0 and norm > NORM_RATIO * own_norm:
            return f"an average {norm / own_norm:.3g}x the norm of this peer's own gradients"
    return None
