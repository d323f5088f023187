"""A forced exit and a graceful leave that end at the same moment: one of them wins, and the exit code says which
(a summary reading "forced exit" from a process that exited 0 was seen at 32 peers)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import os, signal, sys, threading, time
    from collab.process.lifecycle import StopOnSignal

    stop = threading.Event()
    guard = StopOnSignal(stop, grace=0.3).install()

    def write_summary(reason):
        with open(sys.argv[1], "w") as f:
            f.write(reason)
        time.sleep(1.0)  # a summary written slowly (a busy disk, a busy machine)

    StopOnSignal.before_force_exit(write_summary)
    os.kill(os.getpid(), signal.SIGTERM)
    stop.wait(5)
    time.sleep(0.6)  # the graceful leave ends while the watchdog, fired at 0.3 s, is still writing
    guard.cancel()
    sys.exit(0)
""")


def test_a_forced_exit_under_way_is_not_turned_into_exit_0_by_the_graceful_path_ending(tmp_path):
    summary = tmp_path / "summary.txt"
    done = subprocess.run([sys.executable, "-c", CHILD, str(summary)], capture_output=True, text=True, timeout=60)
    stacks = re.search(r"stacks in (\S+)\)", done.stderr)
    if stacks and os.path.exists(stacks.group(1)):
        os.remove(stacks.group(1))
    assert summary.read_text().startswith("graceful shutdown overran"), done.stderr
    assert done.returncode == 1, f"the summary says forced exit, the exit code is {done.returncode}: {done.stderr}"


LEAVE = textwrap.dedent("""
    import os, signal, sys, threading
    from concurrent.futures import Future
    from collab.process.lifecycle import StopOnSignal

    stop = threading.Event()
    guard = StopOnSignal(stop, grace=3.0).install()
    print("before a signal:", StopOnSignal.budget(5.0, keep=1.0), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    stop.wait(5)
    wait = StopOnSignal.budget(5.0, keep=1.0)
    print("after it:", wait, flush=True)
    try:
        Future().result(timeout=wait)  # a figure nobody answers (the DHT's, at the end of a churned run)
    except Exception:
        pass
    guard.cancel()
    sys.exit(0)
""")


def test_a_signalled_leave_waits_only_what_its_grace_leaves(tmp_path):
    # a leave waited READ_TIMEOUT (5 s) for the DHT's figures after a SIGTERM and overran its 7-s grace (CI's churn
    # test); here a 5-s wait under a 3-s grace must shrink to what is left of it, less what the steps after need
    done = subprocess.run([sys.executable, "-c", LEAVE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"the leave overran its grace: {done.stderr}"
    before = float(re.search(r"before a signal: (\S+)", done.stdout).group(1))
    after = float(re.search(r"after it: (\S+)", done.stdout).group(1))
    assert before == 5.0 and 1.0 < after <= 2.0, done.stdout
