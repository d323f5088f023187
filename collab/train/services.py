"""What a trainer peer runs beside its loop, owned in one place: its DHT node, the run's sharer, the dashboard, the
batch plan's keeper and the optimizer. Each starts after the ones it needs and they stop in reverse order, also
when starting or training fails: a failed start never leaves a DHT process or a dashboard thread behind."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Callable, Optional

from collab.dashboard.collector import Collector
from collab.dashboard.server import BackgroundDashboard
from collab.modes import AveragingMode
from collab.run.sharer import RunSharer, SharedRun
from collab.swarm.node import Swarm
from collab.swarm.probe import ProbeServer
from collab.train.data_feed import PeerData
from collab.train.plan_keeper import PlanKeeper, start_plan_keeper


class PeerServices:
    """Use as a context manager: leaving it stops whatever was started, newest first."""

    def __init__(self, swarm: Swarm):
        self.swarm = swarm
        self.sharer: Optional[RunSharer] = None
        self.probe: Optional[ProbeServer] = None
        self.dashboard: Optional[BackgroundDashboard] = None
        self.keeper: Optional[PlanKeeper] = None
        self.opt: Optional[AveragingMode] = None
        self.data: Optional[PeerData] = None
        self._stack = ExitStack()
        self._stack.callback(swarm.shutdown)

    def __enter__(self) -> PeerServices:
        return self

    def __exit__(self, *exc) -> bool:
        return self._stack.__exit__(*exc)

    def start_sharer(self, shared: Optional[SharedRun], on_lost: Callable[[str], None]) -> None:
        """Pass the run's manifest and files on to peers that join through this one (and, in a private run, keep
        its membership current: `on_lost` is called when this peer's invite is revoked or expires)."""
        if shared is not None:
            self.sharer = RunSharer(self.swarm, shared, on_lost=on_lost).start()
            self._stack.callback(self.sharer.stop)

    def start_probe(self) -> None:
        """Answer other peers' probes (dial-back, clock, bandwidth: collab.swarm.probe); a client cannot be dialled."""
        if not self.swarm.peer.client_mode:
            self.probe = ProbeServer(self.swarm.dht).start()
            self._stack.callback(self.probe.stop)

    def start_data(self, data: Optional[PeerData], resume: Optional[dict]) -> None:
        """Place this peer in the run's token shards (its checkpoint's place, its saved one, or the largest gap
        between the others') and start fetching what it lacks."""
        if data is not None:
            self.data = data
            place = data.place_on(self.swarm, resume)
            self._stack.callback(data.close)
            print(f"Data: the run's token shards from window {place.position} at {place.start:.4f} of the ring "
                  f"({place.came_from})", flush=True)

    def start_dashboard(self, port: Optional[int]) -> None:
        if port is not None:  # read through this peer's own DHT node: no second one
            collector = Collector(self.swarm.peer.run_id, dht=self.swarm.dht)
            self.dashboard = BackgroundDashboard(collector, port=port).start()
            self._stack.callback(self.dashboard.stop)

    def start_plan_keeper(self, config, shared: Optional[SharedRun]) -> None:
        """The run's target and learning-rate gain for each epoch, when they follow the noise scale."""
        self.keeper = start_plan_keeper(config, self.swarm, shared,
                                        lambda: self.opt.local_epoch if self.opt is not None else 0)
        if self.keeper is not None:
            self._stack.callback(self.keeper.stop)

    def start_optimizer(self, build: Callable[[], AveragingMode],
                        leave: Callable[[AveragingMode], None]) -> AveragingMode:
        """`leave(opt)` is how the optimizer stops: the trainer's last re-sync, shutdown and checkpoint."""
        self.opt = build()
        self._stack.callback(leave, self.opt)
        return self.opt
