"""A forced exit's stacks file has the stacks of the peer's hivemind processes, not only its own: the 12-peer scale
run's stuck peer showed its trainer waiting for the gradient averager, and where the averager itself waited was
guessed (collab.process.child_stacks)."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

from collab.process.child_stacks import catches_signal

CHILD = textwrap.dedent("""
    import multiprocessing as mp, os, signal, sys, threading, time
    import hivemind
    from collab.process.lifecycle import StopOnSignal

    stop = threading.Event()
    guard = StopOnSignal(stop, grace=0.5).install()
    dht = hivemind.DHT(start=True)  # a real hivemind process (and its p2pd, which must not be sent SIGUSR1)
    lock = mp.get_context("fork").Lock()
    lock.acquire()

    def the_child_waits_here(grandchild_pid):
        if os.fork() == 0:  # a grandchild: no handler, its dump would go into a file nobody reads
            grandchild_pid.value = os.getpid()  # (after the fork's hooks)
            time.sleep(60)
            os._exit(0)
        lock.acquire()

    grandchild_pid = mp.get_context("fork").Value("i", 0)
    child = mp.get_context("fork").Process(target=the_child_waits_here, args=(grandchild_pid,), daemon=True)
    child.start()
    while not grandchild_pid.value:
        time.sleep(0.05)
    time.sleep(0.5)
    from collab.process.child_stacks import catches_signal
    print("pids:", dht.pid, child.pid, flush=True)
    print("catch:", catches_signal(child.pid), catches_signal(grandchild_pid.value), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    stop.wait(5)
    time.sleep(30)  # the graceful path hangs: the watchdog's forced exit ends this process
""")


def _section(text: str, pid: int) -> str:
    """The part of a stacks file headed by process `pid`."""
    found = re.search(rf"^process {pid} \(.*?\):\n(.*?)(?=^process |\Z)", text, re.M | re.S)
    return found.group(1) if found else ""


def test_a_forced_exit_writes_the_stacks_of_the_peers_processes(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path), "COLLAB_CHILD_STACKS": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=90, env=env)
    assert done.returncode == 1, done.stderr
    dht_pid, child_pid = map(int, re.search(r"pids: (\d+) (\d+)", done.stdout).groups())
    assert "catch: True False" in done.stdout, done.stdout  # the peer's child answers; the child's child does not
    files = list(tmp_path.glob("collab-shutdown-*.log"))
    assert len(files) == 1, done.stderr
    text = files[0].read_text()
    assert "in the_child_waits_here" in _section(text, child_pid), text
    assert "hivemind/dht/dht.py" in _section(text, dht_pid), text
    headed = {int(pid) for pid in re.findall(r"^process (\d+) \(", text, re.M)}
    assert headed == {dht_pid, child_pid, int(re.search(r"^process (\d+) \(this peer\)", text, re.M).group(1))}, text


def _catch_and_sleep(ready) -> None:
    faulthandler.register(signal.SIGUSR1)
    ready.set()
    time.sleep(60)


def test_a_stopped_process_is_not_signalled():
    """A frozen process (a `simulate` fault, a debugger) would cost the forced exit its whole wait, for nothing."""
    fork = mp.get_context("fork")
    ready = fork.Event()
    child = fork.Process(target=_catch_and_sleep, args=(ready,), daemon=True)
    child.start()
    try:
        assert ready.wait(20)
        assert catches_signal(child.pid)
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while catches_signal(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not catches_signal(child.pid), "a stopped process would be signalled and waited for"
    finally:
        child.kill()
        child.join(10)


UNARMED = textwrap.dedent("""
    import multiprocessing as mp, threading, time
    from collab.process.child_stacks import catches_signal
    from collab.process.lifecycle import StopOnSignal

    guard = StopOnSignal(threading.Event()).install()
    child = mp.get_context("fork").Process(target=time.sleep, args=(30,), daemon=True)
    child.start()
    time.sleep(0.5)
    print("catch:", catches_signal(child.pid), flush=True)
    child.kill()
    guard.cancel()
""")


def test_a_peer_arms_its_children_only_when_asked():
    """Armed, 32 peers on 2 cores lost a fifth of their samples/s and gave up a third of their state rounds (cause
    not known): off unless COLLAB_CHILD_STACKS=1."""
    env = {key: value for key, value in os.environ.items() if key != "COLLAB_CHILD_STACKS"}
    done = subprocess.run([sys.executable, "-c", UNARMED], capture_output=True, text=True, timeout=60, env=env)
    assert "catch: False" in done.stdout, done.stdout + done.stderr
