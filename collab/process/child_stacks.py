"""A forced exit's stacks file holds the stacks of the peer's hivemind processes too, not only its own.

A peer that hangs usually hangs in one of its hivemind processes: the gradient averager's never said it was ready, and
the peer's own stacks showed only the trainer waiting for it (the 12-peer scale run of 2026-12-08). Where the child
itself waited was guessed, not read. Now each process forked from an armed peer dumps every thread's stack when it
gets SIGUSR1 (faulthandler: it works in a process whose threads all wait on locks), into one unnamed file the peer
holds open, so nothing is left on disk until a forced exit copies it into its stacks file. Only the armed process's
own children get the handler (a grandchild's is taken off again: a peer that `collab simulate` forked arms a file of
its own), and only a child that catches SIGUSR1 (its /proc status says so) is signalled: a program exec'd in between
keeps the default action (exit), and p2pd (Go catches every signal) is no child of the peer's main process.

Off unless COLLAB_CHILD_STACKS=1 (a peer started with it arms itself; `collab simulate` passes it to its peers): 32
linreg peers on 2 cores (`benchmarks/scale.py --peers 32 --duration 180`) made 628 and 641 samples/s with it on and
gave up 33-34 state rounds, against 787 and 0 with the same code not armed (and 730 and 7 before this module). Why a
handler that no signal reaches costs that is not known; until it is, it is a tool for reproducing a hang.
"""

from __future__ import annotations

import faulthandler
import fcntl
import os
import signal
import tempfile
import time
from typing import Optional

import psutil

SIGNAL = signal.SIGUSR1
ENV = "COLLAB_CHILD_STACKS"
EACH_WAIT = 0.5  # seconds a process has to begin its stacks (a stopped one never does: it is not signalled)
ALL_WAIT = 1.5  # seconds all processes together have: a forced exit must still end the peer within its promise
QUIET_FOR = 0.2  # seconds without a new byte after which a process's dump is taken as whole (a busy one pauses)

_file = None  # the unnamed file forked processes write into: this process's, or inherited from its armed parent
_owner: Optional[int] = None  # the pid that armed _file: only it collects
_hooked = False


def wanted() -> bool:
    """Whether this process was asked to arm itself (COLLAB_CHILD_STACKS=1)."""
    return os.environ.get(ENV, "") == "1"


def arm() -> None:
    """From now on every process forked from this one writes its stacks on SIGUSR1 into this process's unnamed file.
    Call it in the peer's main process before hivemind's processes start; called again, it keeps its file."""
    global _file, _owner, _hooked
    if _file is not None and _owner == os.getpid():
        return
    try:
        handle = tempfile.TemporaryFile(prefix="collab-stacks-")  # unlinked at once: nothing stays on disk
        fcntl.fcntl(handle.fileno(), fcntl.F_SETFL, fcntl.fcntl(handle.fileno(), fcntl.F_GETFL) | os.O_APPEND)
    except OSError:  # no room in TMPDIR: a forced exit then has its own stacks only
        return
    _file, _owner = handle, os.getpid()
    if not _hooked:
        os.register_at_fork(after_in_child=_dump_on_signal)
        _hooked = True


def _dump_on_signal() -> None:
    if _file is not None and os.getppid() == _owner:
        faulthandler.register(SIGNAL, file=_file, all_threads=True, chain=False)
    else:  # a grandchild: its parent's handler (inherited) would write into a file nobody reads
        faulthandler.unregister(SIGNAL)


def catches_signal(pid: int) -> bool:
    """Whether process `pid` handles SIGUSR1 (bit 9 of SigCgt in /proc/PID/status) and can act on it now (not stopped:
    a frozen peer's process would cost the whole wait); False where unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return fields["State"].split()[0] not in ("T", "t") and bool(int(fields["SigCgt"], 16) >> (SIGNAL - 1) & 1)
    except (OSError, ValueError, KeyError, IndexError):
        return False


def collect(processes: list, each: float = EACH_WAIT, total: float = ALL_WAIT) -> str:
    """The stacks of each of `processes` (psutil.Process) that is this process's child and dumps them on SIGUSR1, one
    after another (their dumps would interleave): each headed by its pid and name. Bounded by `each` s a process and
    `total` in all. Raises OSError where the file cannot be written (a full disk)."""
    if _file is None or _owner != os.getpid():
        return ""
    fd = _file.fileno()
    begin = os.fstat(fd).st_size  # (an earlier collect's stacks are not this one's)
    deadline = time.monotonic() + total
    for proc in processes:
        if time.monotonic() >= deadline:
            break
        try:
            if proc.ppid() != _owner or not catches_signal(proc.pid):
                continue
            os.write(fd, f"\nprocess {proc.pid} ({proc.name()}):\n".encode())
            proc.send_signal(SIGNAL)
        except (psutil.Error, OSError):
            continue
        if not _wait_for_dump(fd, min(deadline, time.monotonic() + each)):
            os.write(fd, b"(no stacks in time: a frozen or starved process)\n")
    size = os.fstat(fd).st_size
    return os.pread(fd, size - begin, begin).decode(errors="replace") if size > begin else ""


def stacks_file(pids: list, prefix: str) -> Optional[str]:
    """The stacks of processes `pids` (this process's children) in a new file named with `prefix`; None if none of them
    catches SIGUSR1 (or this process is not armed). For a process that hangs while the peer itself goes on: an
    averager's process that never said it was ready: not a forced exit, so it waits longer for a busy process. Raises
    OSError where the file cannot be written."""
    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.Error:
            pass
    text = collect(processes, each=5.0, total=10.0)
    if not text:
        return None
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def _wait_for_dump(fd: int, until: float) -> bool:
    """Until `until`, or until the file has grown and then stayed the same for QUIET_FOR s; whether it grew."""
    start = size = os.fstat(fd).st_size
    quiet_since: Optional[float] = None
    while time.monotonic() < until:
        time.sleep(0.01)
        now = os.fstat(fd).st_size
        if now != size:
            size, quiet_since = now, None
        elif size > start:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since >= QUIET_FOR:
                return True
    return os.fstat(fd).st_size > start
