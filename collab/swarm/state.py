"""The run state: one JSON object built from every peer's records in the DHT.

`collab status --json` and the dashboard's `GET /api/run` both return `RunState`. Global
progress follows hivemind's ProgressTracker: the global epoch is the highest epoch among
non-client peers, and only peers at that epoch count toward the target batch.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Optional

from pydantic import BaseModel

from collab.adaptive.batch_plan import efficiency
from collab.adaptive.noise_scale import WINDOW
from collab.modes.gossip_rules import SKETCH_SIZE, spread_from_mean
from collab.records.metrics import PeerMetricsRecord, metrics_key
from collab.records.shared_reads import recent_or_new
from collab.records.untrusted import LATE_PART, Rejections, accept, drop_implausible_epochs, read_progress, signed_values


class PeerState(BaseModel):
    peer_id: str
    role: str
    client_mode: bool
    samples_per_second: float
    epoch: int
    loss: Optional[float]
    samples_contributed: int
    contribution: float  # share of all samples contributed by current peers, 0..1
    samples_accumulated: int  # toward the current epoch's target
    bandwidth_mbps: Optional[float]
    rounds_joined: int
    rounds_failed: int
    last_seen: float  # seconds since the peer last published
    online: bool
    straggler: bool  # online but an epoch or more behind, or under a quarter of the median speed
    straggler_reason: Optional[str] = None  # "compute: ..." or "link: ..." (or "behind: ...") for a straggler
    batches_dropped: int = 0  # its own micro-batches it did not send (non-finite loss or gradients)
    mb_per_round: Optional[float] = None  # sent + received per gradient round, as it counted them
    fewer_bytes_than_fp32: Optional[float] = None  # how many times fewer than the same rounds uncompressed
    inner_steps: Optional[int] = None  # diloco: this peer's inner steps toward the coming outer step
    pseudo_gradient_norm: Optional[float] = None  # diloco: the norm of the last pseudo-gradient it sent
    merges_per_minute: Optional[float] = None  # gossip: its merges in the last minute
    merge_update_norm: Optional[float] = None  # gossip: how far its last merge moved its replica
    distance_to_mean: Optional[float] = None  # gossip: its replica's distance to the replicas' mean, relative to
    # the mean's norm, estimated from the peers' sketches (collab.modes.gossip_rules.spread_from_mean)
    contributions_rejected: int = 0  # what other peers refused from it (collab.records.rejections), summed over them
    rejected_by_reason: dict[str, int] = {}
    reported_by: int = 0  # how many other peers refused something from it
    suspect: bool = False  # reported by at least half of the other peers (one peer's word is not enough)
    data_start: Optional[float] = None  # where it entered the run's shards, and windows read since (collab.data.order)
    data_position: Optional[int] = None


class RunState(BaseModel):
    run_id: str
    mode: str = "sync"  # averaging.mode, as the peers' records say (an epoch is an outer step in diloco)
    replica_spread: Optional[float] = None  # gossip: the largest distance_to_mean among online peers
    # the gradient noise scale B_noise, in samples: the online peers' smoothed tr(Sigma) over their |G|^2 (pooled:
    # collab.adaptive.noise_scale), and how many peers measured it
    noise_scale: Optional[float] = None
    noise_scale_peers: int = 0
    noise_scale_rounds: int = 0  # the rounds behind it, summed over those peers
    # the run's batch plan (collab.adaptive.batch_plan), as most online peers follow it: AdaScale's learning-rate gain,
    # the schedule's scale-invariant progress (steps of base_batch_size) and its length; goodput (Pollux): the
    # samples/s times their statistical efficiency (B_noise + base) / (B_noise + target), i.e. samples/s as
    # worth at the base batch; and the time until the schedule's end, at the swarm's current pace
    lr_gain: Optional[float] = None
    progress_steps: Optional[float] = None
    total_steps: Optional[int] = None
    base_batch_size: Optional[int] = None
    efficiency: Optional[float] = None
    goodput: Optional[float] = None
    eta_to_end_seconds: Optional[float] = None
    global_epoch: int
    samples_accumulated: int
    target_batch_size: Optional[int]
    samples_per_second: float
    eta_seconds: Optional[float]
    num_peers: int
    num_clients: int
    rejected_records: int  # other peers' records dropped as untrusted input (collab.records.untrusted)
    rejected_by_reason: dict[str, int] = {}
    rejected_by_signer: dict[str, int] = {}  # the 20 signers with the most, by the peer id of their key
    peers: list[PeerState]
    time: float


def read_run_state(dht, run_id: str, stale_after: float = 120.0) -> RunState:
    """One snapshot of the run, from this node's DHT (any node: a trainer, a client, the dashboard)."""
    now = time.time()
    rejected = Rejections()
    progress = read_progress(dht, run_id, rejected, now)
    records = accept(signed_values(recent_or_new(dht, metrics_key(run_id))), PeerMetricsRecord.parse_obj,
                     lambda record: record.peer_id, rejected, now)
    records = drop_implausible_epochs(records, rejected, now, reference={**records, **progress})

    trainers = [p for p in progress.values() if not p.client_mode] or list(progress.values())
    global_epoch = max((p.epoch for p in trainers), default=max((r.epoch for r in records.values()), default=0))
    accumulated = sum(p.samples_accumulated for p in progress.values() if p.epoch == global_epoch)
    throughput = sum(p.samples_per_second for p in progress.values())
    targets = Counter(r.target_batch_size for r in records.values())
    target = targets.most_common(1)[0][0] if targets else None
    eta = max(0.0, target - accumulated) / throughput if target and throughput > 0 else None
    total_contributed = sum(r.samples_contributed for r in records.values()) or 1

    peers = []
    for peer_id in sorted(set(progress) | set(records)):
        p, r = progress.get(peer_id), records.get(peer_id)
        seen = max(p.time if p else 0.0, r.time if r else 0.0)
        peers.append(PeerState(
            peer_id=peer_id,
            role=r.role if r else ("client" if p and p.client_mode else "trainer"),
            client_mode=r.client_mode if r else bool(p and p.client_mode),
            samples_per_second=p.samples_per_second if p else (r.samples_per_second if r else 0.0),
            epoch=max(p.epoch if p else 0, r.epoch if r else 0),
            loss=r.loss if r else None,
            samples_contributed=r.samples_contributed if r else 0,
            contribution=(r.samples_contributed / total_contributed) if r else 0.0,
            samples_accumulated=p.samples_accumulated if p and p.epoch == global_epoch else 0,
            bandwidth_mbps=r.bandwidth_mbps if r else None,
            rounds_joined=r.rounds_joined if r else 0,
            rounds_failed=r.rounds_failed if r else 0,
            last_seen=max(0.0, now - seen),
            online=now - seen < stale_after,
            straggler=False,
            batches_dropped=r.batches_dropped if r else 0,
            mb_per_round=r.mb_per_round if r else None,
            fewer_bytes_than_fp32=r.fewer_bytes_than_fp32 if r else None,
            inner_steps=r.inner_steps if r else None,
            pseudo_gradient_norm=r.pseudo_gradient_norm if r else None,
            merges_per_minute=r.merges_per_minute if r else None,
            merge_update_norm=r.merge_update_norm if r else None,
            data_start=r.data_start if r else None,
            data_position=r.data_position if r else None,
        ))
    _estimate_spread(peers, records)
    _flag_suspects(peers, records)
    _flag_stragglers(peers, global_epoch)  # after: a link straggler is told by the late parts others reported
    modes = Counter(r.mode for r in records.values())
    online = {p.peer_id for p in peers if p.online}
    live = [r for peer, r in records.items() if peer in online]
    noise_scale, measured = pooled_noise_scale(live)
    return RunState(
        run_id=run_id,
        mode=modes.most_common(1)[0][0] if modes else "sync",
        noise_scale=noise_scale,
        noise_scale_peers=measured,
        noise_scale_rounds=noise_rounds(live),
        **adaptive_progress(live, noise_scale, target, throughput),
        replica_spread=max((p.distance_to_mean for p in peers if p.online and p.distance_to_mean is not None),
                           default=None),
        global_epoch=global_epoch,
        samples_accumulated=accumulated,
        target_batch_size=target,
        samples_per_second=throughput,
        eta_seconds=eta,
        num_peers=len(progress),
        num_clients=sum(p.client_mode for p in progress.values()),
        rejected_records=rejected.total,
        rejected_by_reason=dict(rejected.by_reason),
        rejected_by_signer=dict(rejected.by_signer.most_common(20)),
        peers=peers,
        time=now,
    )


def adaptive_progress(records, noise_scale: Optional[float], target: Optional[int], throughput: float) -> dict:
    """RunState's plan fields from the online peers' records (the most common values: one peer may lie)."""
    def common(name):
        values = Counter(getattr(r, name) for r in records if getattr(r, name, None) is not None)
        return values.most_common(1)[0][0] if values else None

    gain, total, base = common("lr_gain"), common("total_steps"), common("base_batch_size")
    positions = sorted(r.progress_steps for r in records if r.progress_steps is not None)
    progress = positions[len(positions) // 2] if positions else None  # the median: one record cannot move it
    fields = dict(lr_gain=gain, progress_steps=progress, total_steps=total, base_batch_size=base)
    if base is None or not target:
        return fields
    if noise_scale is not None:
        fields["efficiency"] = efficiency(noise_scale, base, target)
        fields["goodput"] = throughput * fields["efficiency"]
    if progress is not None and total and throughput > 0:  # an epoch every target/throughput s, gain steps each
        fields["eta_to_end_seconds"] = max(0.0, total - progress) * target / (throughput * (gain or 1.0))
    return fields


def pooled_noise_scale(records) -> tuple[Optional[float], int]:
    """B_noise from the peers' smoothed estimates: their tr(Sigma) over their |G|^2, each averaged over the peers
    weighted by the rounds behind it, up to the smoothing's window (each peer's own ratio is much noisier:
    collab.adaptive.noise_scale), and how many peers had one."""
    measured = [(r.noise_signal, r.noise_trace, _rounds(r))
                for r in records if r.noise_signal is not None and r.noise_trace is not None]
    if not measured:
        return None, 0
    total = sum(n for _, _, n in measured)
    signal = sum(s * n for s, _, n in measured) / total
    trace = sum(t * n for _, t, n in measured) / total
    return (trace / signal if signal > 0 and trace > 0 else None), len(measured)


def _rounds(record) -> int:
    """The rounds a record's estimate stands for, as a reader counts them: at most the smoothing's window (a
    record may claim any number)."""
    return min(WINDOW, max(1, getattr(record, "noise_rounds", None) or 1))


def noise_rounds(records) -> int:
    return sum(_rounds(r) for r in records if r.noise_signal is not None and r.noise_trace is not None)


SPREAD_FRESH_SECONDS = 30.0


def _estimate_spread(peers: list[PeerState], records: dict) -> None:
    """gossip: each online peer's distance to the mean replica, from the sketches of equal length they published."""
    # a peer publishes every 10 s: a sketch older than 3 of those is a peer that left (kill -9 leaves its last
    # record "online" for 2 minutes), and its stale replica would widen the spread of those still merging
    sketches = {p.peer_id: records[p.peer_id].param_sketch for p in peers
                if p.online and p.last_seen < SPREAD_FRESH_SECONDS and p.peer_id in records and records[p.peer_id].param_sketch is not None
                and len(records[p.peer_id].param_sketch) == SKETCH_SIZE}
    distances = spread_from_mean(sketches) if len(sketches) >= 2 else {}
    for p in peers:
        p.distance_to_mean = distances.get(p.peer_id)


LATE_PARTS_FOR_LINK = 3  # late parts (as others reported them) that mark a peer whose link holds rounds up


def _flag_stragglers(peers: list[PeerState], global_epoch: int) -> None:
    online = [p for p in peers if p.online]
    speeds = sorted(p.samples_per_second for p in online if p.role == "trainer")
    median = speeds[len(speeds) // 2] if speeds else 0.0
    for p in online:
        if p.role != "trainer":
            continue
        slow = median > 0 and p.samples_per_second < 0.25 * median
        # others left its parts out of their rounds because they came too late: its uplink holds them up
        late = sum(n for reason, n in p.rejected_by_reason.items() if reason.startswith(LATE_PART))
        behind = p.epoch < global_epoch - 1
        # (the reports are totals over the run: late in a quarter of its rounds or more, not once long ago)
        lagging_link = late >= LATE_PARTS_FOR_LINK and late >= 0.25 * max(1, p.rounds_joined + p.rounds_failed)
        p.straggler = behind or slow or lagging_link
        if slow:
            p.straggler_reason = (f"compute: {p.samples_per_second:.1f} samples/s, under a quarter of the median "
                                  f"{median:.1f}")
        elif lagging_link:
            p.straggler_reason = f"link: its parts came too late for {late} of the others' rounds"
        elif behind:
            p.straggler_reason = f"behind: epoch {p.epoch}, the swarm's {global_epoch}, at a normal compute speed"


def _flag_suspects(peers: list[PeerState], records: dict) -> None:
    """Each peer's record says what it refused from whom; a reporter may lie, so a peer is a suspect only when
    at least half of the others (one, in a pair) have refused something from it - other than a part that came too
    late, which a slow link explains."""
    by_id = {p.peer_id: p for p in peers}
    for reporter, record in records.items():
        for accused, reasons in record.rejected.items():
            peer = by_id.get(accused)
            if peer is None or accused == reporter:
                continue
            if any(not reason.startswith(LATE_PART) for reason in reasons):  # a slow link is not foul play
                peer.reported_by += 1
            for reason, count in reasons.items():
                peer.contributions_rejected += count
                peer.rejected_by_reason[reason] = peer.rejected_by_reason.get(reason, 0) + count
    others = max(1, len(records) - 1)
    for peer in peers:
        peer.suspect = peer.reported_by > 0 and peer.reported_by >= others / 2
