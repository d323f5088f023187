"""One simulated run, start to report: network, peers, churn, progress lines, cleanup.

`collab simulate` is a thin CLI over `Simulation`; tests and benchmarks use it directly.
With a network profile the peers live in namespaces (collab.peers.netns) on shaped links; without one,
or where namespaces cannot be made, on 127.0.0.1 (and the report says shaping was off).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from collab.peers.churn import ChurnDriver, ChurnSpec
from collab.peers.launcher import LocalSwarm
from collab.peers.netns import NetworkLab, namespaces_unavailable_reason
from collab.peers.profiles import LinkSpec, NetworkProfile
from collab.peers.report import EpochTimeline, SwarmReport, build_report


@dataclass
class SimulationSpec:
    peers: int
    run_id: str
    workdir: Path
    config_path: Path
    profile: Optional[NetworkProfile] = None
    churn: Optional[ChurnSpec] = None
    duration: float = 600.0
    max_epochs: Optional[int] = None  # None: run for the whole duration
    dashboard_port: Optional[int] = None
    require_namespaces: bool = False  # tests of shaping must not silently fall back to 127.0.0.1
    join_args: list[str] = field(default_factory=list)
    per_peer_args: dict[int, list[str]] = field(default_factory=dict)
    env: Optional[dict] = None
    seed: int = 0
    forks: Optional[object] = None  # a started ForkServer (collab.peers.forkserver) to share (tests); None: its own


class Simulation:
    def __init__(self, spec: SimulationSpec, say: Callable[[str], None] = print):
        self.spec, self.say = spec, say
        self.links = spec.profile.links(spec.peers) if spec.profile else [LinkSpec() for _ in range(spec.peers)]
        self.lab: Optional[NetworkLab] = None
        self.swarm: Optional[LocalSwarm] = None
        self.warnings: list[str] = []
        self.started_again: set[int] = set()  # peers whose failed start was tried once more

    def _network(self) -> contextlib.AbstractContextManager:
        if self.spec.profile is None:
            return contextlib.nullcontext()
        reason = namespaces_unavailable_reason()
        if reason is None:
            self.lab = NetworkLab(self.links, observer=True)
            return self.lab
        if self.spec.require_namespaces:
            raise RuntimeError(f"network namespaces are unavailable: {reason}")
        self.warnings.append(f"network shaping is OFF ({reason}); peers run on 127.0.0.1 and only announce "
                             "the profile's bandwidth (NAT peers still run in client mode)")
        return contextlib.nullcontext()

    def run(self, stop: Optional[threading.Event] = None) -> SwarmReport:
        spec, stop = self.spec, stop or threading.Event()
        limit = ["--max-epochs", str(spec.max_epochs)] if spec.max_epochs is not None else []
        started = time.monotonic()
        with self._network():
            self.warnings += self.lab.warnings if self.lab else []
            for warning in self.warnings:
                self.say(f"WARNING: {warning}")
            with LocalSwarm(spec.peers, spec.run_id, spec.workdir, ["--config", str(spec.config_path), *limit,
                                                                     *spec.join_args],
                            per_peer_args=spec.per_peer_args, env=spec.env, network=self.lab,
                            links=self.links if spec.profile else None, forks=spec.forks) as swarm:
                self.swarm = swarm
                swarm.start()
                self._announce()
                dashboard = self._start_dashboard()
                churn = ChurnDriver(swarm, spec.churn, seed=spec.seed, on_event=self._say_event) if spec.churn else None
                timeline = EpochTimeline(swarm)
                try:
                    if churn is not None:
                        churn.start()
                    self._follow(timeline, started + spec.duration, stop)
                finally:
                    if churn is not None:
                        churn.stop(revive=False)
                    if dashboard is not None:
                        dashboard.terminate()
                        dashboard.wait(timeout=15)
                    swarm.stop()
                timeline.sample()
                counters = [self.lab.counters(i) for i in range(spec.peers)] if self.lab else None
                network = (f"namespaces {self.lab.switch.removesuffix('-sw')}-*, shaped by tc" if self.lab
                           else "127.0.0.1, no shaping")
                return build_report(swarm, time.monotonic() - started, timeline, self.links if spec.profile else None,
                                    counters, network,
                                    self.warnings, churn.events if churn else [])

    def _announce(self) -> None:
        swarm, spec = self.swarm, self.spec
        self.say(f"Peer 0 started run {spec.run_id} at {swarm.initial_peer}; logs in {spec.workdir}")
        for peer, link in zip(swarm.peers, self.links):
            shaped = f"  {link.describe()}" if spec.profile else ""
            self.say(f"  peer {peer.index}: {peer.placement.host}{shaped}"
                     + ("  (client mode)" if peer.placement.client_mode else ""))
        inside = " ".join(self.lab.observer_prefix()) + " " if self.lab else ""
        self.say(f"Watch it with:\n  {inside}collab status --run-id {spec.run_id} --initial-peers {swarm.initial_peer}")

    def _start_dashboard(self) -> Optional[subprocess.Popen]:
        """`collab dashboard` on 127.0.0.1:PORT; in the lab its DHT node lives in the observer namespace.

        The listening socket is made here, in the root namespace, and handed over: the browser reaches
        it on 127.0.0.1 while the collector talks to the peers over the simulated network.
        """
        port = self.spec.dashboard_port
        if port is None:
            return None
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(128)
        prefix = self.lab.observer_prefix() if self.lab else []
        command = [*prefix, sys.executable, "-m", "collab", "dashboard", "--run-id", self.spec.run_id,
                   "--initial-peers", self.swarm.initial_peer, "--fd", str(listener.fileno())]
        log = open(self.spec.workdir / "dashboard.log", "ab")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   pass_fds=[listener.fileno()], env=self.spec.env or os.environ,
                                   start_new_session=True)
        log.close()
        listener.close()
        self.say(f"  dashboard: http://127.0.0.1:{port}/")
        return process

    def _follow(self, timeline: EpochTimeline, deadline: float, stop: threading.Event) -> None:
        """Until the peers finish, the duration ends or `stop`: one line whenever the swarm's epoch grows."""
        shown = -1
        while time.monotonic() < deadline and not stop.is_set():
            if self.spec.max_epochs is not None and self.swarm.wait(timeout=0):
                return
            self._start_failed_starts_again()
            epoch = timeline.sample()
            lines = [_last_epoch_line(p.log_text()) for p in self.swarm.peers] if epoch > shown else []
            if any(lines):
                shown = epoch
                self.say(f"  epoch {epoch}: " + "   ".join(f"peer {i}: {text}" for i, text in enumerate(lines) if text))
            stop.wait(2.0)
        if not stop.is_set() and time.monotonic() >= deadline:
            self.say(f"{self.spec.duration:.0f} s reached: stopping the peers")

    def _start_failed_starts_again(self) -> None:
        """A peer that exited with an error before training (on a busy machine: its dial of the initial peers or its
        wait for the manifest timed out) is started once more. The others' --wait-peers counts it: without it they
        wait out their timeout, and a 32-peer run on 2 cores spent all its 240 s so. Said, and kept in the report."""
        for peer in self.swarm.peers:
            code = peer.popen.poll() if peer.popen is not None else None
            if code is None or code <= 0 or peer.index in self.started_again:  # running, done, or signalled (churn)
                continue
            log = peer.log_text()
            if _last_epoch_line(log) is not None:  # it trained: a failure to report, not a start to retry
                continue
            self.started_again.add(peer.index)
            why = _last_error(log)
            self.warnings.append(f"peer {peer.index} exited while joining ({why}); it was started once more")
            self.say(f"  peer {peer.index} exited while joining ({why}): starting it once more")
            self.swarm.start_peer(peer.index, self.swarm.start_args)

    def _say_event(self, event) -> None:
        self.say(f"  churn at {event.at:.0f} s: {event.action} peer {event.peer}")


def _last_error(log: str, most: int = 160) -> str:
    """The peer's one-line error (`collab join: error: ...`), shortened; or its exit without one."""
    lines = [line for line in log.splitlines() if ": error: " in line]
    return lines[-1].split(": error: ", 1)[1][:most] if lines else "no error line in its log"


def _last_epoch_line(log: str) -> Optional[str]:
    """A short text from a peer's last per-epoch line, or None before its first."""
    lines = [line for line in log.splitlines() if line.startswith("epoch ")]
    if not lines:
        return None
    # "epoch 3 | peers 2 | local 14.1 samples/s | contributed 376 | averaging rounds 5 | loss 9.602"
    match = re.match(r"epoch (\d+) .*local ([\d.]+) samples/s .*averaging rounds (\d+) \| loss (\S+)", lines[-1])
    if not match:
        return None
    epoch, speed, rounds, loss = match.groups()
    return f"{speed} samples/s, {rounds} rounds, loss {loss}"
