"""`collab dashboard`: the run in a browser (collector -> cache -> page, JSON API, Prometheus)."""

from __future__ import annotations

import argparse
import math
import os
import stat
from functools import partial

from collab.commands.status import add_watcher_flags, watcher_swarm
from collab.errors import UserError
from collab.process.ports import require_free_port

# the dashboard (fastapi, uvicorn), hivemind, torch and psutil are imported inside run(): 'collab --help' and flag
# errors stay instant


def add_parser(sub) -> None:
    p = sub.add_parser("dashboard", help="serve the run's dashboard in a browser",
                       description="Join a run as a client, read every peer's records every few seconds, and serve "
                                   "the page (/), the JSON API (/api/run, one page of its peers with "
                                   "?offset=&limit=&sort=&order=, /api/history, /api/peers/ID), /metrics and /docs.")
    p.add_argument("--run-id", required=True)
    p.add_argument("--initial-peers", action="extend", nargs="+", required=True, metavar="MADDR",
                   help="multiaddr of any peer in the run")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000, help="port to serve on (default 8000)")
    p.add_argument("--fd", type=int, default=None, metavar="FD",
                   help="serve on this inherited listening socket instead of --host/--port (used by collab simulate "
                        "to serve on 127.0.0.1 from inside a network namespace)")
    p.add_argument("--interval", type=float, default=3.0, help="seconds between reads of the swarm (default 3)")
    p.add_argument("--forget-after", type=float, default=3600.0, metavar="SECONDS",
                   help="drop a peer's history once it has been gone this long (default 3600)")
    p.add_argument("--max-peers", type=int, default=None, metavar="N",
                   help="list and keep a history for at most this many peers, the most recently seen (default 2000); "
                        "the cards still count every peer")
    add_watcher_flags(p)
    p.set_defaults(run=run, hard_exit=True)


def run(args: argparse.Namespace) -> int:
    # flags first: a mistake is answered before hivemind and torch import (seconds)
    if args.fd is None:
        require_free_port(args.port, "--port", host=args.host)
    if not (math.isfinite(args.interval) and args.interval > 0):
        raise UserError(f"--interval {args.interval} must be a positive number of seconds, e.g. --interval 3")
    if not (math.isfinite(args.forget_after) and args.forget_after > 0):
        raise UserError(f"--forget-after {args.forget_after} must be a positive number of seconds, e.g. 3600")
    if args.max_peers is not None and args.max_peers < 1:
        raise UserError(f"--max-peers {args.max_peers} must be at least 1, e.g. --max-peers 2000")

    from collab.dashboard.collector import Collector
    from collab.dashboard.snapshot import MAX_PEERS
    from collab.dashboard.server import serve_forever
    from collab.process.lifecycle import reap_children
    from collab.swarm.node import peer_config_from_flags

    peer_config_from_flags(run_id=args.run_id, initial_peers=args.initial_peers)  # validates the flags
    collector = Collector(args.run_id, args.initial_peers, interval=args.interval, forget_after=args.forget_after,
                          max_peers=args.max_peers or MAX_PEERS, make_swarm=partial(watcher_swarm, args))
    if args.fd is not None:
        try:
            is_socket = stat.S_ISSOCK(os.fstat(args.fd).st_mode)
        except OSError:
            is_socket = False
        if not is_socket:
            raise UserError(f"--fd {args.fd} is not an open socket; pass a listening socket's descriptor, or use --port")
    where = f"inherited socket {args.fd}" if args.fd is not None else f"http://{args.host}:{args.port}/"
    print(f"Dashboard for run {args.run_id} at {where}", flush=True)
    try:
        serve_forever(collector, args.host, args.port, fd=args.fd)
    finally:
        reap_children()
    return 0
