"""No ghosts: when a collab process dies by any signal, SIGKILL included, everything it started dies too.

hivemind starts a DHT process (which starts p2pd) and two averager processes per peer. Our DHT
process sits in a process group of its own (so Ctrl-C reaches only the trainer, which leaves
gracefully), and none of them watches its parent. A main process killed by the OOM killer or
`kill -9` therefore left all four running, re-parented to init: a ghost node in the swarm holding
the peer's ports. A parent-death signal set in each child would miss p2pd (hivemind starts it, not
us), so one small watcher process does the job for all of them:

- `watch_this_process()` starts `python -m collab.process.reaper PID` once per process, before hivemind;
- every process forked from the main one (hivemind's DHT and averagers) writes its pid to the
  watcher's stdin the moment it is born (an at-fork hook), and the watcher also notes the main
  process's descendants (what it spawned otherwise, e.g. simulated peers): once re-parented to init they
  can no longer be found through the tree. It looks every half second while the tree changes, and less
  often, up to every LOOK_AT_MOST_SECONDS, while it does not: each look reads every process's /proc
  entry (psutil; this kernel has no /proc/PID/task/TID/children), 5 ms with 96 processes on the machine,
  and a machine simulating 64 peers runs ~400, each peer with a watcher. Otherwise it blocks on a pidfd
  of the main process;
- when the main process is gone, it sends SIGTERM to every noted process that still runs (and to
  their own children, which catches a p2pd started since the last look), then SIGKILL after 3 s, and
  removes the socket files in /tmp that they listened on (read just before), then any made since the main process
  started that nobody is bound to any more (the main process's own, which can no longer be read from it), and the
  main process's own multiprocessing folder (pymp-*).

A main process that exits normally has already shut its children down; the watcher then finds
nothing left and exits at once. It ignores SIGINT, SIGTERM and SIGHUP: Ctrl-C in a terminal or a
`docker stop` reaches the whole group, and the watcher must outlive the main process to do its job.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from typing import Optional

# psutil is imported inside the functions that use it, which run in the watcher process and when reaping: collab.cli
# imports this module for every command, 'collab --help' included

LOOK_EVERY_SECONDS = 0.5
LOOK_AT_MOST_SECONDS = 8.0  # after looks that found nothing new, each one twice as long after the last
KILL_AFTER_SECONDS = 3.0

_watcher: Optional[subprocess.Popen] = None
_watched_pid: Optional[int] = None  # a forked child is another process: it would need a watcher of its own
_own_folder: list[str] = []  # the watched process's own multiprocessing folder, if it made one (see below)


def watch_this_process() -> None:
    """Start the watcher for this process, once. Cheap: a small Python process that mostly sleeps."""
    global _watcher, _watched_pid
    if _watched_pid == os.getpid():
        return
    _watched_pid = os.getpid()
    _own_folder[:] = _own_multiprocessing_folder()
    _watcher = subprocess.Popen([sys.executable, "-m", "collab.process.reaper", str(os.getpid())] + _own_folder,
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    os.register_at_fork(after_in_child=_announce_fork)


def _own_multiprocessing_folder() -> list[str]:
    """multiprocessing's temp folder (pymp-*) of this process, made now if it has none yet: its sockets (the resource
    sharer's, hivemind's averagers pass connections through it) live there, and only a normal exit removes it, which
    a peer's os._exit, a SIGTERM or a SIGKILL skip: every peer of a simulation left one in /tmp. The watcher removes
    it once this process and all its forks are gone. One this process inherited (it was forked from a process that
    had one) belongs to that process and its other forks: left alone ([])."""
    from multiprocessing import process, util

    if process.current_process()._config.get("tempdir") is not None:
        return []
    return [util.get_temp_dir()]


def _announce_fork() -> None:
    """In a child just forked from the watched process (or from one of its forks): tell the watcher our pid.
    A polled list would miss a child born in the last half second before a SIGKILL."""
    if _watcher is not None and _watcher.stdin is not None:
        try:
            os.write(_watcher.stdin.fileno(), f"{os.getpid()}\n".encode())
        except OSError:  # the watcher is gone: nothing to tell
            pass


def watcher_pid() -> Optional[int]:
    """The watcher of this process, which this process's own reaping must leave alone."""
    return _watcher.pid if _watcher is not None and _watched_pid == os.getpid() else None


class _Watch:
    def __init__(self, main_pid: int):
        import psutil

        self.main = psutil.Process(main_pid)
        self.main_started = self.main.create_time()
        self.noted: dict[int, psutil.Process] = {}  # psutil.Process.is_running() tells a reused pid apart
        self.announcements_open = True  # forks write their pids to our stdin
        self.news = 0  # processes noted so far (announced or found)
        try:
            self.pidfd: Optional[int] = os.pidfd_open(main_pid)
        except (AttributeError, OSError):  # no pidfd on this kernel or Python: poll instead
            self.pidfd = None

    def main_exited(self, within: float) -> bool:
        """Waits up to `within` seconds, noting the pids that forks announce meanwhile."""
        waiting_on = ([sys.stdin.fileno()] if self.announcements_open else []) + \
            ([self.pidfd] if self.pidfd is not None else [])
        ready = select.select(waiting_on, [], [], within)[0]
        if self.announcements_open and sys.stdin.fileno() in ready:
            self.note_announced()
        if self.pidfd is not None:
            return self.pidfd in ready
        return not self.main.is_running()

    def note_announced(self) -> None:
        import psutil

        try:
            data = os.read(sys.stdin.fileno(), 65536)
        except OSError:
            return
        if not data:  # every writer closed the pipe: nothing more will be announced
            self.announcements_open = False
            return
        for line in data.decode(errors="replace").splitlines():
            try:
                self._note(psutil.Process(int(line)))
            except (ValueError, psutil.Error):
                pass

    def note_descendants(self) -> None:
        import psutil

        try:
            for child in self.main.children(recursive=True):
                if child.pid != os.getpid():
                    self._note(child)
        except psutil.Error:
            pass

    def _note(self, proc) -> None:
        if proc.pid not in self.noted:
            self.noted[proc.pid] = proc
            self.news += 1

    def left_behind(self) -> list:
        """Noted processes that still run, and their children (p2pd may have started after the last look)."""
        import psutil

        found: dict[int, psutil.Process] = {}
        for proc in self.noted.values():
            try:
                if proc.is_running():
                    found[proc.pid] = proc
                    for child in proc.children(recursive=True):
                        found.setdefault(child.pid, child)
            except psutil.Error:
                pass
        found.pop(os.getpid(), None)
        return list(found.values())


def next_look(every: float, found_new: bool) -> float:
    """Seconds until the next look at the main process's descendants: soon while they change (a peer starting its
    DHT, p2pd and averagers), then twice as long after each look that found nothing new, up to LOOK_AT_MOST_SECONDS."""
    return LOOK_EVERY_SECONDS if found_new else min(2 * every, LOOK_AT_MOST_SECONDS)


HIVEMIND_SOCKETS = "/tmp/hivemind-"  # hivemind's P2P puts p2pd's socket and each client's there (_UNIX_SOCKET_PREFIX)


def end_processes(processes: list, timeout: float = KILL_AFTER_SECONDS) -> None:
    """SIGTERM, then SIGKILL whatever still runs after `timeout` seconds (psutil.Process objects); then remove the
    socket files hivemind's processes among them listened on (remove_sockets_of)."""
    import psutil

    sockets = hivemind_sockets(processes)
    for proc in processes:
        try:
            proc.send_signal(signal.SIGCONT)  # a frozen process cannot act on SIGTERM
            proc.terminate()
        except psutil.Error:
            pass
    alive = running_after(processes, timeout)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    remove_sockets_of(sockets, still_running=running_after(alive, timeout))


def running_after(processes: list, timeout: float) -> list:
    """Those of `processes` still running after up to `timeout` s; this process's children among them are reaped. A
    zombie another process should reap has ended: psutil's wait alone waited out the whole timeout for one (a p2pd
    whose DHT process died before it, in a container whose first process reaps nothing)."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        _, alive = psutil.wait_procs(processes, timeout=0.05)
        processes = [proc for proc in alive if is_running(proc) or not _reaped_or_not_ours(proc)]
        if not processes or time.monotonic() >= deadline:
            return processes


def _reaped_or_not_ours(zombie) -> bool:
    """Whether a zombie is done with: reaped here if it is this process's child, or another's (ended all the same, and
    never reaped by this process). A child whose main thread exited while its other threads still end shows as a zombie
    before it can be reaped (a CI run found one so, after psutil's wait(timeout=0) gave up on it): it is waited for."""
    try:
        pid, _ = os.waitpid(zombie.pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return pid != 0


def hivemind_sockets(processes: list) -> dict[int, list[str]]:
    """The socket files in /tmp that hivemind's processes among `processes` listen on (p2pd's, and each p2pd
    client's), by process id: read before those processes are ended, since an ended process no longer shows them."""
    import psutil

    sockets = {}
    for proc in processes:
        try:
            sockets[proc.pid] = [c.laddr for c in proc.net_connections(kind="unix")
                                 if isinstance(c.laddr, str) and c.laddr.startswith(HIVEMIND_SOCKETS)]
        except psutil.Error:
            pass
    return sockets


def is_running(proc) -> bool:
    """Whether a process (psutil's, or a started multiprocessing.Process) still runs: a zombie has ended (its parent
    has yet to reap it, or in a container whose first process reaps nothing, never will)."""
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
    except AttributeError:  # a multiprocessing.Process has no status: it was alive when the caller asked
        return True


def remove_own_sockets() -> None:
    """Remove the socket files of hivemind's p2pd clients in this process, which is about to end with os._exit (no
    client's __del__ runs then): hivemind's cached replica, or a service thread's client still closing."""
    import psutil

    remove_sockets_of(hivemind_sockets([psutil.Process()]))


def remove_own_multiprocessing_folder() -> None:
    """Remove this process's own multiprocessing folder, as it is about to end with os._exit (which skips
    multiprocessing's own removal: collab.cli's hard exit, a fork server's peer): a command that ended before its
    watcher had begun watching (bad input) left it.
    Not while a child other than the watcher still runs (a fork shares it): the watcher removes it then."""
    import psutil

    if _watched_pid != os.getpid() or not _own_folder:
        return
    try:
        children = [c for c in psutil.Process().children(recursive=True) if c.pid != watcher_pid()]
    except psutil.Error:
        return
    if not any(is_running(child) for child in children):
        remove_multiprocessing_folder(_own_folder[0])


def remove_sockets_of(sockets: dict[int, list[str]], still_running: list = ()) -> None:
    """Remove the socket files of processes that were ended (hivemind_sockets' answer; not those still running):
    hivemind removes them only on a graceful shutdown, and every process ended from outside left its file in /tmp."""
    running = {proc.pid for proc in still_running if is_running(proc)}
    for path in (path for pid, paths in sockets.items() if pid not in running for path in paths):
        try:
            os.unlink(path)
        except OSError:
            pass


def main(argv: list[str]) -> int:
    import psutil

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    main_pid = int(argv[0])
    if os.getppid() != main_pid:
        return 0  # the main process is already gone: nothing we noted, nothing we can tell apart
    try:
        watch = _Watch(main_pid)
    except psutil.Error:
        return 0
    every, news = LOOK_EVERY_SECONDS, 0
    while not watch.main_exited(within=every):
        watch.note_descendants()
        every, news = next_look(every, found_new=watch.news > news), watch.news
    os.set_blocking(sys.stdin.fileno(), False)
    watch.note_announced()  # a fork announced just before the main process died
    left = watch.left_behind()
    if left:
        end_processes(left)
    # the main process's own files (its clients of p2pd: a state served, gossip's exchanges) can no longer be read
    # from it, nor those of a child that ended on its own (one that left gracefully removed its own)
    remove_unbound_sockets(made_since=watch.main_started)
    if len(argv) > 1 and not watch.left_behind():  # (a process that would not die may still use the folder)
        remove_multiprocessing_folder(argv[1])
    return 0


def remove_unbound_sockets(made_since: float, recheck_after: float = 0.2) -> None:
    """Remove hivemind's socket files in /tmp made since `made_since` (the main process's start) that no socket is bound
    to, in any network namespace. A killed process's files can no longer be read from it: a client of p2pd made
    between two looks was known to nobody, and a gossip peer's kill -9 left one in CI. A file nobody is bound to can
    never be listened on again, whoever made it; one made a moment ago may not be bound yet, so a file must be unbound
    at two readings `recheck_after` s apart. (A socket file's mtime is its bind's time. psutil's start time may be up
    to 1 s early: a file made just before the main process started may go too.)"""
    folder, prefix = os.path.split(HIVEMIND_SOCKETS)
    candidates = set()
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        try:
            if name.startswith(prefix) and os.stat(path).st_mtime >= made_since:
                candidates.add(path)
        except OSError:  # removed meanwhile
            continue
    candidates -= bound_unix_paths()
    if candidates:
        time.sleep(recheck_after)
        for path in candidates - bound_unix_paths():
            try:
                os.unlink(path)
            except OSError:
                pass


def bound_unix_paths() -> set[str]:
    """Paths of the unix sockets bound in any network namespace: /proc/net/unix lists only the reader's own, and peers
    in namespaces of their own (a network lab, containers) share this /tmp."""
    tables, seen = ["/proc/self/net/unix"], set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            namespace = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:  # gone, or not ours to read
            continue
        if namespace not in seen:
            seen.add(namespace)
            tables.append(f"/proc/{pid}/net/unix")
    bound = set()
    for path in tables:
        try:
            with open(path) as table:
                bound |= {fields[-1] for fields in (line.split() for line in table.readlines()[1:]) if len(fields) >= 8}
        except OSError:
            continue
    return bound


def remove_multiprocessing_folder(path: str) -> None:
    """Remove the main process's own pymp-* folder (see _own_multiprocessing_folder); nothing else."""
    import shutil
    import tempfile

    folder = os.path.realpath(path)
    if os.path.dirname(folder) == os.path.realpath(tempfile.gettempdir()) and \
            os.path.basename(folder).startswith("pymp-"):
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
