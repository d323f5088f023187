"""`collab simulate`: a whole swarm of real `collab join` peers on this machine, then a report."""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import threading
import uuid
from pathlib import Path

from collab.config import load_config, resolve_config_path
from collab.errors import UserError
from collab.peers.churn import ChurnSpec
from collab.peers.netns import NetworkError
from collab.peers.profiles import load_profile
from collab.process.ports import require_free_port

# the simulation's launcher and report (hivemind, torch, psutil) and collab.process.lifecycle (psutil) are imported
# inside run(), once the flags are checked: 'collab --help' and flag errors stay instant


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="run a local swarm of real peers and report on it",
                       description="Start N real `collab join` peers on this machine - on 127.0.0.1, or with "
                                   "--profile each in its own network namespace on a shaped link - let them train "
                                   "together, optionally crash/leave/freeze them (--churn), then print a report.")
    p.add_argument("--peers", type=int, default=2, metavar="N", help="number of peers (default 2)")
    p.add_argument("--config", default=None, help="run config for every peer (default: albert-tiny)")
    p.add_argument("--profile", default=None, metavar="NAME",
                   help="network profile: a shipped one (datacenter, home-broadband, mixed) or a YAML file; "
                        "needs root for namespaces and tc (default: 127.0.0.1, unshaped)")
    p.add_argument("--churn", default=None, metavar="ACTION:EVERY:DOWNTIME",
                   help="hit a random peer every EVERY s and bring it back after DOWNTIME s; ACTION is kill "
                        "(kill -9, restart), term (SIGTERM, restart) or stop (SIGSTOP, SIGCONT); e.g. kill:30:20")
    p.add_argument("--compile", default="off", choices=("auto", "on", "off"),
                   help="torch.compile each peer's model (default off: peers started together on one machine's cores "
                        "would spend longer compiling than a short simulation gains; auto: as collab join)")
    p.add_argument("--max-epochs", type=int, default=None, metavar="N",
                   help="stop at this global epoch (default 15, or none when --duration is given)")
    p.add_argument("--duration", type=float, default=None, metavar="S",
                   help="run for S seconds (default: until --max-epochs, at most 600 s)")
    p.add_argument("--workdir", type=Path, default=None, help="where peer logs and summaries go (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--dashboard-port", type=int, default=None, metavar="P",
                   help="serve the swarm's dashboard on 127.0.0.1:P while it runs")
    p.add_argument("--seed", type=int, default=0, help="seed of the churn's choice of peers (default 0)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.peers < 1:
        raise UserError(f"--peers {args.peers} must be at least 1")
    if args.max_epochs is not None and args.max_epochs < 1:
        raise UserError(f"--max-epochs {args.max_epochs} must be at least 1")
    if args.duration is not None and not (math.isfinite(args.duration) and args.duration > 0):
        raise UserError(f"--duration {args.duration} must be positive (seconds)")
    if args.dashboard_port is not None:
        require_free_port(args.dashboard_port, "--dashboard-port")
    churn = ChurnSpec.parse(args.churn) if args.churn else None
    if churn is not None and args.peers < 2:
        raise UserError("--churn needs --peers 2 or more (one peer always stays up)")
    profile = load_profile(args.profile) if args.profile else None
    config_path = resolve_config_path(Path(args.config) if args.config else None)
    load_config(config_path)  # fail here, once, rather than in every peer

    from collab.peers.launcher import LaunchError
    from collab.peers.simulation import Simulation, SimulationSpec
    from collab.process.lifecycle import StopOnSignal

    max_epochs = args.max_epochs if args.max_epochs is not None else (15 if args.duration is None else None)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="collab-simulate-"))
    # peers share this machine's cores: one torch thread each keeps them from fighting over them
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.peers)))
    spec = SimulationSpec(peers=args.peers, run_id=f"sim-{uuid.uuid4().hex[:8]}", workdir=workdir,
                          config_path=config_path, profile=profile, churn=churn,
                          duration=args.duration or 600.0, max_epochs=max_epochs,
                          dashboard_port=args.dashboard_port, env=env, seed=args.seed,
                          join_args=["--compile", args.compile])
    print(f"Starting {args.peers} peers for run {spec.run_id}", flush=True)
    stop = threading.Event()
    # Ctrl-C ends the run early and still prints the report; stopping peers and namespaces takes a while
    guard = StopOnSignal(stop, grace=90.0).install()
    try:
        report = Simulation(spec, say=lambda line: print(line, flush=True)).run(stop)
    except (LaunchError, NetworkError) as e:
        raise UserError(str(e).splitlines()[0]) from None
    finally:
        guard.cancel()
    print(report.to_json() if args.json else report.to_table(), flush=True)
    return 0
