"""Collect -> cache: one background thread reads the run's records from the DHT every few seconds.

Routes only ever read the cached snapshot and the bounded history, so a hundred browsers cost the
swarm nothing: the DHT is asked once per interval, whoever is watching. Nothing starts at import
time; start() joins the swarm (or uses a DHT the caller already runs) and stop() leaves it.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Optional

from collab.swarm.node import PeerConfig, Swarm
from collab.swarm.state import RunState, read_run_state

logger = logging.getLogger(__name__)


@dataclass
class RunPoint:
    time: float
    global_epoch: int
    samples_per_second: float
    peers_online: int
    loss: Optional[float]  # median loss of the online trainers
    noise_scale: Optional[float] = None  # B_noise (collab.adaptive.noise_scale)
    target_batch_size: Optional[int] = None
    goodput: Optional[float] = None  # samples/s x statistical efficiency (collab.adaptive.batch_plan)


@dataclass
class PeerPoint:
    time: float
    epoch: int
    samples_per_second: float
    loss: Optional[float]
    samples_contributed: int


class Collector:
    def __init__(self, run_id: str, initial_peers: list[str] = (), interval: float = 3.0,
                 history_size: int = 1200, dht=None, host_maddrs: Optional[list[str]] = None,
                 forget_after: float = 3600.0, make_swarm=None):
        """`make_swarm(peer_config)`: how to join the run (collab dashboard passes the reader's credentials)."""
        self.run_id, self.initial_peers, self.interval = run_id, list(initial_peers), interval
        self.history_size = history_size
        # a peer's series is dropped once it has been gone this long: short-lived (or fake) peers must not
        # grow the dashboard's memory for ever
        self.forget_after = forget_after
        self.host_maddrs = host_maddrs or ["/ip4/127.0.0.1/tcp/0"]
        self._dht, self._swarm, self._make_swarm = dht, None, make_swarm
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.snapshot: Optional[RunState] = None
        self.snapshot_json: Optional[bytes] = None  # serialised once per collection, served as is
        self.snapshot_time: Optional[float] = None
        self.history: deque[RunPoint] = deque(maxlen=history_size)
        self.peer_history: dict[str, deque[PeerPoint]] = {}
        self.last_error: Optional[str] = None
        self.collections = 0

    def start(self) -> "Collector":
        if self._dht is None:
            peer = PeerConfig(run_id=self.run_id, initial_peers=self.initial_peers, client_mode=True,
                              host_maddrs=self.host_maddrs)
            self._swarm = (self._make_swarm or Swarm)(peer)
            self._dht = self._swarm.dht
        self._thread = threading.Thread(target=self._run, name="dashboard-collector", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._swarm is not None:
            self._swarm.shutdown()
            self._swarm = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.collect_once()
            except Exception as e:  # a DHT hiccup must not kill the dashboard: keep the last snapshot
                self.last_error = f"{type(e).__name__}: {e}"
                logger.warning("collecting the run state failed: %s", self.last_error)
            self._stop.wait(self.interval)

    def collect_once(self) -> RunState:
        state = read_run_state(self._dht, self.run_id)
        self.ingest(state)
        return state

    def ingest(self, state: RunState) -> None:
        online = [p for p in state.peers if p.online]
        losses = [p.loss for p in online if p.loss is not None and math.isfinite(p.loss)]
        point = RunPoint(state.time, state.global_epoch, state.samples_per_second, len(online),
                         statistics.median(losses) if losses else None, state.noise_scale, state.target_batch_size,
                         state.goodput)
        encoded = state.model_dump_json().encode()
        with self._lock:
            self.snapshot, self.snapshot_json, self.snapshot_time = state, encoded, time.time()
            self.history.append(point)
            for p in state.peers:
                series = self.peer_history.setdefault(p.peer_id, deque(maxlen=self.history_size))
                series.append(PeerPoint(state.time, p.epoch, p.samples_per_second, p.loss, p.samples_contributed))
            gone = [peer for peer, series in self.peer_history.items()
                    if state.time - series[-1].time > self.forget_after]
            for peer in gone:
                del self.peer_history[peer]
            self.collections += 1
            self.last_error = None

    def history_json(self) -> list[dict]:
        with self._lock:
            return [asdict(p) for p in self.history]

    def peer_json(self, peer_id: str) -> Optional[list[dict]]:
        with self._lock:
            series = self.peer_history.get(peer_id)
            return None if series is None else [asdict(p) for p in series]
