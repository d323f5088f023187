"""`collab simulate`: a whole swarm of real `collab join` peers on this machine, then a report."""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import time
import uuid
from pathlib import Path
from typing import Optional


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="run a local swarm of real peers and report on it",
                       description="Start N real `collab join` peers on 127.0.0.1, let them train together until "
                                   "they reach --max-epochs (or --duration runs out), then print a report.")
    p.add_argument("--peers", type=int, default=2, metavar="N", help="number of peers (default 2)")
    p.add_argument("--config", default=None, help="run config for every peer (default: albert-tiny)")
    p.add_argument("--max-epochs", type=int, default=15, metavar="N", help="stop at this global epoch (default 15)")
    p.add_argument("--duration", type=float, default=600.0, metavar="S", help="stop after S seconds at most")
    p.add_argument("--workdir", type=Path, default=None, help="where peer logs and summaries go (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--dashboard-port", type=int, default=None, metavar="P",
                   help="serve the swarm's dashboard on 127.0.0.1:P while it runs")
    p.set_defaults(run=run)


def _start_dashboard(run_id: str, initial_peer: str, port: Optional[int]):
    if port is None:
        return None
    from dashboard.collector import Collector
    from dashboard.server import BackgroundDashboard

    dashboard = BackgroundDashboard(Collector(run_id, [initial_peer]), port=port).start()
    print(f"  dashboard: {dashboard.url}", flush=True)
    return dashboard


def _follow(swarm, duration: float) -> bool:
    """Wait for the peers to finish, printing one line whenever the swarm reaches a new epoch."""
    deadline, shown = time.monotonic() + duration, -1
    while time.monotonic() < deadline:
        if swarm.wait(timeout=2.0):
            return True
        progress = [_last_epoch_line(peer.log_text()) for peer in swarm.peers]
        epochs = [epoch for epoch, _ in filter(None, progress)]
        if epochs and max(epochs) > shown:
            shown = max(epochs)
            print("  " + "   ".join(f"peer {i}: {p[1]}" for i, p in enumerate(progress) if p), flush=True)
    return False


def _last_epoch_line(log: str) -> Optional[tuple[int, str]]:
    """(epoch, short text) from a peer's last per-epoch line, or None before its first."""
    lines = [line for line in log.splitlines() if line.startswith("epoch ")]
    if not lines:
        return None
    # "epoch 3 | peers 2 | local 14.1 samples/s | contributed 376 | averaging rounds 5 | loss 9.602"
    match = re.match(r"epoch (\d+) .*local ([\d.]+) samples/s .*averaging rounds (\d+) \| loss (\S+)", lines[-1])
    if not match:
        return None
    epoch, speed, rounds, loss = match.groups()
    return int(epoch), f"epoch {epoch}, {speed} samples/s, {rounds} rounds, loss {loss}"


def run(args: argparse.Namespace) -> int:
    from collab.config import load_config, resolve_config_path
    from collab.errors import UserError
    from peers.launcher import LaunchError, LocalSwarm
    from peers.report import build_report

    if args.peers < 1:
        raise UserError(f"--peers {args.peers} must be at least 1")
    if args.max_epochs < 1 or args.duration <= 0:
        raise UserError("--max-epochs and --duration must be positive")
    config_path = resolve_config_path(Path(args.config) if args.config else None)
    load_config(config_path)  # fail here, once, rather than in every peer
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="collab-simulate-"))
    run_id = f"sim-{uuid.uuid4().hex[:8]}"
    print(f"Starting {args.peers} peers for run {run_id}; logs in {workdir}", flush=True)
    # peers share 2 cores here: one torch thread each keeps them from fighting over them
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.peers)))
    started = time.monotonic()
    with LocalSwarm(args.peers, run_id, workdir, ["--config", str(config_path), "--max-epochs", str(args.max_epochs)]) as swarm:
        try:
            swarm.start()
            print(f"Peer 0 started the swarm at {swarm.initial_peer}; watch it with:\n"
                  f"  collab status --run-id {run_id} --initial-peers {swarm.initial_peer}", flush=True)
            dashboard = _start_dashboard(run_id, swarm.initial_peer, args.dashboard_port)
            try:
                finished = _follow(swarm, args.duration)
            finally:
                if dashboard is not None:
                    dashboard.stop()
        except LaunchError as e:
            raise UserError(str(e)) from None
        if not finished:
            print(f"--duration {args.duration:.0f} s reached: stopping the peers", flush=True)
        swarm.stop()
        report = build_report(swarm, time.monotonic() - started)
    print(report.to_json() if args.json else report.to_table(), flush=True)
    return 0
