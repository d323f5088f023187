"""A lock shared by a process and the processes it forks that a holder's death releases.

hivemind guards each MPFuture update (a result sent down the pipe to the future's origin process) with one
multiprocessing.Lock, shared by every process forked from the one that imported hivemind: a peer's trainer, its DHT
process and its averagers. A semaphore does not know its holder: a process killed while it held the lock (a SIGTERM
from a leave that ran out of time, a kill -9, an interpreter exit that stops a daemon thread mid-send) leaves it
held for good, and every other process then blocks at its next update - a DHT that never answers, an averager whose
round never returns. In CI a test worker's DHT processes hung that way in `DHT.__init__`, test after test.

Here the kernel does the bookkeeping: a POSIX record lock (fcntl) on an unlinked file belongs to the process that
took it and goes when that process ends, however it ends. Record locks do not exclude the threads of one process,
so a thread lock does that, made anew in each forked child (a thread that held it in the parent is not there).

A lock whose section does work that a fork must not cut in half (SharedBytes': torch's share_memory_, whose own
locks a child would inherit held) is made `quiet_at_fork`: a fork waits, up to FORK_WAIT, until no thread of the
forking process is inside it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import tempfile
import threading

FORK_WAIT = 2.0  # seconds a fork waits for a quiet_at_fork lock's section to end (then it forks anyway)


class DeathSafeLock:
    """A lock between processes and threads, released when its holder dies. Made before the processes that share it
    are forked (they inherit the file); `with` or acquire/release, like multiprocessing's lock."""

    def __init__(self, quiet_at_fork: bool = False):
        self._file = tempfile.TemporaryFile()  # unlinked at once: nothing is left in /tmp, whatever happens
        self._threads = threading.Lock()
        self._held_for_fork = False
        if quiet_at_fork:
            os.register_at_fork(before=self._before_fork, after_in_parent=self._after_fork_in_parent,
                                after_in_child=self._forked)
        else:
            os.register_at_fork(after_in_child=self._forked)

    def _before_fork(self) -> None:
        self._held_for_fork = self._threads.acquire(timeout=FORK_WAIT)

    def _after_fork_in_parent(self) -> None:
        if self._held_for_fork:
            self._held_for_fork = False
            self._threads.release()

    def _forked(self) -> None:
        self._threads, self._held_for_fork = threading.Lock(), False

    def acquire(self, block: bool = True) -> bool:
        if not self._threads.acquire(block):
            return False
        try:
            fcntl.lockf(self._file.fileno(), fcntl.LOCK_EX if block else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            self._threads.release()
            if not block and e.errno in (errno.EACCES, errno.EAGAIN):  # another process holds it
                return False
            raise
        except BaseException:
            self._threads.release()
            raise
        return True

    def release(self) -> None:
        try:
            fcntl.lockf(self._file.fileno(), fcntl.LOCK_UN)
        finally:
            self._threads.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *_exc) -> None:
        self.release()
