"""Collect -> cache: one background thread reads the run's records from the DHT every few seconds.

Routes only ever read the cached snapshot and the bounded history, so a hundred browsers cost the
swarm nothing: the DHT is asked once per interval, whoever is watching. Nothing starts at import
time; start() joins the swarm (or uses a DHT the caller already runs) and stop() leaves it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from array import array
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass
from typing import Optional

from collab.dashboard.snapshot import MAX_PEERS, DashboardRun, Snapshot
from collab.swarm.node import PeerConfig, Swarm
from collab.swarm.state import PeerState, RunState, read_run_state

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


PEER_HISTORY_POINTS = 300  # per peer: 15 minutes at the default interval (the run's own history keeps an hour)
PEER_FIELDS = ("time", "epoch", "samples_per_second", "loss", "samples_contributed")


class PeerSeries:
    """One peer's recent points, five doubles each in a ring (40 bytes a point, against ~200 as objects): with
    thousands of peers, the per-peer history is most of what the dashboard holds."""

    __slots__ = ("values", "capacity", "start")

    def __init__(self, capacity: int):
        self.values, self.capacity, self.start = array("d"), capacity, 0

    def append(self, p: PeerState, at: float) -> None:
        point = (at, p.epoch, p.samples_per_second, math.nan if p.loss is None else p.loss, p.samples_contributed)
        width = len(PEER_FIELDS)
        if len(self.values) < self.capacity * width:
            self.values.extend(point)
            return
        self.values[self.start * width:(self.start + 1) * width] = array("d", point)
        self.start = (self.start + 1) % self.capacity

    @property
    def last_time(self) -> float:
        width = len(PEER_FIELDS)
        last = (self.start - 1) % (len(self.values) // width)
        return self.values[last * width]

    def points(self) -> list[dict]:
        width, values = len(PEER_FIELDS), self.values
        count = len(values) // width
        rows = []
        for i in range(count):
            at = ((self.start + i) % count) * width
            t, epoch, rate, loss, contributed = values[at:at + width]
            # loss is NaN only where the record had none: the schema refuses a NaN loss
            rows.append(dict(time=t, epoch=int(epoch), samples_per_second=rate, loss=None if math.isnan(loss) else loss,
                             samples_contributed=int(contributed)))
        return rows


class Collector:
    def __init__(self, run_id: str, initial_peers: list[str] = (), interval: float = 3.0,
                 history_size: int = 1200, dht=None, host_maddrs: Optional[list[str]] = None,
                 forget_after: float = 3600.0, make_swarm=None, max_peers: int = MAX_PEERS,
                 peer_history_size: Optional[int] = None):
        """`make_swarm(peer_config)`: how to join the run (collab dashboard passes the reader's credentials).
        `max_peers`: peers a snapshot lists and peers with a history, at most (the most recently seen)."""
        self.run_id, self.initial_peers, self.interval = run_id, list(initial_peers), interval
        self.history_size = history_size
        self.peer_history_size = peer_history_size or min(history_size, PEER_HISTORY_POINTS)
        self.max_peers = max_peers
        # a peer's series is dropped once it has been gone this long, or when more than max_peers newer ones have
        # one: short-lived (or fake) peers must not grow the dashboard's memory for ever
        self.forget_after = forget_after
        self.host_maddrs = host_maddrs or ["/ip4/127.0.0.1/tcp/0"]
        self._dht, self._swarm, self._make_swarm = dht, None, make_swarm
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.view: Optional[Snapshot] = None  # what every request reads: replaced whole at each collection
        self.snapshot_time: Optional[float] = None
        self.history: deque[RunPoint] = deque(maxlen=history_size)
        self.peer_history: OrderedDict[str, PeerSeries] = OrderedDict()  # least recently seen first
        # histories dropped to stay within max_peers (not those of peers gone forget_after: they left the run)
        self.peer_histories_dropped = 0
        self.last_error: Optional[str] = None
        self.collections = 0

    @property
    def snapshot(self) -> Optional[DashboardRun]:
        view = self.view
        return None if view is None else view.run

    @property
    def snapshot_json(self) -> Optional[bytes]:
        view = self.view
        return None if view is None else view.full_json

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
        view = Snapshot(state, self.max_peers)  # serialised here, once, outside the lock
        run = view.run
        point = RunPoint(state.time, state.global_epoch, state.samples_per_second, run.peers_online, run.median_loss,
                         state.noise_scale, state.target_batch_size, state.goodput)
        with self._lock:
            self.view, self.snapshot_time = view, time.time()
            self.history.append(point)
            for p in run.peers:
                series = self.peer_history.get(p.peer_id)
                if series is None:
                    series = self.peer_history[p.peer_id] = PeerSeries(self.peer_history_size)
                else:
                    self.peer_history.move_to_end(p.peer_id)  # the most recently seen last, the first to drop first
                series.append(p, state.time)
            while self.peer_history:
                oldest, series = next(iter(self.peer_history.items()))
                gone = state.time - series.last_time > self.forget_after
                if not gone and len(self.peer_history) <= self.max_peers:
                    break
                self.peer_histories_dropped += not gone
                del self.peer_history[oldest]
            self.collections += 1
            self.last_error = None

    def history_json(self) -> list[dict]:
        with self._lock:
            return [asdict(p) for p in self.history]

    def peer_json(self, peer_id: str) -> Optional[list[dict]]:
        with self._lock:
            series = self.peer_history.get(peer_id)
            return None if series is None else series.points()
