"""What every collab process sets before it does anything else: the settings hivemind reads at import, and how
collab's own log lines look. Imports nothing heavy: the fork server (collab.peers.forkserver) calls it before it
preloads hivemind."""

from __future__ import annotations

import logging
import os


def set_process_defaults() -> None:
    """Settings hivemind reads when it is imported: set before that (collab.peers.forkserver imports it ahead)."""
    # hivemind logs every matchmaking step at INFO; a volunteer needs the progress bar, not that
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    # hivemind shares tensors between its processes through files by default, which starts a
    # torch_shm_manager that can outlive the peer; file descriptors need no manager process
    os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")


def timestamp_own_logs() -> None:
    """collab's own log lines (a re-sync, a round given up, a donor staying on) carry the time, as hivemind's do:
    a peer's log is read beside its groupmates' to tell what happened when (without it, a peer that left with its
    own step cannot be explained from the logs)."""
    logger = logging.getLogger("collab")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("{asctime}.{msecs:03.0f} {message}", datefmt="%b %d %H:%M:%S",
                                               style="{"))
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)
        logger.propagate = False


DEBUG_LOGGERS_ENV = "COLLAB_DEBUG_LOGGERS"


def debug_loggers_from_env() -> list[str]:
    """Loggers named in COLLAB_DEBUG_LOGGERS (comma-separated, e.g. hivemind.averaging.matchmaking) log at DEBUG in
    this process and the averager processes it forks, while everything else stays at its level: what a peer
    did in a rare race (a group assembled without it) can be read from its log without hivemind's whole debug
    output. A COLLAB_ variable, so a test's forked peers may set it (collab.peers.forkserver)."""
    names = [name.strip() for name in os.environ.get(DEBUG_LOGGERS_ENV, "").split(",") if name.strip()]
    for name in names:
        logging.getLogger(name).setLevel(logging.DEBUG)
    return names
