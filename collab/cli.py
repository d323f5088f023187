"""The `collab` command: one module per subcommand in collab/commands/.

Every user error ends as one line on stderr and exit code 2; nothing prints a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from collab.commands import dashboard, doctor, init, invite, join, revoke, simulate, status
from collab.commands import id as id_command
from collab.errors import InternalError, UserError
from collab.process.defaults import debug_loggers_from_env, set_process_defaults, timestamp_own_logs
from collab.process.lifecycle import remember_early_signals
from collab.process.reaper import remove_own_multiprocessing_folder, remove_own_sockets, watch_this_process


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line that names it and points at --help."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message}; see '{self.prog} --help'\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="collab", description="Train one model together over the internet.")
    parser.add_argument("--version", action="version", version=f"collab {__import__('collab').__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for module in (init, join, doctor, id_command, invite, revoke, status, dashboard, simulate):
        module.add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    set_process_defaults()
    timestamp_own_logs()
    debug_loggers_from_env()
    argv = list(sys.argv[1:] if argv is None else argv)
    # `join` installs its handlers only once its command is parsed; a SIGTERM before that (a simulation
    # ending, `docker stop`) is still a request to leave, not a reason to die
    early_stop = remember_early_signals() if argv[:1] == ["join"] else None
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
        remove_own_sockets()
        remove_own_multiprocessing_folder()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
