"""What a peer publishes: one signed, schema-checked metrics record per peer, refreshed every epoch.

The wire schema uses pydantic.v1 because hivemind's SchemaValidator is built on it; the DHT
drops a record that fails it (or the signature) before it reaches any reader. Readers re-check
anyway (a peer may run another collab version) and count what they reject.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Dict, Literal, Optional

from hivemind.dht.schema import BytesWithPublicKey
from hivemind.utils.timed_storage import get_dht_time
from pydantic import v1 as pydantic

from collab import __version__

METRICS_SUFFIX = "_metrics"
PROGRESS_SUFFIX = "_progress"  # written by hivemind's ProgressTracker
_LARGE = 1e9
LOSS_BOUNDS = (0.0, 1e6)  # PeerMetricsRecord.loss: what every reader accepts
MAX_PEERS_IN_RECORD = 16  # PeerMetricsRecord.rejected: peers named, and reasons each
MAX_REASONS_PER_PEER = 8


class PeerMetricsRecord(pydantic.BaseModel):
    """One peer's view of itself. Bounds reject absurd values (NaN, negative, 1e30) at the schema."""

    peer_id: pydantic.constr(min_length=1, max_length=128, strict=True)
    role: Literal["trainer", "auxiliary", "monitor"]
    version: pydantic.constr(max_length=32, strict=True) = __version__
    epoch: pydantic.conint(ge=0, le=10**9, strict=True)
    loss: Optional[pydantic.confloat(ge=LOSS_BOUNDS[0], le=LOSS_BOUNDS[1], strict=True)]
    samples_per_second: pydantic.confloat(ge=0, le=_LARGE, strict=True)
    samples_contributed: pydantic.conint(ge=0, le=10**15, strict=True)
    target_batch_size: pydantic.conint(gt=0, le=10**9, strict=True)
    client_mode: pydantic.StrictBool
    bandwidth_mbps: Optional[pydantic.confloat(gt=0, le=_LARGE, strict=True)]
    rounds_joined: pydantic.conint(ge=0, strict=True)
    rounds_failed: pydantic.conint(ge=0, strict=True)
    last_group_size: pydantic.conint(ge=0, le=100_000, strict=True)
    time: pydantic.confloat(ge=0, strict=True)
    # what this peer kept from the swarm (collab.train.guard) and refused from others (collab.records.rejections)
    batches_dropped: pydantic.conint(ge=0, le=10**15, strict=True) = 0
    # gradient rounds' traffic as this peer's all-reduce counted it (collab.averaging.traffic), over its recent rounds
    mb_per_round: Optional[pydantic.confloat(ge=0, le=1e6, strict=True)] = None
    fewer_bytes_than_fp32: Optional[pydantic.confloat(gt=0, le=1e6, strict=True)] = None
    # averaging.mode diloco (collab.modes.diloco): inner steps this outer step, and the last pseudo-gradient's norm
    mode: Literal["sync", "diloco", "gossip"] = "sync"
    inner_steps: Optional[pydantic.conint(ge=0, le=10**12, strict=True)] = None
    pseudo_gradient_norm: Optional[pydantic.confloat(ge=0, le=1e12, strict=True)] = None
    # averaging.mode gossip (collab.modes.gossip): merges in the last minute, the last merge's update norm, and this
    # replica's norm and count sketch (collab.modes.gossip_rules.sketch: readers estimate the replicas' spread from it)
    merges_per_minute: Optional[pydantic.confloat(ge=0, le=1e6, strict=True)] = None
    merge_update_norm: Optional[pydantic.confloat(ge=0, le=1e12, strict=True)] = None
    param_norm: Optional[pydantic.confloat(ge=0, le=1e12, strict=True)] = None
    param_sketch: Optional[pydantic.conlist(pydantic.confloat(ge=-1e12, le=1e12, strict=True), max_items=64)] = None
    # the gradient noise scale's smoothed |G|^2 and tr(Sigma) from this peer's rounds, each per unit of its rounds'
    # averaged |g|^2 (collab.adaptive.noise_scale): readers pool the peers' (their ratio is B_noise)
    noise_signal: Optional[pydantic.confloat(ge=-1e12, le=1e12, strict=True)] = None
    noise_trace: Optional[pydantic.confloat(ge=-1e12, le=1e12, strict=True)] = None
    noise_rounds: Optional[pydantic.conint(ge=0, le=10**12, strict=True)] = None  # rounds behind the two
    # the run's batch plan as this peer follows it (collab.adaptive.batch_plan): AdaScale's gain, the schedule's
    # scale-invariant progress, and the base batch and length it is measured in (readers: goodput and the ETA)
    lr_gain: Optional[pydantic.confloat(ge=1, le=1e6, strict=True)] = None
    progress_steps: Optional[pydantic.confloat(ge=0, le=1e12, strict=True)] = None
    base_batch_size: Optional[pydantic.conint(gt=0, le=10**9, strict=True)] = None
    total_steps: Optional[pydantic.conint(gt=0, le=10**12, strict=True)] = None
    # the run's token shards (collab.data.feed): where this peer entered the ring of shards and how many windows it has
    # read; with the manifest's shard list, anyone can list the text it trained on (collab.data.order)
    data_start: Optional[pydantic.confloat(ge=0, lt=1, strict=True)] = None
    data_position: Optional[pydantic.conint(ge=0, le=10**15, strict=True)] = None
    rejected: Dict[pydantic.constr(max_length=128, strict=True),
                   Dict[pydantic.constr(max_length=160, strict=True), pydantic.conint(ge=0, le=10**12, strict=True)]] = {}

    class Config:
        extra = pydantic.Extra.forbid

    @pydantic.validator("rejected")
    def _bounded(cls, value):
        if len(value) > MAX_PEERS_IN_RECORD or any(len(reasons) > MAX_REASONS_PER_PEER for reasons in value.values()):
            raise ValueError(f"at most {MAX_PEERS_IN_RECORD} peers and {MAX_REASONS_PER_PEER} reasons each")
        return value


class MetricsSchema(pydantic.BaseModel):
    """The run's DHT keys ({run_id}_metrics, {run_id}_manifest): each value under the key of the peer that signed it."""

    metrics: Dict[BytesWithPublicKey, Optional[PeerMetricsRecord]]
    manifest: Dict[BytesWithPublicKey, Optional[pydantic.conbytes(max_length=256 * 1024)]]  # collab.run.sharing


@dataclass
class AveragingLog:
    """Outcomes of gradient-averaging rounds, as hivemind returned them (group sizes), not log text."""

    joined: int = 0
    failed: int = 0
    last_group_size: int = 0
    group_sizes: list[int] = field(default_factory=list)
    groups: list[dict] = field(default_factory=list)  # each successful round: {"epoch": e, "peers": [peer ids]}
    failed_by_reason: dict[str, int] = field(default_factory=dict)  # why the failed rounds failed, in a few words
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def success(self, group: list[str], epoch: int = -1) -> None:
        with self._lock:
            self.joined += 1
            self.last_group_size = len(group)
            self.group_sizes.append(len(group))
            self.groups.append({"epoch": epoch, "peers": sorted(group)})

    def failure(self, reason: str) -> None:
        with self._lock:
            self.failed += 1
            self.failed_by_reason[reason] = self.failed_by_reason.get(reason, 0) + 1

    def copy_to(self, summary) -> None:
        """Into a trainer Summary (rounds_joined, rounds_failed, group_sizes)."""
        with self._lock:
            summary.rounds_joined, summary.rounds_failed = self.joined, self.failed
            summary.group_sizes = list(self.group_sizes)
            summary.groups = [dict(group) for group in self.groups]
            summary.rounds_failed_by_reason = dict(self.failed_by_reason)


def metrics_key(run_id: str) -> str:
    return run_id + METRICS_SUFFIX


_said_out_of_bounds: set[str] = set()


def loss_for_record(loss: Optional[float]) -> Optional[float]:
    """The loss as the record carries it: one outside the schema's bounds (NaN, a diverging task's 1e7, a
    misconfigured task's negative loss) is published as missing - a peer must never crash on its own
    metrics - and said once in the peer's log, not at every epoch."""
    if loss is None:
        return None
    low, high = LOSS_BOUNDS
    if math.isfinite(loss) and low <= loss <= high:
        return float(loss)
    if "loss" not in _said_out_of_bounds:
        _said_out_of_bounds.add("loss")
        print(f"warning: loss {loss!r} is outside what a metrics record carries ({low:g} to {high:g}); it is published "
              "as missing (the task diverged or is misconfigured: check the learning rate and the data)", flush=True)
    return None


def rate_for_record(value: float) -> float:
    """A throughput for the record: hivemind's estimate can be inf or NaN before its first measurement."""
    return float(value) if math.isfinite(value) and 0 <= value <= _LARGE else 0.0


def publish(dht, run_id: str, public_key: bytes, record: PeerMetricsRecord, expiration: float) -> None:
    """Store without waiting: a slow DHT must never stall training."""
    dht.store(
        key=metrics_key(run_id),
        subkey=public_key,
        value=record.dict(),
        expiration_time=get_dht_time() + expiration,
        return_future=True,
    )
