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
  removes the socket files in /tmp that they and the main process listened on (read at each look), and the
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


def announce_socket(path: str) -> None:
    """Tell this process's watcher of a socket file it just made (a client of p2pd): its looks read them too, but up
    to LOOK_AT_MOST_SECONDS apart once the tree is quiet, and a gossip peer killed (kill -9) after its first exchange
    made a client and before the next look left that file in /tmp (CI)."""
    if _watcher is not None and _watcher.stdin is not None and _watched_pid == os.getpid():
        try:
            os.write(_watcher.stdin.fileno(), f"{path}\n".encode())
        except OSError:  # the watcher is gone: nothing to tell
            pass


def watcher_pid() -> Optional[int]:
    """The watcher of this process, which this process's own reaping must leave alone."""
    return _watcher.pid if _watcher is not None and _watched_pid == os.getpid() else None


class _Watch:
    def __init__(self, main_pid: int):
        import psutil

        self.main = psutil.Process(main_pid)
        self.noted: dict[int, psutil.Process] = {}  # psutil.Process.is_running() tells a reused pid apart
        self.announcements_open = True  # forks write their pids to our stdin
        self.news = 0  # processes noted so far (announced or found)
        # the main process's own socket files (its clients of p2pd: a state served, gossip's exchanges), every one seen
        # at a look: once it is killed they can no longer be read (nor while it dies), and a kill -9 left them in /tmp
        self.main_sockets: set[str] = set()
        self.note_main_sockets()
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
            if line.startswith(HIVEMIND_SOCKETS):  # announce_socket's: a file the main process made
                self.main_sockets.add(line)
                continue
            try:
                self._note(psutil.Process(int(line)))
            except (ValueError, psutil.Error):
                pass

    def note_descendants(self) -> None:
        import psutil

        self.note_main_sockets()
        try:
            for child in self.main.children(recursive=True):
                if child.pid != os.getpid():
                    self._note(child)
        except psutil.Error:
            pass

    def note_main_sockets(self) -> None:
        for paths in hivemind_sockets([self.main]).values():
            self.main_sockets.update(paths)

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
    remove_sockets_of({main_pid: sorted(watch.main_sockets)})  # (one that left gracefully removed its own)
    if len(argv) > 1 and not watch.left_behind():  # (a process that would not die may still use the folder)
        remove_multiprocessing_folder(argv[1])
    return 0


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
