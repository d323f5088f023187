"""Start simulated peers in a fraction of a second: fork them from one process that imported collab once.

A `collab join` spends about 7 CPU-seconds importing torch, transformers and hivemind before it does
anything. A local swarm of N peers on a laptop (or CI's 2 cores) would pay that N times, and every restart
of a churned peer again, while the peers already running starve. The fork server imports it
all once; each peer is then a fork of it that runs the ordinary CLI, with its own session, log, and
environment, so to the swarm (and to the user) it is the same `collab join` a volunteer runs.

What makes a fork equivalent to a fresh process:
- the server only imports: it runs no torch op and starts no thread of its own (a fork of a process
  with OpenMP workers can hang), and it reads every environment variable that a library reads at import
  time from the swarm's environment, the same for every peer. A peer whose environment differs in
  anything but collab's own runtime settings (COLLAB_*) is started as a plain process instead;
- hivemind keeps process-shared locks at module level (MPFuture's, its executor's): each fork gets
  fresh ones, as a fresh import would, so a peer frozen or killed while holding one cannot block another;
- `python -m collab join ...`, `python SCRIPT.py ...` (the fault-injection wrappers) and a network
  namespace (`ip netns exec NS`, entered with setns) are supported; any other command is not forked.

The server reaps its children and reports each exit status, so `ForkedProcess` answers poll()/wait()
like a Popen. It ends when its stdin closes, when the swarm stops or the process that started it dies;
peers still running then get SIGTERM (they leave gracefully), and SIGKILL 15 s later.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Optional

from collab.process.defaults import set_process_defaults

READY_TIMEOUT = 180.0  # the server imports torch, transformers and hivemind: a loaded CI machine is slow
CLONE_NEWNET = 0x40000000
LEAVE_GRACE = 15.0  # seconds a peer has to leave when its launcher goes away
RUNTIME_ENV_PREFIX = "COLLAB_"  # read when used, not at import: may differ between peers of one server


class ForkedProcess:
    """The part of subprocess.Popen that launchers use, for a peer forked by the server."""

    def __init__(self, pid: int, args: list[str], server: "ForkServer"):
        self.pid, self.args, self._server = pid, args, server
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if not self._server.wait_for_exit(self.pid, None if deadline is None else deadline - time.monotonic()):
                if self.poll() is None:
                    raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # once reaped, the pid may belong to someone else
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The launcher's side: start the server, ask it for peers, learn when they exit."""

    def __init__(self, env: dict, log_path: Path):
        self.env = dict(env)
        self.log_path = Path(log_path)
        self._process: Optional[subprocess.Popen] = None
        self._exits: dict[int, int] = {}
        self._replies: list[str] = []
        self._changed = threading.Condition()
        self._reader: Optional[threading.Thread] = None
        self._eof = False  # the server's stdout closed: it is gone, no more replies or exits will come
        self._write_lock = threading.Lock()

    def start(self) -> "ForkServer":
        with open(self.log_path, "ab") as log:
            # its own session: Ctrl-C in a terminal reaches the launcher, which stops the peers in order
            self._process = subprocess.Popen([sys.executable, "-m", "collab.peers.forkserver"], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, stderr=log, env=self.env,
                                             start_new_session=True)
        # ends by itself at end of file: when the server exits
        self._reader = threading.Thread(target=self._read_replies, name="forkserver-replies", daemon=True)
        self._reader.start()
        if self._reply(READY_TIMEOUT) != "ready":
            self.close()
            raise RuntimeError(f"the fork server did not start; see {self.log_path}")
        return self

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None and not self._eof

    @property
    def pid(self) -> Optional[int]:
        return None if self._process is None else self._process.pid

    def can_fork(self, command: list[str], env: dict) -> bool:
        return self.why_not(command, env) is None

    def why_not(self, command: list[str], env: dict) -> Optional[str]:
        """Why `command` in `env` cannot be a fork of this server (None: it can)."""
        if self._process is None:
            return "the fork server is not running"
        if _plan(command) is None:
            return f"it runs {command[0]}, not this Python's collab or a script"
        mine, theirs = dict(_env_key(self.env)), dict(_env_key(env))
        differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        if differ:
            return f"its environment differs from the server's in {', '.join(differ)}"
        return None

    def spawn(self, command: list[str], env: dict, log_path: Path, err_path: Optional[Path] = None) -> ForkedProcess:
        """`command` in a fork, its stdout and stderr appended to `log_path` (stderr to `err_path` if given)."""
        netns, kind, target, argv = _plan(command)
        request = dict(netns=netns, kind=kind, target=target, argv=argv, log=str(log_path), env=env,
                       err=None if err_path is None else str(err_path))
        with self._write_lock:
            self._process.stdin.write((json.dumps(request) + "\n").encode())
            self._process.stdin.flush()
            reply = self._reply(30.0)
        if reply is None or not reply.startswith("pid "):
            raise RuntimeError(f"the fork server could not start {' '.join(command)}: {reply}")
        return ForkedProcess(int(reply.split()[1]), command, self)

    def exit_code(self, pid: int) -> Optional[int]:
        with self._changed:
            return self._exits.get(pid)

    def wait_for_exit(self, pid: int, timeout: Optional[float]) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: pid in self._exits or self._eof,
                                          None if timeout is None else max(0.0, timeout)) and pid in self._exits

    def close(self, timeout: float = 2 * LEAVE_GRACE + 5) -> None:
        if self._process is None:
            return
        try:
            self._process.stdin.close()
        except OSError:
            pass
        try:
            self._process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if self._reader is not None:
            self._reader.join(timeout=timeout)
        self._process = None

    def _read_replies(self) -> None:
        for raw in self._process.stdout:
            line = raw.decode(errors="replace").strip()
            with self._changed:
                if line.startswith("exit "):
                    _, pid, code = line.split()
                    self._exits[int(pid)] = int(code)
                else:
                    self._replies.append(line)
                self._changed.notify_all()
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    def _reply(self, timeout: float) -> Optional[str]:
        with self._changed:
            if self._changed.wait_for(lambda: self._replies or self._eof, timeout) and self._replies:
                return self._replies.pop(0)
        return None


_shared: dict[tuple, ForkServer] = {}
_shared_lock = threading.Lock()


def shared_server(env: dict) -> ForkServer:
    """This process's started server for `env`, started on first use and closed when the process exits.

    A process that runs one swarm after another (the test suite, a benchmark) then imports collab once: a fresh
    server takes ~7 s of a 2-core machine before its first peer starts. Swarms that use it must not close it."""
    key = _env_key(env)
    with _shared_lock:
        server = _shared.get(key)
        if server is None or not server.alive():
            log = Path(tempfile.gettempdir()) / f"collab-forkserver-{os.getpid()}-{len(_shared)}.log"
            server = ForkServer(env, log).start()
            if not _shared:
                atexit.register(close_shared_servers)
            _shared[key] = server
        return server


def _env_key(env: dict) -> tuple:
    """What a fork inherits from the server's imports: the environment less collab's runtime settings."""
    return tuple(sorted((k, v) for k, v in env.items() if not k.startswith(RUNTIME_ENV_PREFIX)))


def shared_server_pids() -> set[int]:
    with _shared_lock:
        return {server.pid for server in _shared.values() if server.alive()}


def close_shared_servers() -> None:
    with _shared_lock:
        servers = list(_shared.values())
        _shared.clear()
    for server in servers:
        server.close()
        if server.log_path.exists() and server.log_path.stat().st_size == 0:
            server.log_path.unlink()


def _plan(command: list[str]) -> Optional[tuple]:
    """(netns, kind, target, argv) for a command the server can run in a fork; None for any other."""
    netns = None
    if command[:3] == ["ip", "netns", "exec"] and len(command) > 3:
        netns, command = command[3], command[4:]
    if not command or command[0] != sys.executable:
        return None
    if command[1:3] == ["-m", "collab"]:
        return netns, "collab", "", command[3:]
    if len(command) > 1 and command[1].endswith(".py") and Path(command[1]).is_file():
        return netns, "script", str(Path(command[1]).resolve()), command[2:]
    return None


# ---- the server process ---------------------------------------------------------------------------------

PRELOAD = ["hivemind", "transformers.models.albert.modeling_albert", "collab.commands.join", "collab.run.gate",
           "collab.run.joining", "collab.tasks.albert", "collab.train.trainer"]


def _preload() -> None:
    set_process_defaults()  # hivemind reads these at import
    for module in PRELOAD:
        importlib.import_module(module)


def _enter_netns(name: str) -> None:
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if hasattr(os, "setns"):
            os.setns(fd, CLONE_NEWNET)
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns into network namespace {name}: {os.strerror(error)}")
    finally:
        os.close(fd)


def _child(request: dict) -> None:
    """In the fork: become the peer, run it, and never return into the server's loop."""
    code = 1
    try:
        if request["kind"] == "collab" and request["argv"][:1] == ["join"]:
            from collab.process.lifecycle import remember_early_signals

            remember_early_signals()  # a SIGTERM from now on is a request to leave, which `join` reads
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # (blocked by the server for the fork)
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        err = os.open(request["err"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if request.get("err") else log
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(err, 2)
        for fd in {log, err, null}:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(request["env"])
        if request["netns"]:
            _enter_netns(request["netns"])
        # imported here, not at the top: the server sets every process default before hivemind is imported
        from collab.hivemind_hooks.patches import fresh_process_state

        fresh_process_state()
        # the command runs as `python -m collab ...` or `python script.py ...` would (its SystemExit is its code)
        if request["kind"] == "collab":
            sys.argv = ["collab", *request["argv"]]
            runpy.run_module("collab", run_name="__main__", alter_sys=True)
        else:
            sys.argv = [request["target"], *request["argv"]]
            sys.path.insert(0, str(Path(request["target"]).parent))
            runpy.run_path(request["target"], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the peer's log is where its crash must show
        traceback.print_exc()
    finally:
        try:
            from collab.process.reaper import remove_own_multiprocessing_folder

            remove_own_multiprocessing_folder()  # (os._exit skips multiprocessing's own removal)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when peers stop
    _preload()
    out = sys.stdout.buffer
    children: set[int] = set()

    def say(line: str) -> None:
        out.write((line + "\n").encode())
        out.flush()

    def reap() -> None:
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            children.discard(pid)
            say(f"exit {pid} {os.waitstatus_to_exitcode(status)}")

    say("ready")
    pending = b""
    while True:
        readable = select.select([0], [], [], 0.1)[0]
        reap()
        if not readable:
            continue
        data = os.read(0, 65536)
        if not data:  # the launcher closed our stdin, or died: its peers leave with it
            _end(children, reap)
            return
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            if request["netns"] and not os.path.exists(f"/run/netns/{request['netns']}"):
                say(f"error: no network namespace {request['netns']}")
                continue
            out.flush()
            # the launcher may signal the peer as soon as it reads its pid (a simulation that ends as churn restarts
            # a peer): held until the child has its handlers, it cannot kill it before (test_churn's restarted peer
            # was "killed by SIGTERM" with an empty log)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            try:
                pid: Optional[int] = os.fork()
            except OSError as error:  # out of processes or memory: this peer is not started, the others go on
                pid = None
                say(f"error: cannot fork a peer: {error}")
            if pid == 0:
                _child(request)  # never returns
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            if pid is not None:
                children.add(pid)
                say(f"pid {pid}")


def _end(children: set[int], reap, grace: float = LEAVE_GRACE) -> None:
    """SIGTERM (a graceful leave) to every peer still running, SIGKILL to what is left after `grace` s."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for pid in list(children):
            try:
                os.kill(pid, signal.SIGCONT)  # a frozen peer cannot act on SIGTERM
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while children and time.monotonic() < deadline:
            time.sleep(0.1)
            reap()


if __name__ == "__main__":
    _serve()
