"""The `collab` command: one module per subcommand in collab/commands/.

Every user error ends as one line on stderr and exit code 2; nothing prints a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Optional, Sequence

from collab.errors import InternalError, UserError
from collab.reaper import watch_this_process


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line that names it and points at --help."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message}; see '{self.prog} --help'\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    from collab.commands import dashboard, init, invite, join, revoke, simulate, status
    from collab.commands import id as id_command

    parser = OneLineParser(prog="collab", description="Train one model together over the internet.")
    parser.add_argument("--version", action="version", version=f"collab {__import__('collab').__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for module in (init, join, id_command, invite, revoke, status, dashboard, simulate):
        module.add_parser(sub)
    return parser


def _remember_early_signals() -> threading.Event:
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    return stop


def set_process_defaults() -> None:
    """Settings hivemind reads when it is imported: set before that (peers.forkserver imports it ahead)."""
    # hivemind logs every matchmaking step at INFO; a volunteer needs the progress bar, not that
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    # hivemind shares tensors between its processes through files by default, which starts a
    # torch_shm_manager that can outlive the peer; file descriptors need no manager process
    os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")


def timestamp_own_logs() -> None:
    """collab's own log lines (a re-sync, a round given up, a donor staying on) carry the time, as hivemind's do:
    a peer's log is read beside its groupmates' to tell what happened when (without it, a CI failure in which a
    peer left with its own step could not be explained from the logs)."""
    logger = logging.getLogger("collab")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("{asctime}.{msecs:03.0f} {message}", datefmt="%b %d %H:%M:%S",
                                               style="{"))
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)
        logger.propagate = False


def main(argv: Optional[Sequence[str]] = None) -> int:
    set_process_defaults()
    timestamp_own_logs()
    argv = list(sys.argv[1:] if argv is None else argv)
    # `join` installs its handlers only once its command is parsed; a SIGTERM before that (a simulation
    # ending, `docker stop`) is still a request to leave, not a reason to die
    early_stop = _remember_early_signals() if argv[:1] == ["join"] else None
    parser = build_parser()
    args = parser.parse_args(argv)
    args.early_stop = early_stop
    if args.command is None:
        parser.print_help()
        return 2
    # every command starts processes (hivemind's DHT, averagers, p2pd; simulated peers): if this one is
    # killed outright, a watcher ends them, so a crash or the OOM killer leaves no ghost in the swarm
    watch_this_process()
    try:
        code = int(args.run(args) or 0)
    except (UserError, InternalError) as e:
        print(f"collab {args.command}: error: {e}", file=sys.stderr, flush=True)
        code = e.exit_code
    except KeyboardInterrupt:
        code = 130
    if getattr(args, "hard_exit", False):
        # hivemind can leave non-daemon threads behind (its ProgressTracker after a failed start); once our
        # children are reaped nothing is left to flush, so do not let them hold the process open
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
