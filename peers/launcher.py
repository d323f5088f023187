"""Launch N real `collab join` processes and always clean them up.

Each peer runs in its own session, so stopping it stops everything it started: hivemind's DHT and
averager processes and p2pd. Peers listen on fixed addresses, and their identities are made before
they start, so every peer's multiaddr is known up front: a peer restarted after a crash rejoins as
itself through whichever peers are up. On 127.0.0.1 by default; inside a NetworkLab's namespaces
(collab.peers.netns) when one is given, each peer on its own shaped link. Peers are forked from a server that
imported collab once (collab.peers.forkserver): a peer starts in about a second instead of seven CPU-seconds.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil

from collab.peers.forkserver import ForkServer
from collab.process.lifecycle import leave_grace
from collab.process.reaper import hivemind_sockets, remove_sockets_of, running_after
from collab.records.identity import load_or_create_identity

JOIN_LINE = re.compile(r"--initial-peers (\S+)")
REACHABLE_LINE = re.compile(r"^Reachability: ", re.MULTILINE)
INITIAL_PEERS_MOST = 4  # initial peers a started peer is given (LocalSwarm.start_peer)
RESTART_LINE = "===== restart"  # in a peer's log, before each incarnation's lines but the first
NAMESPACE_PORT = 31337  # every peer has its own address in a lab, so they can share a port
LEAVE_GRACE = 15.0  # seconds a stopped swarm's peers have to leave, from the last one that left
LEAVE_WAIT_MOST = 120.0  # and in all, however many still leave one after another
# beyond a peer's own grace (collab.process.lifecycle.leave_grace): its forced exit writes the summary, then reaps
FORCED_EXIT_SECONDS = 5.0


class LaunchError(RuntimeError):
    pass


@dataclass
class Placement:
    """Where a peer runs on the network and what it tells hivemind about its link."""

    host: str = "127.0.0.1"
    port: int = 0
    prefix: list[str] = field(default_factory=list)  # e.g. ["ip", "netns", "exec", NS]
    client_mode: bool = False  # behind NAT: nobody can dial it (the peer finds that out and runs as a client)
    bandwidth_mbit: Optional[float] = None  # announced, so the all-reduce gives a slow peer a smaller share


@dataclass
class PeerProcess:
    index: int
    args: list[str]
    workdir: Path
    placement: Placement = field(default_factory=Placement)
    popen: Optional[subprocess.Popen] = None  # or a ForkedProcess: the same poll/wait/pid/returncode
    starts: int = 0  # incarnations: a restarted peer writes a new summary and appends to its log
    peer_id: str = ""
    # what runs `join ARGS...`: collab itself, or (in fault-injection tests) a wrapper that patches it first
    program: list[str] = field(default_factory=lambda: [sys.executable, "-m", "collab"])

    @property
    def log_path(self) -> Path:
        return self.workdir / f"peer{self.index}.log"

    @property
    def summary_path(self) -> Path:
        """The summary of the current (latest) incarnation."""
        return self._summary(max(self.starts - 1, 0))

    def summary_paths(self) -> list[Path]:
        return [self._summary(k) for k in range(self.starts)]

    def _summary(self, incarnation: int) -> Path:
        suffix = "" if incarnation == 0 else f".restart{incarnation}"
        return self.workdir / f"peer{self.index}{suffix}.summary.json"

    @property
    def identity_path(self) -> Path:
        return self.workdir / f"peer{self.index}.identity"

    @property
    def checkpoint_dir(self) -> Path:
        return self.workdir / f"peer{self.index}-checkpoints"

    @property
    def maddr(self) -> str:
        return f"/ip4/{self.placement.host}/tcp/{self.placement.port}/p2p/{self.peer_id}"

    def make_identity(self) -> None:
        """Create the peer's key now (the peer reuses it: `collab join` makes the same kind), so its peer id is known
        before it starts."""
        self.peer_id = load_or_create_identity(self.identity_path).peer_id

    def start(self, extra: list[str] = (), env: Optional[dict] = None, forks=None) -> None:
        """Start this peer: forked from `forks` (a started ForkServer) when it can run the command, else a process."""
        env = dict(env if env is not None else os.environ, PYTHONUNBUFFERED="1")
        where = self.placement
        command = [*where.prefix, *self.program, "join", *self.args,
                   "--host-maddrs", f"/ip4/{where.host}/tcp/{where.port}", *extra,
                   "--identity", str(self.identity_path), "--summary-json", str(self._summary(self.starts)),
                   "--no-live"]
        # a peer behind NAT is not told so: as a volunteer's would, it asks the swarm to dial it back, finds that
        # nobody can, and joins as a client by itself (collab.commands.join)
        if where.bandwidth_mbit is not None and "--bandwidth" not in command:
            command += ["--bandwidth", f"{where.bandwidth_mbit:g}"]
        with open(self.log_path, "ab") as log:
            if self.starts:
                log.write(f"\n{RESTART_LINE} {self.starts} =====\n".encode())
                log.flush()
            unforkable = None if forks is None else forks.why_not(command, env)
            if forks is not None and unforkable is None:
                self.popen = forks.spawn(command, env, self.log_path)
            else:
                if unforkable is not None:  # slower (a fresh process imports everything), not broken: say why
                    print(f"peer {self.index} starts as a process of its own: {unforkable}", file=sys.stderr,
                          flush=True)
                self.popen = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.starts += 1
        self._joined = False

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive():
            try:
                os.kill(self.popen.pid, signum)
            except ProcessLookupError:
                pass  # it exited between the check and the signal (a forked peer's exit is reported late)

    def wait(self, timeout: float) -> Optional[int]:
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        return code

    def session_processes(self) -> list[psutil.Process]:
        """Everything of this peer: its process and all that share its session (p2pd included).

        The peer's DHT moves itself and p2pd into a process group of its own (see collab.swarm.node), so
        signalling the peer's group is not enough: the session is what they all share.
        """
        if self.popen is None:
            return []
        found = []
        for proc in psutil.process_iter():
            try:
                if os.getsid(proc.pid) == self.popen.pid:
                    found.append(proc)
            except (ProcessLookupError, PermissionError, psutil.Error, OSError):
                pass
        return found

    def signal_session(self, signum: int) -> None:
        for proc in self.session_processes():
            try:
                proc.send_signal(signum)
            except psutil.Error:
                pass

    def kill_group(self) -> None:
        """SIGKILL the whole session: what a crash or a pulled plug does to a volunteer's machine."""
        if self.popen is None:
            return
        processes = self.session_processes()
        # a machine that crashed boots with an empty /tmp; this one goes on: the files of p2pd's sockets that the
        # killed processes listened on are removed here (a churn run left 5 a kill)
        sockets = hivemind_sockets(processes)
        self.signal_session(signal.SIGCONT)  # a frozen process cannot be reaped until it runs
        self.signal_session(signal.SIGKILL)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        remove_sockets_of(sockets, still_running=running_after(processes, timeout=10))

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    _joined = False

    def joined(self) -> bool:
        """Whether this peer, running, has joined the swarm as a peer others can dial: the first peer's join line, or
        its reachability check's line (collab.commands.join); a client (behind NAT) says otherwise. Remembered."""
        if not self._joined and self.alive():
            text = self.log_text().rsplit(RESTART_LINE, 1)[-1]  # this incarnation's lines
            self._joined = bool(JOIN_LINE.search(text) or REACHABLE_LINE.search(text))
        return self._joined and self.alive()


def free_ports(count: int) -> list[int]:
    """Ports that are free on 127.0.0.1 now (held open together, so they are distinct)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class LocalSwarm:
    """A context manager: on exit (normal, exception or Ctrl-C) every peer's process group is gone.

    `network` (a NetworkLab) puts peer i in its namespace; `links` (profile LinkSpecs) set each
    peer's client mode (NAT) and announced bandwidth, with or without a network.
    """

    def __init__(self, num_peers: int, run_id: str, workdir: Path, join_args: list[str] = (),
                 per_peer_args: Optional[dict[int, list[str]]] = None, startup_timeout: float = 180.0,
                 env: Optional[dict] = None, network=None, links: Optional[list] = None,
                 per_peer_program: Optional[dict[int, list[str]]] = None,
                 per_peer_env: Optional[dict[int, dict[str, str]]] = None, fork_server: bool = True,
                 forks=None):
        if num_peers < 1:
            raise ValueError("num_peers must be at least 1")
        self.run_id, self.workdir, self.startup_timeout = run_id, Path(workdir), startup_timeout
        self.env, self.network = env, network
        self.per_peer_env = per_peer_env or {}  # e.g. another cache dir: another volunteer's machine
        self.use_fork_server = fork_server
        # a ForkServer (collab.peers.forkserver): given (shared with other swarms; this one never closes it), or
        # started with the first peer and closed with the swarm
        self.forks, self.owns_forks = forks, forks is None
        self.workdir.mkdir(parents=True, exist_ok=True)
        per_peer_args = per_peer_args or {}
        ports = free_ports(num_peers) if network is None else [NAMESPACE_PORT] * num_peers
        self.peers = []
        for i in range(num_peers):
            link = links[i] if links else None
            placement = Placement(
                host=network.address(i) if network is not None else "127.0.0.1", port=ports[i],
                prefix=network.command_prefix(i) if network is not None else [],
                client_mode=bool(link and link.nat), bandwidth_mbit=link.upload_mbit if link else None)
            args = ["--run-id", run_id, *join_args, *per_peer_args.get(i, [])]
            peer = PeerProcess(i, args, self.workdir, placement)
            if per_peer_program and i in per_peer_program:
                peer.program = list(per_peer_program[i])
            self.peers.append(peer)
        for peer in self.peers:
            peer.make_identity()
        self.initial_peer: Optional[str] = None
        self.start_args: list[str] = []

    def __enter__(self) -> "LocalSwarm":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, count: Optional[int] = None, wait_peers: Optional[int] = None) -> None:
        """Start the first peer, wait for its join line, then start the others (or only `count` peers).

        All of them wait until `wait_peers` (default: `count`) peers are in the run before their first step, so
        none trains alone through the first epochs while the others are still importing torch.
        """
        count = len(self.peers) if count is None else count
        wait = str(count if wait_peers is None else wait_peers)
        self.start_args = ["--wait-peers", wait]  # what a peer started again after a failed start is given too
        first = self.peers[0]
        first.start(["--wait-peers", wait], env=self._env(0), forks=self._fork_server())
        self._wait_for_join_line(first)
        self.initial_peer = first.maddr
        for peer in self.peers[1:count]:
            self.start_peer(peer.index, ["--wait-peers", wait])

    def start_peer(self, index: int, extra: list[str] = ()) -> None:
        """Start (or restart) a peer, joining through a few running peers, as a volunteer's join line names a few:
        the first peer and others that said others can dial them (PeerProcess.joined), a spread of them by this
        peer's index. p2pd dials every initial peer and the DHT pings each: joining through all 26 started before it,
        most still starting, the last 6 of 32 peers on 2 cores failed to join (p2pd's start timed out)."""
        running = [p for p in self.peers if p.index != index and p.alive()]
        joined = [p for p in running if p.joined()]
        first, rest = [p for p in joined if p.index == 0], [p for p in joined if p.index != 0]
        random.Random(index).shuffle(rest)
        chosen = (first + rest or running)[:INITIAL_PEERS_MOST]
        others = [p.maddr for p in chosen] or [self.initial_peer]
        self.peers[index].start(["--initial-peers", *others, *extra], env=self._env(index), forks=self._fork_server())

    def _fork_server(self):
        if self.use_fork_server and self.forks is None:
            env = dict(self.env if self.env is not None else os.environ, PYTHONUNBUFFERED="1")
            try:
                self.forks = ForkServer(env, self.workdir / "forkserver.log").start()
            except RuntimeError as e:  # slower, not broken: every peer imports collab itself
                print(f"peers start as separate processes: {e}", file=sys.stderr, flush=True)
                self.use_fork_server = False
        return self.forks

    def _env(self, index: int) -> Optional[dict]:
        if index not in self.per_peer_env:
            return self.env
        return {**(self.env if self.env is not None else os.environ), **self.per_peer_env[index]}

    def _wait_for_join_line(self, peer: PeerProcess) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if JOIN_LINE.search(peer.log_text()):
                return
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

    def stop(self, grace: Optional[float] = None, most: float = LEAVE_WAIT_MOST) -> None:
        """SIGTERM (a graceful leave) to every peer, then SIGKILL to those still running once `grace` seconds
        passed with no peer leaving, or `most` in all: peers stopped at once on a machine they share leave one
        after another (32 on 2 cores: 17 overran a fixed 15 s), and while they do, the rest are given time.
        `grace` None: LEAVE_GRACE, or longer where the machine's load lengthens each peer's own grace (a SIGKILL
        before that would lose the summary its forced exit writes)."""
        if grace is None:
            grace = max(LEAVE_GRACE, leave_grace() + FORCED_EXIT_SECONDS)
        for peer in self.peers:
            if peer.alive():
                peer.signal_session(signal.SIGCONT)  # a frozen peer cannot handle SIGTERM
            peer.signal(signal.SIGTERM)
        began = last_left = time.monotonic()
        running = sum(peer.alive() for peer in self.peers)
        while running and time.monotonic() - last_left < grace and time.monotonic() - began < most:
            time.sleep(0.2)
            still = sum(peer.alive() for peer in self.peers)
            if still < running:
                running, last_left = still, time.monotonic()
        for peer in self.peers:
            peer.kill_group()
        if self.forks is not None and self.owns_forks:
            self.forks.close()
            self.forks = None
