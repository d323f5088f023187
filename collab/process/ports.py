"""Checks on a TCP port the user named, made before anything starts: a taken port is a one-line error."""

from __future__ import annotations

import errno
import socket

from collab.errors import UserError


def require_free_port(port: int, flag: str, host: str = "127.0.0.1") -> None:
    """Raise a UserError naming `flag` unless `port` is a TCP port that can be listened on at `host` now."""
    if not 0 < port < 65536:
        raise UserError(f"{flag} {port} is not a TCP port; pass 1-65535")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UserError(f"{flag} {port}: the port is already in use on {host}; pick another port, "
                                "or stop what listens there") from None
            raise UserError(f"{flag} {port}: cannot listen on {host} ({e.strerror}); pick another port") from None
