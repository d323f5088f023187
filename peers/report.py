"""The end-of-simulation report, from each peer's exit summary (written by `collab join --summary-json`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from peers.launcher import LocalSwarm


@dataclass
class PeerReport:
    index: int
    peer_id: str
    start_epoch: int
    final_epoch: int
    samples_contributed: int
    rounds_joined: int
    rounds_failed: int
    mean_group_size: Optional[float]
    first_loss: Optional[float]
    last_loss: Optional[float]
    loaded_state_from_peers: bool
    exit: str


@dataclass
class SwarmReport:
    run_id: str
    duration_seconds: float
    epochs_reached: int
    epochs_per_minute: float
    peers: list[PeerReport]

    @property
    def loss_fell(self) -> bool:
        pairs = [(p.first_loss, p.last_loss) for p in self.peers if p.first_loss is not None and p.last_loss is not None]
        return bool(pairs) and all(last < first for first, last in pairs)

    def to_json(self) -> str:
        from dataclasses import asdict

        return json.dumps(dict(asdict(self), loss_fell=self.loss_fell), indent=1)

    def to_table(self) -> str:
        rows = [("peer", "id", "epochs", "samples", "rounds ok/failed", "group", "loss first -> last", "exit")]
        for p in self.peers:
            loss = f"{p.first_loss:.3f} -> {p.last_loss:.3f}" if p.first_loss is not None and p.last_loss else "-"
            group = f"{p.mean_group_size:.1f}" if p.mean_group_size else "-"
            rows.append((str(p.index), p.peer_id[-10:], f"{p.start_epoch}->{p.final_epoch}", str(p.samples_contributed),
                         f"{p.rounds_joined}/{p.rounds_failed}", group, loss, p.exit))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
        lines.append(f"swarm: reached epoch {self.epochs_reached} in {self.duration_seconds:.0f} s "
                     f"({self.epochs_per_minute:.1f} epochs/min); loss fell on every peer: {'yes' if self.loss_fell else 'no'}")
        return "\n".join(lines)


def build_report(swarm: LocalSwarm, duration: float) -> SwarmReport:
    peers = []
    for peer in swarm.peers:
        code = peer.popen.returncode if peer.popen is not None else None
        exit_text = "not started" if peer.popen is None else ("running" if code is None else f"exit {code}")
        try:
            s = json.loads(peer.summary_path.read_text())
        except (OSError, ValueError):
            peers.append(PeerReport(peer.index, "?", 0, 0, 0, 0, 0, None, None, None, False, exit_text + ", no summary"))
            continue
        losses = [v for _, v in sorted((int(k), v) for k, v in s["loss_by_epoch"].items())]
        sizes = s["group_sizes"]
        peers.append(PeerReport(
            index=peer.index, peer_id=s["peer_id"], start_epoch=s["start_epoch"], final_epoch=s["final_epoch"],
            samples_contributed=s["samples_contributed"], rounds_joined=s["rounds_joined"],
            rounds_failed=s["rounds_failed"], mean_group_size=sum(sizes) / len(sizes) if sizes else None,
            first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None,
            loaded_state_from_peers=s["loaded_state_from_peers"], exit=f"{exit_text}, {s['exit_reason']}",
        ))
    reached = max((p.final_epoch for p in peers), default=0)
    return SwarmReport(swarm.run_id, duration, reached, reached / max(duration, 1e-9) * 60, peers)
