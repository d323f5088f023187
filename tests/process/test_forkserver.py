"""The fork server starts peers as forks of one process that imported collab: they must behave as processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from collab.peers.forkserver import ForkServer
from tests.conftest import peer_env

SCRIPT = """
import os, sys
print("argv", sys.argv[1:], "cache", os.environ.get("COLLAB_CACHE_DIR"), "own session", os.getsid(0) == os.getpid())
if sys.argv[1] == "sleep":
    import time; time.sleep(60)
raise SystemExit(int(sys.argv[1]))
"""


def test_forked_processes_behave_like_processes_and_leave_with_their_launcher(tmp_path, no_leftover_processes):
    script = tmp_path / "child.py"
    script.write_text(SCRIPT)
    env = dict(peer_env(), PYTHONUNBUFFERED="1")
    server = ForkServer(env, tmp_path / "server.log").start()
    try:
        # collab's own CLI, in a fork: output to its log, exit code through the server
        version = server.spawn([sys.executable, "-m", "collab", "--version"], env, tmp_path / "version.log")
        assert version.wait(timeout=30) == 0
        assert (tmp_path / "version.log").read_text().startswith("collab ")

        # a wrapper script, with a per-peer runtime setting (COLLAB_*), in a session of its own
        command = [sys.executable, str(script), "3"]
        assert server.can_fork(command, dict(env, COLLAB_CACHE_DIR="/elsewhere"))
        child = server.spawn(command, dict(env, COLLAB_CACHE_DIR="/elsewhere"), tmp_path / "child.log")
        assert child.wait(timeout=30) == 3
        log = (tmp_path / "child.log").read_text()
        assert "argv ['3'] cache /elsewhere own session True" in log, log

        # a signal ends it as it would a process: poll() is None until then, -SIGNAL after
        sleeper = server.spawn([sys.executable, str(script), "sleep"], env, tmp_path / "sleeper.log")
        assert sleeper.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            sleeper.wait(timeout=0.5)
        sleeper.kill()
        assert sleeper.wait(timeout=30) == -signal.SIGKILL
        sleeper.kill()  # reaped: signalling it again must not reach whatever process reuses its pid

        # what the server cannot reproduce goes to a plain process instead
        assert not server.can_fork(command, dict(env, OMP_NUM_THREADS="4")), "a library reads it at import"
        assert not server.can_fork(["sleep", "1"], env)

        # a launcher that stops (or dies) closes the server's stdin: a peer still running must not stay on
        survivor = server.spawn([sys.executable, str(script), "sleep"], env, tmp_path / "survivor.log")
    finally:
        server.close()
    assert server._process is None
    assert survivor.poll() == -signal.SIGTERM and not os.path.exists(f"/proc/{survivor.pid}")


def test_a_peer_that_cannot_be_forked_is_told_why(tmp_path):
    """The launcher prints why a peer given a fork server starts as a process of its own (~8 s of import on this
    machine): a test environment that silently stopped matching the server's cost the suite 5 minutes."""
    server = ForkServer({"A": "1", "COLLAB_PEER": "0"}, tmp_path / "log")
    collab = [sys.executable, "-m", "collab", "join"]
    assert server.why_not(collab, {"A": "1"}) == "the fork server is not running"
    server._process = object()  # why_not only asks whether there is one
    assert server.why_not(collab, {"A": "1", "COLLAB_PEER": "3"}) is None  # collab's runtime settings may differ
    assert server.why_not(collab, {"A": "2", "PYTEST_CURRENT_TEST": "x"}) == \
        "its environment differs from the server's in A, PYTEST_CURRENT_TEST"
    assert server.why_not(["/bin/echo"], {"A": "1"}).startswith("it runs /bin/echo")


def test_a_peer_signalled_as_soon_as_it_is_forked_leaves_gracefully(tmp_path, no_leftover_processes):
    """A launcher may SIGTERM a peer the moment it reads its pid (a simulation that ends as its churn restarts a
    peer). The server holds the signal over the fork, and the child takes it as `join`'s request to leave: exit 0,
    never "killed by SIGTERM" (test_churn's restarted peer was, with an empty log)."""
    env = dict(peer_env(), PYTHONUNBUFFERED="1")
    server = ForkServer(env, tmp_path / "server.log").start()
    try:
        for attempt in range(2):
            log = tmp_path / f"join{attempt}.log"
            peer = server.spawn([sys.executable, "-m", "collab", "join", "--run-id", f"early-{attempt}",
                                 "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--no-live"],
                                env, log)
            peer.terminate()
            code = peer.wait(timeout=90)
            assert code == 0, (code, log.read_text()[-2000:] if log.exists() else "no log: killed before it opened one")
    finally:
        server.close()
