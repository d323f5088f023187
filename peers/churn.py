"""Churn: peers that crash, leave or freeze, and come back, on a schedule.

A spec is ACTION:EVERY:DOWNTIME, e.g. `kill:30:20`: every 30 s a random peer is hit, and after
20 s it comes back.
  kill  SIGKILL to the peer's whole session (a crash or a pulled plug); restarted with its identity
  term  SIGTERM (a volunteer pressing Ctrl-C); restarted with its identity once it has left
  stop  SIGSTOP to the whole session (a laptop lid closed); SIGCONT after the downtime
A restarted peer rejoins as itself through the peers that are up and catches up with the swarm.
At least one peer is never down, so the run itself survives.
"""

from __future__ import annotations

import random
import re
import signal
import threading
import time
from dataclasses import dataclass
from typing import Literal, Optional

from collab.errors import UserError

SPEC = re.compile(r"^(kill|term|stop):(\d+(?:\.\d+)?):(\d+(?:\.\d+)?)$")


@dataclass(frozen=True)
class ChurnSpec:
    action: Literal["kill", "term", "stop"]
    every: float
    downtime: float

    @classmethod
    def parse(cls, text: str) -> "ChurnSpec":
        match = SPEC.match(text.strip())
        if not match:
            raise UserError(f"--churn {text!r} is not ACTION:EVERY:DOWNTIME; e.g. kill:30:20 (ACTION is kill, "
                            "term or stop; EVERY and DOWNTIME in seconds)")
        action, every, downtime = match.group(1), float(match.group(2)), float(match.group(3))
        if every <= 0:
            raise UserError(f"--churn {text!r}: EVERY must be more than 0 seconds")
        return cls(action, every, downtime)  # type: ignore[arg-type]


@dataclass
class ChurnEvent:
    at: float  # seconds since the churn started
    peer: int
    action: str  # "kill", "term", "stop", "restart", "continue"


class ChurnDriver:
    """A thread that hits peers of a LocalSwarm by `spec`; stop() ends it and revives whoever is down."""

    def __init__(self, swarm, spec: ChurnSpec, seed: int = 0, on_event=None):
        self.swarm, self.spec = swarm, spec
        self.rng = random.Random(seed)
        self.events: list[ChurnEvent] = []
        self.on_event = on_event
        self._down: dict[int, float] = {}  # peer index -> when it comes back
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._started = 0.0

    def start(self) -> "ChurnDriver":
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="collab-churn", daemon=True)
        self._thread.start()
        return self

    def stop(self, revive: bool = True) -> None:
        """Stop hitting peers. Frozen peers are always thawed; dead ones restarted only if `revive`."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for index in list(self._down):
            if self.spec.action == "stop" or revive:
                self._bring_back(index)

    def _loop(self) -> None:
        next_hit = self._started + self.spec.every
        while not self._stop.is_set():
            now = time.monotonic()
            for index, back_at in list(self._down.items()):
                if now >= back_at:
                    self._bring_back(index)
            if now >= next_hit:
                self._hit()
                next_hit += self.spec.every
            wake = min([next_hit, *self._down.values()])
            self._stop.wait(max(0.05, wake - time.monotonic()))

    def _hit(self) -> None:
        candidates = [p.index for p in self.swarm.peers if p.alive() and p.index not in self._down]
        if len(candidates) < 2:  # never take the last peer standing: the run would end, not churn
            return
        index = self.rng.choice(candidates)
        peer = self.swarm.peers[index]
        if self.spec.action == "kill":
            peer.kill_group()
        elif self.spec.action == "term":
            peer.signal(signal.SIGTERM)
        else:
            peer.signal_session(signal.SIGSTOP)
        self._down[index] = time.monotonic() + self.spec.downtime
        self._record(index, self.spec.action)

    def _bring_back(self, index: int) -> None:
        peer = self.swarm.peers[index]
        del self._down[index]
        if self.spec.action == "stop":
            peer.signal_session(signal.SIGCONT)
            self._record(index, "continue")
            return
        if peer.alive() and peer.wait(timeout=15) is None:  # a SIGTERM'd peer that has not left yet
            peer.kill_group()
        peer.kill_group()  # whatever it left behind (a SIGTERM'd peer cleans up itself; be sure)
        self.swarm.start_peer(index)
        self._record(index, "restart")

    def _record(self, index: int, action: str) -> None:
        event = ChurnEvent(round(time.monotonic() - self._started, 1), index, action)
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)
