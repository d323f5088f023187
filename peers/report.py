"""The end-of-simulation report: per-peer outcomes from each incarnation's summary, the swarm's rate.

Peers write their summary (collab join --summary-json) at every epoch and at exit, so even a peer
killed with SIGKILL leaves what it had done by its last epoch.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

from collab.modes.gossip_rules import spread_from_mean
from collab.records.metrics import PROGRESS_SUFFIX
from collab.peers.launcher import LocalSwarm, PeerProcess


@dataclass
class PeerReport:
    index: int
    peer_id: str
    link: str
    incarnations: int
    start_epoch: int
    final_epoch: int
    samples_contributed: int
    rounds_joined: int
    rounds_failed: int
    mean_group_size: Optional[float]
    first_loss: Optional[float]
    last_loss: Optional[float]
    loaded_state_from_peers: bool
    bytes_sent: Optional[int]
    bytes_received: Optional[int]
    nonfinite_parameters: list[str]
    exit: str
    # share of its time in the training loop spent computing micro-batches (the rest: waiting on rounds, downloads)
    compute_utilization: Optional[float] = None
    train_seconds: Optional[float] = None  # its time in the training loop (not start-up, the wait for peers, leaving)
    allreduce_mb_per_round: Optional[float] = None  # what its gradient all-reduces sent + received, per round
    fewer_bytes_than_fp32: Optional[float] = None
    loss_epochs: int = 0  # epochs with a loss from this peer (a peer restarted in the last seconds has one or two)
    merges: Optional[int] = None  # gossip: parameter merges it made (asked and answered)
    final_sketch: Optional[list] = None  # gossip: its replica's count sketch at the end (collab.modes.gossip_rules)
    # per gradient round: seconds finding the group, seconds in the all-reduce (collab.averaging.traffic)
    matchmaking_seconds: Optional[float] = None
    allreduce_seconds: Optional[float] = None
    # what its DHT node sent the swarm, per minute: requests, and KB sent + received (collab.swarm.dht_traffic)
    dht_requests_per_minute: Optional[float] = None
    dht_kb_per_minute: Optional[float] = None
    # of the records its DHT node read, the share answered from memory, not checked again (collab.records.verdicts)
    records_remembered: Optional[float] = None
    # the progress key's reads (every peer's record, each read): KB a minute, and the share of its readers' asks
    # answered by a read under way or just made, without a walk (collab.records.shared_reads)
    progress_read_kb_per_minute: Optional[float] = None
    progress_reads_shared: Optional[float] = None
    # of the reads it made, the share that asked the key's nearest nodes, not a walk; the records such a read found,
    # and the live records the last walk had found that it missed (collab.records.shared_reads.NearestReads)
    progress_reads_from_nearest: Optional[float] = None
    records_per_nearest_read: Optional[float] = None
    records_missed_per_nearest_read: Optional[float] = None
    # its tracker's reads of the progress key that found no record at all while others trained: failed reads, which
    # the last read stood in for (collab.modes.tracker.FOUND_NOTHING_KEPT)
    progress_reads_found_nothing: int = 0
    rounds_failed_by_reason: dict = field(default_factory=dict)  # collab.modes.round_failures.round_failure
    rounds_replayed: int = 0  # failed rounds it then applied from a peer that made them (averaging.round_replay)
    state_rounds: dict = field(default_factory=dict)  # state rounds: ok, given_up, failed; "peers": group sizes summed
    # epoch -> a sketch of its replica as that epoch began (collab.train.summary.sketch_replica), the last epochs
    replica_sketches: dict = field(default_factory=dict)


MIN_LOSS_EPOCHS = 3


def aligned(rows: list) -> list[str]:
    """Rows of cells (a header first) as lines of left-aligned columns, two spaces apart."""
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in cells]


@dataclass
class SwarmReport:
    run_id: str
    network: str
    duration_seconds: float
    epochs_reached: int
    epochs_per_minute: float
    peers: list[PeerReport]
    warnings: list[str] = field(default_factory=list)
    churn_events: list[dict] = field(default_factory=list)

    @property
    def replica_spread(self) -> Optional[float]:
        """gossip: the largest distance of a final replica from the replicas' mean, relative to its norm."""
        sketches = {str(p.index): p.final_sketch for p in self.peers if p.final_sketch}
        return max(spread_from_mean(sketches).values()) if len(sketches) >= 2 else None

    @property
    def spread_by_epoch(self) -> dict[int, float]:
        """At the start of each epoch that two peers or more reported: the furthest replica's distance from the
        replicas' mean, relative to the mean's norm (estimated from sketches; exactly 0 when they were equal)."""
        by_epoch: dict[int, dict[str, list]] = {}
        for p in self.peers:
            for epoch, values in p.replica_sketches.items():
                by_epoch.setdefault(int(epoch), {})[str(p.index)] = values
        return {epoch: max(spread_from_mean(sketches).values())
                for epoch, sketches in sorted(by_epoch.items()) if len(sketches) >= 2}

    @property
    def loss_fell(self) -> bool:
        """Loss fell on every peer that trained MIN_LOSS_EPOCHS epochs or more. A peer restarted near the end
        has a loss or two from a few micro-batches of 8 samples: noise (a churn run's 7.314 -> 7.319 from 32)."""
        pairs = [(p.first_loss, p.last_loss) for p in self.peers
                 if p.first_loss is not None and p.last_loss is not None and p.loss_epochs >= MIN_LOSS_EPOCHS]
        return bool(pairs) and all(last < first for first, last in pairs)

    @property
    def any_nonfinite(self) -> bool:
        return any(p.nonfinite_parameters for p in self.peers)

    def to_json(self) -> str:
        return json.dumps(dict(asdict(self), loss_fell=self.loss_fell, any_nonfinite=self.any_nonfinite,
                               replica_spread=self.replica_spread, spread_by_epoch=self.spread_by_epoch), indent=1)

    def to_table(self) -> str:
        rows = [("peer", "id", "link", "epochs", "samples", "compute", "rounds ok/failed", "group", "sent/recv MB",
                 "MB/round", "loss first -> last", "exit")]
        for p in self.peers:
            loss = f"{p.first_loss:.3f} -> {p.last_loss:.3f}" if p.first_loss is not None and p.last_loss else "-"
            group = f"{p.mean_group_size:.1f}" if p.mean_group_size else "-"
            traffic = f"{p.bytes_sent / 1e6:.1f}/{p.bytes_received / 1e6:.1f}" if p.bytes_sent is not None else "-"
            compute = f"{p.compute_utilization:.0%}" if p.compute_utilization is not None else "-"
            per_round = "-" if p.allreduce_mb_per_round is None else f"{p.allreduce_mb_per_round:.3g}" + (
                f" ({p.fewer_bytes_than_fp32:.1f}x)" if p.fewer_bytes_than_fp32 else "")
            rows.append((str(p.index), p.peer_id[-10:], p.link, f"{p.start_epoch}->{p.final_epoch}",
                         str(p.samples_contributed), compute, f"{p.rounds_joined}/{p.rounds_failed}", group, traffic,
                         per_round, loss, p.exit))
        lines = aligned(rows)
        lines.append(f"network: {self.network}")
        lines += [f"warning: {w}" for w in self.warnings]
        if self.churn_events:
            hit = [e["peer"] for e in self.churn_events if e["action"] in ("kill", "term", "stop")]
            lines.append(f"churn: {len(hit)} hits on {len(set(hit))} of {len(self.peers)} peers, "
                         f"{len(self.churn_events) - len(hit)} brought back")
        if any(p.merges is not None for p in self.peers):
            spread = self.replica_spread
            lines.append(f"gossip: {sum(p.merges or 0 for p in self.peers)} merges; at the end the replicas were within "
                         + (f"{spread:.2%} of their mean (estimated from sketches)" if spread is not None else "? of "
                            "their mean (fewer than two replicas reported)"))
        spreads = self.spread_by_epoch
        if spreads:
            worst = max(spreads, key=spreads.get)
            lines.append(f"replicas: at the start of epochs {min(spreads)}-{max(spreads)} at most {spreads[worst]:.2g} "
                         f"of their norm from their mean (epoch {worst}; estimated from sketches)")
        lines.append(f"swarm: reached epoch {self.epochs_reached} in {self.duration_seconds:.0f} s "
                     f"({self.epochs_per_minute:.2f} epochs/min while training); "
                     f"loss fell on every peer that trained {MIN_LOSS_EPOCHS}+ epochs: {'yes' if self.loss_fell else 'no'}; "
                     f"NaN/inf parameters: {'YES' if self.any_nonfinite else 'none'}")
        return "\n".join(lines)


class EpochTimeline:
    """(time, highest epoch any peer reached), sampled from the summaries while the swarm runs.

    The rate is taken from the first epoch change on, so start-up (importing torch, joining the
    DHT) is not counted as slow training.
    """

    def __init__(self, swarm: LocalSwarm):
        self.swarm = swarm
        self.samples: list[tuple[float, int]] = []

    def sample(self) -> int:
        epoch = max((_read(path).get("final_epoch", 0) for peer in self.swarm.peers
                     for path in peer.summary_paths()), default=0)
        self.samples.append((time.monotonic(), epoch))
        return epoch

    def epochs_per_minute(self) -> float:
        first_epoch = self.samples[0][1] if self.samples else 0
        moving = [(t, e) for t, e in self.samples if e > first_epoch]
        if len(moving) < 2:
            return 0.0
        (t0, e0), (t1, e1) = moving[0], moving[-1]
        return (e1 - e0) / max(t1 - t0, 1e-9) * 60


def _read(path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _exit_text(peer: PeerProcess, last: dict) -> str:
    if peer.popen is None:
        return "not started"
    code = peer.popen.returncode
    if code is None:
        return "running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    reason = last.get("exit_reason", "no summary")
    return f"exit {code} ({reason})"


def _add_up(counts) -> dict:
    total: dict = {}
    for count in counts:
        for key, n in count.items():
            total[key] = total.get(key, 0) + n
    return total


def peer_report(peer: PeerProcess, link: str, counters: Optional[dict], hits: int) -> PeerReport:
    summaries = [s for s in (_read(p) for p in peer.summary_paths()) if s]
    last = summaries[-1] if summaries else {}
    losses = [v for s in summaries for _, v in sorted((int(k), v) for k, v in s.get("loss_by_epoch", {}).items())]
    sizes = [size for s in summaries for size in s.get("group_sizes", [])]
    exit_text = _exit_text(peer, last)
    trained = sum(s.get("train_seconds", 0.0) for s in summaries)
    rounds = sum(s.get("rounds_joined", 0) + s.get("rounds_failed", 0) for s in summaries)
    moved = sum(s.get("allreduce_bytes_sent", 0) + s.get("allreduce_bytes_received", 0) for s in summaries)
    fp32 = sum(s.get("allreduce_fp32_bytes", 0.0) for s in summaries)
    if hits:
        exit_text += f"; hit by churn {hits}x, started {peer.starts}x"
    timed = [s["round_seconds"] for s in summaries if s.get("round_seconds", {}).get("rounds")]
    timed_rounds = sum(t["rounds"] for t in timed)
    dht = [s["dht"] for s in summaries if s.get("dht", {}).get("seconds")]
    dht_minutes = sum(d["seconds"] for d in dht) / 60
    return PeerReport(
        index=peer.index, peer_id=peer.peer_id, link=link, incarnations=peer.starts,
        start_epoch=summaries[0].get("start_epoch", 0) if summaries else 0,
        # the furthest any incarnation got: one restarted in the last seconds and stopped while starting up
        # reports epoch 0, which is not how far this peer trained
        final_epoch=max((s.get("final_epoch", 0) for s in summaries), default=0),
        samples_contributed=sum(s.get("samples_contributed", 0) for s in summaries),
        rounds_joined=sum(s.get("rounds_joined", 0) for s in summaries),
        rounds_failed=sum(s.get("rounds_failed", 0) for s in summaries),
        rounds_failed_by_reason=_add_up(s.get("rounds_failed_by_reason", {}) for s in summaries),
        rounds_replayed=sum(s.get("rounds_replayed", 0) for s in summaries),
        state_rounds=_add_up(s.get("state_rounds", {}) for s in summaries),
        mean_group_size=sum(sizes) / len(sizes) if sizes else None,
        first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None, loss_epochs=len(losses),
        loaded_state_from_peers=any(s.get("loaded_state_from_peers") for s in summaries),
        bytes_sent=counters["bytes_sent"] if counters else None,
        bytes_received=counters["bytes_received"] if counters else None,
        nonfinite_parameters=sorted({n for s in summaries for n in s.get("nonfinite_parameters", [])}),
        exit=exit_text,
        compute_utilization=sum(s.get("compute_seconds", 0.0) for s in summaries) / trained if trained > 0 else None,
        train_seconds=trained or None,
        allreduce_mb_per_round=moved / rounds / 1e6 if rounds and moved else None,
        fewer_bytes_than_fp32=fp32 / moved if moved else None,
        merges=sum(s["gossip"].get("merges", 0) for s in summaries if s.get("gossip")) if last.get("gossip") else None,
        final_sketch=last.get("gossip", {}).get("sketch") or None,
        matchmaking_seconds=sum(t["matchmaking"] for t in timed) / timed_rounds if timed_rounds else None,
        allreduce_seconds=sum(t["allreduce"] for t in timed) / timed_rounds if timed_rounds else None,
        dht_requests_per_minute=sum(d["requests"] for d in dht) / dht_minutes if dht_minutes else None,
        dht_kb_per_minute=(sum(d["bytes_sent"] + d["bytes_received"] for d in dht) / 1e3 / dht_minutes
                           if dht_minutes else None),
        records_remembered=_remembered_share([d["records"] for d in dht if d.get("records")]),
        progress_read_kb_per_minute=(sum(row["bytes"] for d in dht for key, row in d.get("by_key", {}).items()
                                         if key.endswith(PROGRESS_SUFFIX)) / 1e3 / dht_minutes
                                     if dht_minutes else None),
        progress_reads_shared=_shared_share([d["shared_reads"] for d in dht if d.get("shared_reads")]),
        **_reads_made([d["shared_reads"] for d in dht if d.get("shared_reads")]),
        progress_reads_found_nothing=sum(s.get("progress_reads", {}).get("found_nothing", 0) for s in summaries),
        # a later incarnation's sketch of an epoch replaces an earlier one's
        replica_sketches={epoch: values for s in summaries for epoch, values in s.get("replica_sketches", {}).items()},
    )


def _shared_share(counts: list) -> Optional[float]:
    asked = sum(c["walked"] + c["served"] + c["joined"] for c in counts)
    return sum(c["served"] + c["joined"] for c in counts) / asked if asked else None


def _reads_made(counts: list) -> dict:
    """Of the reads a peer's shared stream made (collab.records.shared_reads.NearestReads): the share from the
    key's nearest nodes, and per such read the records it found and those it missed."""
    nearest = sum(c.get("from_nearest", 0) for c in counts)
    walks = sum(c.get("full_walks", 0) for c in counts)
    return dict(
        progress_reads_from_nearest=nearest / (nearest + walks) if nearest + walks else None,
        records_per_nearest_read=sum(c.get("records_from_nearest", 0) for c in counts) / nearest if nearest else None,
        records_missed_per_nearest_read=(sum(c.get("records_missed", 0) for c in counts) / nearest
                                         if nearest else None),
    )


def _remembered_share(counts: list) -> Optional[float]:
    seen = sum(c["checked"] + c["remembered"] for c in counts)
    return sum(c["remembered"] for c in counts) / seen if seen else None


def build_report(swarm: LocalSwarm, duration: float, timeline: Optional[EpochTimeline] = None,
                 links: Optional[list] = None, counters: Optional[list] = None, network: str = "127.0.0.1",
                 warnings: list[str] = (), churn_events: list = ()) -> SwarmReport:
    events = [asdict(e) for e in churn_events]
    peers = [peer_report(peer, links[peer.index].describe() if links else "-",
                         counters[peer.index] if counters else None,
                         sum(e["peer"] == peer.index and e["action"] in ("kill", "term", "stop") for e in events))
             for peer in swarm.peers]
    reached = max((p.final_epoch for p in peers), default=0)
    if timeline is not None and timeline.epochs_per_minute() > 0:
        rate = timeline.epochs_per_minute()
    else:
        rate = reached / max(duration, 1e-9) * 60
    return SwarmReport(swarm.run_id, network, duration, reached, rate, peers, list(warnings), events)
