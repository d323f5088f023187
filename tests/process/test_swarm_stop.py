"""A stopped local swarm gives its peers time to leave while they are still leaving (collab.peers.launcher).

Peers stopped at once on a machine they share leave one after another: 32 linreg peers on 2 cores, 17 overran a
fixed 15 s and were killed. Here real processes stand in for peers whose leave takes longer the later they get the
CPU: each exits 0.5 s after the one before it, well past a grace of 1 s in all, and each leaves on its own. One that
never leaves is killed, `grace` after the last one left."""

from __future__ import annotations

import subprocess
import sys
import time

from collab.peers.launcher import LocalSwarm

LEAVES = """
import signal, sys, time
delay = float(sys.argv[1])
def leave(*_):
    time.sleep(delay)  # the leave's work, slower for the later peers
    sys.exit(0)
signal.signal(signal.SIGTERM, leave)
print("ready", flush=True)
time.sleep(60)
"""
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); " \
           "time.sleep(60)"


def test_peers_that_leave_one_after_another_all_leave_and_one_that_never_does_is_killed(tmp_path,
                                                                                       no_leftover_processes):
    swarm = LocalSwarm(5, "stop", tmp_path, fork_server=False)
    programs = [[sys.executable, "-c", LEAVES, str(0.5 * (i + 1))] for i in range(4)]
    programs.append([sys.executable, "-c", STUBBORN])
    try:
        for peer, program in zip(swarm.peers, programs):
            peer.popen = subprocess.Popen(program, stdout=subprocess.PIPE, start_new_session=True, text=True)
        for peer in swarm.peers:
            assert peer.popen.stdout.readline().strip() == "ready"  # its SIGTERM handler is in place
        began = time.monotonic()
        swarm.stop(grace=1.0, most=20.0)
        took = time.monotonic() - began
        codes = [peer.popen.returncode for peer in swarm.peers]
        assert codes[:4] == [0, 0, 0, 0], f"a peer still leaving was killed: {codes}"
        assert codes[4] == -9, "the peer that ignored SIGTERM was not killed"
        assert 2.0 + 1.0 <= took < 10.0, f"the stop took {took:.1f} s: the last leave at 2 s, then the grace of 1 s"
    finally:
        for peer in swarm.peers:
            if peer.popen is not None and peer.popen.poll() is None:
                peer.kill_group()
