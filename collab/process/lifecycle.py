"""Leaving cleanly: signals, a bounded shutdown, and no orphaned hivemind processes.

hivemind starts several processes per peer (the DHT, averagers) and the DHT starts p2pd. The
first Ctrl-C or SIGTERM asks the training loop to stop and leave gracefully; if that takes longer
than the grace period, or a second signal arrives, the whole process tree is killed so the peer
is gone within the promised 10 seconds, p2pd included.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Optional

import psutil

from collab.process import child_stacks
from collab.process.reaper import end_processes, remove_own_sockets, watcher_pid

GRACE_SECONDS = 7.0  # a leave's time on a machine with a core to spare
GRACE_MOST = 42.0  # on a crowded one


def leave_grace() -> float:
    """The time a leave has after a signal: 7 s, times the runnable processes per core (the 1-minute load) where they
    outnumber the cores, at most 42 s. A leave is the shutdowns of a few processes (averagers, the DHT, p2pd); on
    a machine shared N ways each gets 1/N of a core. 64 simulated peers leaving at once on 2 cores overran 7 s in
    62 cases, each a forced exit with a stacks file in /tmp; on an idle machine the grace stays 7 s."""
    try:
        per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        return GRACE_SECONDS
    return min(GRACE_MOST, GRACE_SECONDS * max(1.0, per_core))


def descendants() -> list[psutil.Process]:
    """Our process tree, less torch_shm_manager (killing it breaks torch's pipe to it and aborts this
    process with std::system_error; it exits by itself once its last client is gone) and less our
    watcher (collab.process.reaper), which must outlive us and exits by itself once we are gone."""
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    kept = []
    for child in children:
        try:
            if child.name() != "torch_shm_manager" and child.pid != watcher_pid():
                kept.append(child)
        except psutil.Error:
            pass
    return kept


def reap_children(timeout: float = 2.0) -> None:
    """Terminate, then kill, every process this one started (directly or not)."""
    end_processes(descendants(), timeout)


class _OrphanedRequestFilter(logging.Filter):
    """Drops the DHT's traceback for a request whose sender (one of our averager processes) already exited.

    When a peer shuts down, an averager may leave a request in the DHT's pipe; unpickling it then fails
    with a connection error. It is harmless, but hivemind logs a full traceback for it at exit.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, (ConnectionError, FileNotFoundError, EOFError))


class _ClosedLoopChildFilter(logging.Filter):
    """Drops asyncio's "Loop <...> that handles pid N is closed": a DHT process whose p2pd failed to start closes its
    loop before p2pd's exit is reaped, and asyncio says so on stderr, a second line beside collab's one-line error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "Loop %r that handles pid %r is closed"


def quiet_orphaned_requests() -> None:
    """Call before the DHT process is forked, so that it inherits the filters."""
    for name, kind in (("hivemind.dht.dht", _OrphanedRequestFilter), ("asyncio", _ClosedLoopChildFilter)):
        logger = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())


_early_stop = threading.Event()  # a SIGINT or SIGTERM that came before `join` installed its own handlers


def remember_early_signals() -> threading.Event:
    """From now on SIGINT and SIGTERM only set the returned event (`join` reads it once it is set up). Called again
    (a fork server's child calls it at once, then collab's CLI), it keeps what came before."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: _early_stop.set())
    return _early_stop


class StopOnSignal:
    """Sets `stop` on SIGINT/SIGTERM; forces the exit if the graceful path overruns."""

    def __init__(self, stop: threading.Event, grace: Optional[float] = None):
        """`grace`: seconds the graceful path has after the first signal; None: leave_grace() at that signal."""
        self.stop, self.grace = stop, grace
        self._signals = 0
        self._watchdog = None
        self._on_stop: list = []  # run once, at the first signal: e.g. abort averaging rounds in flight
        self._before_force_exit: list = []  # e.g. write the exit summary, so a forced exit is reported as such
        # one ending only: a forced exit that began (its summary written) ends in exit 1, even if the graceful path
        # finishes meanwhile; a graceful path that finished first is never overwritten by the watchdog
        # (re-entrant: a second signal's handler may run on the main thread while it is inside cancel())
        self._ending = threading.RLock()
        self._cancelled = False
        self._forced_at: Optional[float] = None  # time.monotonic() when the watchdog fires
        self._forcing = threading.Event()  # a forced exit began: it is killing this peer's hivemind processes

    _active: "StopOnSignal | None" = None

    @classmethod
    def on_stop(cls, callback) -> None:
        if cls._active is not None:
            cls._active._on_stop.append(callback)

    @classmethod
    def budget(cls, wanted: float, keep: float) -> float:
        """How long a leave may wait for something (at most `wanted` s): after a signal, only what the grace has
        left beyond `keep` s for the steps after it. A wait past the grace is a forced exit: exit 1, and the exit
        summary's last figures lost."""
        active = cls._active
        if active is None or active._forced_at is None:
            return wanted
        return min(wanted, max(0.0, active._forced_at - time.monotonic() - keep))

    @classmethod
    def wait_out_forced_exit(cls, at_most: float) -> bool:
        """If a forced exit is under way, wait (at most `at_most` s) for it to end this process; whether one was.
        An error that its killing of the hivemind processes causes on another thread (a pipe to one of them
        broken) is that exit, not a bug to report (64 peers leaving at once on 2 cores left an empty crash report,
        cut off by the exit)."""
        active = cls._active
        if active is None or not active._forcing.is_set():
            return False
        time.sleep(at_most)  # os._exit comes first, unless the forced exit itself hangs
        return True

    @classmethod
    def before_force_exit(cls, callback) -> None:
        if cls._active is not None:
            cls._active._before_force_exit.append(callback)

    def install(self) -> "StopOnSignal":
        self._owner = os.getpid()
        if child_stacks.wanted():  # before hivemind's processes fork: a forced exit then has their stacks too
            child_stacks.arm()
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)
        StopOnSignal._active = self
        return self

    @classmethod
    def reinstall(cls) -> None:
        """hivemind's averagers set SIGINT to SIG_IGN in the *calling* process when they start; undo that."""
        if cls._active is not None and cls._active._owner == os.getpid():
            cls._active.install()

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self._owner:
            # a hivemind process forked from this one inherited the handler: it is being reaped, so just go
            os._exit(128 + signum)
        self._signals += 1
        self.stop.set()
        if self._signals > 1:
            self._force_exit(f"second {signal.Signals(signum).name}: leaving now")
        if self._watchdog is None:
            print(f"\n{signal.Signals(signum).name} received: leaving the swarm (again to force)...",
                  file=sys.stderr, flush=True)
            grace = leave_grace() if self.grace is None else self.grace
            self._forced_at = time.monotonic() + grace
            self._watchdog = threading.Timer(grace, self._force_exit, args=("graceful shutdown overran",))
            self._watchdog.daemon = True
            self._watchdog.start()
            # not here: a handler runs on the main thread between two of its bytecodes, maybe inside a lock a
            # callback needs (SIGTERM can come while the main thread holds hivemind's MPFuture update lock, and
            # abort_rounds' cancel would wait for it inside the handler until the watchdog fires: a deadlock)
            threading.Thread(target=self._run_on_stop, name="collab-on-stop", daemon=True).start()

    def _run_on_stop(self) -> None:
        for callback in self._on_stop:
            _quietly(callback)

    def cancel(self) -> None:
        """The graceful path is done. A forced exit under way is let finish (this waits for it: it exits 1)."""
        with self._ending:
            self._cancelled = True
        if self._watchdog is not None:
            self._watchdog.cancel()

    def _force_exit(self, reason: str) -> None:
        self._ending.acquire()  # held until os._exit: cancel() then waits, never exits 0 after a "forced exit"
        if self._cancelled:  # the graceful path finished while the timer fired: its summary stands
            self._ending.release()
            return
        self._forcing.set()
        for callback in self._before_force_exit:
            _quietly(callback, reason)

        path = _write_stacks()
        where = f" (stacks in {path})" if path else ""
        print(f"{reason}; stopping hivemind processes{where}", file=sys.stderr, flush=True)
        reap_children(timeout=1.0)
        remove_own_sockets()
        os._exit(1)


def _write_stacks() -> Optional[str]:
    """Where it hung is what a bug report needs: every thread's stack, its hivemind processes' too, in a file; its
    path, or None where it could not be written (a full disk: the forced exit must still reach its end)."""
    try:
        fd, path = tempfile.mkstemp(prefix="collab-shutdown-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write(f"process {os.getpid()} (this peer):\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.write(child_stacks.collect(descendants()))
        return path
    except (OSError, psutil.Error):
        return None


def _quietly(callback, *args) -> None:
    """A shutdown helper must not turn a clean leave into a traceback."""
    try:
        callback(*args)
    except Exception as e:  # noqa: BLE001 - reported, and leaving goes on
        print(f"while leaving: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
