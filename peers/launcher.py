"""Launch N real `collab join` processes on 127.0.0.1 and always clean them up.

Each peer runs in its own session (process group), so stopping it stops everything it started:
hivemind's DHT and averager processes and p2pd. The first peer starts the swarm; the others join
through the multiaddr it prints (the same line a human organizer would copy).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil

JOIN_LINE = re.compile(r"--initial-peers (\S+)")


class LaunchError(RuntimeError):
    pass


@dataclass
class PeerProcess:
    index: int
    args: list[str]
    workdir: Path
    popen: Optional[subprocess.Popen] = None

    @property
    def log_path(self) -> Path:
        return self.workdir / f"peer{self.index}.log"

    @property
    def summary_path(self) -> Path:
        return self.workdir / f"peer{self.index}.summary.json"

    @property
    def identity_path(self) -> Path:
        return self.workdir / f"peer{self.index}.identity"

    @property
    def checkpoint_dir(self) -> Path:
        return self.workdir / f"peer{self.index}-checkpoints"

    def start(self, extra: list[str] = (), env: Optional[dict] = None) -> None:
        env = dict(env if env is not None else os.environ, PYTHONUNBUFFERED="1")
        command = [sys.executable, "-m", "collab", "join", *self.args, *extra,
                   "--identity", str(self.identity_path), "--summary-json", str(self.summary_path), "--no-live"]
        log = open(self.log_path, "ab")
        self.popen = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=env, start_new_session=True)
        log.close()

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive():
            os.kill(self.popen.pid, signum)

    def wait(self, timeout: float) -> Optional[int]:
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        return code

    def kill_group(self) -> None:
        """Kill every process of the peer's session (p2pd and hivemind's processes included).

        The peer's DHT moves itself and p2pd into a process group of its own (see collab.swarm), so
        killing the peer's group is not enough: everything that shares its session goes.
        """
        if self.popen is None:
            return
        for proc in psutil.process_iter():
            try:
                if os.getsid(proc.pid) == self.popen.pid:
                    proc.kill()
            except (ProcessLookupError, PermissionError, psutil.Error, OSError):
                pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class LocalSwarm:
    """A context manager: on exit (normal, exception or Ctrl-C) every peer's process group is gone."""

    def __init__(self, num_peers: int, run_id: str, workdir: Path, join_args: list[str] = (),
                 per_peer_args: Optional[dict[int, list[str]]] = None, startup_timeout: float = 180.0,
                 env: Optional[dict] = None):
        if num_peers < 1:
            raise ValueError("num_peers must be at least 1")
        self.run_id, self.workdir, self.startup_timeout = run_id, Path(workdir), startup_timeout
        self.env = env
        self.workdir.mkdir(parents=True, exist_ok=True)
        per_peer_args = per_peer_args or {}
        base = ["--run-id", run_id, "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *join_args]
        self.peers = [PeerProcess(i, base + list(per_peer_args.get(i, [])), self.workdir) for i in range(num_peers)]
        self.initial_peer: Optional[str] = None

    def __enter__(self) -> "LocalSwarm":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, count: Optional[int] = None) -> None:
        """Start the first peer, wait for its join line, then start the others (or only `count` peers).

        All of them wait until `count` peers are in the run before their first step, so none trains
        alone through the first epochs while the others are still importing torch.
        """
        count = len(self.peers) if count is None else count
        first = self.peers[0]
        first.start(["--wait-peers", str(count)], env=self.env)
        self.initial_peer = self._wait_for_join_line(first)
        for peer in self.peers[1:count]:
            self.start_peer(peer.index, ["--wait-peers", str(count)])

    def start_peer(self, index: int, extra: list[str] = ()) -> None:
        self.peers[index].start(["--initial-peers", self.initial_peer, *extra], env=self.env)

    def _wait_for_join_line(self, peer: PeerProcess) -> str:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            match = JOIN_LINE.search(peer.log_text())
            if match:
                return match.group(1)
            if not peer.alive():
                raise LaunchError(f"peer 0 exited before printing its address:\n{peer.log_text()[-2000:]}")
            time.sleep(0.2)
        raise LaunchError(f"peer 0 printed no join command within {self.startup_timeout:.0f} s")

    def wait(self, timeout: float) -> bool:
        """Wait until every started peer has exited; False if the timeout came first."""
        deadline = time.monotonic() + timeout
        for peer in self.peers:
            if peer.popen is None:
                continue
            if peer.wait(max(0.0, deadline - time.monotonic())) is None:
                return False
        return True

    def stop(self, grace: float = 15.0) -> None:
        for peer in self.peers:
            peer.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for peer in self.peers:
            if peer.popen is not None:
                peer.wait(max(0.0, deadline - time.monotonic()))
            peer.kill_group()
