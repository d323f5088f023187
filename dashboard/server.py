"""Running the dashboard: in the foreground (`collab dashboard`) or beside a peer or a simulation."""

from __future__ import annotations

import gc
import threading
import time
from typing import Optional

import uvicorn

from collab.dashboard.app import create_app
from collab.dashboard.collector import Collector
from collab.errors import UserError


class BackgroundDashboard:
    """uvicorn in a thread, with a collector on an existing DHT (a peer's) or its own client node."""

    def __init__(self, collector: Collector, host: str = "127.0.0.1", port: int = 8000):
        self.collector = collector
        config = uvicorn.Config(create_app(collector), host=host, port=port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # the owner (a peer) handles signals itself
        self._thread: Optional[threading.Thread] = None
        self.url = f"http://{host}:{port}/"

    def start(self, timeout: float = 30.0) -> "BackgroundDashboard":
        self._thread = threading.Thread(target=self.server.run, name="dashboard", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not self.server.started:
            raise UserError(f"the dashboard could not listen on {self.url} (is the port free?); pick another port")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)


def serve_forever(collector: Collector, host: str, port: int, fd: Optional[int] = None) -> None:
    """The foreground server of `collab dashboard`; Ctrl-C stops uvicorn, which stops the collector."""
    # hivemind imports torch: a heap of ~10^6 long-lived objects that every full collection walks,
    # stalling every open request (the p99 of a busy dashboard). Freeze them out of the collector.
    gc.collect()
    gc.freeze()
    where = dict(fd=fd) if fd is not None else dict(host=host, port=port)
    # joined before uvicorn starts: an unreachable run, or a private one without an invite, is the CLI's one
    # line (exit 2), not a traceback from inside uvicorn's startup
    collector.start()
    try:
        uvicorn.run(create_app(collector, manage_collector=False), log_level="warning", **where)
    finally:
        collector.stop()
