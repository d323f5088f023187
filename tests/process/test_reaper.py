"""The watcher's looks at the main process's tree: soon while it changes, rarely while it does not (each look reads
every process's /proc entry, and a machine simulating many peers runs hundreds, each peer with a watcher)."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import time

import psutil
import pytest

from collab.process import reaper
from collab.process.reaper import LOOK_AT_MOST_SECONDS, LOOK_EVERY_SECONDS, _Watch, next_look


def test_looks_slow_down_while_nothing_changes_and_come_soon_again_when_something_does():
    every, schedule = LOOK_EVERY_SECONDS, []
    for found_new in (False,) * 6 + (True, False):
        every = next_look(every, found_new)
        schedule.append(every)
    assert schedule == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 0.5, 1.0], schedule
    assert max(schedule) == LOOK_AT_MOST_SECONDS


def test_a_look_counts_only_processes_not_noted_before():
    watch = _Watch(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        watch.note_descendants()
        assert child.pid in watch.noted and watch.news >= 1
        news = watch.news
        watch.note_descendants()  # the same tree again: nothing new, so the next look may wait longer
        assert watch.news == news
    finally:
        child.kill()
        child.wait(timeout=10)
        if watch.pidfd is not None:
            os.close(watch.pidfd)


def test_a_child_that_dies_between_two_looks_is_counted_ended_and_reaped(monkeypatch):
    """The race a CI run lost: the child died after psutil's wait had polled it and before its status was read. It is
    a zombie then: ended, and, being this process's child, reaped on the spot (not left for the caller to find still
    "running" in psutil's eyes)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    proc = psutil.Process(child.pid)
    real_wait_procs = psutil.wait_procs

    def wait_then_die(procs, timeout):
        gone, alive = real_wait_procs(procs, timeout=timeout)
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while proc.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.01)
        return gone, alive

    monkeypatch.setattr(psutil, "wait_procs", wait_then_die)
    try:
        assert reaper.running_after([proc], timeout=5.0) == []
        assert not proc.is_running()
        with pytest.raises(ChildProcessError):
            os.waitpid(child.pid, os.WNOHANG)  # reaped already
    finally:
        if proc.is_running():
            child.kill()
            child.wait(timeout=10)


# SYS_exit: ends the calling thread only (Python's exits end the whole process)
THREAD_EXIT = {"x86_64": 60, "aarch64": 93}


@pytest.mark.skipif(platform.machine() not in THREAD_EXIT, reason="SYS_exit's number is known for x86_64 and aarch64")
def test_a_child_whose_main_thread_exited_first_is_waited_for_until_it_can_be_reaped():
    """A process whose main thread has exited shows as a zombie while its other threads still run, and cannot be
    reaped before they end (a CI run's averager, killed, showed so; psutil's wait(timeout=0) gave up on it and left
    it unreaped). Staged: the main thread exits alone, another ends a second later."""
    code = ("import ctypes, threading, time\n"
            "threading.Thread(target=time.sleep, args=(1.0,)).start()\n"
            f"ctypes.CDLL(None).syscall({THREAD_EXIT[platform.machine()]}, 0)\n")
    child = subprocess.Popen([sys.executable, "-c", code])
    proc = psutil.Process(child.pid)
    try:
        deadline = time.monotonic() + 10
        while proc.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.status() == psutil.STATUS_ZOMBIE and proc.num_threads() >= 1
        started = time.monotonic()
        assert reaper.running_after([proc], timeout=5.0) == []
        assert time.monotonic() - started >= 0.3  # it did wait for the other thread
        with pytest.raises(ChildProcessError):
            os.waitpid(child.pid, os.WNOHANG)  # reaped
    finally:
        if proc.is_running():
            child.kill()
            child.wait(timeout=10)


KILLED_WITH_A_SOCKET = """
import socket, sys, time
from collab.process.reaper import watch_this_process
server = socket.socket(socket.AF_UNIX)
server.bind(sys.argv[1])  # a client of p2pd listens on such a file (hivemind's P2P.replicate)
server.listen()
watch_this_process()
from multiprocessing import util
print("ready", util.get_temp_dir(), flush=True)
time.sleep(120)
"""


def test_a_main_process_killed_with_kill_9_leaves_no_socket_file_or_folder_of_its_own():
    """hivemind removes a client's socket file only on a graceful shutdown; the watcher, which reads the main
    process's files at each look, removes them once it is gone (a gossip peer's kill -9 left its file in CI). So too
    the main process's multiprocessing folder (pymp-*: every simulated peer left one)."""
    path = f"{reaper.HIVEMIND_SOCKETS}p2pclient-reaper-test-{os.getpid()}.sock"
    main = subprocess.Popen([sys.executable, "-c", KILLED_WITH_A_SOCKET, path], stdout=subprocess.PIPE, text=True)
    try:
        ready, folder = main.stdout.readline().split()
        assert ready == "ready" and os.path.exists(path) and os.path.isdir(folder), folder
        watcher = _watcher_of(main.pid)
        _kill_9(main, watcher)
        assert not os.path.exists(path), "the killed main process's socket file is still in /tmp"
        assert not os.path.exists(folder), "the killed main process's multiprocessing folder is still in /tmp"
    finally:
        _end(main, path)


def test_a_forked_process_leaves_the_multiprocessing_folder_it_inherited_to_its_parent():
    """A fork shares its parent's pymp-* folder (and so do the parent's other forks): its watcher must not remove
    it (a cleanup that did hung a later fork's DHT in CI). Only a folder a process made itself is its own."""
    from multiprocessing import util

    parents = util.get_temp_dir()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # (the child only answers: no thread, no torch op)
        os.write(write, repr(reaper._own_multiprocessing_folder()).encode())
        os._exit(0)
    os.close(write)
    try:
        with os.fdopen(read) as answer:
            assert answer.read() == "[]"
    finally:
        os.waitpid(pid, 0)
    assert os.path.isdir(parents)


ENDING_WITH_OS_EXIT = """
import os, subprocess, sys
from multiprocessing import util
from collab.process.reaper import remove_own_multiprocessing_folder, watch_this_process
watch_this_process()
folder = util.get_temp_dir()
# (the child ends when this process does, killed or not: its stdin closes)
child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE) \
    if sys.argv[1] == "child" else None
remove_own_multiprocessing_folder()
print(folder, os.path.isdir(folder), flush=True)
if child:
    sys.stdin.readline()  # (once its watcher watches)
    child.kill()
    child.wait()
os._exit(0)
"""


@pytest.mark.parametrize("child", [False, True])
def test_a_process_ending_with_os_exit_removes_its_multiprocessing_folder_unless_a_child_still_runs(child):
    """collab's hard exit and a fork server's peer end with os._exit, which skips multiprocessing's own removal, and a
    quick one (bad input) ends before its watcher watches: each bad flag left a folder. A child may share it."""
    main = subprocess.Popen([sys.executable, "-c", ENDING_WITH_OS_EXIT, "child" if child else "alone"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        folder, kept = main.stdout.readline().split()
        assert kept == str(child)
        if child:
            _watcher_of(main.pid)
            main.stdin.write("end\n")
            main.stdin.flush()
        assert main.wait(timeout=30) == 0
    finally:
        if main.poll() is None:
            main.kill()
            main.wait(timeout=10)
    if child:  # (its watcher removes it once both are gone)
        deadline = time.monotonic() + 30
        while os.path.isdir(folder):
            assert time.monotonic() < deadline, "the watcher left the folder of a process and child both gone"
            time.sleep(0.1)


def _watcher_of(pid: int):
    """The watcher of process `pid`, once it watches. It is forked, then runs python: its command line names the
    reaper only once that has begun. It has read the main process's files once it waits on its pidfd."""
    deadline, watcher = time.monotonic() + 30, []
    while not (watcher and _waits_on_a_pidfd(watcher[0].pid)):
        assert time.monotonic() < deadline, f"the watcher never started watching (found: {watcher})"
        time.sleep(0.05)
        watcher = [p for p in psutil.Process(pid).children() if "collab.process.reaper" in _cmdline(p)]
    assert len(watcher) == 1, watcher
    return watcher[0]


def _cmdline(process) -> list:
    try:
        return process.cmdline()
    except psutil.Error:  # (one that just ended)
        return []


def _waits_on_a_pidfd(pid: int) -> bool:
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[pidfd]" for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


SOCKET_MADE_LATE = """
import socket, sys, time
from collab.process.reaper import watch_this_process
watch_this_process()
print("watched", flush=True)
sys.stdin.readline()  # the test says when: after the watcher's looks have slowed down
server = socket.socket(socket.AF_UNIX)
server.bind(sys.argv[1])  # a client of p2pd made mid-run (a gossip peer's first exchange), told to nobody
server.listen()
print("made", flush=True)
time.sleep(120)
"""


def test_a_socket_made_between_two_looks_is_removed_and_an_older_unbound_file_is_left_alone():
    """The watcher's looks come up to LOOK_AT_MOST_SECONDS apart once the tree is quiet, and a killed process's files
    can no longer be read from it: a gossip peer killed after its first exchange made a client of p2pd, and before the
    next look, left that file in /tmp (CI). Nobody is bound to it once its process is gone: the watcher removes it.
    A file that was there before the main process started is not its to judge: left alone."""
    path = f"{reaper.HIVEMIND_SOCKETS}p2pclient-made-late-test-{os.getpid()}.sock"
    older = f"{reaper.HIVEMIND_SOCKETS}p2pclient-older-test-{os.getpid()}.sock"
    open(older, "w").close()
    # an hour old: any watcher may judge a file made since its main process started (the other pytest worker's too)
    os.utime(older, (time.time() - 3600, time.time() - 3600))
    main = subprocess.Popen([sys.executable, "-c", SOCKET_MADE_LATE, path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert main.stdout.readline().strip() == "watched"
        watcher = _watcher_of(main.pid)
        time.sleep(4.0)  # looks at 0.5, 1, 2 and 4 s apart: the next one is seconds away
        main.stdin.write("go\n")
        main.stdin.flush()
        assert main.stdout.readline().strip() == "made" and os.path.exists(path)
        _kill_9(main, watcher)
        assert not os.path.exists(path), "the killed process's socket file, made between two looks, is still in /tmp"
        assert os.path.exists(older), "a file older than the main process was removed"
    finally:
        _end(main, path)
        if os.path.exists(older):
            os.unlink(older)


def _kill_9(main, watcher) -> None:
    """kill -9 the main process, and wait for its watcher to have done its job."""
    main.kill()
    main.wait(timeout=10)
    watcher.wait(timeout=10)


def _end(main, path: str) -> None:
    """Whatever the test found: the main process ended, and the socket file gone."""
    if main.poll() is None:
        main.kill()
        main.wait(timeout=10)
    if os.path.exists(path):
        os.unlink(path)
